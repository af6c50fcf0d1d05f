"""The spawned world: this process as rank 0 (the driver) and one started process per other device.

:class:`DistributedRunner` (and :func:`moirai.runtime.distributed.run_distributed`, one call) starts ranks
1..N-1 with ``torch.multiprocessing``, forked from a server process that imported torch once
(:mod:`moirai.runtime.rank_processes`; :func:`_worker_main`), connected on 127.0.0.1 with process groups of
their own (the default process group is left alone). While the runner is open this process runs on rank
0's share of the cores (see :mod:`moirai.runtime.resources`). Before it spawns, it checks that the
shared-memory directory holds the rings and the parts' loads; where it does not, the ranks send through
gloo instead, with a :class:`moirai.errors.SharedMemoryWarning`. When a rank fails, the driver fails the
pending requests with the error naming it, and new ranks start in the background.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, NoReturn

import psutil
import torch

from moirai.cluster.devices import Device
from moirai.errors import DistributedError, InputError, SharedMemoryWarning, user_stacklevel
from moirai.progress import carried, stage
from moirai.runtime import orphans, shm
from moirai.runtime.blame import (
    PeerFailure,
    RankSilent,
    blamed,
    describe_error,
    failure_key,
    read_report,
    report_failure,
)
from moirai.runtime.driver import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_TIMEOUT_S,
    Driver,
    check_max_in_flight,
    check_timeout,
)
from moirai.runtime.groups import Group, local_group
from moirai.runtime.local import check_inputs
from moirai.runtime.protocol import load_bytes, request_message_bytes, serve
from moirai.runtime.rank_processes import RankInheritance, RankStarter, become_rank, flush_standard_streams
from moirai.runtime.resources import (
    RankResources,
    apply_resources,
    io_thread_cores,
    pin_io_threads,
    rank_resources,
    restore_resources,
)
from moirai.runtime.shm_files import shm_dir
from moirai.runtime.split import SplitProgram
from moirai.runtime.store import RunStore, get_json, join_store, start_store
from moirai.runtime.weights_sent import WeightsSent

__all__ = ["DistributedRunner", "Worlds", "torch_device"]

_log = logging.getLogger(__name__)
_START_POLL_S = 0.05
# How long past the join timeout rank 0 waits for its joining thread to report torch's own timeout error.
_JOIN_SLACK_S = 1.0
# Exit code of a spawned rank that found the user's script re-imported without a __main__ guard.
_NO_MAIN_GUARD_EXIT_CODE = 86
# How long a stop waits for the ranks to exit on their own (after a failure, the time they have to report it).
_RANKS_EXIT_GRACE_S = 5.0
# The least a stop waits for a failed driver's threads to end, after its ranks' grace is spent.
_FAILED_THREADS_GRACE_S = 1.0


class DistributedRunner:
    """This process as rank 0 and one spawned process per other device, kept between calls.

    ``run(program, flat_inputs)`` returns the flat outputs on ``torch_devices[0]``; ``submit``
    returns a future of them, so several requests can be in flight (at most ``max_in_flight``
    are sent ahead). A program is sent to the workers the first time it is used (several
    programs with at most ``len(torch_devices)`` parts can share one runner). Workers start on
    the first call; once a failure has failed the pending requests, new ones start in the background, and a call
    meanwhile waits for them. Where the shared-memory directory cannot hold the rings and the parts' loads, the
    ranks send through gloo (a :class:`moirai.errors.SharedMemoryWarning` says so). Use as a context manager or
    call ``close()``.
    """

    def __init__(
        self,
        torch_devices: Sequence[str | Device],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_timeout_s: float = 180.0,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        state_on_ranks: str | None = None,
    ) -> None:
        """``state_on_ranks``: what ranks other than 0 keep from request to request (buffers written in place), if
        anything; once a failure has ended a world that ran requests, every later request is refused, as new ranks
        would start from that state's values before the runner and compute silently wrong outputs."""
        self.devices = list(torch_devices)
        self.torch_devices = [torch_device(d) for d in self.devices]
        self.timeout_s = check_timeout(timeout_s)
        self.start_timeout_s = check_timeout(start_timeout_s)
        self.max_in_flight = check_max_in_flight(max_in_flight)
        self._workers: list[multiprocessing.Process] = []
        self._starter: RankStarter | None = None  # what started this world's ranks
        self._driver: Driver | None = None
        self._store: RunStore | None = None
        self._restore: RankResources | None = None
        self._shared_memory = False  # whether the running ranks send through shared memory
        self._starting = threading.Lock()  # submit may be called from several threads, and a restart runs in one
        self._closing = False
        self._restarting: threading.Thread | None = None
        self._joining: threading.Thread | None = None  # a join rank 0 gave up waiting for (see _join)
        self.worlds = Worlds()
        self._state_on_ranks = state_on_ranks
        self._state_lost: BaseException | None = None  # the failure that ended the ranks' state (state_on_ranks)
        self._weights_sent: dict[SplitProgram, WeightsSent] = {}  # per program, what the running ranks were sent
        # The workers start at the first request, after the call that made this runner (run_distributed, server)
        # has returned: they report as it would have (its progress).
        self._reporting = carried()
        _LIVE_RUNNERS.add(self)

    def __enter__(self) -> DistributedRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run(
        self, program: SplitProgram, flat_inputs: Sequence[torch.Tensor], timeout_s: float | None = None
    ) -> list[torch.Tensor]:
        """The flat outputs; every wait of this call is bounded by ``timeout_s`` (default: the runner's)."""
        driver, spill_bytes = self._driver_for(program, flat_inputs)
        try:
            return driver.run(
                program, flat_inputs, lambda outputs: outputs, self.timeout_s if timeout_s is None else timeout_s
            )
        finally:
            _SPILLS_AHEAD.release(spill_bytes)

    def submit(
        self, program: SplitProgram, flat_inputs: Sequence[torch.Tensor], timeout_s: float | None = None
    ) -> Future:
        """A future of the flat outputs; requests run in submission order, pipelined through the ranks."""
        return self.submit_with(program, flat_inputs, lambda outputs: outputs, timeout_s)

    def submit_with(
        self,
        program: SplitProgram,
        flat_inputs: Sequence[torch.Tensor],
        finish: Callable[[list[torch.Tensor]], Any],
        timeout_s: float | None = None,
    ) -> Future:
        """Like :meth:`submit`, the future holding ``finish(flat_outputs)``."""
        driver, spill_bytes = self._driver_for(program, flat_inputs)
        try:
            future = driver.submit(program, flat_inputs, finish, self.timeout_s if timeout_s is None else timeout_s)
        except BaseException:
            _SPILLS_AHEAD.release(spill_bytes)
            raise
        if spill_bytes:
            future.add_done_callback(lambda _: _SPILLS_AHEAD.release(spill_bytes))
        return future

    def _driver_for(self, program: SplitProgram, flat_inputs: Sequence[torch.Tensor]) -> tuple[Driver, int]:
        """The running driver (workers started, or restarted after a failure) once the call is checked, and the
        bytes of spill files the request's messages were given (:data:`_SPILLS_AHEAD`, released when it ends)."""
        if program.num_devices > len(self.torch_devices):
            raise InputError(
                f"the program has {program.num_devices} parts but this runner has {len(self.torch_devices)} devices"
            )
        check_inputs(program, flat_inputs)
        with self._starting:
            if self._closing:  # a submit from a done callback while close waits: a restart now would outlive it
                raise InputError(
                    "this runner is closing: a request submitted after close() began is not served; submit it "
                    "before closing, or to a new runner"
                )
            if self._driver is not None and self._driver.failure is None and self._driver.idle:
                self._fail_on_a_dead_rank()  # only when idle: a death under load fails the requests in flight
            if self._driver is not None and self._driver.failure is not None:
                self._stop()
            if self._driver is None:
                with self._reporting():
                    self._start([program])
            elif self._shared_memory and not any(p is program for p in self._driver.loaded):
                _check_room_to_load(program)
            self._refuse_lost_state()
            self._refuse_changed_weights(program)
            spill_bytes = _take_room_for_messages(program, flat_inputs) if self._shared_memory else 0
            return self._driver, spill_bytes

    def _fail_on_a_dead_rank(self) -> None:
        """Fail the driver where a rank's process has exited while no request was in flight, so that this call
        starts new ranks and is served by them: sent to the dead rank, it failed (and the requests after it), though
        the process's exit was known. A rank that is alive but stopped is found by the request's own timeout."""
        for rank, worker in enumerate(self._workers, start=1):
            if not worker.is_alive():
                _log.info("rank %d exited while no request was in flight: starting new ranks", rank)
                self._driver.fail_named(
                    DistributedError(
                        f"rank {rank} ({self._names()[rank]}) died while no request was in flight"
                        f"{self._describe_process(rank)}"
                    )
                )
                return

    def _refuse_changed_weights(self, program: SplitProgram) -> None:
        """An :class:`InputError` where the model changed in place a weight the running ranks were sent
        (:mod:`moirai.runtime.weights_sent`); a program's first request here takes note of what they hold."""
        sent = self._weights_sent.get(program)
        if sent is None:
            self._weights_sent[program] = WeightsSent.of(program)
        else:
            sent.refuse_changed(self._names())

    def _refuse_lost_state(self) -> None:
        """A :class:`DistributedError` where the state the ranks kept ended with a failed world (``state_on_ranks``)."""
        if self._state_lost is not None:
            raise DistributedError(
                f"{self._state_lost}; the ranks that failed held state this runner's requests write in place "
                f"({self._state_on_ranks}), which ended with them, and new ranks would start from its values before "
                "the server: later requests would compute from the wrong state, so they are refused. Close this "
                "server and open a new one to start from that state, or run with compiled(...), which keeps it"
            ) from self._state_lost

    def resources_in_use(self) -> list[dict[str, Any]]:
        """Per rank, what it runs with, read back inside its process: ``cores`` (affinity), ``threads`` (rank 0's:
        the count its driver's threads set for themselves) and ``io_thread_cores`` (the affinity of each of gloo's I/O
        threads)."""
        with self._starting:
            if self._driver is None:
                self._start([])
        return [
            {**_resources_in_use(), "threads": self._driver.threads},
            *(_checked_resources(self._store, k) for k in range(1, len(self._workers) + 1)),
        ]

    def close(self) -> None:
        """Finish the requests in flight, stop the workers and give this process its cores back."""
        self.check_close_allowed()
        self._closing = True  # a restart not yet begun starts nothing, and later submits are refused
        try:
            with self._starting:
                driver = self._driver if self._driver is not None and self._driver.failure is None else None
            if driver is not None:
                driver.close()  # not under _starting: a done callback's submit takes it (to be refused)
            with self._starting:
                self._stop()
            if self._restarting is not None:  # [Note: no thread of ours outlives close]
                self._restarting.join()
            if self._joining is not None:  # ends with gloo's connect, its ranks killed
                self._joining.join()
        finally:
            self._closing = False

    def check_close_allowed(self) -> None:
        """:class:`UsageError` where the caller is a done callback in the running driver's threads
        (:meth:`Driver.check_close_allowed`); a failed driver's threads may close, as they wait for nothing."""
        driver = self._driver
        if driver is not None and driver.failure is None:
            driver.check_close_allowed()

    def _restart_in_background(self, failed: Driver) -> None:
        """Called by a driver once its failure has failed its pending requests."""
        self._restarting = threading.Thread(target=self._restart, args=(failed,), name="moirai-restart", daemon=True)
        self._restarting.start()

    def _restart(self, failed: Driver) -> None:
        """New workers in place of a failed driver's, for the programs it had: a later call waits for what is left."""
        with self._starting:
            if self._driver is not failed or self._closing:
                return  # a call restarted it already, or the runner closes
            _log.info("starting new ranks after: %s", failed.failure)
            self._stop()
            try:
                self._start(failed.loaded, abandon_on_close=True)
            except _StartAbandoned:
                _log.info("the runner closed while new ranks started: they were stopped")
            except Exception as error:  # the next call starts again and raises its own error
                _log.warning("restarting the ranks after a failure failed: %s", error)

    @stage("start workers", "one process per device but the first")
    def _start(self, programs: Sequence[SplitProgram], abandon_on_close: bool = False) -> None:
        """Spawn ranks 1..N-1 and make the driver; ``programs``: those the first calls will load (to check room).

        ``abandon_on_close``: a restart nobody waits for yet; if ``close()`` comes while the ranks start, they are
        killed at once (raising :class:`_StartAbandoned`) instead of started only to be stopped."""
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # This is a rank importing the user's script, which starts a runner at import: stop quietly with a code
            # the parent recognises, instead of three multiprocessing tracebacks (os._exit: a process forked from
            # the fork server turns a SystemExit into exit code 1).
            flush_standard_streams()
            os._exit(_NO_MAIN_GUARD_EXIT_CODE)
        world_size = len(self.torch_devices)
        resources = rank_resources(self.devices)
        self._weights_sent = {}  # new ranks: each program is sent (as it is then) at its first request
        # Joining (store and groups) may take as long as start-up; each message waits with its request's timeout.
        self._shared_memory = shm.enabled() and _room_for_shared_memory(world_size, programs)
        self._starter = RankStarter()  # first: a bad MOIRAI_RANK_START leaves no store open
        self._store = start_store(world_size, self.start_timeout_s)
        self._workers = []
        for rank in range(1, world_size):
            arguments = (
                self.torch_devices,
                self._names(),
                self._store.port,
                self._store.secret,
                self.timeout_s,
                self.start_timeout_s,
                resources[rank],
                self._shared_memory,
            )
            try:
                worker = self._starter.start(rank, _worker_main, arguments, orphans.rank_process_name(rank))
            except Exception as error:
                self._fail_start(
                    f"could not start rank {rank}'s process ({type(error).__name__}: {error})", grace_s=0.0
                )
            self._workers.append(worker)
        self._await_ready(abandon_on_close)
        # The process's cores only: rank 0 computes in the driver's threads, which set its thread count themselves.
        self._restore = apply_resources(resources[0], self._names()[0], own_process=False, set_threads=False)
        group = self._join()
        pin_io_threads(resources[0])
        self._driver = Driver(
            group,
            self.timeout_s,
            self.max_in_flight,
            describe_rank=self._describe_process,
            helper_cores=resources[0].helper_cores,
            on_failure=self._restart_in_background,
            threads=resources[0].threads,
        )
        self.worlds.started()

    def _await_ready(self, abandon_on_close: bool) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        waiting = set(range(1, len(self._workers) + 1))
        while waiting:
            if abandon_on_close and self._closing:
                self._stop(grace_s=0.0)
                raise _StartAbandoned
            for rank in sorted(waiting):
                if self._store.check([f"moirai/ready/{rank}"]):
                    waiting.discard(rank)
                elif self._store.check([failure_key(rank)]):
                    try:
                        message = read_report(self._store, rank, len(self.torch_devices))["message"]
                    except DistributedError as forged:
                        self._fail_start(str(forged))
                    self._fail_start(f"rank {rank} ({self._names()[rank]}) failed during start-up: {message}")
                elif not self._workers[rank - 1].is_alive():
                    self._fail_start(self._start_death(rank))
            if waiting and time.monotonic() > deadline:
                self._fail_start(f"rank(s) {sorted(waiting)} did not start within {self.start_timeout_s:.0f} s")
            time.sleep(_START_POLL_S if waiting else 0)

    def _join(self) -> Group:
        """Rank 0's side of the groups, once every rank reported ready.

        A rank that halts in between (stopped, dead) fails the join; but where gloo already took its address, gloo's
        connect gives up only after about five join timeouts (17 s of a 3 s one, 32 s of 6 s, measured), and killing
        the rank does not end it sooner. So the join runs in a thread rank 0 waits on for the join timeout: past it,
        the start fails naming the halted ranks, which are killed, and the thread is left to end on its own."""
        outcome: dict[str, Any] = {}
        joined = threading.Event()

        def join() -> None:
            try:
                outcome["group"] = local_group(
                    0, self.torch_devices, self._store, self.start_timeout_s, self._shared_memory
                )
            except Exception as error:  # torch's DistError, for the start to report
                outcome["error"] = error
            joined.set()

        joining = threading.Thread(target=join, name="moirai-join", daemon=True)
        joining.start()
        joined.wait(self.start_timeout_s + _JOIN_SLACK_S)
        if "group" in outcome:
            return outcome["group"]
        error = outcome.get("error")
        if error is None:
            self._joining = joining  # close() joins it ([Note: no thread of ours outlives close])
        halted = {rank: state for rank, worker in enumerate(self._workers, 1) if (state := _halted(worker))}
        named = sorted(halted) or list(range(1, len(self._workers) + 1))
        states = "; ".join(f"rank {rank} ({self._names()[rank]}) {halted[rank]}" for rank in sorted(halted))
        cause = f"{type(error).__name__}: {error}" if error is not None else "rank 0 was still waiting for them"
        self._fail_start(
            f"rank(s) {named} reported ready but did not join rank 0's process groups within "
            f"{self.start_timeout_s:.0f} s{f' ({states})' if states else ''}: {cause}",
            grace_s=0.0 if halted or error is None else None,  # a stopped rank cannot exit on its own
        )

    def _start_death(self, rank: int) -> str:
        code = self._workers[rank - 1].exitcode
        if code == _NO_MAIN_GUARD_EXIT_CODE:
            return (
                "the worker processes re-import your script, and it starts a distributed run when imported: put the "
                "code that calls run_distributed / DistributedRunner / compiled.server() under `if __name__ == "
                '"__main__":`'
            )
        return (
            f"rank {rank} ({self._names()[rank]}) died during start-up with exit code {code} without reporting an "
            'error (see its output above); if your script has no `if __name__ == "__main__":` guard, add one'
        )

    def _fail_start(self, message: str, grace_s: float | None = None) -> NoReturn:
        self._stop(grace_s)
        raise DistributedError(message)

    def _describe_process(self, rank: int) -> str:
        if rank == 0 or rank > len(self._workers):
            return ""
        code = self._workers[rank - 1].exitcode
        return f"; its process exited with code {code}" if code is not None else ""

    def _names(self) -> list[str]:
        return [d.name if isinstance(d, Device) else d for d in self.devices]

    def _stop(self, grace_s: float | None = None) -> None:
        """Stop the ranks, killing those still alive after ``grace_s`` (default: ``_RANKS_EXIT_GRACE_S``), and give
        back what the driver held."""
        # After a failure the other ranks still name the guilty rank on their stderr (within the report grace); a
        # rank nobody heard from is not waited for.
        failure = self._driver.failure if self._driver is not None else None
        if failure is not None:
            self.worlds.ended(failure)
            if self._state_on_ranks is not None and self._driver.dispatched and self._state_lost is None:
                self._state_lost = failure
        if isinstance(failure, RankSilent) and 1 <= failure.rank <= len(self._workers):
            self._workers[failure.rank - 1].kill()
        deadline = time.monotonic() + (_RANKS_EXIT_GRACE_S if grace_s is None else grace_s)
        for worker in self._workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in self._workers:
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5.0)
        if self._starter is not None:
            self._starter.kill_orphans(self._workers)
        if self._driver is not None:
            if self._driver.failure is not None:
                self._driver.join_after_failure(max(deadline - time.monotonic(), _FAILED_THREADS_GRACE_S))
            self._driver.group.close()
        if self._restore is not None:
            restore_resources(self._restore)
        self._workers, self._driver, self._store, self._restore = [], None, None, None


