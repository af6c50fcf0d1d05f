"""The local machine: its devices' properties, and the CPU cores a process may run on.

:meth:`moirai.Cluster.detect` and :meth:`moirai.Cluster.from_devices` describe devices with
:func:`detect_device`; the runtime pins ranks to the blocks of :func:`split_cores`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from moirai.cluster.files import device_types
from moirai.cluster.hardware import GB, MICROSECOND, TFLOPS, Device
from moirai.cluster.kinds import kind_of
from moirai.errors import ClusterError

_CPU_MEMORY_BANDWIDTH_BYTES_PER_S = 10e9
_CPU_CLOCK_HZ_IF_UNKNOWN = 2.5e9
# fp32 FLOPs per cycle and core of the widest vector FMA the CPU flags announce (2 FMA units).
_FP32_FLOPS_PER_CYCLE_BY_FLAG = (("avx512f", 64), ("fma", 32), ("avx", 16))
_FP32_FLOPS_PER_CYCLE_BASELINE = 8
# Eager PyTorch spends about this long in Python and the dispatcher on every op on a CPU.
_CPU_LAUNCH_OVERHEAD_S = 10e-6


def _matches(patterns: Sequence[str], device_name: str) -> bool:
    """Whole-word match, so that ``"P4"`` names a Tesla P4 but not a Tesla P40."""
    return any(re.search(rf"\b{re.escape(p)}\b", device_name) for p in patterns)


def device_index(device: Device) -> int:
    return torch.device(device.torch_device).index or 0


def detect_device(torch_device: str, name: str, share: int) -> Device:
    """Properties of a local device; ``share`` logical devices split one physical device."""
    kind = kind_of(torch_device)
    if kind.accelerator:
        if kind.count() == 0:
            raise ClusterError(f"{torch_device} requested but {kind.name.upper()} is not available on this machine")
        index = torch.device(torch_device).index or 0
        if index >= kind.count():
            raise ClusterError(f"{torch_device} requested but this machine has {kind.count()} {kind.name} devices")
        props = kind.properties(index)
        known = next((key for key, row in device_types().items() if _matches(row["match"], props.name)), None)
        if known is not None:
            row = device_types()[known]
            peaks = {key: value * TFLOPS for key, value in row["peak_tflops"].items()}
            return Device(
                name,
                torch_device,
                props.total_memory / share,
                peaks["fp32"],
                row["memory_bandwidth_gb_per_s"] * GB,
                row["launch_overhead_us"] * MICROSECOND,
                "gpu",
                known,
                peaks.get("fp16"),
                peaks.get("bf16"),
                row["efficiency"],
            )
        # 2 FLOPs per FMA, 128 FP32 lanes per SM on recent NVIDIA parts: a datasheet-level estimate.
        peak = 2 * 128 * props.multi_processor_count * 1.5e9
        bandwidth = 2 * getattr(props, "memory_bus_width", 256) / 8 * getattr(props, "memory_clock_rate", 7e6) * 1e3
        return Device(name, torch_device, props.total_memory / share, peak, bandwidth, 10e-6, "gpu")
    if torch_device != "cpu":
        raise ClusterError(f"unsupported device {torch_device!r}; use 'cpu' or 'cuda:N'")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(split_cores(available_cores(), share)[0])
    flags, clock_hz = _cpu_flags_and_clock()
    per_cycle = next(
        (flops for flag, flops in _FP32_FLOPS_PER_CYCLE_BY_FLAG if flag in flags), _FP32_FLOPS_PER_CYCLE_BASELINE
    )
    peak = per_cycle * clock_hz * cores
    # AVX512-BF16 dot products run two bf16 pairs per fp32 lane.
    peak_bf16 = 2 * peak if "avx512_bf16" in flags else None
    return Device(
        name,
        "cpu",
        memory / share,
        peak,
        _CPU_MEMORY_BANDWIDTH_BYTES_PER_S,
        _CPU_LAUNCH_OVERHEAD_S,
        "cpu",
        peak_flops_bf16=peak_bf16,
    )


# The cores this process had before moirai pinned it to rank 0's share (None while it is not pinned).
_cores_before_pinning: tuple[int, ...] | None = None


def current_cores() -> tuple[int, ...]:
    """The CPU cores this process may run on right now."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def available_cores() -> tuple[int, ...]:
    """The CPU cores this process may give its ranks: its own, or, while moirai has pinned it to rank 0's share
    (a runner or server open in it), those it had before, so that a second runner splits the same cores as the
    first instead of putting all its ranks on rank 0's."""
    return _cores_before_pinning if _cores_before_pinning is not None else current_cores()


def note_pinning(cores_before: tuple[int, ...], pinned: bool) -> None:
    """Record that moirai pinned this process (``pinned``) or gave it ``cores_before`` back."""
    global _cores_before_pinning
    if pinned and _cores_before_pinning is None:
        _cores_before_pinning = cores_before
    elif not pinned and cores_before == _cores_before_pinning:
        _cores_before_pinning = None


def split_cores(cores: Sequence[int], share: int) -> list[tuple[int, ...]]:
    """``share`` disjoint blocks of ``cores`` of equal size, one per logical device (cores left over stay idle).

    The cost model gives each of ``share`` logical CPU devices one block's worth of peak FLOP/s
    and the runtime pins each rank to its block: one rule for both. With more devices than
    cores, each gets one core and the blocks wrap around.
    """
    size = max(1, len(cores) // share)
    return [tuple(cores[(k * size + i) % len(cores)] for i in range(size)) for k in range(share)]


def _cpu_flags_and_clock() -> tuple[set[str], float]:
    """The CPU's feature flags and clock from /proc/cpuinfo (empty and a typical clock elsewhere)."""
    flags: set[str] = set()
    clock_hz = _CPU_CLOCK_HZ_IF_UNKNOWN
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return flags, clock_hz
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "cpu MHz" and clock_hz == _CPU_CLOCK_HZ_IF_UNKNOWN:
            clock_hz = float(value) * 1e6
    return flags, clock_hz
