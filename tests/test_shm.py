"""Shared-memory links between ranks of one host: messages matched by tag, large ones spilled, failures prompt."""

from __future__ import annotations

import datetime
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from moirai.runtime import shm, shm_files
from moirai.runtime.groups import Group


def connected_pair(world_size: int = 2, inference_mode: bool = False) -> list[shm.SharedMemoryLinks]:
    """Every rank's links, each rank connecting in a thread of this process (as processes do through a store);
    ``inference_mode``: each connecting inside ``torch.inference_mode``."""
    store = dist.HashStore()

    def connect(rank: int) -> shm.SharedMemoryLinks | None:
        with torch.inference_mode(inference_mode):
            return shm.connect(rank, world_size, store, 10.0, "test")

    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(connect, rank) for rank in range(world_size)]
        links = [future.result() for future in futures]
    assert all(link is not None for link in links)
    return links  # type: ignore[return-value]


def received(links: shm.SharedMemoryLinks, like: torch.Tensor, src: int, tag: int, timeout_s: float = 10.0):
    buffer = torch.empty_like(like)
    links.recv([buffer], src, tag).wait(datetime.timedelta(seconds=timeout_s))
    return buffer


def test_messages_arrive_by_tag_whatever_the_order_of_the_waits():
    a, b = connected_pair()
    sent = {tag: torch.randn(3, 5) * tag for tag in range(1, 21)}
    for tag, tensor in sent.items():
        a.send([tensor], 1, tag)
    for tag in reversed(sent):  # the first wait reads every message ahead of its own and keeps them
        torch.testing.assert_close(received(b, sent[tag], 0, tag), sent[tag])
    assert a.peers == {1} and b.peers == {0}


def test_links_made_inside_inference_mode_carry_messages_sent_and_received_outside_it():
    """Under torchrun, compiled.server() makes the rings in the caller's thread, maybe inside torch.inference_mode,
    and the driver's threads use them. Before, the rings were inference tensors there and every send failed with
    'Inplace update to inference tensor outside InferenceMode'."""
    a, b = connected_pair(inference_mode=True)
    sent = torch.randn(3, 5)
    a.send([sent], 1, 7)
    torch.testing.assert_close(received(b, sent, 0, 7), sent)


def test_messages_both_ways_of_every_dtype_and_shape():
    a, b = connected_pair()
    tensors = [torch.arange(7, dtype=torch.int64), torch.tensor(True), torch.zeros(0, 4), torch.randn(2, 3).half()]
    for tag, tensor in enumerate(tensors):
        a.send([tensor], 1, tag)
        b.send([tensor + 1 if tensor.dtype != torch.bool else ~tensor], 0, tag)
    for tag, tensor in enumerate(tensors):
        torch.testing.assert_close(received(b, tensor, 0, tag), tensor)
        torch.testing.assert_close(received(a, tensor, 1, tag), tensor + 1 if tensor.dtype != torch.bool else ~tensor)


