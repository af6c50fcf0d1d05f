"""Hosts under torchrun: the plan's hosts against torchrun's layout, each rank's share of its own host, and which
ranks share memory."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from moirai.cluster.hardware import Device
from moirai.cluster.host import available_cores
from moirai.errors import InputError
from moirai.runtime import distributed, shm, shm_files
from moirai.runtime.hosts import TorchrunLayout, host_ranks, plan_host_blocks, torchrun_layout


def layout(rank: int, local_world_size: int, world_size: int = 4) -> TorchrunLayout:
    return TorchrunLayout(rank, world_size, rank % local_world_size, local_world_size, rank // local_world_size)


def test_torchruns_layout_is_read_from_its_variables() -> None:
    environment = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert torchrun_layout(environment) == layout(3, 2)
    assert torchrun_layout(environment).host_ranks == range(2, 4)
    assert torchrun_layout({"RANK": "0", "WORLD_SIZE": "2"}) is None  # a group the user set up: no layout
    with pytest.raises(InputError, match="does not add up"):
        torchrun_layout({**environment, "LOCAL_WORLD_SIZE": "3"})
    # RANK and WORLD_SIZE are torchrun_world's to read: its answers, not a second reading's.
    with pytest.raises(InputError, match="RANK=4 and WORLD_SIZE=4 do not fit"):
        torchrun_layout({**environment, "RANK": "4"})
    one_rank = {**environment, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert torchrun_layout(one_rank) is None  # a world of one rank is a local run


def test_a_plan_on_several_hosts_puts_ranks_host_by_host() -> None:
    hosts = ["a", "a", "b", "b"]
    assert plan_host_blocks(hosts) == [("a", range(0, 2)), ("b", range(2, 4))]
    assert host_ranks(hosts, 3, layout(3, 2)) == range(2, 4)
    assert host_ranks(hosts, 1, None) == range(0, 2)  # no layout: the plan's hosts


def test_a_plan_on_one_host_runs_on_the_hosts_torchrun_gives_it() -> None:
    assert host_ranks(["localhost"] * 4, 3, layout(3, 1)) == range(3, 4)
    assert host_ranks(["localhost"] * 4, 3, layout(3, 4)) == range(0, 4)


def test_a_mismatch_between_the_plans_hosts_and_torchruns_layout_names_both() -> None:
    with pytest.raises(InputError) as mismatch:
        host_ranks(["a", "a", "b", "b"], 2, layout(2, 1))
    assert "a: ranks 0-1, b: ranks 2-3" in str(mismatch.value) and "LOCAL_WORLD_SIZE 1" in str(mismatch.value)
    with pytest.raises(InputError, match="GROUP_RANK 0"):  # the right size, the wrong node
        host_ranks(["a", "a", "b", "b"], 2, TorchrunLayout(2, 4, 0, 2, 0))
    with pytest.raises(InputError, match="not contiguous"):
        host_ranks(["a", "b", "a"], 0, None)


def torchrun_environment(monkeypatch, where: TorchrunLayout) -> None:
    variables = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    for variable, value in zip(variables, dataclasses.astuple(where), strict=True):
        monkeypatch.setenv(variable, str(value))


def test_a_rank_alone_on_its_host_gets_the_whole_host(monkeypatch) -> None:
    # ["cpu", "cpu"] across two hosts: each rank's host has one device, so its rank gets every core there.
    cores = tuple(available_cores())
    torchrun_environment(monkeypatch, layout(1, local_world_size=1, world_size=2))
    resources, neighbours = distributed._torchrun_resources(["cpu", "cpu"], 1)
    assert resources.cores == cores and neighbours == range(1, 2)
    torchrun_environment(monkeypatch, layout(1, local_world_size=2, world_size=2))
    shared, neighbours = distributed._torchrun_resources(["cpu", "cpu"], 1)
    assert neighbours == range(0, 2)
    if len(cores) > 1:
        assert len(shared.cores) == len(cores) // 2


def test_a_rank_splits_only_its_own_hosts_cores(monkeypatch) -> None:
    devices = [Device(f"cpu_{k}", "cpu", 1e9, 1e11, 1e10, host=host) for k, host in enumerate("aab")]
    torchrun_environment(monkeypatch, TorchrunLayout(2, 3, 0, 1, 1))  # host b: rank 2 alone
    resources, neighbours = distributed._torchrun_resources(devices, 2)
    assert resources.cores == tuple(available_cores()) and neighbours == range(2, 3)
    monkeypatch.setenv("GROUP_RANK", "2")
    with pytest.raises(InputError, match="host 'b'"):
        distributed._torchrun_resources(devices, 2)


def test_shared_memory_joins_only_the_ranks_of_one_host() -> None:
    store = dist.HashStore()
    with ThreadPoolExecutor(2) as pool:
        apart = list(pool.map(lambda rank: shm.connect(rank, 2, store, 10.0, "apart", neighbours=[rank]), range(2)))
        together = list(pool.map(lambda rank: shm.connect(rank, 2, store, 10.0, "together", [0, 1]), range(2)))
    assert [links.peers for links in apart] == [frozenset(), frozenset()]
    assert [links.peers for links in together] == [frozenset({1}), frozenset({0})]
    for links in apart + together:
        links.close()


def test_a_hosts_identity_tells_apart_two_shared_memory_file_systems(monkeypatch, tmp_path) -> None:
    here, default_dir = shm_files.host_identity(), shm_files.shm_dir()
    monkeypatch.setenv(shm_files.DIR_ENV, str(tmp_path))
    elsewhere = shm_files.host_identity()
    assert here.split("/")[:2] == elsewhere.split("/")[:2]  # one hostname, one boot
    assert (here == elsewhere) == (os.stat(tmp_path).st_dev == os.stat(default_dir).st_dev)
