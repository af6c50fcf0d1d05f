"""The runtime's typed messages: header kinds, headers and the driver's queue items print what they are, and every
link a group picks (gloo, shared memory) has the send/recv surface the protocol calls."""

from __future__ import annotations

import datetime
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import torch
import torch.distributed as dist

from moirai.runtime import shm
from moirai.runtime.driver import ControlSent, Ran, Sent, Stop, Submitted
from moirai.runtime.groups import Link, Work
from moirai.runtime.protocol import Header, HeaderKind


def test_header_kinds_print_by_name_and_keep_their_numbers_on_the_wire():
    assert [(str(kind), int(kind)) for kind in HeaderKind] == [("RUN", 1), ("LOAD", 2), ("HEARTBEAT", 3), ("CLOSE", 4)]
    assert f"{HeaderKind.HEARTBEAT}" == "HEARTBEAT"


def test_headers_print_their_kind_and_the_size_of_their_payload_not_its_bytes():
    load = Header(HeaderKind.LOAD, 3, payload=bytes(10_000))
    assert repr(load) == str(load) == "Header(LOAD, program 3, 10000 payload bytes)"
    run = Header(HeaderKind.RUN, 1, request=7, timeout_ms=2500)
    assert repr(run) == "Header(RUN, program 1, request 7, limit 2500 ms)"


def test_the_drivers_queue_items_print_what_they_carry():
    program = SimpleNamespace(num_devices=3)  # a stand-in: printing reads its part count only
    submitted = Submitted(program, [torch.ones(2), torch.ones(3)], Future(), list, 1.5)  # type: ignore[arg-type]
    assert str(submitted) == "Submitted(2 inputs, 3 parts, limit 1.5 s)"
    headers = [object(), object()]  # stand-ins for the headers' Messages: printing counts them
    assert repr(Sent(4, headers, object(), submitted)) == "Sent(request 4, 2 headers)"  # type: ignore[arg-type]
    assert repr(Ran(4, headers, list, Future(), list)) == "Ran(request 4, 2 headers)"  # type: ignore[arg-type]
    assert str(ControlSent(HeaderKind.HEARTBEAT, headers)) == "ControlSent(HEARTBEAT to 2 ranks)"  # type: ignore[arg-type]
    assert str(Stop("closed")) == "Stop(closed)"


def test_gloo_and_shared_memory_links_have_the_surface_the_protocol_calls():
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    assert isinstance(dist.ProcessGroupGloo(dist.HashStore(), 0, 1, options), Link)
    store = dist.HashStore()
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda rank: shm.connect(rank, 2, store, 10.0, "links"), range(2))
    try:
        assert isinstance(a, Link) and isinstance(b, Link)
        buffer = torch.empty(3)
        receive = b.recv([buffer], 0, 5)
        send = a.send([torch.arange(3.0)], 1, 5)
        assert isinstance(send, Work) and isinstance(receive, Work)
        assert send.wait(datetime.timedelta(seconds=10)) and receive.wait(datetime.timedelta(seconds=10))
        torch.testing.assert_close(buffer, torch.arange(3.0))
    finally:
        a.close()
        b.close()


def test_a_rank_reads_several_headers_ahead_and_posts_their_receives(monkeypatch) -> None:
    """[Note: receives posted ahead]: while a rank runs one request, the receives of the next HEADERS_READ_AHEAD + 1
    are posted (their "ready to receive" goes out behind the link's backlog), and no more."""
    import threading
    import time

    from moirai.runtime import protocol

    read: list[int] = []
    posted: list[int] = []
    more = threading.Event()

    def receive_header(group, sequence, timeout):  # noqa: ANN001, ANN202
        if sequence >= 50:
            more.wait(10)
            return Header(HeaderKind.CLOSE)
        read.append(sequence)
        return Header(HeaderKind.RUN, 0, request=sequence)

    def post_receives(group, programs, header):  # noqa: ANN001, ANN202
        posted.append(header.request)
        return None

    monkeypatch.setattr(protocol, "receive_header", receive_header)
    monkeypatch.setattr(protocol, "_post_receives", post_receives)
    headers = protocol._headers_read_ahead(None, {}, datetime.timedelta(seconds=10))
    first, _ = next(headers)  # request 0 runs; the reader goes on
    deadline = time.monotonic() + 5
    while len(posted) < protocol.HEADERS_READ_AHEAD + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert first.request == 0
    assert posted == read == list(range(protocol.HEADERS_READ_AHEAD + 2))  # request 0, the queue's, one waiting
    assert protocol.HEADERS_READ_AHEAD >= 4
    more.set()
    rest = [header for header, _ in headers]
    assert [header.request for header in rest[:-1]] == list(range(1, 50)) and rest[-1].kind == HeaderKind.CLOSE


