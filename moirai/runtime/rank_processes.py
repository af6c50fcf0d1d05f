"""How rank 0 starts the processes of a spawned world's ranks 1..N-1 (:class:`moirai.runtime.DistributedRunner`).

[Note: ranks fork from a server that imported torch once]
A spawned rank is a fresh interpreter that imports torch and moirai before it can join: 1-2 s of a core on every start
and every restart after a failure, and a notebook or a test that starts many servers pays it each time. So ranks are
started with multiprocessing's ``forkserver`` method: on first use rank 0's process starts one server process that
imports the runtime once (``set_forkserver_preload``: fork_server.py first, then torch) and computes nothing, so torch
has started no thread pool to break in a fork; each rank is forked from it in a few milliseconds. The server listens
on a Unix socket in a private (0700) directory, as multiprocessing makes it, and lives as long as rank 0 or a rank.
Multiprocessing starts the server (and a spawned rank) as ``python -c``, which would import a ``torch.py`` planted in
the current directory: it starts in safe-path mode (:mod:`moirai.safe_path`).

A forked rank must still get what a spawned one got from rank 0 *at its start*, not what the server had when it
started: multiprocessing hands it rank 0's working directory, ``sys.path`` and main script (re-imported, so a script
without a ``__main__`` guard is still caught), and :class:`RankInheritance` hands it rank 0's environment, standard
output and error (a notebook or pytest redirects them between runs), cores and umask as they are now. The server,
not rank 0, is the rank's parent, so a rank watches rank 0 through a pidfd the server opened on its parent
(:mod:`moirai.runtime.orphans`), and names its process ``moirai-rank<k>`` (what ``ps`` and ``top`` show) since its
command line is the server's. Where forking from a server is unsafe (:func:`rank_context`), or
``MOIRAI_RANK_START=spawn`` asks for it, ranks are spawned.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import reduction
from typing import Any

import psutil
import torch.multiprocessing

from moirai.errors import InputError
from moirai.runtime.orphans import RANK_PROCESS_PREFIX, prctl, watch_rank_0_if_started_rank
from moirai.safe_path import safe_path_environment

__all__ = ["RANK_PROCESS_PREFIX", "RankInheritance", "RankStarter", "become_rank", "rank_context", "started_ranks"]

_log = logging.getLogger(__name__)

# Imported once by the fork server, so that a rank forked from it starts at once: everything a rank runs, after
# fork_server, which must see the server's parent (rank 0) first.
_PRELOADED_MODULES = ("moirai.runtime.fork_server", "torch", "moirai.runtime.runner")
START_METHOD_ENV = "MOIRAI_RANK_START"
_server_owner: int | None = None  # the process that started ranks first: the fork server is its child
_PR_SET_NAME = 15
# What multiprocessing reads as a forked rank's exit code when the fork server that forked it is gone.
_FORK_SERVER_LOST_EXIT_CODE = 255
_FORK_SERVER_COMMAND = "from multiprocessing.forkserver import main"  # its command line, which its children keep
_STANDARD_STREAMS = (1, 2)
# Limits a user sets in their script (a memory cap, open files, core dumps) that a spawned rank inherits and the fork
# server, started earlier, may not have.
_INHERITED_LIMITS = tuple(
    getattr(resource, name)
    for name in ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_FSIZE", "RLIMIT_STACK")
    if hasattr(resource, name)
)


def rank_context(fork_server_usable: bool = True) -> multiprocessing.context.BaseContext:
    """The multiprocessing context that starts ranks: forked from a server where that is safe, else spawned.

    ``fork_server_usable=False``: the server failed to start a rank as one that this process did not start does
    (``ChildProcessError``; this process was forked from one that started it): spawn from now on."""
    global _server_owner
    if _server_owner is None:
        _server_owner = os.getpid()
    if not fork_server_usable:
        _server_owner = -1
    if _start_method() == "spawn" or not _fork_server_is_safe() or _server_owner != os.getpid():
        # A process forked from one whose server runs cannot use that server (it is not its child): spawn.
        return torch.multiprocessing.get_context("spawn")
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOADED_MODULES))  # used when the server starts: once per process
    return context


def _start_method() -> str:
    """``$MOIRAI_RANK_START``: ``fork-server`` (the default) or ``spawn`` (each rank a fresh interpreter)."""
    method = os.environ.get(START_METHOD_ENV) or "fork-server"
    if method not in ("fork-server", "spawn"):
        raise InputError(f"{START_METHOD_ENV} is {method!r}; set it to 'fork-server' (the default) or 'spawn'")
    return method


def _fork_server_is_safe() -> bool:
    """Linux (macOS forks unsafely), and not a Python whose fork server any local user could reach (before 3.10.9
    its socket was in the abstract namespace: CVE-2022-42919)."""
    return sys.platform.startswith("linux") and sys.version_info >= (3, 10, 9)


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
    """What a rank takes from rank 0 at its start as a spawned one would: the environment, the standard output and
    error, the calling thread's cores, the file-creation mask and the resource limits."""

    environment: dict[str, str]
    streams: tuple[Any, ...]
    cores: frozenset[int] | None
    umask: int | None
    limits: dict[int, tuple[int, int]] = field(default_factory=dict)  # by resource.RLIMIT_*

    @classmethod
    def of_this_process(cls) -> RankInheritance:
        streams = tuple(_InheritedStream(d) for d in _STANDARD_STREAMS if _is_open(d))
        cores = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        limits = {limit: resource.getrlimit(limit) for limit in _INHERITED_LIMITS}
        return cls(dict(os.environ), streams, cores, _umask(), limits)

    def apply(self) -> None:
        """In the rank, before anything else: rank 0's in place of the fork server's."""
        os.environ.clear()
        os.environ.update(self.environment)
        for duplicate, descriptor in self.streams:  # unpickled: (the descriptor received, the one it replaces)
            if duplicate != descriptor:  # equal where the rank was spawned: it has rank 0's descriptor already
                flush_standard_streams()
                os.dup2(duplicate, descriptor)
                os.close(duplicate)
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)
        if self.umask is not None:
            os.umask(self.umask)
        for limit, (soft, hard) in self.limits.items():
            _set_limit(limit, soft, hard)


