"""What share of its host each rank gets: the CPU cores it may run on and its torch thread counts.

Logical CPU devices on one host split the host's cores into disjoint blocks with
:func:`moirai.cluster.host.split_cores`, the rule the cost model uses for their peak FLOP/s, so a
rank computes with the cores the plan assumed instead of every rank using every core. A
device's ``cores`` / ``threads`` from the cluster file override the split; cores claimed
explicitly are left out of the split of the others. A rank of a kind that is not pinned
(:attr:`moirai.cluster.kinds.DeviceKind.pinned`: a GPU rank only feeds its GPU) gets its kind's few host
threads and no pinning unless the cluster file gives cores.

gloo's I/O threads (one per process group) do not run on their rank's cores but on the host's
spare cores, else on the other ranks' (:func:`pin_io_threads`). gloo's I/O thread handles a
connection's events only if it takes the connection's lock at once, and otherwise goes back to
epoll, which reports the same events again: on the rank's own core it spins, for a whole time
slice, against the rank's thread that holds the lock and waits to be scheduled (in bench/RESULTS.md's
git history, 2026-11-23: calls with transfers stalled in steps of about 3 ms).

A CPU rank keeps the memory it frees (:func:`keep_freed_memory`, [Note: fresh pages] in docs/design.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moirai.cluster.devices import Device
from moirai.cluster.host import available_cores, current_cores, note_pinning, split_cores
from moirai.cluster.kinds import DeviceKind, kind_of
from moirai.errors import ClusterError, OversubscriptionWarning, user_stacklevel

# Every apply_resources not yet restored, oldest first: (what it returned, what it set), and what the process had
# before the first of them. Runners open at once hold the process newest first, whatever order they close in.
_APPLIED: list[tuple[RankResources, RankResources]] = []
_ORIGINAL: list[RankResources] = []
_APPLIED_LOCK = threading.Lock()

# The name (``/proc/<pid>/task/<tid>/comm``) of gloo's I/O threads starts with this.
_IO_THREAD_NAME = "gloo_tcp"

# glibc's mallopt parameters (malloc.h) and what a rank sets them to: allocations up to glibc's largest mmap
# threshold come from the heap, and the heap is never trimmed, so a step's freed memory serves the next step.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_KEPT_HEAP_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 40), (_M_TOP_PAD, 64 << 20))


@dataclass(frozen=True)
class RankResources:
    """``cores``: the CPU affinity (None: leave it); ``threads``: torch intra-op threads; ``io_cores``: where
    gloo's I/O threads run (None: with the rest of the process); ``helper_cores``: where the driver's helper
    thread runs, only cores no rank computes on (None: with the rest of the process, so the driver's work stays
    on its own device's cores, where the model charges it, :attr:`moirai.planning.costs.RequestCosts.request_cpu_s`)."""

    cores: tuple[int, ...] | None
    threads: int
    io_cores: tuple[int, ...] | None = None
    helper_cores: tuple[int, ...] | None = None


def rank_resources(devices: Sequence[str | Device], cores: Sequence[int] | None = None) -> list[RankResources]:
    """One entry per rank (rank ``k`` serves ``devices[k]``).

    ``cores``: the host's usable cores (default: this process's). A plain torch device string
    is a device on this host with no ``cores``/``threads`` settings.
    """
    host_cores = tuple(available_cores() if cores is None else cores)
    entries = [_as_device(d) for d in devices]
    resources: list[RankResources | None] = [None] * len(entries)
    for host in dict.fromkeys(host for host, _, _, _ in entries):
        ranks = [k for k, entry in enumerate(entries) if entry[0] == host]
        claimed: dict[int, int] = {}
        for k in ranks:
            for core in entries[k][2] or ():
                if core in claimed:
                    raise ClusterError(
                        f"devices {_name(devices[claimed[core]])!r} and {_name(devices[k])!r} on host {host!r} both "
                        f"claim core {core}; give each device its own cores"
                    )
                claimed[core] = k
        free = tuple(c for c in host_cores if c not in claimed) or host_cores
        automatic = [k for k in ranks if entries[k][1].pinned and entries[k][2] is None]
        for k, block in zip(automatic, split_cores(free, len(automatic)) if automatic else [], strict=True):
            resources[k] = RankResources(block, entries[k][3] or len(block))
        for k in ranks:
            _, kind, explicit, threads = entries[k]
            if explicit is not None:
                resources[k] = RankResources(explicit, threads or len(explicit))
            elif not kind.pinned:
                resources[k] = RankResources(None, threads or min(kind.rank_threads or 1, len(host_cores)))
        _place_io_threads(resources, ranks, host_cores)
    placed = [r for r in resources if r is not None]
    _warn_if_threads_exceed_cores(devices, placed)
    return placed


def _warn_if_threads_exceed_cores(devices: Sequence[str | Device], resources: Sequence[RankResources]) -> None:
    """A rank with more torch threads than cores time-slices them: say so, with the numbers."""
    for device, resource in zip(devices, resources, strict=True):
        if resource.cores is not None and resource.threads > len(resource.cores):
            warnings.warn(
                f"device {_name(device)!r} runs {resource.threads} threads on {len(resource.cores)} core(s) "
                f"{list(resource.cores)}: they take turns, and it computes slower than its threads suggest; give it "
                "at most as many threads as cores in the cluster file",
                OversubscriptionWarning,
                stacklevel=user_stacklevel(),
            )


def _place_io_threads(resources: list[RankResources | None], ranks: Sequence[int], host_cores: Sequence[int]) -> None:
    """Give each pinned rank of one host cores for its I/O threads: the host's spare cores, else the other ranks'."""
    pinned = {k: resources[k].cores for k in ranks if resources[k] is not None and resources[k].cores is not None}
    assigned = {core for cores in pinned.values() for core in cores}
    spare = tuple(core for core in host_cores if core not in assigned)
    for k, own in pinned.items():
        others = tuple(sorted(assigned - set(own)))
        io_cores = spare or others
        if io_cores:
            resources[k] = dataclasses.replace(resources[k], io_cores=io_cores, helper_cores=spare or None)


def pin_io_threads(resources: RankResources) -> None:
    """Move this process's gloo I/O threads (started with its process groups) to ``resources.io_cores``."""
    if resources.io_cores is None or not hasattr(os, "sched_setaffinity"):
        return
    for thread_id in _io_thread_ids():
        try:
            os.sched_setaffinity(thread_id, resources.io_cores)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def io_thread_cores() -> list[list[int]]:
    """The cores each of this process's gloo I/O threads may run on (what :func:`pin_io_threads` set)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return [sorted(os.sched_getaffinity(thread_id)) for thread_id in _io_thread_ids()]


def _io_thread_ids() -> list[int]:
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return []
    found = []
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().startswith(_IO_THREAD_NAME):
                found.append(int(task.name))
        except OSError:
            pass  # the thread ended meanwhile
    return found


def apply_resources(resources: RankResources, device_name: str, own_process: bool = True) -> RankResources:
    """Pin every thread of this process to ``resources.cores`` and set torch's thread counts; what was set before.

    In a process of its own (``own_process``) a rank also gets 1 interop thread where torch still
    allows it (only before any inter-op work; it cannot be undone, so a caller's process keeps its own).
    Every process that computes as a rank, the caller's included, keeps the memory it frees from then on
    (:func:`keep_freed_memory`; nor can that be undone).
    """
    before = RankResources(current_cores(), torch.get_num_threads())
    _set_resources(resources, device_name)
    with _APPLIED_LOCK:
        if not _APPLIED:
            _ORIGINAL[:] = [before]
        _APPLIED.append((before, resources))
    keep_freed_memory()
    if own_process:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # already set, or inter-op work has started in this process: torch keeps its count
    return before


@functools.cache  # once a process: it cannot be undone, so setting it again changes nothing
def keep_freed_memory() -> bool:
    """Have this process's C heap keep what it frees instead of returning it to the kernel (see [Note: fresh
    pages]); True where that was set (glibc), False elsewhere. The process keeps it: its memory stays at its high
    mark, as a GPU's caching allocator keeps its blocks."""
    library = ctypes.util.find_library("c")
    if library is None:
        return False
    try:
        mallopt = ctypes.CDLL(library).mallopt
    except (OSError, AttributeError):
        return False  # not glibc: musl and macOS have no mallopt
    return all(mallopt(parameter, value) == 1 for parameter, value in _KEPT_HEAP_SETTINGS)


