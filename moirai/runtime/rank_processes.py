"""How rank 0 starts the processes of a spawned world's ranks 1..N-1 (:class:`moirai.runtime.DistributedRunner`).

[Note: ranks fork from a server that imported torch once]
A spawned rank is a fresh interpreter that imports torch and moirai before it can join: 1-2 s of a core on every start
and every restart after a failure, and a notebook or a test that starts many servers pays it each time. So ranks are
started with multiprocessing's ``forkserver`` method: on first use rank 0's process starts one server process that
imports torch and the runtime once (``set_forkserver_preload``) and computes nothing, so no thread pool exists to
break in a fork; each rank is forked from it in a few milliseconds. The server listens on a Unix socket in a private
(0700) directory, as multiprocessing makes it, and exits with rank 0's process.

A forked rank must still get what a spawned one got from rank 0 *at its start*, not what the server had when it
started: multiprocessing hands it rank 0's working directory, ``sys.path`` and main script (re-imported, so a script
without a ``__main__`` guard is still caught), and :class:`RankInheritance` hands it rank 0's environment and its
standard output and error as they are now (a notebook or pytest redirects them between runs). The server, not rank 0,
is the rank's parent, so a rank watches rank 0's pid to end with it (:mod:`moirai.runtime.orphans`), and names its
process ``moirai-rank<k>`` (what ``ps`` and ``top`` show) since its command line is the server's.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

import psutil
import torch.multiprocessing

from moirai.runtime.orphans import RANK_PROCESS_PREFIX

__all__ = ["RANK_PROCESS_PREFIX", "RankInheritance", "name_this_process", "rank_context", "started_ranks"]

# Imported once by the fork server, so that a rank forked from it starts at once: everything a rank runs.
_PRELOADED_MODULES = ("torch", "moirai.runtime.runner")
_PR_SET_NAME = 15
_STANDARD_STREAMS = (1, 2)


def rank_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context that starts ranks: forked from a server where the platform has one."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return torch.multiprocessing.get_context("spawn")
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOADED_MODULES))  # used when the server starts: once per process
    return context


class _InheritedStream:
    """One of rank 0's standard streams, handed to the rank as an open descriptor when the process starts."""

    def __init__(self, descriptor: int) -> None:
        self.descriptor = descriptor

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled while multiprocessing starts the rank: DupFd sends the descriptor along with the process.
        return (_received_descriptor, (reduction.DupFd(self.descriptor), self.descriptor))


def _received_descriptor(duplicate: Any, descriptor: int) -> tuple[int, int]:
    return duplicate.detach(), descriptor


@dataclass(frozen=True)
class RankInheritance:
    """What a rank takes from rank 0 at its start: the environment and the standard output and error."""

    environment: dict[str, str]
    streams: tuple[Any, ...]

    @classmethod
    def of_this_process(cls) -> RankInheritance:
        streams = tuple(_InheritedStream(d) for d in _STANDARD_STREAMS if _is_open(d))
        return cls(dict(os.environ), streams)

    def apply(self) -> None:
        """In the rank, before anything else: rank 0's environment and streams in place of the fork server's."""
        os.environ.clear()
        os.environ.update(self.environment)
        for duplicate, descriptor in self.streams:  # unpickled: (the descriptor received, the one it replaces)
            if duplicate != descriptor:  # equal where the rank was spawned: it has rank 0's descriptor already
                for stream in (sys.stdout, sys.stderr):
                    if stream is not None:
                        stream.flush()
                os.dup2(duplicate, descriptor)
                os.close(duplicate)


def name_this_process(name: str) -> None:
    """Name this process (Linux: what ``ps``, ``top`` and ``psutil.Process.name`` show; 15 bytes at most)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def started_ranks(rank_0_pid: int | None = None) -> list[psutil.Process]:
    """The live ranks that rank 0's process (default: this one) started, by rank: not the fork server, nor a rank
    that was killed and not yet reaped."""
    ranks = []
    for process in psutil.Process(rank_0_pid).children(recursive=True):
        try:
            if process.status() != psutil.STATUS_ZOMBIE and process.name().startswith(RANK_PROCESS_PREFIX):
                ranks.append(process)
        except psutil.Error:
            pass  # it ended meanwhile
    return sorted(ranks, key=lambda process: (int(process.name().removeprefix(RANK_PROCESS_PREFIX)), process.pid))


def _is_open(descriptor: int) -> bool:
    try:
        os.fstat(descriptor)
    except OSError:
        return False
    return True
