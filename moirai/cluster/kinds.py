"""Device kinds (``cpu``, ``cuda``): the one registry of what the cost model, the runtime, calibration and the
cluster files ask about a kind of device.

A kind owns its detection (:meth:`DeviceKind.describe`), its role in the cluster model (``accelerator``), its
process-group backend, whether its ranks are pinned to CPU cores and how many host threads they get, the
default local links of its devices and the names cluster files may give it (its name and ``aliases``).
Code elsewhere asks :func:`kind_of` (a torch device) or :func:`kind_named` (a cluster file's ``kind``) instead
of testing for a device type. Supporting another kind (MPS, XPU) is one more :class:`DeviceKind` passed to
:func:`register`, and a row of the device table for each part its detection should know by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from moirai.cluster.hardware import GB, MICROSECOND, TFLOPS, Device, device_type_named, device_types, from_unit
from moirai.cluster.host import available_cores, core_shares, cpu_flags_and_clock
from moirai.errors import ClusterError

_CPU_MEMORY_BANDWIDTH_BYTES_PER_S = 10e9
# fp32 FLOPs per cycle and core of the widest vector FMA the CPU flags announce (2 FMA units).
_FP32_FLOPS_PER_CYCLE_BY_FLAG = (("avx512f", 64), ("fma", 32), ("avx", 16))
_FP32_FLOPS_PER_CYCLE_BASELINE = 8
# Eager PyTorch spends about this long in Python and the dispatcher on every op on a CPU.
_CPU_LAUNCH_OVERHEAD_S = 10e-6


class LocalLink(NamedTuple):
    """A link between two local devices before any calibration."""

    bandwidth_bytes_per_s: float
    latency_s: float


class HostSpans:
    """The profiler's clock between op groups where ops run as they are called (the CPU): ``clock``'s readings."""

    warmup_s = 0.0  # least seconds of warm-up runs before the timed ones

    def __init__(self, clock: Callable[[], float]) -> None:
        self.read = clock
        self.name = clock.__name__

    def seconds(self, readings: Sequence[Any]) -> list[float]:
        return list(readings)


class CudaEventSpans:
    """The profiler's clock between op groups on a GPU: an event recorded on the stream at each reading.

    [Note: timing a GPU's ops] A GPU runs its kernels after the host has queued them. Synchronizing at every reading
    times each group as its queueing plus its kernels plus a round trip to the device, which a run of the whole part
    never waits for. An event's time is when the stream reaches it: after the group's kernels where they are the
    slower, after the host's queueing where the device waits for it (small ops), which is how the group takes its
    time in a run of the whole part. Read out after the run, with one synchronize.

    [Note: a GPU's clocks] An idle GPU runs at a fraction of its clock (an H200 of the device machines: 345 MHz idle,
    1980 MHz under load) and raises it only under load: warm-up lasts at least ``warmup_s``, so that the timed runs
    see the clock a served model runs at. (On the first H200 runs it did not close the gap between predicted and
    measured: bench/RESULTS.md, "CUDA: the first runs".)
    """

    name = "cuda events"
    warmup_s = 1.0

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, readings: Sequence[Any]) -> list[float]:
        torch.cuda.synchronize(self.device)
        return [readings[0].elapsed_time(event) / 1e3 for event in readings]


Spans = HostSpans | CudaEventSpans  # how the profiler reads time between op groups on one kind of device


@dataclass(frozen=True)
class DeviceKind:
    """One kind of torch device; the base class is the host CPU."""

    name: str = "cpu"  # torch.device(...).type, and the kind's name in cluster files and the device table
    aliases: tuple[str, ...] = ()  # other names cluster files may give the kind
    accelerator: bool = False  # its own memory, fed over a link, and detected one device per index
    backend: str = "gloo"  # torch.distributed backend between ranks of this kind
    messages_in_device_memory: bool = False  # ranks of this kind exchange tensors without staging through the host
    pinned: bool = True  # its ranks compute on the host's cores: each gets its own block of them
    rank_threads: int | None = None  # host threads of an unpinned rank (None: one per core of its block)
    # A loopback link between two processes on one host, as measured on a 2-core machine.
    local_link: LocalLink = LocalLink(2e9, 50e-6)

    def count(self) -> int:
        """How many devices of this kind this machine has."""
        return 1

    def available(self, device: torch.device) -> bool:
        """Whether ``device`` exists on this machine."""
        return True

    def synchronize(self, device: torch.device) -> None:
        """Wait until the work queued on ``device`` is done (a no-op where work runs as it is called)."""

    def spans(self, device: torch.device, clock: Callable[[], float]) -> Spans:
        """The profiler's clock between the op groups of a run on ``device``; ``clock`` where ops run as called."""
        return HostSpans(clock)

    def set_current(self, device: torch.device) -> None:
        """Make ``device`` the process's current device of its kind (before joining a process group)."""

    def can_access_peer(self, a: int, b: int) -> bool:
        """Whether devices ``a`` and ``b`` of this kind reach each other's memory directly."""
        return False

    def hardware_name(self, device: torch.device) -> str | None:
        """The product name of ``device``, or None where the caller knows better (the CPU model)."""
        return None

    def properties(self, index: int) -> Any:
        """The driver's description of device ``index`` (memory, multiprocessors), where it has one."""
        raise ClusterError(f"no device properties for kind {self.name!r}")

    def device_group(self, store: Any, rank: int, world_size: int) -> Any:
        """A process group that carries messages in this kind's device memory (kinds that keep them there)."""
        raise ClusterError(f"ranks of kind {self.name!r} exchange messages through the host")

    def describe(self, torch_device: str, name: str, share: int, index: int = 0) -> Device:
        """The local device ``torch_device`` (detected) as ``name``; ``share`` logical devices split it and this is
        the ``index``-th of them (with more devices than cores, some share a core: :func:`core_shares`)."""
        if torch_device != self.name:
            raise ClusterError(f"unsupported device {torch_device!r}; use {self.name!r} for the host CPU")
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cores = core_shares(available_cores(), share)[index]
        flags, clock_hz = cpu_flags_and_clock()
        per_cycle = next(
            (flops for flag, flops in _FP32_FLOPS_PER_CYCLE_BY_FLAG if flag in flags), _FP32_FLOPS_PER_CYCLE_BASELINE
        )
        peak = per_cycle * clock_hz * cores
        # AVX512-BF16 dot products run two bf16 pairs per fp32 lane.
        peak_bf16 = 2 * peak if "avx512_bf16" in flags else None
        return Device(
            name,
            torch_device,
            memory / share,
            peak,
            _CPU_MEMORY_BANDWIDTH_BYTES_PER_S,
            _CPU_LAUNCH_OVERHEAD_S,
            self.name,
            peak_flops_bf16=peak_bf16,
        )

    def describe_accelerator(self, torch_device: str, name: str, share: int, memory_bytes: float) -> Device | None:
        """An accelerator of a known type (a row of the device table of this kind matching its product name)
        with ``memory_bytes`` of memory, or None where the table does not know it."""
        known = device_type_named(self.name, self.hardware_name(torch.device(torch_device)) or "")
        if known is None:
            return None
        row = device_types()[known]
        peaks = {key: from_unit(value, TFLOPS) for key, value in row["peak_tflops"].items()}
        return Device(
            name,
            torch_device,
            memory_bytes / share,
            peaks["fp32"],
            from_unit(row["memory_bandwidth_gb_per_s"], GB),
            from_unit(row["launch_overhead_us"], MICROSECOND),
            self.name,
            known,
            peaks.get("fp16"),
            peaks.get("bf16"),
            row["efficiency"],
        )

    def check_index(self, torch_device: str) -> int:
        """The index of ``torch_device``, checked against the devices of this kind this machine has."""
        if self.count() == 0:
            raise ClusterError(f"{torch_device} requested but {self.name.upper()} is not available on this machine")
        index = torch.device(torch_device).index or 0
        if index >= self.count():
            raise ClusterError(f"{torch_device} requested but this machine has {self.count()} {self.name} devices")
        return index


@dataclass(frozen=True)
class CudaKind(DeviceKind):
    name: str = "cuda"
    aliases: tuple[str, ...] = ("gpu",)  # what cluster files and the device table said before kinds had names
    accelerator: bool = True
    backend: str = "nccl"
    messages_in_device_memory: bool = True
    pinned: bool = False
    # Enough to launch kernels and copy, few enough to leave the CPU ranks alone.
    rank_threads: int | None = 2
    # A PCIe 3 x16 link, the slowest path between two local GPUs or a GPU and the host.
    local_link: LocalLink = LocalLink(12e9, 10e-6)

    def count(self) -> int:
        return torch.cuda.device_count()

    def available(self, device: torch.device) -> bool:
        return (device.index or 0) < torch.cuda.device_count()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def spans(self, device: torch.device, clock: Callable[[], float]) -> Spans:
        return CudaEventSpans(device)

    def set_current(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def can_access_peer(self, a: int, b: int) -> bool:
        return torch.cuda.can_device_access_peer(a, b)

    def hardware_name(self, device: torch.device) -> str | None:
        return torch.cuda.get_device_name(device.index or 0)

    def properties(self, index: int) -> Any:
        return torch.cuda.get_device_properties(index)

    def device_group(self, store: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupNCCL(store, rank, world_size)

    def describe(self, torch_device: str, name: str, share: int, index: int = 0) -> Device:
        props = self.properties(self.check_index(torch_device))
        known = self.describe_accelerator(torch_device, name, share, props.total_memory)
        if known is not None:
            return known
        # 2 FLOPs per FMA, 128 FP32 lanes per SM on recent NVIDIA parts: a datasheet-level estimate.
        peak = 2 * 128 * props.multi_processor_count * 1.5e9
        bandwidth = 2 * getattr(props, "memory_bus_width", 256) / 8 * getattr(props, "memory_clock_rate", 7e6) * 1e3
        return Device(name, torch_device, props.total_memory / share, peak, bandwidth, 10e-6, self.name)


CPU = DeviceKind()
CUDA = CudaKind()
KINDS: dict[str, DeviceKind] = {}


def register(kind: DeviceKind) -> DeviceKind:
    """Add ``kind`` to the registry (replacing one of its name); every question about its devices then finds it."""
    KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove the kind ``name`` (a test's fake kind); the host CPU stays."""
    if name != CPU.name:
        KINDS.pop(name, None)


for _kind in (CPU, CUDA):
    register(_kind)


def kind_of(device: str | torch.device | Device) -> DeviceKind:
    """The kind of ``device`` (``"cuda:1"``, ``torch.device("cpu")``, or a :class:`Device`, whose own ``kind``
    a cluster file may have given)."""
    if isinstance(device, Device):
        if device.kind is None:
            return kind_of(device.torch_device)
        return kind_named(device.kind, f"device {device.name!r}")
    device_type = torch.device(device).type
    try:
        return KINDS[device_type]
    except KeyError:
        raise ClusterError(f"unsupported device {str(device)!r}; moirai knows {device_spellings()}") from None


def kind_named(name: str, where: str = "a device") -> DeviceKind:
    """The kind a cluster file or the device table calls ``name`` (its name or an alias)."""
    for kind in KINDS.values():
        if name == kind.name or name in kind.aliases:
            return kind
    raise ClusterError(f"{where} has kind {name!r}; use one of {kind_names()}")


def kind_names() -> list[str]:
    """Every name a cluster file may give a device's kind."""
    return [name for kind in KINDS.values() for name in (kind.name, *kind.aliases)]


def device_spellings() -> str:
    """How a user names a device of each kind, for error messages: ``'cpu' and 'cuda:N'``."""
    return " and ".join(f"'{kind.name}:N'" if kind.accelerator else f"'{kind.name}'" for kind in KINDS.values())


def torch_device_types() -> tuple[str, ...]:
    """The torch device types moirai runs parts on."""
    return tuple(KINDS)


def host_device() -> torch.device:
    """Where messages that do not live in device memory are staged: the host's memory."""
    return torch.device(CPU.name)


def detect_device(torch_device: str, name: str, share: int, index: int = 0) -> Device:
    """Properties of a local device; ``share`` logical devices split one physical device, this is the ``index``-th."""
    return kind_of(torch_device).describe(torch_device, name, share, index)


def local_link(a: DeviceKind, b: DeviceKind) -> LocalLink:
    """The default link between two local devices of kinds ``a`` and ``b``: an accelerator's where either is one."""
    return max((a, b), key=lambda kind: kind.accelerator).local_link


def accelerator_kinds() -> tuple[DeviceKind, ...]:
    """Every accelerator kind, for detection."""
    return tuple(kind for kind in KINDS.values() if kind.accelerator)


def kind_for_backend(backend: str) -> DeviceKind:
    """The device kind whose ranks talk over ``backend`` (``"gloo"``: CPU, ``"nccl"``: CUDA)."""
    for kind in KINDS.values():
        if kind.backend == backend:
            return kind
    raise ClusterError(f"unknown backend {backend!r}; choose one of {backends()}")


def backends() -> list[str]:
    """Every process-group backend of a registered kind."""
    return sorted({kind.backend for kind in KINDS.values()})


def backend_for(torch_devices: Sequence[str | torch.device]) -> str:
    """The process-group backend of a world with these devices: one backend when every rank is of one kind,
    else one per kind (``"cpu:gloo,cuda:nccl"``) so torch dispatches each message by its tensor's device."""
    kinds = sorted({kind_of(d) for d in torch_devices}, key=lambda kind: kind.name)
    if len(kinds) == 1:
        return kinds[0].backend
    return ",".join(f"{kind.name}:{kind.backend}" for kind in kinds)


def default_group_backend(torch_devices: Sequence[str | torch.device]) -> str:
    """The backend of the default process group of a world with these devices: :func:`backend_for`, with the
    host's backend beside any kind whose messages live in device memory (headers are host tensors)."""
    kinds = {kind_of(d) for d in torch_devices}
    if any(kind.messages_in_device_memory for kind in kinds):
        kinds.add(CPU)
    return backend_for([kind.name for kind in kinds])


def device_memory_kind(torch_devices: Sequence[str | torch.device]) -> DeviceKind | None:
    """The kind whose ranks need a process group in device memory: one whose messages live there, with at least
    two ranks in this world (messages between two of them use it), or None."""
    kinds = [kind_of(d) for d in torch_devices]
    return next((k for k in dict.fromkeys(kinds) if k.messages_in_device_memory and kinds.count(k) >= 2), None)
