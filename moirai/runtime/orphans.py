"""A rank started by rank 0 (``moirai-rank<k>``) ends as soon as rank 0's process does, at any stage.

A rank forked from the fork server ([Note: ranks fork from a server that imported torch once], rank_processes.py)
starts its watch first thing: a thread that waits on rank 0's pid (a pidfd where Linux has one, else polling it).
Where the rank imports torch itself (a spawned rank, or a fork server someone started without the preload) the watch
starts when the process unpickles its target, which imports this package before torch; while it imports (importing
torch holds the interpreter lock for seconds, so the thread may not run), the kernel also kills the rank when the
thread that started it ends (Linux ``PR_SET_PDEATHSIG``): that thread waits for the ranks to start (or is the fork
server's, which ends with rank 0), and the signal is cleared before the rank says it is ready (:func:`started`), since
a thread that submits a server's first request may end while the server lives.
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

RANK_PROCESS_PREFIX = "moirai-rank"
_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1
_watching = threading.Event()


def rank_process_name(rank: int) -> str:
    """The name of rank ``rank``'s process, started by this one: it carries this pid, which the rank watches."""
    return f"{RANK_PROCESS_PREFIX}{rank}@{os.getpid()}"


def watch_rank_0_if_started_rank() -> None:
    """In a process that multiprocessing is starting as a moirai rank, exit when rank 0's process ends (once)."""
    process = multiprocessing.current_process()
    if not process.name.startswith(RANK_PROCESS_PREFIX) or _watching.is_set():
        return
    _, _, started_by = process.name.rpartition("@")
    if not started_by.isdigit():
        return
    _watching.set()
    rank_0 = int(started_by)
    _death_signal(signal.SIGKILL)

    def watch() -> None:
        _wait_for_exit(rank_0)
        print(f"moirai {process.name}: rank 0's process (pid {rank_0}) ended; this rank stops", file=sys.stderr)
        os._exit(1)

    threading.Thread(target=watch, name="moirai-rank-0-watch", daemon=True).start()


def started() -> None:
    """This rank started: from now on only the watch thread ends it with rank 0 (see the module docstring)."""
    _death_signal(0)


def _wait_for_exit(pid: int) -> None:
    try:
        descriptor = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # it ended already
    except (AttributeError, OSError):  # no pidfd here (Linux before 5.3, other systems): poll
        while _alive(pid):
            time.sleep(_POLL_S)
        return
    poller = select.poll()
    poller.register(descriptor, select.POLLIN)  # readable once the process has exited
    poller.poll()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _death_signal(signal_number: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal_number), 0, 0, 0)


if getattr(multiprocessing.current_process(), "_inheriting", False):
    watch_rank_0_if_started_rank()  # at import: before the rest of moirai.runtime imports torch
