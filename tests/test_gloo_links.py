"""Gloo's three connections per pair of ranks (moirai.runtime.groups.GlooLinks, [Note: a connection per direction]):
which connection each message takes, and a world of gloo groups that carries headers and data both ways."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from moirai.runtime.groups import GlooLinks, Group, local_group
from moirai.runtime.protocol import Header, HeaderKind, Messages, receive_header, send_header
from moirai.runtime.store import RunStore


class RecordingLink:
    """A link that records the messages posted on it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.posted: list[tuple[str, int]] = []

    def send(self, tensors, dst, tag):  # noqa: ANN001, ANN201
        self.posted.append(("send", dst))

    def recv(self, tensors, src, tag):  # noqa: ANN001, ANN201
        self.posted.append(("recv", src))


def links_of_rank(rank: int) -> GlooLinks:
    return GlooLinks(rank, RecordingLink("to higher"), RecordingLink("to lower"), RecordingLink("control"))


def test_data_to_a_higher_rank_and_its_receive_share_one_connection_and_the_other_way_another() -> None:
    middle = links_of_rank(1)
    one = torch.ones(1)
    middle.send([one], 2, 0)
    middle.recv([one], 0, 0)
    middle.send([one], 0, 0)
    middle.recv([one], 2, 0)
    assert middle.to_higher.posted == [("send", 2), ("recv", 0)]  # 1 -> 2 and 0 -> 1: from lower to higher
    assert middle.to_lower.posted == [("send", 0), ("recv", 2)]
    assert middle.control.posted == []


def test_a_group_sends_headers_through_the_control_connection_and_shared_memory_peers_through_shared_memory() -> None:
    gloo = links_of_rank(0)
    group = Group(0, [torch.device("cpu")] * 3, gloo=gloo, nccl=None, store=None)
    cpu = torch.device("cpu")
    assert group.link(cpu, 1) is gloo
    assert group.link(cpu, 1, control=True) is gloo.control
    shared = type("SharedMemoryToRank1", (), {"peers": {1}})()
    group = Group(0, [torch.device("cpu")] * 3, gloo=gloo, nccl=None, store=None, shared_memory=shared)
    assert group.link(cpu, 1, control=True) is shared  # one host: headers in shared memory too
    assert group.link(cpu, 2, control=True) is gloo.control


def test_a_gloo_world_of_three_carries_headers_and_data_both_ways() -> None:
    """Every rank sends every other a header (control connection) and a tensor (a data connection), all posted
    before any is waited for: each arrives whole at its rank, under its tag."""
    world_size = 3
    store = RunStore(dist.HashStore(), None)
    timeout = datetime.timedelta(seconds=30)

    def rank_main(rank: int) -> dict[int, tuple[int, list[float]]]:
        group = local_group(rank, ["cpu"] * world_size, store, 30.0, shared_memory=False)
        assert isinstance(group.gloo, GlooLinks)
        peers = [peer for peer in range(world_size) if peer != rank]
        data = Messages(group, 0, timeout)
        pending = {peer: data.post_recv((2,), torch.float32, peer, 5, "data") for peer in peers}
        sent = []
        if rank == 0:
            sent = [send_header(group, 0, peer, Header(HeaderKind.RUN, 7, 100 + peer, 1000), timeout) for peer in peers]
        for peer in peers:
            data.send(torch.tensor([rank, peer], dtype=torch.float32), peer, 5, "data")
        header = receive_header(group, 0, timeout) if rank != 0 else None
        got = {peer: (header.request if header else -1, data.wait_recv(pending[peer]).tolist()) for peer in peers}
        data.wait_sends()
        for control in sent:
            control.wait_sends()
        return got

    with ThreadPoolExecutor(world_size) as pool:
        results = list(pool.map(rank_main, range(world_size)))
    for rank, got in enumerate(results):
        for peer, (request, tensor) in got.items():
            assert tensor == [peer, rank]
            assert request == (-1 if rank == 0 else 100 + rank)


@pytest.mark.parametrize("rank", [0, 2])
def test_the_end_ranks_use_one_data_connection_each_way(rank: int) -> None:
    links = links_of_rank(rank)
    peer = 1
    links.send([torch.ones(1)], peer, 0)
    used = links.to_higher if rank < peer else links.to_lower
    assert used.posted == [("send", peer)]