def test_messages_larger_than_the_ring_or_finding_it_full_go_through_files_of_their_own(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_files, "shm_dir", lambda: str(tmp_path))  # this test's files only, whoever else runs
    a, b = connected_pair()
    large = torch.randn(shm.RING_BYTES // 4 + 10)  # more bytes than the whole ring
    medium = [torch.full((shm.RING_BYTES // 16,), float(k)) for k in range(12)]  # together 3x the ring, unread
    a.send([large], 1, 100)
    for tag, tensor in enumerate(medium):
        a.send([tensor], 1, tag)
    assert shm_files.spill_files()  # written, not yet read
    for tag in reversed(range(len(medium))):
        torch.testing.assert_close(received(b, medium[tag], 0, tag), medium[tag])
    torch.testing.assert_close(received(b, large, 0, 100), large)
    assert not shm_files.spill_files()  # a spill file is removed once read


def test_many_messages_wrap_around_the_ring(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_files, "shm_dir", lambda: str(tmp_path))  # this test's files only, whoever else runs
    a, b = connected_pair()
    message = torch.randn(shm.RING_BYTES // 40)  # ~1/10 of the ring: it wraps every ten messages
    for tag in range(100):
        a.send([message + tag], 1, tag)
        torch.testing.assert_close(received(b, message, 0, tag), message + tag)
    assert not shm_files.spill_files(), "a message that fits the ring must not spill"


def test_waiters_in_several_threads_each_get_their_own_message():
    a, b = connected_pair()
    tags = list(range(40))
    results: dict[int, torch.Tensor] = {}

    def wait_for(tag: int) -> None:
        results[tag] = received(b, torch.empty(64), 0, tag)

    threads = [threading.Thread(target=wait_for, args=(tag,)) for tag in tags]
    for thread in threads:
        thread.start()
    for tag in reversed(tags):
        a.send([torch.full((64,), float(tag))], 1, tag)
        time.sleep(0.001)
    for thread in threads:
        thread.join(timeout=20)
    assert sorted(results) == tags
    for tag in tags:
        torch.testing.assert_close(results[tag], torch.full((64,), float(tag)))


def test_spill_files_of_closed_links_and_ended_processes_are_removed(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_files, "shm_dir", lambda: str(tmp_path))
    a, _ = connected_pair()
    a.send([torch.ones(shm.RING_BYTES)], 1, 1)  # spilled, never read
    ended = tmp_path / f"{shm_files._SPILL_PREFIX}ended-abc"  # its owner's lock file is held by nobody
    ended.write_bytes(b"x")
    (tmp_path / f"{shm_files._SPILL_PREFIX}ended{shm_files._LOCK_SUFFIX}").touch(mode=0o600)
    connected_pair()
    assert not ended.exists() and len(shm_files.spill_files()) == 1  # a live writer's file stays
    a.close()
    assert not shm_files.spill_files()


def test_a_full_ring_fails_a_send_at_the_time_limit(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_files, "shm_dir", lambda: str(tmp_path))
    monkeypatch.setattr(shm, "RING_BYTES", 1 << 16)
    store = dist.HashStore()
    with ThreadPoolExecutor(2) as pool:
        a, _ = pool.map(lambda rank: shm.connect(rank, 2, store, 0.3, "full"), range(2))
    with pytest.raises(TimeoutError, match="ring stayed full"):
        for tag in range(2000):  # unread: spilled once the ring is full, until spill records fill it too
            a.send([torch.ones(256)], 1, tag)
    assert tag > 32 and shm_files.spill_files()  # the ring held many before it spilled, then spill records filled it
    a.close()
    assert not shm_files.spill_files()


def test_a_wait_ends_at_its_time_limit():
    _, b = connected_pair()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="Timed out"):
        received(b, torch.empty(4), 0, 7, timeout_s=0.3)
    assert 0.25 < time.monotonic() - started < 5.0


def test_a_peer_that_closes_fails_a_waiting_rank_at_once():
    a, b = connected_pair()
    threading.Timer(0.2, a.close).start()
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="closed"):
        received(b, torch.empty(4), 0, 7, timeout_s=30.0)
    assert time.monotonic() - started < 5.0


def test_switched_off_by_the_environment_the_group_uses_gloo(monkeypatch):
    monkeypatch.setenv(shm.ENV_SWITCH, "0")
    assert shm.connect(0, 2, dist.HashStore(), 1.0, "off") is None
    group = Group(0, [torch.device("cpu")] * 2, gloo="gloo group", nccl=None, store=None)
    assert group.link(torch.device("cpu"), 1) == "gloo group"


def test_links_leave_no_files_behind(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_files, "shm_dir", lambda: str(tmp_path))
    a, _, c = connected_pair(3)
    a.send([torch.ones(3)], 2, 1)
    a.send([torch.ones(shm.RING_BYTES)], 2, 2)  # spilled
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(shm_files._LOCK_SUFFIX))
    assert left == [p.name for p in shm_files.spill_files()]  # rings and FIFOs: gone
    torch.testing.assert_close(received(c, torch.empty(3), 0, 1), torch.ones(3))
    torch.testing.assert_close(received(c, torch.empty(shm.RING_BYTES), 0, 2), torch.ones(shm.RING_BYTES))
    assert all(p.name.endswith(shm_files._LOCK_SUFFIX) for p in tmp_path.iterdir())  # the live links' locks only
    group = Group(0, [torch.device("cpu")] * 3, gloo="gloo group", nccl=None, store=None, shared_memory=a)
    assert group.link(torch.device("cpu"), 2) is a
    for links in (a, _, c):
        links.close()
    assert not list(tmp_path.iterdir())


def test_a_send_after_close_fails_and_writes_to_no_other_file():
    """Fault injected: the FIFO's descriptor is closed and its number taken by a new pipe, as another thread of the
    rank could take it; a send then must not announce its message into that pipe."""
    import os

    a, _ = connected_pair()
    outbound = a._outbound[1]
    a.close()
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ConnectionError, match="closed"):
            a.send([torch.ones(4)], 1, 3)
        os.set_blocking(read_end, False)
        with pytest.raises(BlockingIOError):
            os.read(read_end, 1)  # nothing was written into the pipe, whatever number it got
        assert outbound._closed
    finally:
        os.close(read_end)
        os.close(write_end)


def test_closing_a_rank_while_its_thread_waits_on_the_fifo_wakes_it_and_closes_the_fifo_after():
    """The waiting thread is in select on the FIFO when close() runs: it fails at once (not at its time limit), and
    the FIFO is closed by it, after its select, so no select ever runs on a descriptor closed under it."""
    _, b = connected_pair()
    inbound = b._inbound[0]
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            received(b, torch.empty(4), 0, 7, timeout_s=600.0)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            failure.append(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while not inbound._reading:  # the waiter is reading: in (or on its way to) its select
        time.sleep(0.01)
    b.close()
    waiter.join(60)  # far below its own 600 s: only close() can have ended it
    assert not waiter.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], ConnectionError), failure
    assert not inbound._descriptors_open