class Worlds:
    """The worlds (sets of ranks) a runner has started, counted from 1, and the failure that ended each. What a rank
    keeps between requests (a KV cache, a buffer written in place) lives as long as its world: a reader that notes
    the world its state began in learns here that the state is gone, even where the ranks died and restarted while
    it had no request in flight (no request failed to tell it)."""

    def __init__(self) -> None:
        self.current = 0  # the running (or last) world; 0: none started yet
        self._ended_by: dict[int, BaseException] = {}

    def started(self) -> None:
        self.current += 1

    def ended(self, failure: BaseException) -> None:
        """The current world ended with ``failure`` (a rank died or hung): its ranks' state is gone."""
        self._ended_by.setdefault(self.current, failure)

    def ended_by(self, world: int) -> BaseException | None:
        """The failure that ended ``world``; None while it runs (or once it ended by a close)."""
        return self._ended_by.get(world)


# [Note: no thread of ours outlives close]
# A daemon thread that drops the last reference to a gloo process group while the interpreter finalizes aborts the
# process ("terminate called without an active exception": the group's destructor gives up the GIL and cannot take
# it back). So close() joins the restart thread, a join rank 0 gave up waiting for, and the failed driver's threads
# (which hold the failed groups), and runners a script never closed are closed at its exit, while threads can still
# run.
_LIVE_RUNNERS: weakref.WeakSet[DistributedRunner] = weakref.WeakSet()


