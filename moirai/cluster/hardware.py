"""Device and Link: what a cluster is made of, with the units their numbers are given in, and the device table.

:mod:`moirai.cluster.devices` builds a :class:`~moirai.cluster.devices.Cluster` from them;
:mod:`moirai.cluster.files` reads and writes them as cluster files and the device kinds
(:mod:`moirai.cluster.kinds`) detect the local ones. They live here, below all three, so that none imports
another in a cycle.
"""

from __future__ import annotations

import math
import re
import socket
from dataclasses import dataclass
from decimal import Decimal
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


class FloatLiteral(float):
    """A number as a cluster file writes it: a float that keeps its decimal text, so that scaling it by its unit
    (:func:`from_unit`) is exact: ``0.1344 * 1e12`` in floats is ``134399999999.99998``, not ``134400000000.0``, and a
    value in base units does not always have a float in the file's unit that scales back to it."""

    text: str

    def __new__(cls, text: str) -> FloatLiteral:
        digits = text.replace("_", "")  # TOML allows 1_000.5
        literal = super().__new__(cls, digits)
        if math.isinf(literal) and digits.lstrip("+-") != "inf":  # 1e400: infinity means no link, cannot run there
            raise ValueError(
                f"the number {digits[:40]} is too large for a float (at most about 1.8e308) and would read as "
                "infinity; write the number it means, or write inf where that is meant"
            )
        literal.text = digits
        return literal

    def __getnewargs__(self) -> tuple[str]:  # copy and pickle rebuild it from its text, not from the float
        return (self.text,)


def from_unit(value: Any, unit: float) -> float:
    """``value`` (a number in a file, in ``unit``s) in base units, rounded once, from its decimal text."""
    if isinstance(value, int):  # exact however long (float() of a 400-digit integer raises)
        return float(Decimal(value) * Decimal(repr(unit)))
    if not math.isfinite(float(value)):
        return float(value) * unit
    text = value.text if isinstance(value, FloatLiteral) else repr(float(value))  # numpy's repr names its type
    return float(Decimal(text) * Decimal(repr(unit)))


def in_unit(value: float, unit: float) -> float:
    """``value`` (base units) in ``unit``s, as a number :func:`from_unit` reads back as exactly ``value``: the
    plain quotient where it does, else its exact decimal (the units are powers of ten, or 10**9 / 8)."""
    value = float(value)
    plain = value / unit
    if not math.isfinite(value) or from_unit(plain, unit) == value:
        return plain
    exact = Decimal(repr(value)) / Decimal(repr(unit))
    # Plain digits where they are few (10.0, not 1E+1): the file is for people to read and edit too.
    return FloatLiteral(format(exact, "f") if abs(exact.adjusted()) < 16 else str(exact))


# torch dtype name -> the precision column of the device table.
PRECISION_OF_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


# The host of a device that names none: this machine, whichever it is (a plan of ["cpu", "cpu"] runs where loaded).
LOCAL_HOST = "localhost"


def is_this_host(host: str) -> bool:
    """Whether a device's ``host`` names the machine this process runs on: :data:`LOCAL_HOST`, the loopback address or
    this machine's hostname. The one answer the measured costs, the oversubscription warning and the rest ask."""
    return host in (LOCAL_HOST, "127.0.0.1", socket.gethostname())


def host_key(host: str) -> str:
    """The machine a device's ``host`` names, as devices are grouped by host (their cores shared, their number
    weighed against the cores): :data:`LOCAL_HOST` for every name of this machine (:func:`is_this_host`), else the
    name itself."""
    return LOCAL_HOST if is_this_host(host) else host


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
    host: str = LOCAL_HOST
    rank: int | None = None
    cores: tuple[int, ...] | None = None
    threads: int | None = None

    @property
    def on_this_host(self) -> bool:
        """Whether ``host`` names the machine this process runs on (:func:`is_this_host`)."""
        return is_this_host(self.host)

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
    return tomllib.loads(
        resources.files("moirai").joinpath("data/device_types.toml").read_text(), parse_float=FloatLiteral
    )


def device_type_named(kind_name: str, product_name: str) -> str | None:
    """The row of the device table for a device of kind ``kind_name`` whose driver calls it ``product_name``
    (one of the row's ``match`` words, whole words so that ``"P4"`` names a Tesla P4 but not a Tesla P40)."""
    for type_name, row in device_types().items():
        if row.get("kind") == kind_name and any(
            re.search(rf"\b{re.escape(word)}\b", product_name) for word in row.get("match", ())
        ):
            return type_name
    return None
