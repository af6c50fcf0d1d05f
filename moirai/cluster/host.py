"""The local machine: its CPU's features, and the CPU cores a process may run on.

The device kinds (:mod:`moirai.cluster.kinds`) describe the host CPU from :func:`cpu_flags_and_clock` and
:func:`split_cores`; the runtime pins ranks to the blocks of :func:`split_cores`.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from moirai.cluster.hardware import Device

_CPU_CLOCK_HZ_IF_UNKNOWN = 2.5e9


def device_index(device: Device) -> int:
    return torch.device(device.torch_device).index or 0


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


def core_shares(cores: Sequence[int], share: int) -> list[float]:
    """The cores' worth each block of :func:`split_cores` really gets: a core that ``n`` blocks hold (more devices
    than cores) counts ``1 / n`` for each of them, so the cost model's speed follows the pinning."""
    blocks = split_cores(cores, share)
    holders: dict[int, int] = {}
    for block in blocks:
        for core in block:
            holders[core] = holders.get(core, 0) + 1
    return [sum(1.0 / holders[core] for core in block) for block in blocks]


def cpu_flags_and_clock() -> tuple[set[str], float]:
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


def cpu_model() -> str:
    """The CPU's model name (its architecture where the system does not say)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
