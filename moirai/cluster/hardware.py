"""Device and Link: what a cluster is made of, with the units their numbers are given in.

:mod:`moirai.cluster.devices` builds a :class:`~moirai.cluster.devices.Cluster` from them;
:mod:`moirai.cluster.files` reads and writes them as cluster files and :mod:`moirai.cluster.host` detects the
local ones. They live here, below all
three, so that none imports another in a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GBPS_IN_BYTES_PER_S = 1e9 / 8
TFLOPS = 1e12
MICROSECOND = 1e-6

# torch dtype name -> the precision column of the device table.
PRECISION_OF_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Device:
    """One device a part of the model runs on.

    ``torch_device`` is where its tensors live (``"cpu"``, ``"cuda:1"``) on ``host``; several
    logical devices may share a torch device (they are separate processes in a distributed run).
    ``peak_flops`` is the fp32 peak; ``peak_flops_fp16`` / ``peak_flops_bf16`` are ``None`` where
    the device has no faster path for that dtype (the fp32 peak applies).
    """

    name: str
    torch_device: str
    memory_bytes: float
    peak_flops: float
    memory_bandwidth_bytes_per_s: float
    launch_overhead_s: float = 5e-6
    kind: str = "cpu"
    device_type: str | None = None
    peak_flops_fp16: float | None = None
    peak_flops_bf16: float | None = None
    efficiency: float = 0.5
    host: str = "localhost"
    rank: int | None = None
    cores: tuple[int, ...] | None = None
    threads: int | None = None

    def peak_flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for a torch dtype name (``"float16"``); other dtypes use the fp32 peak."""
        precision = PRECISION_OF_DTYPE.get(dtype.removeprefix("torch."), "fp32")
        peak = {"fp16": self.peak_flops_fp16, "bf16": self.peak_flops_bf16}.get(precision)
        return self.peak_flops if peak is None else peak


@dataclass(frozen=True)
class Link:
    """A direct, directed link ``src -> dst`` between two devices (names)."""

    src: str
    dst: str
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
