"""A rank spawned by rank 0 (``moirai-rank<k>``) ends as soon as rank 0's process does, at any stage.

The watch starts when the spawned process unpickles its target, which imports this package before
torch: a thread polls the parent's pid. While it starts (importing torch holds the interpreter
lock for seconds, so the thread may not run), the kernel also kills the rank when the thread that
spawned it ends (Linux ``PR_SET_PDEATHSIG``): that thread waits for the ranks to start, and the
signal is cleared before the rank says it is ready (:func:`started`), since a thread that submits
a server's first request may end while the server lives.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time

RANK_PROCESS_PREFIX = "moirai-rank"
_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


def rank_process_name(rank: int) -> str:
    """The name of rank ``rank``'s process, spawned by this one: it carries this pid, so that a rank whose
    parent already ended when it got this far knows."""
    return f"{RANK_PROCESS_PREFIX}{rank}@{os.getpid()}"


def watch_parent_if_spawned_rank() -> None:
    """In a process that multiprocessing is starting as a moirai rank, exit when its parent ends."""
    process = multiprocessing.current_process()
    if not (getattr(process, "_inheriting", False) and process.name.startswith(RANK_PROCESS_PREFIX)):
        return
    _, _, spawned_by = process.name.rpartition("@")
    parent = int(spawned_by) if spawned_by.isdigit() else os.getppid()
    _death_signal(signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL_S)
        print(f"moirai {process.name}: rank 0's process (pid {parent}) ended; this rank stops", file=sys.stderr)
        os._exit(1)

    threading.Thread(target=watch, name="moirai-parent-watch", daemon=True).start()


def started() -> None:
    """This rank started: from now on only the watch thread ends it with its parent (see the module docstring)."""
    _death_signal(0)


def _death_signal(signal_number: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal_number), 0, 0, 0)


watch_parent_if_spawned_rank()  # at import: before the rest of moirai.runtime imports torch
