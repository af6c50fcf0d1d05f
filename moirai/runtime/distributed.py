"""Run a :class:`~moirai.runtime.split.SplitProgram` with one process per device: the entry points and the launchers.

Part ``k`` runs on rank ``k``, and the caller's process is rank 0, the driver
(:mod:`moirai.runtime.driver`): it takes the requests, sends each rank the inputs its part reads,
runs part 0 itself and receives the outputs of the other parts. Requests are pipelined: before
each request the driver sends every rank a small header (which program, the request's symbolic
dimension values, from which each rank sizes its receive buffers, and its time limit) without
waiting for earlier requests to finish, and each rank runs its part for the requests in header
order, so rank ``k`` works on request ``r + 1`` while rank ``k + 1`` still works on request ``r``
(the messages and their tags: :mod:`moirai.runtime.protocol`). Between two CUDA ranks tensors go
over NCCL straight from device memory; a link with a CPU (or any other non-CUDA) end goes over
gloo, staged through host memory (:mod:`moirai.runtime.groups`).

Waiting for work is not failure detection: an idle driver sends heartbeat headers, so a rank
waits for its next header at most a fraction of the timeout while the driver is alive. Every
other wait has the timeout of its request. When one fails, every rank's error and the driver's
name the rank that failed on its own or that nobody heard from, a hung or dead rank
(:mod:`moirai.runtime.blame`), and every pending request fails with that error.

Launching:

- :class:`DistributedRunner` (and :func:`run_distributed`, one call) makes this process rank 0
  and spawns ranks 1..N-1 with ``torch.multiprocessing`` (:func:`_worker_main`), connected on
  127.0.0.1 with process groups of their own (the default process group is left alone). While
  the runner is open this process runs on rank 0's share of the cores (see
  :mod:`moirai.runtime.resources`).
- Under ``torchrun`` the ranks are torchrun's (``RANK``; the default process group is
  initialised from its environment if needed): rank ``k`` serves the plan's device ``k``, and
  the world size must equal the number of devices. Either every rank calls :func:`run_rank`
  once per request, or rank 0 serves requests through a :class:`moirai.runtime.server.Server`
  (``compiled.server()``, backed by :func:`torchrun_driver`) while the others call
  :func:`serve_rank` until rank 0 closes it.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from moirai.cluster import kinds as device_kinds
from moirai.cluster.devices import Device
from moirai.cluster.kinds import kind_of
from moirai.errors import DistributedError, InputError
from moirai.progress import stage
from moirai.runtime import orphans, shm
from moirai.runtime.blame import PeerFailure, blamed, describe_error, read_report, report_failure
from moirai.runtime.driver import Driver, check_max_in_flight, check_timeout
from moirai.runtime.groups import Group, local_group, placed_part
from moirai.runtime.hosts import host_ranks, rank_hosts, torchrun_layout
from moirai.runtime.local import check_inputs
from moirai.runtime.network import choose_gloo_interface
from moirai.runtime.protocol import Header, Messages, receive_header, run_part, send_header, send_inputs, serve
from moirai.runtime.resources import (
    RankResources,
    apply_resources,
    io_thread_cores,
    pin_io_threads,
    rank_resources,
    restore_resources,
)
from moirai.runtime.split import SplitProgram
from moirai.runtime.store import RUN_SECRET_ENV, RunStore, join_store, start_store

__all__ = [
    "DistributedRunner",
    "backend_for",
    "check_timeout",
    "init_rank",
    "run_distributed",
    "run_rank",
    "serve_rank",
    "torchrun_driver",
    "torchrun_group",
    "torchrun_store",
]

_START_POLL_S = 0.05
# Exit code of a spawned rank that found the user's script re-imported without a __main__ guard.
_NO_MAIN_GUARD_EXIT_CODE = 86


def run_distributed(
    program: SplitProgram,
    flat_inputs: Sequence[torch.Tensor],
    torch_devices: Sequence[str | Device],
    timeout_s: float = 60.0,
) -> list[torch.Tensor]:
    """Run ``program`` once on ``len(torch_devices)`` processes (this one is rank 0); outputs on device 0."""
    with DistributedRunner(torch_devices, timeout_s=timeout_s) as runner:
        return runner.run(program, flat_inputs)


def backend_for(torch_devices: Sequence[str]) -> str:
    """The process-group backend for a world with these devices (see the module docstring)."""
    return device_kinds.backend_for(torch_devices)


def init_rank(
    rank: int, world_size: int, torch_devices: Sequence[str], timeout_s: float, init_method: str = "env://"
) -> None:
    """Join the default process group (``env://`` reads torchrun's MASTER_ADDR/MASTER_PORT).

    Headers are host tensors, so a world of GPUs only still gets gloo for host memory. Across hosts gloo gets the
    interface that routes to the master address unless ``GLOO_SOCKET_IFNAME`` names one
    (:func:`moirai.runtime.network.choose_gloo_interface`).
    """
    device = torch.device(torch_devices[rank])
    kind_of(device).set_current(device)
    choose_gloo_interface(rank=rank)
    dist.init_process_group(
        device_kinds.default_group_backend(torch_devices),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def run_rank(
    program: SplitProgram,
    rank: int,
    world_size: int,
    flat_inputs: Sequence[torch.Tensor] | None,
    torch_devices: Sequence[str | Device],
    timeout_s: float = 60.0,
) -> list[torch.Tensor] | None:
    """Run this rank's part of one request under torchrun; every rank calls it for every request, in the same order.

    Rank 0 passes the flat inputs and gets the flat outputs; the others pass and get None.
    """
    timeout_s = check_timeout(timeout_s)
    if (flat_inputs is None) != (rank != 0):
        raise InputError(f"rank 0, and only rank 0, takes the flat inputs; rank {rank} was given {flat_inputs!r:.40}")
    group = _torchrun_group(program, rank, world_size, torch_devices, timeout_s)
    if flat_inputs is not None:
        check_inputs(program, flat_inputs)
    request = next(group.requests)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if flat_inputs is not None:
            header = Header.run(program, 0, request, flat_inputs, timeout_s)
            control = [send_header(group, request, k, header, timeout) for k in range(1, program.num_devices)]
        else:
            header = receive_header(group, request, timeout)
            control = []
        messages = Messages(group, request, timeout, header.symbol_values)
        if flat_inputs is not None:
            send_inputs(program, messages, flat_inputs)
        outputs = run_part(program, group, placed_part(program, group), messages, flat_inputs)()
        for sent in control:
            sent.wait_sends()
        return outputs
    except DistributedError as error:
        raise blamed(group, error, f"request {request}") from error


def serve_rank(program: SplitProgram, torch_devices: Sequence[str | Device], timeout_s: float = 120.0) -> None:
    """Under torchrun, on every rank but 0: run this rank's part of each request rank 0's server sends, until it closes.

    Raises :class:`moirai.DistributedError` naming the guilty rank if a rank fails or hangs.
    """
    timeout_s = check_timeout(timeout_s)
    rank, world_size = _torchrun_rank()
    if rank == 0:
        raise InputError("rank 0 is the driver: serve requests there with compiled.server(), not serve_rank")
    group = _torchrun_group(program, rank, world_size, torch_devices, timeout_s)
    try:
        serve(group, {0: program}, timeout_s)
    except DistributedError as error:
        raise blamed(group, error, "serving") from error


def torchrun_driver(
    program: SplitProgram, torch_devices: Sequence[str | Device], timeout_s: float, max_in_flight: int
) -> Driver:
    """Rank 0's driver under torchrun (the others call :func:`serve_rank` with the same program)."""
    rank, world_size = _torchrun_rank()
    if rank != 0:
        raise InputError(
            f"this is rank {rank}: only rank 0 serves requests; call moirai.serve_rank(compiled) on the other ranks"
        )
    group = _torchrun_group(program, rank, world_size, torch_devices, timeout_s)
    helper_cores = _torchrun_resources(torch_devices, rank)[0].helper_cores
    return Driver(group, timeout_s, max_in_flight, preloaded=program, helper_cores=helper_cores)


def _torchrun_rank() -> tuple[int, int]:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise InputError("RANK and WORLD_SIZE are not set: run the script with torchrun (or use compiled.server())")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class DistributedRunner:
    """This process as rank 0 and one spawned process per other device, kept between calls.

    ``run(program, flat_inputs)`` returns the flat outputs on ``torch_devices[0]``; ``submit``
    returns a future of them, so several requests can be in flight (at most ``max_in_flight``
    are sent ahead). A program is sent to the workers the first time it is used (several
    programs with at most ``len(torch_devices)`` parts can share one runner). Workers start on
    the first call; after a failure the next call starts new ones. Use as a context manager or
    call ``close()``.
    """

    def __init__(
        self,
        torch_devices: Sequence[str | Device],
        timeout_s: float = 60.0,
        start_timeout_s: float = 180.0,
        max_in_flight: int = 8,
    ) -> None:
        self.devices = list(torch_devices)
        self.torch_devices = [_torch_device(d) for d in self.devices]
        self.timeout_s = check_timeout(timeout_s)
        self.start_timeout_s = check_timeout(start_timeout_s)
        self.max_in_flight = check_max_in_flight(max_in_flight)
        self._workers: list[multiprocessing.Process] = []
        self._driver: Driver | None = None
        self._store: RunStore | None = None
        self._restore: RankResources | None = None
        self._starting = threading.Lock()  # submit may be called from several threads

    def __enter__(self) -> DistributedRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run(
        self, program: SplitProgram, flat_inputs: Sequence[torch.Tensor], timeout_s: float | None = None
    ) -> list[torch.Tensor]:
        """The flat outputs; every wait of this call is bounded by ``timeout_s`` (default: the runner's)."""
        driver = self._driver_for(program, flat_inputs)
        return driver.run(
            program, flat_inputs, lambda outputs: outputs, self.timeout_s if timeout_s is None else timeout_s
        )

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
        driver = self._driver_for(program, flat_inputs)
        return driver.submit(program, flat_inputs, finish, self.timeout_s if timeout_s is None else timeout_s)

    def _driver_for(self, program: SplitProgram, flat_inputs: Sequence[torch.Tensor]) -> Driver:
        """The running driver (workers started, or restarted after a failure) once the call is checked."""
        if program.num_devices > len(self.torch_devices):
            raise InputError(
                f"the program has {program.num_devices} parts but this runner has {len(self.torch_devices)} devices"
            )
        check_inputs(program, flat_inputs)
        with self._starting:
            if self._driver is not None and self._driver.failure is not None:
                self._stop()
            if self._driver is None:
                self._start()
            return self._driver

    def resources_in_use(self) -> list[dict[str, Any]]:
        """Per rank, what it runs with, read back inside its process: ``cores`` (affinity), ``threads`` and
        ``io_thread_cores`` (the affinity of each of gloo's I/O threads)."""
        with self._starting:
            if self._driver is None:
                self._start()
        return [
            _resources_in_use(),
            *(_checked_resources(self._store, k) for k in range(1, len(self._workers) + 1)),
        ]

    def close(self) -> None:
        """Finish the requests in flight, stop the workers and give this process its cores back."""
        if self._driver is not None and self._driver.failure is None:
            self._driver.close()
        self._stop()

    @stage("start workers", "one process per device but the first")
    def _start(self) -> None:
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # This is a spawned rank importing the user's script, which starts a runner at import: stop quietly
            # with a code the parent recognises, instead of three multiprocessing tracebacks.
            raise SystemExit(_NO_MAIN_GUARD_EXIT_CODE)
        world_size = len(self.torch_devices)
        resources = rank_resources(self.devices)
        # Joining (store and groups) may take as long as start-up; each message waits with its request's timeout.
        if shm.enabled():
            shm.check_space(world_size)
        self._store = start_store(world_size, self.start_timeout_s)
        context = torch.multiprocessing.get_context("spawn")
        self._workers = [
            context.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.torch_devices,
                    self._names(),
                    self._store.port,
                    self._store.secret,
                    self.timeout_s,
                    self.start_timeout_s,
                    resources[rank],
                ),
                daemon=True,
                name=orphans.rank_process_name(rank),
            )
            for rank in range(1, world_size)
        ]
        for worker in self._workers:
            worker.start()
        self._await_ready()
        self._restore = apply_resources(resources[0], self._names()[0], own_process=False)
        group = local_group(0, self.torch_devices, self._store, self.start_timeout_s)
        pin_io_threads(resources[0])
        self._driver = Driver(
            group,
            self.timeout_s,
            self.max_in_flight,
            describe_rank=self._describe_process,
            helper_cores=resources[0].helper_cores,
        )

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        waiting = set(range(1, len(self._workers) + 1))
        while waiting:
            for rank in sorted(waiting):
                if self._store.check([f"moirai/ready/{rank}"]):
                    waiting.discard(rank)
                elif self._store.check([f"moirai/failure/{rank}"]):
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

    def _fail_start(self, message: str) -> None:
        self._stop()
        raise DistributedError(message)

    def _describe_process(self, rank: int) -> str:
        if rank == 0 or rank > len(self._workers):
            return ""
        code = self._workers[rank - 1].exitcode
        return f"; its process exited with code {code}" if code is not None else ""

    def _names(self) -> list[str]:
        return [d.name if isinstance(d, Device) else d for d in self.devices]

    def _stop(self) -> None:
        # After a failure the other ranks still name the guilty rank on their stderr (within the report grace).
        deadline = time.monotonic() + 5.0
        for worker in self._workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in self._workers:
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5.0)
        if self._driver is not None:
            self._driver.group.close()
        if self._restore is not None:
            restore_resources(self._restore)
        self._workers, self._driver, self._store, self._restore = [], None, None, None