def test_control_messages_stay_in_host_memory_between_cuda_ranks():
    """Between two CUDA ranks data lives in device memory (NCCL, matched by order); a header and its payload go
    through host memory (gloo's control connection or shared memory, matched by tag), and a CUDA rank reads them
    there (the first H200 run: a payload moved to the GPU could not be read)."""
    from moirai.runtime.protocol import Messages

    posted = []

    class Link:
        def recv(self, tensors, src, tag):  # noqa: ANN001, ANN202
            posted.append(("recv", tensors[0].device.type, src))
            return SimpleNamespace(wait=lambda *_: True)

        def send(self, tensors, dst, tag):  # noqa: ANN001, ANN202
            posted.append(("send", tensors[0].device.type, dst))
            return SimpleNamespace(wait=lambda *_: True, complete_when_posted=True)

    cuda = SimpleNamespace(type="cuda")  # stands in for torch.device("cuda:0"), which this machine may not have
    group = SimpleNamespace(
        rank=1,
        devices=[cuda, cuda],
        wire_device=lambda peer: cuda,
        link=lambda wire, peer, control=False: Link(),
    )
    control = Messages(group, 0, datetime.timedelta(seconds=1), control=True)
    received = control.wait_recv(control.post_recv((3,), torch.uint8, 0, 0, "a payload"))
    control.send(torch.zeros(2), 0, 1, "a reply")
    assert received.device.type == "cpu" and posted == [("recv", "cpu", 0), ("send", "cpu", 0)]


def test_waits_that_time_out_together_in_a_loop_name_no_rank_as_stopped() -> None:
    """A message never sent (rank 0 leaves out a send): rank 1 waits for rank 0, rank 0 for rank 2's output and rank 2
    for rank 1, each with the same time limit, started together. Rank 0's and rank 1's waits time out at once, and
    when rank 0's report is first by a hair, rank 2 (which only heard rank 1 hang up) was called "stopped
    responding", a suspended process: no rank stopped (test_split_runtime's missing message, seen once in CI)."""
    from types import SimpleNamespace

    from moirai.runtime.blame import _loop_headline

    group = SimpleNamespace(rank=0, devices=["cpu", "cpu", "cpu"])
    timed_out = "TimeoutError: Timed out after 3 s waiting for the message"
    reports = {
        0: {"peer": 2, "at": 100.0, "message": f"rank 0: receiving flat output 0 from rank 2 failed ({timed_out})"},
        1: {"peer": 0, "at": 100.01, "message": f"rank 1: receiving tensor relu from rank 0 failed ({timed_out})"},
        2: {"peer": 1, "at": 100.05, "message": "rank 2: receiving from rank 1 failed (ConnectionError: closed)"},
    }
    assert _loop_headline(group, reports, 0, "request 11") is None
    # A rank that stopped (its own wait ends long after the others', once it is resumed) is still named.
    reports[1]["at"] = 100.0
    reports[0] = {**reports[0], "at": 130.0}
    reports[2] = {**reports[2], "peer": 0, "message": "rank 2: receiving from rank 0 failed (ConnectionError: closed)"}
    stopped = {0: {**reports[0], "peer": 1}, 1: reports[1]}
    assert "rank 0 (cpu, this process) stopped responding" in (_loop_headline(group, stopped, 0, "request 11") or "")
