"""Device and Link: what a cluster is made of, with the units their numbers are given in, and the device table.

:mod:`moirai.cluster.devices` builds a :class:`~moirai.cluster.devices.Cluster` from them;
:mod:`moirai.cluster.files` reads and writes them as cluster files and the device kinds
(:mod:`moirai.cluster.kinds`) detect the local ones. They live here, below all three, so that none imports
another in a cycle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

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
    ``kind`` is its :class:`~moirai.cluster.kinds.DeviceKind` by name (what its rank gets, how it is detected);
    a cluster file may give it apart from ``torch_device`` (a GPU of a cluster being planned, tried on a CPU).
    ``peak_flops`` is the fp32 peak; ``peak_flops_fp16`` / ``peak_flops_bf16`` are ``None`` where
    the device has no faster path for that dtype (the fp32 peak applies).
    """

    name: str
    torch_device: str
    memory_bytes: float
    peak_flops: float
    memory_bandwidth_bytes_per_s: float
    launch_overhead_s: float = 5e-6
    kind: str | None = None  # a name of moirai.cluster.kinds.KINDS; None: the kind of torch_device
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


@cache
def device_types() -> dict[str, dict[str, Any]]:
    """The built-in device table (``moirai/data/device_types.toml``), by type name."""
    return tomllib.loads(resources.files("moirai").joinpath("data/device_types.toml").read_text())


def device_type_named(kind_name: str, product_name: str) -> str | None:
    """The row of the device table for a device of kind ``kind_name`` whose driver calls it ``product_name``
    (one of the row's ``match`` words, whole words so that ``"P4"`` names a Tesla P4 but not a Tesla P40)."""
    for type_name, row in device_types().items():
        if row.get("kind") == kind_name and any(
            re.search(rf"\b{re.escape(word)}\b", product_name) for word in row.get("match", ())
        ):
            return type_name
    return None