def _torch_device(device: str | Device) -> str:
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
    key = f"moirai/resources/{rank}"
    resources = json.loads(store.get(key))
    if not isinstance(resources, dict) or not isinstance(resources.get("threads"), int):
        raise DistributedError(f"store key {key!r} holds no resources report: {resources!r:.80}")
    return resources


def torchrun_secret() -> bytes | None:
    """Under torchrun, the run's secret from ``MOIRAI_RUN_SECRET`` (hex, the same on every rank), if set.

    Without it, rank 0's headers are not authenticated, and a rank refuses to load a program sent over
    the network (under torchrun every rank has its program already).
    """
    text = os.environ.get(RUN_SECRET_ENV)
    if not text:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise InputError(f"{RUN_SECRET_ENV} must be hexadecimal (e.g. from `openssl rand -hex 32`)") from None


def _worker_main(
    rank: int,
    torch_devices: list[str],
    names: list[str],
    port: int,
    secret: bytes,
    timeout_s: float,
    start_timeout_s: float,
    resources: RankResources,
) -> None:
    """A spawned rank: take its share of the cores, join the groups on loopback, serve until rank 0 closes.

    ``secret`` (the run's, from rank 0's arguments, never from the store) opens the store's values and
    authenticates rank 0's headers. The rank exits as soon as rank 0's process does (:mod:`moirai.runtime.orphans`).
    """
    store = join_store(port, len(torch_devices), secret, start_timeout_s)
    group = None
    try:
        apply_resources(resources, names[rank])
        orphans.started()
        store.set(f"moirai/ready/{rank}", "1")
        group = local_group(rank, torch_devices, store, start_timeout_s)
        pin_io_threads(resources)
        store.set(f"moirai/resources/{rank}", json.dumps(_resources_in_use()))
        serve(group, {}, timeout_s)
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