def _set_limit(limit: int, soft: int, hard: int) -> None:
    """Rank 0's ``limit``, as far as this process may take it: a hard limit rank 0 raised after the fork server
    started (as root) stays the server's, and the soft one no higher (a lower limit is never refused)."""
    try:
        resource.setrlimit(limit, (soft, hard))
    except (ValueError, OSError):
        _, own_hard = resource.getrlimit(limit)
        resource.setrlimit(limit, (_lower_limit(soft, own_hard), own_hard))


def _lower_limit(a: int, b: int) -> int:
    """The lower of two resource limits, where RLIM_INFINITY (-1 on Linux) is no limit."""
    if a == resource.RLIM_INFINITY:
        return b
    return a if b == resource.RLIM_INFINITY else min(a, b)


class RankStarter:
    """How this process starts the rank processes of one world: the context (:func:`rank_context`), what each rank
    inherits (:class:`RankInheritance`, as it is now), and when they were started (to tell them from reused pids)."""

    def __init__(self) -> None:
        self.context = rank_context()  # first: a bad MOIRAI_RANK_START raises before anything starts
        self.inheritance = RankInheritance.of_this_process()
        self.started_at_s = time.time()

    def start(
        self, rank: int, target: Callable[..., None], args: tuple[Any, ...], name: str
    ) -> multiprocessing.process.BaseProcess:
        """Start rank ``rank``'s process (daemonic), which runs ``target(rank, *args, inheritance)``."""
        try:
            return self._started(rank, target, args, name)
        except ChildProcessError:
            # A fork server this process did not start (it was forked from one that did): spawn from now on.
            self.context = rank_context(fork_server_usable=False)
            return self._started(rank, target, args, name)

    def _started(
        self, rank: int, target: Callable[..., None], args: tuple[Any, ...], name: str
    ) -> multiprocessing.process.BaseProcess:
        process = self.context.Process(target=target, args=(rank, *args, self.inheritance), daemon=True, name=name)
        with safe_path_environment():  # the fork server or a spawned rank: `python -c`, never the cwd's modules
            process.start()
        return process

    def kill_orphans(self, processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
        """Kill the ranks still running that multiprocessing counts as ended: a rank forked from a fork server that
        died (killed, out of memory) reads as exited with 255, and ``kill()`` would signal nothing. A process is that
        rank where it runs the server's command line (a forked rank keeps it, named or still re-importing the main
        script) and started after this starter was made, so a reused pid is never killed."""
        for process in processes:
            if process.exitcode != _FORK_SERVER_LOST_EXIT_CODE:
                continue
            with contextlib.suppress(psutil.Error):
                running = psutil.Process(process.pid)
                forked = _FORK_SERVER_COMMAND in " ".join(running.cmdline())
                if forked and running.create_time() >= self.started_at_s - 1:
                    _log.warning("killing %s (pid %d): its fork server ended while it ran", process.name, process.pid)
                    running.kill()


def _umask() -> int | None:
    """This process's file-creation mask, read without setting it (setting it to read it races other threads)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return None


def become_rank(rank: int, inheritance: RankInheritance) -> None:
    """A rank's first steps, in its own process: rank 0's environment and streams, its name, the watch on rank 0."""
    inheritance.apply()
    # What ps, top and psutil.Process.name show (15 bytes at most), since the command line is the fork server's.
    prctl(_PR_SET_NAME, f"{RANK_PROCESS_PREFIX}{rank}".encode()[:15])
    watch_rank_0_if_started_rank()


def flush_standard_streams() -> None:
    """Flush Python's stdout and stderr: before their descriptors change, or the process ends by ``os._exit``."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


def started_ranks(rank_0_pid: int | None = None) -> list[psutil.Process]:
    """The live ranks that rank 0's process (default: this one) started, by rank: not the fork server, nor a rank
    that was killed and not yet reaped."""
    ranks = []
    for process in psutil.Process(rank_0_pid).children(recursive=True):
        try:
            name = process.name()
            if process.status() != psutil.STATUS_ZOMBIE and name.startswith(RANK_PROCESS_PREFIX):
                ranks.append((int(name.removeprefix(RANK_PROCESS_PREFIX)), process.pid, process))
        except (psutil.Error, ValueError):
            pass  # it ended meanwhile, or another process of that name
    return [process for _, _, process in sorted(ranks, key=lambda rank: rank[:2])]


def _is_open(descriptor: int) -> bool:
    try:
        os.fstat(descriptor)
    except OSError:
        return False
    return True
