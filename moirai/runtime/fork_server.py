"""Imported first by the fork server that rank 0's process starts (moirai.runtime.rank_processes), and by nothing else.

Its parent is rank 0's process, alive now: a pidfd on it, opened here, is how every rank forked from this server
ends with rank 0 from its first instant (before multiprocessing re-imports the main script, which may load a model
for minutes), and no later pid reuse can fool it.

The server forks with a thread it did not start: numpy's BLAS pool, idle, which handles a fork itself. Python 3.12
and later warn at every fork of a process with threads, and an error filter (``-W error``, ``PYTHONWARNINGS``, which
the server takes from rank 0) would make that warning end the server: it is ignored here, in the server alone.
"""

from __future__ import annotations

import os
import warnings

from moirai.runtime import orphans

warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)

_RANK_0_PID = os.getppid()
try:
    _RANK_0_PIDFD: int | None = os.pidfd_open(_RANK_0_PID)
except (AttributeError, OSError):  # no pidfd here: each rank watches rank 0's pid from its name once it runs
    _RANK_0_PIDFD = None

if _RANK_0_PIDFD is not None:
    os.register_at_fork(after_in_child=lambda: orphans.watch_from_fork(_RANK_0_PID, _RANK_0_PIDFD))
