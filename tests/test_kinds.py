"""The device-kind registry (moirai/cluster/kinds.py): adding a kind is one class, registered, and nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moirai.cluster.devices import Cluster, Device
from moirai.cluster.kinds import (
    CPU,
    CUDA,
    DeviceKind,
    LocalLink,
    backend_for,
    default_group_backend,
    device_memory_kind,
    kind_named,
    kind_of,
    register,
    unregister,
)
from moirai.errors import ClusterError
from moirai.runtime.resources import rank_resources


@dataclass(frozen=True)
class FakeMpsKind(DeviceKind):
    """An MPS-like accelerator: one device, host-staged messages over gloo, three host threads, a fast local link.
    Only what torch cannot fake without the hardware (its count, its properties) is faked."""

    name: str = "mps"
    aliases: tuple[str, ...] = ("apple-gpu",)
    accelerator: bool = True
    backend: str = "gloo"
    messages_in_device_memory: bool = False
    pinned: bool = False
    rank_threads: int | None = 3
    local_link: LocalLink = LocalLink(50e9, 4e-6)

    def count(self) -> int:
        return 1

    def available(self, device: torch.device) -> bool:
        return (device.index or 0) < self.count()

    def describe(self, torch_device: str, name: str, share: int, index: int = 0) -> Device:
        self.check_index(torch_device)
        return Device(name, torch_device, 32e9 / share, 13.6e12, 400e9, 8e-6, self.name)


@pytest.fixture
def mps() -> Iterator[DeviceKind]:
    kind = register(FakeMpsKind())
    yield kind
    unregister(kind.name)


def test_a_registered_kind_is_detected(mps: DeviceKind) -> None:
    cluster = Cluster.from_devices(["cpu", "mps"])
    assert [kind_of(d) for d in cluster.devices] == [CPU, mps]
    assert cluster.devices[1].kind == "mps" and cluster.devices[1].memory_bytes == 32e9
    # The default local link between a CPU and an accelerator is the accelerator's.
    assert cluster.bandwidth_bytes_per_s[0, 1] == 50e9 and cluster.latency_s[1, 0] == 4e-6
    assert "mps0" in Cluster.detect().names
    with pytest.raises(ClusterError, match="has 1 mps devices"):
        Cluster.from_devices(["mps:1"])


def test_a_registered_kind_is_parsed_from_cluster_files_by_its_name_or_alias(mps: DeviceKind, tmp_path: Path) -> None:
    path = tmp_path / "mac.toml"
    path.write_text(
        '[[devices]]\nname = "m2"\ntorch_device = "mps"\nkind = "apple-gpu"\n'
        "memory_gb = 32\npeak_tflops = { fp32 = 13.6 }\nmemory_bandwidth_gb_per_s = 400\n"
    )
    (device,) = Cluster.from_file(path).devices
    assert (device.torch_device, device.kind) == ("mps", "mps")
    Cluster.from_file(path).to_file(tmp_path / "again.toml")
    assert Cluster.from_file(tmp_path / "again.toml").devices == (device,)


def test_a_registered_kind_gets_its_backend_and_rank_resources(mps: DeviceKind) -> None:
    assert backend_for(["mps", "mps"]) == "gloo" and default_group_backend(["mps", "mps"]) == "gloo"
    assert backend_for(["cpu", "mps"]) == "cpu:gloo,mps:gloo"
    assert device_memory_kind(["mps", "mps"]) is None, "its messages go through the host"
    cpu_a, cpu_b, accelerator = rank_resources(["cpu", "cpu", "mps"], cores=[0, 1, 2, 3])
    assert (cpu_a.cores, cpu_b.cores) == ((0, 1), (2, 3)), "CPU ranks split the cores, the MPS rank takes none"
    assert (accelerator.cores, accelerator.threads) == (None, 3), "an unpinned rank gets its kind's threads"


def test_without_registration_the_kind_is_unknown() -> None:
    with pytest.raises(ClusterError, match="moirai runs parts on 'cpu' and 'cuda:N' devices, not mps"):
        Cluster.from_devices(["mps"])


def test_one_notion_of_kind_and_files_that_say_gpu_still_load(tmp_path: Path) -> None:
    assert kind_named("gpu") is CUDA and kind_named("cuda") is CUDA and kind_named("cpu") is CPU
    with pytest.raises(ClusterError, match="device 'x' has kind 'tpu'; use one of"):
        kind_named("tpu", "device 'x'")
    path = tmp_path / "old.toml"
    path.write_text('[[devices]]\nname = "g"\ntorch_device = "cuda:0"\nkind = "gpu"\ntype = "t4"\n')
    (device,) = Cluster.from_file(path).devices
    assert device.kind == "cuda" and kind_of(device) is CUDA
    # A GPU of a cluster being planned, tried on this CPU: its own kind decides what its rank gets.
    planned = Device("g", "cpu", 16e9, 8e12, 300e9, kind="gpu")
    assert kind_of(planned) is CUDA and rank_resources([planned], cores=[0, 1, 2])[0].cores is None
    assert kind_of(Device("c", "cpu", 1e9, 1e12, 1e10)) is CPU, "no kind given: that of its torch device"
