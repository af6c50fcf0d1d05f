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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from moirai.cluster.hardware import LOCAL_HOST, Device, host_key
from moirai.cluster.host import available_cores, current_cores, note_pinning, split_cores
from moirai.cluster.kinds import DeviceKind, kind_of
from moirai.errors import ClusterError, OversubscriptionWarning, user_stacklevel

# Every apply_resources not yet restored, oldest first, and what the process had before the first of them. Runners
# open at once hold the process's cores newest first, whatever order they close in.
_APPLIED: list[_Applied] = []
_ORIGINAL: list[RankResources] = []
_APPLIED_LOCK = threading.Lock()
# Held while a thread sets its own torch thread count and puts back the count new threads start with.
_THREAD_COUNT_LOCK = threading.Lock()

T = TypeVar("T")

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


def apply_resources(
    resources: RankResources, device_name: str, own_process: bool = True, set_threads: bool = True
) -> RankResources:
    """Pin every thread of this process to ``resources.cores`` and set the calling thread's torch thread count
    (``set_threads``); what was set before.

    In a process of its own (``own_process``) a rank also gets 1 interop thread where torch still
    allows it (only before any inter-op work; it cannot be undone, so a caller's process keeps its own).
    Every process that computes as a rank, the caller's included, keeps the memory it frees from then on
    (:func:`keep_freed_memory`; nor can that be undone). A runner's rank 0 sets no thread's count here
    (``set_threads=False``): its driver's threads set their own ([Note: a torch thread count is a thread's]).
    """
    before = RankResources(current_cores(), torch.get_num_threads())
    _set_cores(resources, device_name)
    if set_threads:
        torch.set_num_threads(resources.threads)
    with _APPLIED_LOCK:
        if not _APPLIED:
            _ORIGINAL[:] = [before]
        _APPLIED.append(_Applied(before, resources, threading.get_ident() if set_threads else None, before.threads))
    keep_freed_memory()
    if own_process:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # already set, or inter-op work has started in this process: torch keeps its count
    return before


@dataclass
class _Applied:
    """An :func:`apply_resources` not yet restored: ``before`` (what it returned), ``resources`` (what it set),
    ``thread`` (the id of the thread whose torch count it set; None: it set none) and ``threads_before`` (that
    thread's count to give back)."""

    before: RankResources
    resources: RankResources
    thread: int | None
    threads_before: int


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

    While others are still applied, the newest of them holds the process's cores; the last one restores what
    the process had before the first. A thread count it set goes back in the thread it was set in (restored from
    another thread, that thread keeps it: only a thread can set its own).
    """
    with _APPLIED_LOCK:
        index = next((i for i, applied in enumerate(_APPLIED) if applied.before is before), None)
        if index is None:
            _set_cores(before, "the process before moirai pinned it", restoring=True)
            return
        applied = _APPLIED.pop(index)
        _give_thread_count_back(applied, newer=_APPLIED[index:])
        if _APPLIED:
            _set_cores(_APPLIED[-1].resources, "a runner still open")
        else:
            _set_cores(_ORIGINAL.pop(), "the process before moirai pinned it", restoring=True)


def _give_thread_count_back(applied: _Applied, newer: Sequence[_Applied]) -> None:
    """The torch count of the thread ``applied`` set, as it was before; where a ``newer`` application set the same
    thread's count, that one holds it and gives back what the thread had before both."""
    if applied.thread is None:
        return
    holding = next((other for other in newer if other.thread == applied.thread), None)
    if holding is not None:
        holding.threads_before = applied.threads_before
    elif applied.thread == threading.get_ident():
        torch.set_num_threads(applied.threads_before)


def set_thread_count(threads: int) -> None:
    """Set the calling thread's torch intra-op thread count, and no other thread's ([Note: a torch thread count is a
    thread's])."""
    # Read first: a thread takes the count for new threads when it first reads or computes, over one it had set.
    torch.get_num_threads()
    with _THREAD_COUNT_LOCK:
        for_new_threads = _in_new_thread(torch.get_num_threads)
        torch.set_num_threads(threads)
        if for_new_threads != threads:
            _in_new_thread(lambda: torch.set_num_threads(for_new_threads))
            if torch.get_num_threads() != threads:  # a torch whose count is the process's (no OpenMP): set it so
                torch.set_num_threads(threads)


# [Note: a torch thread count is a thread's]
# Under OpenMP, torch.set_num_threads sets the calling thread's team size only; it also stores the count a thread
# takes when it first computes, so it changes every thread started later too. A runner's rank 0 computes in its
# driver's dispatcher (and, for run(), in the caller's thread while part 0 runs), so those set rank 0's count
# themselves (set_thread_count, Driver.run) and the caller's threads keep theirs. Set once in the thread that made
# the first submit and undone in the thread that closed, the count stayed 1 for good in the first (a request handler)
# while the second (a shutdown hook) got the first one's count.


def _in_new_thread(function: Callable[[], T]) -> T:
    """``function()`` called in a thread of its own: what a thread started now sees, or sets for itself only."""
    result: list[T] = []
    thread = threading.Thread(target=lambda: result.append(function()), name="moirai-thread-count")
    thread.start()
    thread.join()
    return result[0]


def _set_cores(resources: RankResources, device_name: str, restoring: bool = False) -> None:
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
    """(host, kind, cores, threads): the host as :func:`host_key` gives it, one for every name of this machine."""
    if isinstance(device, Device):
        return host_key(device.host), kind_of(device), device.cores, device.threads
    return LOCAL_HOST, kind_of(device), None, None


def _name(device: str | Device) -> str:
    return device.name if isinstance(device, Device) else device