def torchrun_store(torch_devices: Sequence[str], timeout_s: float = 120.0) -> RunStore | None:
    """Under torchrun with one rank per device of ``torch_devices``, the run's store (joining the default process
    group, as the first request would, if not yet joined); None otherwise."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world_size = _torchrun_rank()
    if world_size < 2 or world_size != len(torch_devices):
        return None
    if not dist.is_initialized():
        init_rank(rank, world_size, torch_devices, check_timeout(timeout_s))
    return RunStore(dist.distributed_c10d._get_default_store(), torchrun_secret())


_TORCHRUN_GROUP: Group | None = None


def _torchrun_group(
    program: SplitProgram, rank: int, world_size: int, devices: Sequence[str | Device], timeout_s: float
) -> Group:
    """The default process group (initialised from torchrun's environment if needed), once per process."""
    global _TORCHRUN_GROUP
    torch_devices = [_torch_device(d) for d in devices]
    if not len(torch_devices) == world_size == program.num_devices:
        raise InputError(
            f"the plan has {program.num_devices} devices, so it needs exactly {program.num_devices} ranks, one per "
            f"device (rank k serves device k; on several hosts, give the hosts' processes consecutive ranks in the "
            f"plan's device order); this run has {world_size} ranks and {len(torch_devices)} devices"
        )
    if _TORCHRUN_GROUP is None or _TORCHRUN_GROUP.rank != rank or _TORCHRUN_GROUP.world_size != world_size:
        _TORCHRUN_GROUP = torchrun_group(rank, world_size, devices, timeout_s, f"moirai/shm/{world_size}")
    return _TORCHRUN_GROUP


def torchrun_group(
    rank: int, world_size: int, devices: Sequence[str | Device], timeout_s: float, shm_prefix: str
) -> Group:
    """This torchrun rank set up as the runtime sets up its ranks: its share of its host's cores, the default process
    group (gloo between hosts), shared memory with the ranks of its host (a collective: every rank calls it, with one
    ``shm_prefix`` per call)."""
    torch_devices = [_torch_device(d) for d in devices]
    if not dist.is_initialized():
        init_rank(rank, world_size, torch_devices, timeout_s)
    resources, neighbours = _torchrun_resources(devices, rank)
    apply_resources(resources, str(devices[rank]))
    pin_io_threads(resources)
    default = dist.distributed_c10d._get_default_group()
    store = RunStore(dist.distributed_c10d._get_default_store(), torchrun_secret())
    links = shm.connect(rank, world_size, store, timeout_s, shm_prefix, neighbours)
    group = Group(rank, [torch.device(d) for d in torch_devices], default, default, store, shared_memory=links)
    hosts = rank_hosts(store, rank, world_size, f"{shm_prefix}/host", timeout_s)
    if len(set(hosts)) > 1:  # a rank that went silent is named with its host: a host may have gone away
        group.describe_rank = lambda peer: f"; it ran on host {hosts[peer]}"
    return group


def _torchrun_resources(devices: Sequence[str | Device], rank: int) -> tuple[RankResources, range]:
    """This rank's share of its host, split among its host's devices only, and the ranks on its host
    (:mod:`moirai.runtime.hosts`: torchrun's layout, checked against the plan's hosts)."""
    plan_hosts = [d.host if isinstance(d, Device) else "localhost" for d in devices]
    neighbours = host_ranks(plan_hosts, rank, torchrun_layout())
    return rank_resources([devices[k] for k in neighbours])[rank - neighbours.start], neighbours