@atexit.register
def _close_live_runners() -> None:
    for runner in list(_LIVE_RUNNERS):
        try:
            runner.close()
        except Exception as error:  # the process is exiting: say what went wrong, do not raise
            _log.warning("closing a runner at exit failed: %s", error)


class _StartAbandoned(Exception):
    """A restart's ranks were killed while they started because the runner closed (never reaches a caller)."""


def _room_for_shared_memory(world_size: int, programs: Sequence[SplitProgram]) -> bool:
    """Whether the shared-memory directory holds the rings and every rank's loads of ``programs``; where it does not,
    a warning: the ranks send through gloo, which serves, only slower, rather than refuse to start (docker's default
    64 MB /dev/shm would refuse four ranks of any model)."""
    loads = [load_bytes(program, rank) for program in programs for rank in range(1, program.num_devices)]
    shortfall = shm.room_shortfall(loads, world_size)
    if shortfall is None:
        return True
    warnings.warn(
        f"{shortfall}: the ranks send through gloo instead, which costs each a fraction of a millisecond of CPU per "
        f"message more; enlarge it (e.g. docker --shm-size) or point {shm.DIR_ENV} at a larger tmpfs, or set "
        f"{shm.ENV_SWITCH}=0 to choose gloo without this warning",
        SharedMemoryWarning,
        stacklevel=user_stacklevel(),
    )
    return False


