"""A rank started by rank 0 (``moirai-rank<k>``) ends as soon as rank 0's process does, at any stage.

A rank forked from the fork server ([Note: ranks fork from a server that imported torch once], rank_processes.py)
starts its watch the instant it is forked (:func:`watch_from_fork`): a thread that waits on a pidfd of rank 0 that the
server opened while rank 0, its parent, was alive (fork_server.py), so it runs while multiprocessing re-imports the
main script, and no pid reuse can fool it. The rank's parent is the server, which outlives rank 0 while any rank
holds its pipe, so ``PR_SET_PDEATHSIG`` and ``getppid`` say nothing there.

Where the rank imports torch itself (a spawned rank, or a fork server that moirai did not start) the watch starts
when the process unpickles its target, which imports this package before torch, and waits on rank 0's pid from the
process name; while it imports (importing torch holds the interpreter lock for seconds, so the thread may not run),
the kernel also kills a spawned rank when the thread that spawned it ends (Linux ``PR_SET_PDEATHSIG``): that thread
waits for the ranks to start, and the signal is cleared before the rank says it is ready (:func:`started`), since a
thread that submits a server's first request may end while the server lives.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import select
import signal
import sys
import threading
import time

import psutil

RANK_PROCESS_PREFIX = "moirai-rank"
_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1
_watching = False  # a watch runs in this process
_UNNAMED = "MainProcess"  # the fork server's name, which a process forked from it has until multiprocessing names it
_NAMING_WAIT_S = 5.0


def rank_process_name(rank: int) -> str:
    """The name of rank ``rank``'s process, started by this one: it carries this pid, which the rank watches."""
    return f"{RANK_PROCESS_PREFIX}{rank}@{os.getpid()}"


def watch_rank_0_if_started_rank() -> None:
    """In a process that multiprocessing is starting as a moirai rank, exit when rank 0's process ends (once)."""
    process = multiprocessing.current_process()
    if not process.name.startswith(RANK_PROCESS_PREFIX) or _watching:
        return
    _, _, started_by = process.name.rpartition("@")
    if not started_by.isdigit():
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    _start_watch(int(started_by), None)


def watch_from_fork(rank_0: int, rank_0_pidfd: int) -> None:
    """In a process the fork server just forked (before it knows what it will run): if it is a moirai rank, it exits
    when rank 0's process ends."""
    _start_watch(rank_0, rank_0_pidfd)


def _start_watch(rank_0: int, rank_0_pidfd: int | None) -> None:
    global _watching
    _watching = True
    threading.Thread(target=_watch, args=(rank_0, rank_0_pidfd), name="moirai-rank-0-watch", daemon=True).start()


def _watch(rank_0: int, rank_0_pidfd: int | None) -> None:
    _wait_for_exit(rank_0, rank_0_pidfd)
    process = multiprocessing.current_process()
    deadline = time.monotonic() + _NAMING_WAIT_S
    while process.name == _UNNAMED and time.monotonic() < deadline:
        time.sleep(0.01)  # forked a moment ago: multiprocessing has yet to give it the name it was started with
    if not process.name.startswith(RANK_PROCESS_PREFIX):
        return  # forked from the server for someone else's multiprocessing: theirs to end
    print(f"moirai {process.name}: rank 0's process (pid {rank_0}) ended; this rank stops", file=sys.stderr)
    os._exit(1)


def started() -> None:
    """This rank started: from now on only the watch thread ends it with rank 0 (see the module docstring)."""
    prctl(_PR_SET_PDEATHSIG, 0)


def _wait_for_exit(pid: int, pidfd: int | None) -> None:
    if pidfd is None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return  # it ended already
        except (AttributeError, OSError):  # no pidfd here (Linux before 5.3, other systems): poll
            while _alive(pid):
                time.sleep(_POLL_S)
            return
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)  # readable once the process has exited
    poller.poll()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: not ended, and not a zombie its parent has yet to reap."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # not ours to inspect: it runs


def prctl(option: int, value: int | bytes) -> None:
    """Linux's ``prctl(option, value)`` for this process (or its calling thread); nothing elsewhere."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


if getattr(multiprocessing.current_process(), "_inheriting", False):
    watch_rank_0_if_started_rank()  # at import: before the rest of moirai.runtime imports torch