def restore_resources(before: RankResources) -> None:
    """Undo the :func:`apply_resources` that returned ``before`` (the interop thread count stays).

    While others are still applied, the newest of them holds the process; the last one restores what
    the process had before the first.
    """
    with _APPLIED_LOCK:
        index = next((i for i, (b, _) in enumerate(_APPLIED) if b is before), None)
        if index is None:
            _set_resources(before, "the process before moirai pinned it", restoring=True)
            return
        _APPLIED.pop(index)
        if _APPLIED:
            _set_resources(_APPLIED[-1][1], "a runner still open")
        else:
            _set_resources(_ORIGINAL.pop(), "the process before moirai pinned it", restoring=True)


def _set_resources(resources: RankResources, device_name: str, restoring: bool = False) -> None:
    previous = current_cores()
    if resources.cores is not None and hasattr(os, "sched_setaffinity"):
        unknown = sorted(set(resources.cores) - set(range(os.cpu_count() or 1)))
        if unknown:
            raise ClusterError(
                f"device {device_name!r} asks for cores {unknown}, which this host does not have "
                f"(cores 0..{(os.cpu_count() or 1) - 1}); fix its cores in the cluster file"
            )
        _set_affinity(resources.cores)
        note_pinning(tuple(resources.cores) if restoring else previous, pinned=not restoring)
    torch.set_num_threads(resources.threads)


def _set_affinity(cores: Sequence[int]) -> None:
    """Every thread of this process, not only the calling one (threads started later inherit it)."""
    tasks = Path("/proc/self/task")
    thread_ids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for thread_id in thread_ids:
        try:
            os.sched_setaffinity(thread_id, cores)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def _as_device(device: str | Device) -> tuple[str, DeviceKind, tuple[int, ...] | None, int | None]:
    """(host, kind, cores, threads)."""
    if isinstance(device, Device):
        return device.host, kind_of(device), device.cores, device.threads
    return "localhost", kind_of(device), None, None


def _name(device: str | Device) -> str:
    return device.name if isinstance(device, Device) else device