def _check_room_to_load(program: SplitProgram) -> None:
    """Before a running world loads another program: a :class:`moirai.DistributedError` where its parts do not fit
    in the shared-memory directory (the ranks run on, serving the programs they have)."""
    shortfall = shm.room_shortfall([load_bytes(program, rank) for rank in range(1, program.num_devices)])
    if shortfall is not None:
        raise DistributedError(f"{shortfall}; set {shm.ENV_SWITCH}=0 or enlarge {shm_dir()}, e.g. docker --shm-size")


# Programs of fixed shapes none of whose messages spill: no request of theirs needs room in the directory.
_SPILLS_NOTHING: weakref.WeakSet[SplitProgram] = weakref.WeakSet()


class _SpillsAhead:
    """The bytes of spill files that requests accepted and not yet ended may still write: a request is given room
    only beside them. Each request submitted at once saw the same free space and passed, and then the ranks ran out
    of it while sending, which failed every request in flight and restarted them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0

    def take(self, message_bytes: Sequence[int]) -> int:
        """Room for ``message_bytes``' spills beside those ahead (their bytes, to release), else an InputError."""
        with self._lock:
            shortfall = shm.room_shortfall(
                message_bytes,
                needing="this request",
                spilled="for messages too large for a ring",
                taken_bytes=self._bytes,
            )
            if shortfall is not None:
                raise InputError(
                    f"{shortfall}: the request is refused and the ranks serve on; send smaller requests or fewer at "
                    f"once, enlarge {shm_dir()} (e.g. docker --shm-size) or point {shm.DIR_ENV} at a larger tmpfs, "
                    f"or set {shm.ENV_SWITCH}=0 to send through gloo"
                )
            taken = sum(nbytes for nbytes in message_bytes if shm.spills(nbytes))
            self._bytes += taken
            return taken

    def release(self, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self._bytes -= nbytes


_SPILLS_AHEAD = _SpillsAhead()  # one per process: every runner's spill files share one directory


def _take_room_for_messages(program: SplitProgram, flat_inputs: Sequence[torch.Tensor]) -> int:
    """Before a request is sent: an :class:`InputError` where the messages it spills into files (too large for a
    ring) do not fit in the shared-memory directory beside those of the requests ahead of it; else the bytes taken.
    Refused here, the request fails alone; a spill that failed inside a rank failed that rank, every request in
    flight with it, and restarted the ranks."""
    if not program.dynamic_dims and program in _SPILLS_NOTHING:  # the common case: nothing to count per request
        return 0
    message_bytes = request_message_bytes(program, flat_inputs)
    if not program.dynamic_dims and not any(map(shm.spills, message_bytes)):
        _SPILLS_NOTHING.add(program)
        return 0
    return _SPILLS_AHEAD.take(message_bytes)


def torch_device(device: str | Device) -> str:
    return str(torch.device(device.torch_device if isinstance(device, Device) else device))


def _resources_in_use() -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cores": cores,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "io_thread_cores": io_thread_cores(),
    }


