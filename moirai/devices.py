"""Cluster description: devices of different speed and memory, and a directed link matrix.

Example::

    cluster = Cluster.from_devices(["cpu", "cpu", "cpu"])   # three logical CPU devices
    cluster.transfer_time_s(1e6, 0, 1)                        # latency + bytes / bandwidth
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moirai.errors import ClusterError

# A loopback gloo link between two processes on one host, as measured on a 2-core machine.
_LOCAL_PROCESS_BANDWIDTH_BYTES_PER_S = 2e9
_LOCAL_PROCESS_LATENCY_S = 50e-6
# A PCIe 3 x16 link, the slowest path between two local GPUs or a GPU and the host.
_PCIE_BANDWIDTH_BYTES_PER_S = 12e9
_PCIE_LATENCY_S = 10e-6
_CPU_PEAK_FLOPS_PER_CORE = 30e9
_CPU_MEMORY_BANDWIDTH_BYTES_PER_S = 10e9


@dataclass(frozen=True)
class Device:
    """One device a part of the model runs on.

    ``torch_device`` is where its tensors live (``"cpu"``, ``"cuda:1"``); several logical
    devices may share a torch device (they are separate processes in a distributed run).
    """

    name: str
    torch_device: str
    memory_bytes: float
    peak_flops: float
    memory_bandwidth_bytes_per_s: float
    launch_overhead_s: float = 5e-6


@dataclass(frozen=True, eq=False)
class Cluster:
    """Devices and the directed links between them (``bandwidth[a, b]`` is a -> b)."""

    devices: tuple[Device, ...]
    bandwidth_bytes_per_s: np.ndarray
    latency_s: np.ndarray

    def __post_init__(self) -> None:
        k = len(self.devices)
        if k == 0:
            raise ClusterError("a cluster needs at least one device")
        names = [d.name for d in self.devices]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ClusterError(f"duplicate device names {duplicates}; give every device its own name")
        object.__setattr__(self, "bandwidth_bytes_per_s", np.asarray(self.bandwidth_bytes_per_s, float))
        object.__setattr__(self, "latency_s", np.asarray(self.latency_s, float))
        for label, matrix in (("bandwidth", self.bandwidth_bytes_per_s), ("latency", self.latency_s)):
            if matrix.shape != (k, k):
                raise ClusterError(f"{label} matrix is {matrix.shape}, must be {k}x{k} (one row per device)")
        off_diagonal = ~np.eye(k, dtype=bool)
        if np.any(self.bandwidth_bytes_per_s[off_diagonal] <= 0):
            raise ClusterError("every link between two distinct devices needs a positive bandwidth")
        if np.any(self.latency_s < 0):
            raise ClusterError("link latencies must be non-negative")
        for d in self.devices:
            if d.memory_bytes <= 0 or d.peak_flops <= 0 or d.memory_bandwidth_bytes_per_s <= 0:
                raise ClusterError(f"device {d.name!r} needs positive memory, peak FLOP/s and memory bandwidth")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def transfer_time_s(self, num_bytes: float, src: int, dst: int) -> float:
        """Time to move ``num_bytes`` from device ``src`` to ``dst`` (0 on one device)."""
        if src == dst:
            return 0.0
        return float(self.latency_s[src, dst] + num_bytes / self.bandwidth_bytes_per_s[src, dst])

    @classmethod
    def from_devices(cls, torch_devices: Sequence[str]) -> Cluster:
        """Describe local devices by detection; a device string repeated gives separate logical devices."""
        if not torch_devices:
            raise ClusterError("give at least one device, e.g. ['cpu', 'cpu'] or ['cuda:0', 'cuda:1']")
        counts = {d: list(torch_devices).count(d) for d in torch_devices}
        seen: dict[str, int] = {}
        devices = []
        for spec in torch_devices:
            torch_device = str(torch.device(spec))
            index = seen.get(spec, 0)
            seen[spec] = index + 1
            name = torch_device.replace(":", "") + (f"_{index}" if counts[spec] > 1 else "")
            devices.append(_detect(torch_device, name, share=counts[spec]))
        k = len(devices)
        bandwidth = np.full((k, k), _LOCAL_PROCESS_BANDWIDTH_BYTES_PER_S)
        latency = np.full((k, k), _LOCAL_PROCESS_LATENCY_S)
        for a in range(k):
            for b in range(k):
                if "cuda" in devices[a].torch_device or "cuda" in devices[b].torch_device:
                    bandwidth[a, b], latency[a, b] = _PCIE_BANDWIDTH_BYTES_PER_S, _PCIE_LATENCY_S
        np.fill_diagonal(latency, 0.0)
        return cls(tuple(devices), bandwidth, latency)


def _detect(torch_device: str, name: str, share: int) -> Device:
    """Properties of a local device; ``share`` logical devices split one physical device."""
    if torch_device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ClusterError(f"{torch_device} requested but CUDA is not available on this machine")
        index = torch.device(torch_device).index or 0
        if index >= torch.cuda.device_count():
            raise ClusterError(f"{torch_device} requested but only {torch.cuda.device_count()} CUDA devices exist")
        props = torch.cuda.get_device_properties(index)
        # 2 FLOPs per FMA, 128 FP32 lanes per SM on recent NVIDIA parts: a datasheet-level estimate.
        peak = 2 * 128 * props.multi_processor_count * 1.5e9
        bandwidth = 2 * getattr(props, "memory_bus_width", 256) / 8 * getattr(props, "memory_clock_rate", 7e6) * 1e3
        return Device(name, torch_device, props.total_memory / share, peak, bandwidth)
    if torch_device != "cpu":
        raise ClusterError(f"unsupported device {torch_device!r}; use 'cpu' or 'cuda:N'")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = max(1, (os.cpu_count() or 1) // share)
    return Device(name, "cpu", memory / share, _CPU_PEAK_FLOPS_PER_CORE * cores, _CPU_MEMORY_BANDWIDTH_BYTES_PER_S)