def _checked_resources(store: RunStore, rank: int) -> dict[str, Any]:
    def valid(resources: Any) -> bool:
        return isinstance(resources, dict) and isinstance(resources.get("threads"), int)

    return get_json(store, f"moirai/resources/{rank}", "resources report", valid, '{"threads": an int, ...}')


def _halted(worker: multiprocessing.process.BaseProcess) -> str | None:
    """How a rank's process stopped running (exited, stopped by a signal), or None while it runs."""
    if not worker.is_alive():
        return f"exited with code {worker.exitcode}"
    try:
        status = psutil.Process(worker.pid).status()
    except psutil.Error:
        return None
    return (
        f"is {status}" if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE) else None
    )


def _worker_main(
    rank: int,
    torch_devices: list[str],
    names: list[str],
    port: int,
    secret: bytes,
    timeout_s: float,
    start_timeout_s: float,
    resources: RankResources,
    shared_memory: bool,
    inheritance: RankInheritance,
) -> None:
    """A started rank: take its share of the cores, join the groups on loopback, serve until rank 0 closes.

    ``secret`` (the run's, from rank 0's arguments, never from the store) opens the store's values and
    authenticates rank 0's headers. The rank exits as soon as rank 0's process does (:mod:`moirai.runtime.orphans`).
    """
    become_rank(rank, inheritance)
    store = join_store(port, len(torch_devices), secret, start_timeout_s)
    group = None
    try:
        apply_resources(resources, names[rank])
        orphans.started()
        store.set(f"moirai/ready/{rank}", "1")
        group = local_group(rank, torch_devices, store, start_timeout_s, shared_memory)
        pin_io_threads(resources)
        store.set(f"moirai/resources/{rank}", json.dumps(_resources_in_use()))
        serve(group, {}, timeout_s)
        group.close()  # its shared-memory links and spill owner: their lock file stayed in /dev/shm after each run
    except Exception as error:
        if group is None:
            report_failure(store, rank, None, describe_error(error))
        else:
            # Ranks waiting on this one learn at once (not when its verdict is done) and follow its report.
            report_failure(store, rank, error.peer if isinstance(error, PeerFailure) else None, str(error))
            group.hang_up()
            # Rank 0 names the guilty rank in its own error; this rank's verdict goes to its stderr, as under torchrun.
            verdict = blamed(group, error, "serving")
            print(f"moirai rank {rank}: DistributedError: {verdict}", file=sys.stderr, flush=True)
        os._exit(1)
