"""Run a :class:`~moirai.split.SplitProgram` with one process per device and torch.distributed send/recv.

Part ``k`` runs on rank ``k``. Point-to-point sends and receives move the tensors, into receive
buffers allocated from the traced shapes (:func:`moirai.split.concrete_shape`; no shape
handshake). Between two CUDA ranks the tensors go over NCCL straight from device memory; a
link with a CPU (or any other non-CUDA) end goes over gloo, staged through host memory.

Rank 0 is the driver: it takes the requests, sends each rank the inputs its part reads, runs
part 0 itself and receives the outputs of the other parts. Requests are pipelined: the driver
sends every rank a small header per request (a gloo message: which program, the symbolic
dimension values, the time limit) without waiting for earlier requests to finish, and each
rank runs its part for the requests in header order, so rank ``k`` works on request ``r + 1``
while rank ``k + 1`` still works on request ``r``. Every message of request ``r`` carries a tag
made of ``r`` and its position in the request (header, inputs, the program's transfers in
their global order, outputs), so gloo matches messages per request; NCCL ignores tags and
matches by order, which every rank keeps (requests in order, each part's messages in the
program's global order, see :mod:`moirai.split`).

Waiting for work is not failure detection: an idle driver sends heartbeat headers, so a rank
waits for its next header at most a fraction of the timeout while the driver is alive.

Failure: every wait has the timeout of its request. A rank whose wait fails writes what it was
waiting for into the store, reads the others' reports and follows who waited for whom to the
rank that failed on its own or that nobody heard from (a hung or dead rank): every rank's error
and the driver's name that rank. Pending requests all fail with that error.

Launching:

- :class:`DistributedRunner` (and :func:`run_distributed`, one call) makes this process rank 0
  and spawns ranks 1..N-1 with ``torch.multiprocessing``, connected on 127.0.0.1 with process
  groups of their own (the default process group is left alone). While the runner is open this
  process runs on rank 0's share of the cores (see :mod:`moirai.runtime.resources`).
- Under ``torchrun`` the ranks are torchrun's (``RANK``; the default process group is
  initialised from its environment if needed): rank ``k`` serves the plan's device ``k``, and
  the world size must equal the number of devices. Either every rank calls :func:`run_rank`
  once per request, or rank 0 serves requests through a :class:`moirai.runtime.server.Server`
  (``compiled.server()``) while the others call :func:`serve_rank` until rank 0 closes it.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import multiprocessing
import os
import pickle
import queue
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from moirai import device_kinds
from moirai.device_kinds import kind_of
from moirai.devices import Device
from moirai.errors import DistributedError, InputError, PlanError
from moirai.progress import stage
from moirai.runtime.local import check_inputs, place_part
from moirai.runtime.resources import RankResources, apply_resources, rank_resources, restore_resources
from moirai.split import SplitProgram, concrete_shape, symbol_values
from moirai.trace import TensorSpec

# Header: kind, program id, payload bytes, request index, time limit in ms.
_RUN, _LOAD, _HEARTBEAT, _CLOSE = 1, 2, 3, 4
_HEADER_FIELDS = 5
# Tag = request index modulo a window, then the message's position in the request (0 header, 1 payload).
_TAG_BITS = 20
_TAG_WINDOW = 2048
_FIRST_DATA_TAG = 2
# A heartbeat goes to a rank that has had no header for this fraction of the timeout.
_HEARTBEAT_FRACTION = 0.25
# How long a failed rank waits for the other ranks' reports before naming a rank nobody heard from.
_REPORT_GRACE_S = 3.0
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


def check_timeout(timeout_s: float) -> float:
    """``timeout_s`` if it is a positive number of seconds, else :class:`moirai.InputError` naming the option."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise InputError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def _check_max_in_flight(max_in_flight: int) -> int:
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise InputError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
    return max_in_flight


def init_rank(
    rank: int, world_size: int, torch_devices: Sequence[str], timeout_s: float, init_method: str = "env://"
) -> None:
    """Join the default process group (``env://`` reads torchrun's MASTER_ADDR/MASTER_PORT).

    Headers are host tensors, so a world of GPUs only still gets gloo for host memory.
    """
    device = torch.device(torch_devices[rank])
    kind_of(device).set_current(device)
    backend = backend_for(torch_devices)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
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
            header = _Header.run(program, 0, request, flat_inputs, timeout_s)
            control = [_send_header(group, request, k, header, timeout) for k in range(1, program.num_devices)]
        else:
            header = _receive_header(group, request, timeout)
            control = []
        messages = _Messages(group, request, timeout, header.symbol_values)
        outputs = _run_part(program, group, _placed(program, group), messages, flat_inputs)()
        for sent in control:
            sent.wait_sends()
        return outputs
    except DistributedError as error:
        raise _blamed(group, error, f"request {request}") from error


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
        _serve(group, {0: program}, timeout_s)
    except DistributedError as error:
        raise _blamed(group, error, "serving") from error


def torchrun_driver(
    program: SplitProgram, torch_devices: Sequence[str | Device], timeout_s: float, max_in_flight: int
) -> _Driver:
    """Rank 0's driver under torchrun (the others call :func:`serve_rank` with the same program)."""
    rank, world_size = _torchrun_rank()
    if rank != 0:
        raise InputError(
            f"this is rank {rank}: only rank 0 serves requests; call moirai.serve_rank(compiled) on the other ranks"
        )
    group = _torchrun_group(program, rank, world_size, torch_devices, timeout_s)
    return _Driver(group, timeout_s, max_in_flight, preloaded=program)


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
        self.max_in_flight = _check_max_in_flight(max_in_flight)
        self._workers: list[multiprocessing.Process] = []
        self._driver: _Driver | None = None
        self._store: Any = None
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

    def _driver_for(self, program: SplitProgram, flat_inputs: Sequence[torch.Tensor]) -> _Driver:
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
        """Per rank, what it runs with, read back inside its process: ``cores`` (affinity) and ``threads``."""
        with self._starting:
            if self._driver is None:
                self._start()
        return [
            _resources_in_use(),
            *(json.loads(self._store.get(f"moirai/resources/{k}")) for k in range(1, len(self._workers) + 1)),
        ]

    def close(self) -> None:
        """Finish the requests in flight, stop the workers and give this process its cores back."""
        if self._driver is not None and self._driver.failure is None:
            self._driver.close()
        self._stop()

    @stage("start workers")
    def _start(self) -> None:
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # This is a spawned rank importing the user's script, which starts a runner at import: stop quietly
            # with a code the parent recognises, instead of three multiprocessing tracebacks.
            raise SystemExit(_NO_MAIN_GUARD_EXIT_CODE)
        world_size = len(self.torch_devices)
        resources = rank_resources(self.devices)
        # Joining (store and groups) may take as long as start-up; each message waits with its request's timeout.
        timeout = datetime.timedelta(seconds=self.start_timeout_s)
        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        context = torch.multiprocessing.get_context("spawn")
        self._workers = [
            context.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.torch_devices,
                    self._names(),
                    self._store.port,
                    self.timeout_s,
                    self.start_timeout_s,
                    resources[rank],
                ),
                daemon=True,
                name=f"moirai-rank{rank}",
            )
            for rank in range(1, world_size)
        ]
        for worker in self._workers:
            worker.start()
        self._await_ready()
        self._restore = apply_resources(resources[0], self._names()[0], own_process=False)
        group = _local_group(0, self.torch_devices, self._store, self.start_timeout_s)
        self._driver = _Driver(group, self.timeout_s, self.max_in_flight, describe_rank=self._describe_process)

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        waiting = set(range(1, len(self._workers) + 1))
        while waiting:
            for rank in sorted(waiting):
                if self._store.check([f"moirai/ready/{rank}"]):
                    waiting.discard(rank)
                elif self._store.check([f"moirai/failure/{rank}"]):
                    report = json.loads(self._store.get(f"moirai/failure/{rank}"))
                    self._fail_start(f"rank {rank} ({self._names()[rank]}) failed during start-up: {report['message']}")
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
        if self._restore is not None:
            restore_resources(self._restore)
        self._workers, self._driver, self._store, self._restore = [], None, None, None


def _torch_device(device: str | Device) -> str:
    return str(torch.device(device.torch_device if isinstance(device, Device) else device))


def _resources_in_use() -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cores": cores, "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads()}


def _worker_main(
    rank: int,
    torch_devices: list[str],
    names: list[str],
    port: int,
    timeout_s: float,
    start_timeout_s: float,
    resources: RankResources,
) -> None:
    """A spawned rank: take its share of the cores, join the groups on loopback, serve until rank 0 closes."""
    timeout = datetime.timedelta(seconds=start_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, len(torch_devices), is_master=False, timeout=timeout)
    group = None
    try:
        apply_resources(resources, names[rank])
        store.set(f"moirai/resources/{rank}", json.dumps(_resources_in_use()))
        store.set(f"moirai/ready/{rank}", "1")
        group = _local_group(rank, torch_devices, store, start_timeout_s)
        _serve(group, {}, timeout_s)
    except Exception as error:
        if group is None:
            _report(store, rank, None, _describe(error))
        else:
            # Rank 0 names the guilty rank in its own error; this rank's verdict goes to its stderr, as under torchrun.
            verdict = _blamed(group, error, "serving")
            print(f"moirai rank {rank}: DistributedError: {verdict}", file=sys.stderr, flush=True)
        os._exit(1)


@dataclass
class _Group:
    """This rank's connections: gloo for host memory, NCCL between GPUs, the store for failure reports."""

    rank: int
    devices: list[torch.device]
    gloo: Any
    nccl: Any
    store: Any
    describe_rank: Callable[[int], str] = lambda rank: ""

    def __post_init__(self) -> None:
        self.requests = itertools.count()
        self.placed: weakref.WeakKeyDictionary[SplitProgram, fx.GraphModule] = weakref.WeakKeyDictionary()

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def wire_device(self, peer: int) -> torch.device:
        """Where a message to or from ``peer`` lives: device memory between CUDA ranks (NCCL), else host (gloo)."""
        mine = self.devices[self.rank]
        in_device_memory = kind_of(mine).messages_in_device_memory and self.devices[peer].type == mine.type
        return mine if in_device_memory else torch.device("cpu")

    def process_group(self, wire: torch.device) -> Any:
        return self.nccl if kind_of(wire).messages_in_device_memory else self.gloo


def _local_group(rank: int, torch_devices: Sequence[str], store: Any, join_timeout_s: float) -> _Group:
    """Process groups of our own on loopback (not the default group, which stays the user's)."""
    timeout = datetime.timedelta(seconds=join_timeout_s)
    world_size = len(torch_devices)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("moirai/gloo/", store), rank, world_size, options)
    nccl = None
    # NCCL carries only messages between two GPUs (see _Group.wire_device), so only a world with two needs it.
    nccl_ranks = sum(kind_of(torch.device(d)).backend == "nccl" for d in torch_devices)
    if "nccl" in backend_for(torch_devices) and nccl_ranks >= 2:
        device = torch.device(torch_devices[rank])
        kind_of(device).set_current(device)
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("moirai/nccl/", store), rank, world_size)
    return _Group(rank, [torch.device(d) for d in torch_devices], gloo, nccl, store)


_TORCHRUN_GROUP: _Group | None = None


def _torchrun_group(
    program: SplitProgram, rank: int, world_size: int, devices: Sequence[str | Device], timeout_s: float
) -> _Group:
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
        if not dist.is_initialized():
            init_rank(rank, world_size, torch_devices, timeout_s)
        apply_resources(rank_resources(devices)[rank], str(devices[rank]))
        default = dist.distributed_c10d._get_default_group()
        store = dist.distributed_c10d._get_default_store()
        _TORCHRUN_GROUP = _Group(rank, [torch.device(d) for d in torch_devices], default, default, store)
    return _TORCHRUN_GROUP


def _placed(program: SplitProgram, group: _Group) -> fx.GraphModule:
    """This rank's part on its device, placed once per program."""
    module = group.placed.get(program)
    if module is None:
        module = group.placed[program] = place_part(program.parts[group.rank], group.devices[group.rank])
    return module


class _PeerFailure(DistributedError):
    """A wait on ``peer`` failed: usually a consequence of that rank's (or a rank it waits for) failure."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


@dataclass
class _PendingReceive:
    work: Any
    buffer: torch.Tensor
    what: str
    src: int


class _Messages:
    """One rank's messages of one request: tags from the request index, its time limit, readable failures."""

    def __init__(
        self, group: _Group, sequence: int, timeout: datetime.timedelta, values: dict[str, int] | None = None
    ) -> None:
        self.group = group
        self.timeout = timeout
        self.values = values or {}
        self._tag_base = (sequence % _TAG_WINDOW) << _TAG_BITS
        self._sends: list[tuple[Any, torch.Tensor, str, int]] = []

    def send(self, tensor: torch.Tensor, dst: int, index: int, what: str) -> None:
        wire = self.group.wire_device(dst)
        staged = tensor.detach().to(wire).contiguous()
        what = f"sending {what} to rank {dst}"
        with self._naming_peer(what, dst):
            work = self.group.process_group(wire).send([staged], dst, self._tag_base | index)
        self._sends.append((work, staged, what, dst))

    def post_recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, index: int, what: str) -> _PendingReceive:
        wire = self.group.wire_device(src)
        buffer = torch.empty(shape, dtype=dtype, device=wire)
        what = f"receiving {what} from rank {src}"
        with self._naming_peer(what, src):
            work = self.group.process_group(wire).recv([buffer], src, self._tag_base | index)
        return _PendingReceive(work, buffer, what, src)

    def post_recv_spec(self, spec: TensorSpec, src: int, index: int, what: str) -> _PendingReceive:
        return self.post_recv(concrete_shape(spec, self.values), spec.dtype, src, index, what)

    def wait_recv(self, pending: _PendingReceive) -> torch.Tensor:
        self._wait(pending.work, pending.what, pending.buffer.device, pending.src)
        return pending.buffer.to(self.group.devices[self.group.rank])

    def wait_sends(self) -> None:
        for work, staged, what, dst in self._sends:
            self._wait(work, what, staged.device, dst)
        self._sends.clear()

    def _wait(self, work: Any, what: str, wire: torch.device, peer: int) -> None:
        with self._naming_peer(what, peer):
            # NCCL waits are asynchronous (the compute stream waits); the process group's timeout bounds them.
            if kind_of(wire).messages_in_device_memory:
                work.wait()
            else:
                work.wait(self.timeout)

    @contextlib.contextmanager
    def _naming_peer(self, what: str, peer: int) -> Iterator[None]:
        """A failed post or wait (a closed connection, a timeout) as a failure that names the peer."""
        try:
            yield
        except Exception as error:
            raise _PeerFailure(
                f"rank {self.group.rank}: {what} failed ({type(error).__name__}: {str(error).strip()[:200]})", peer
            ) from error


class _Transport:
    """What a part's send/post_recv/wait_recv nodes call (see :class:`moirai.split.Transport`)."""

    def __init__(self, program: SplitProgram, messages: _Messages) -> None:
        self._transfers = program.transfers
        self._first_tag = _FIRST_DATA_TAG + len(program.input_specs)
        self._messages = messages

    def send(self, tensor: torch.Tensor, transfer_index: int) -> None:
        transfer = self._transfers[transfer_index]
        self._messages.send(tensor, transfer.dst, self._first_tag + transfer.index, f"tensor {transfer.tensor}")

    def post_recv(self, transfer_index: int) -> _PendingReceive:
        transfer = self._transfers[transfer_index]
        return self._messages.post_recv_spec(
            transfer.spec, transfer.src, self._first_tag + transfer.index, f"tensor {transfer.tensor}"
        )

    def wait_recv(self, pending: _PendingReceive) -> torch.Tensor:
        return self._messages.wait_recv(pending)

    @property
    def symbol_values(self) -> dict[str, int]:
        """This request's symbolic dimension sizes: parts compute shape scalars from them."""
        return self._messages.values


def _check_tags(program: SplitProgram) -> None:
    messages = _FIRST_DATA_TAG + len(program.input_specs) + len(program.transfers) + len(program.outputs)
    if messages >= 1 << _TAG_BITS:
        raise PlanError(f"the program sends {messages} messages per request; at most {(1 << _TAG_BITS) - 1} fit a tag")


def _run_part(
    program: SplitProgram,
    group: _Group,
    module: fx.GraphModule,
    messages: _Messages,
    flat_inputs: Sequence[torch.Tensor] | None,
) -> Callable[[], list[torch.Tensor] | None]:
    """Run this rank's part of one request; returns what finishes it (rank 0: the flat outputs, others: None).

    Rank 0 sends each part the inputs it reads, runs part 0 and posts the receives of the other
    parts' outputs; the others receive their inputs, run their part and send their outputs.
    """
    rank, device = group.rank, group.devices[group.rank]
    part = program.parts[rank]
    if flat_inputs is not None:
        for other in program.parts[1:]:
            for index in other.input_indices:
                messages.send(flat_inputs[index], other.device, _FIRST_DATA_TAG + index, f"flat input {index}")
        local_inputs = [flat_inputs[index] for index in part.input_indices]
    else:
        pending_inputs = [
            messages.post_recv_spec(program.input_specs[index], 0, _FIRST_DATA_TAG + index, f"flat input {index}")
            for index in part.input_indices
        ]
        local_inputs = [messages.wait_recv(p) for p in pending_inputs]
    with torch.no_grad():
        part_outputs = module(_Transport(program, messages), *(t.to(device) for t in local_inputs))
    first_tag = _FIRST_DATA_TAG + len(program.input_specs) + len(program.transfers)
    if rank != 0:
        for position, location in enumerate(program.outputs):
            if location.device == rank:
                messages.send(part_outputs[location.index], 0, first_tag + position, f"flat output {position}")

        def finish_sends() -> None:
            messages.wait_sends()

        return finish_sends
    pending = {
        position: messages.post_recv_spec(
            program.parts[location.device].output_specs[location.index],
            location.device,
            first_tag + position,
            f"flat output {position}",
        )
        for position, location in enumerate(program.outputs)
        if location.device != 0
    }

    def finish_outputs() -> list[torch.Tensor]:
        outputs = [
            messages.wait_recv(pending[position]) if position in pending else part_outputs[location.index]
            for position, location in enumerate(program.outputs)
        ]
        messages.wait_sends()
        return outputs

    return finish_outputs


def _serve(group: _Group, programs: dict[int, SplitProgram], timeout_s: float) -> None:
    """A non-driver rank: run each request rank 0 announces, in order, until rank 0 closes.

    The sends of request ``r`` are waited for after running request ``r + 1``, so this rank can
    run ahead of its receivers by one request.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    previous: Callable[[], Any] | None = None
    for sequence in itertools.count():
        header = _receive_header(group, sequence, timeout)
        if header.kind == _CLOSE:
            break
        if header.kind == _LOAD:
            programs[header.program_id] = pickle.loads(header.payload)
        elif header.kind == _RUN:
            program = programs[header.program_id]
            request_timeout = datetime.timedelta(milliseconds=header.timeout_ms)
            messages = _Messages(group, header.request, request_timeout, header.symbol_values)
            finish = _run_part(program, group, _placed(program, group), messages, None)
            if previous is not None:
                previous()
            previous = finish
    if previous is not None:
        previous()


@dataclass(frozen=True)
class _Header:
    """What rank 0 tells a rank before each message of the protocol: run a request, load a program, heartbeat, close.

    A run's payload holds the request's symbolic dimension values (JSON), a load's the pickled program.
    """

    kind: int
    program_id: int = 0
    request: int = 0
    timeout_ms: int = 0
    payload: bytes = b""

    @classmethod
    def run(
        cls, program: SplitProgram, program_id: int, request: int, flat_inputs: Sequence[torch.Tensor], timeout_s: float
    ) -> _Header:
        values = symbol_values(program, flat_inputs)
        payload = json.dumps(values).encode() if values else b""
        return cls(_RUN, program_id, request, round(timeout_s * 1000), payload)

    @property
    def symbol_values(self) -> dict[str, int]:
        return json.loads(self.payload) if self.kind == _RUN and self.payload else {}


def _send_header(group: _Group, sequence: int, dst: int, header: _Header, timeout: datetime.timedelta) -> _Messages:
    """Send ``header`` as rank ``dst``'s message number ``sequence``; wait for the returned messages' sends."""
    fields = [header.kind, header.program_id, len(header.payload), header.request, header.timeout_ms]
    control = _Messages(group, sequence, timeout)
    control.send(torch.tensor(fields, dtype=torch.int64), dst, 0, "a request header")
    if header.payload:
        control.send(torch.frombuffer(bytearray(header.payload), dtype=torch.uint8), dst, 1, "a request's payload")
    return control


def _receive_header(group: _Group, sequence: int, timeout: datetime.timedelta) -> _Header:
    control = _Messages(group, sequence, timeout)
    fields = control.wait_recv(control.post_recv((_HEADER_FIELDS,), torch.int64, 0, 0, "the next request's header"))
    kind, program_id, payload_bytes, request, timeout_ms = fields.tolist()
    payload = b""
    if payload_bytes:
        received = control.wait_recv(control.post_recv((payload_bytes,), torch.uint8, 0, 1, "a request's payload"))
        payload = received.numpy().tobytes()
    return _Header(kind, program_id, request, timeout_ms, payload)


class _Driver:
    """Rank 0: sends requests in submission order, runs part 0, completes each request's future when its outputs arrive.

    Two threads: the dispatcher sends headers and inputs and runs part 0 (request after request,
    without waiting for earlier outputs; at most ``max_in_flight`` unfinished); the completer
    waits for each request's outputs in order and settles its future.
    """

    def __init__(
        self,
        group: _Group,
        timeout_s: float,
        max_in_flight: int,
        preloaded: SplitProgram | None = None,
        describe_rank: Callable[[int], str] | None = None,
    ) -> None:
        _check_max_in_flight(max_in_flight)
        self.group = group
        if describe_rank is not None:
            group.describe_rank = describe_rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.failure: DistributedError | None = None
        self.dispatched = 0  # requests whose part 0 has run (the next request's index)
        self._heartbeat_s = timeout_s * _HEARTBEAT_FRACTION
        self._programs: dict[int, int] = {}  # id(program) -> program id on the ranks
        self._keep: list[SplitProgram] = []
        if preloaded is not None:
            self._programs[id(preloaded)] = 0
            self._keep.append(preloaded)
        self._headers_sent = [0] * group.world_size
        self._last_header_s = [time.monotonic()] * group.world_size
        self._slots = threading.Semaphore(max_in_flight)
        self._lock = threading.Lock()
        self._dispatching = threading.Lock()  # one thread at a time sends headers and runs part 0
        self._pending: set[Future] = set()
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = torch.get_num_threads()  # rank 0's share, set by apply_resources in this thread
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="moirai-dispatch", daemon=True)
        self._completer = threading.Thread(target=self._complete_loop, name="moirai-complete", daemon=True)
        self._dispatcher.start()
        self._completer.start()

    def submit(
        self,
        program: SplitProgram,
        flat_inputs: Sequence[torch.Tensor],
        finish: Callable[[list[torch.Tensor]], Any],
        timeout_s: float,
    ) -> Future:
        future: Future = Future()
        with self._lock:
            if self.failure is not None:
                future.set_exception(self.failure)
                return future
            self._pending.add(future)
        self._incoming.put((program, list(flat_inputs), future, finish, check_timeout(timeout_s)))
        return future

    def run(
        self,
        program: SplitProgram,
        flat_inputs: Sequence[torch.Tensor],
        finish: Callable[[list[torch.Tensor]], Any],
        timeout_s: float,
    ) -> Any:
        """``submit(...).result()``; when no other request is unfinished, run in the caller's thread (no hand-offs)."""
        timeout_s = check_timeout(timeout_s)
        future: Future = Future()
        with self._lock:
            inline = self.failure is None and not self._pending
            if inline:
                self._pending.add(future)  # requests submitted meanwhile queue behind this one
        if not inline:
            return self.submit(program, flat_inputs, finish, timeout_s).result()
        request = None
        try:
            with self._dispatching:
                request = self.dispatched
                _, control, finish_outputs, _, _ = self._start_request(
                    program, list(flat_inputs), future, finish, timeout_s
                )
            for messages in control:
                messages.wait_sends()
            return finish(finish_outputs())
        except BaseException as error:
            self._fail(error, f"request {request}" if request is not None else "a request")
            if self.failure is error:
                raise
            raise self.failure from error
        finally:
            with self._lock:
                self._pending.discard(future)

    def close(self) -> None:
        """Finish every submitted request, then tell the ranks to stop."""
        self._incoming.put(None)
        self._dispatcher.join()
        self._completer.join()

    def _dispatch_loop(self) -> None:
        # Part 0 runs in this thread. A new thread computes with the OpenMP/MKL default team (every core) however
        # torch.get_num_threads() reads, until it sets the count itself: on rank 0's one core, that team spun
        # against itself and ran a part 25-100x slower.
        torch.set_num_threads(self._threads)
        try:
            while self.failure is None:
                try:
                    item = self._incoming.get(timeout=self._heartbeat_s)
                except queue.Empty:
                    item = ()
                if item is None:
                    with self._dispatching:
                        everyone = range(1, self.group.world_size)
                        self._outgoing.put(("control", self._send_headers(_Header(_CLOSE), everyone)))
                    self._outgoing.put(None)
                    return
                if item:
                    self._slots.acquire()
                    if self.failure is not None:
                        return
                    with self._dispatching:
                        self._outgoing.put(("run", *self._start_request(*item)))
                with self._dispatching:
                    due = time.monotonic() - self._heartbeat_s
                    idle = [k for k in range(1, self.group.world_size) if self._last_header_s[k] < due]
                    if idle:
                        self._outgoing.put(("control", self._send_headers(_Header(_HEARTBEAT), idle)))
        except BaseException as error:
            self._fail(error, "sending a request")
            self._outgoing.put(None)

    def _start_request(
        self, program: SplitProgram, flat_inputs: list[torch.Tensor], future: Future, finish: Callable, timeout_s: float
    ) -> tuple:
        request = self.dispatched
        header = _Header.run(program, self._program_id(program), request, flat_inputs, timeout_s)
        control = self._send_headers(header, range(1, program.num_devices))
        messages = _Messages(self.group, request, datetime.timedelta(seconds=timeout_s), header.symbol_values)
        finish_outputs = _run_part(program, self.group, _placed(program, self.group), messages, flat_inputs)
        self.dispatched += 1
        return request, control, finish_outputs, future, finish

    def _program_id(self, program: SplitProgram) -> int:
        if id(program) not in self._programs:
            _check_tags(program)
            program_id = self._programs[id(program)] = len(self._programs)
            self._keep.append(program)  # ids stay unique while the program lives
            ranks = range(1, self.group.world_size)
            load = _Header(_LOAD, program_id, payload=pickle.dumps(program))
            self._outgoing.put(("control", self._send_headers(load, ranks)))
        return self._programs[id(program)]

    def _send_headers(self, header: _Header, ranks: Sequence[int]) -> list[_Messages]:
        # A request's header waits as long as the request may; the others as long as the driver's timeout.
        timeout = datetime.timedelta(milliseconds=header.timeout_ms) if header.timeout_ms else self.timeout
        sent = []
        for rank in ranks:
            sent.append(_send_header(self.group, self._headers_sent[rank], rank, header, timeout))
            self._headers_sent[rank] += 1
            self._last_header_s[rank] = time.monotonic()
        return sent

    def _complete_loop(self) -> None:
        request = None
        try:
            while (item := self._outgoing.get()) is not None:
                if item[0] == "control":
                    for control in item[1]:
                        control.wait_sends()
                    continue
                _, request, control, finish_outputs, future, finish = item
                for messages in control:
                    messages.wait_sends()
                result = finish(finish_outputs())
                with self._lock:
                    self._pending.discard(future)
                    if not future.done():
                        future.set_result(result)
                self._slots.release()
        except BaseException as error:
            self._fail(error, f"request {request}" if request is not None else "sending control messages")

    def _fail(self, error: BaseException, what: str) -> None:
        """Fail every pending request with one DistributedError naming the guilty rank."""
        with self._lock:
            if self.failure is not None:
                return
        if isinstance(error, DistributedError):
            failure = _blamed(self.group, error, what)
        else:
            _report(self.group.store, 0, None, _describe(error))
            failure = (
                error
                if isinstance(error, InputError | PlanError)
                else DistributedError(f"rank 0 ({self.group.devices[0]}) failed during {what}: {_describe(error)}")
            )
        with self._lock:
            self.failure = failure
            pending, self._pending = self._pending, set()
        for future in pending:
            if not future.done():
                future.set_exception(failure)
        self._slots.release()


def _report(store: Any, rank: int, peer: int | None, message: str) -> None:
    """Tell the other ranks why this rank failed: on its own (``peer`` None) or waiting for ``peer``."""
    try:
        store.set_timeout(datetime.timedelta(seconds=_REPORT_GRACE_S))
        store.set(f"moirai/failure/{rank}", json.dumps({"peer": peer, "message": message}))
    except Exception:
        pass  # the store's host is gone too: the others name this rank as one nobody heard from


def _read_report(store: Any, rank: int, deadline: float) -> dict[str, Any] | None:
    key = f"moirai/failure/{rank}"
    while True:
        try:
            if store.check([key]):
                return json.loads(store.get(key))
        except Exception:
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(_START_POLL_S)


def _blamed(group: _Group, error: BaseException, what: str) -> DistributedError:
    """Report this rank's failure, then the error naming the guilty rank: who failed on its own, or went silent.

    Starting from the rank this one waited for, follow each report's "waiting for" to a rank that
    failed on its own or that sent no report within the grace period (hung or dead).
    """
    rank = group.rank
    peer = error.peer if isinstance(error, _PeerFailure) else None
    own = str(error) if peer is not None else _describe(error)
    _report(group.store, rank, peer, own)
    if peer is None:
        return DistributedError(f"rank {rank} ({group.devices[rank]}) failed during {what}: {own}")
    deadline = time.monotonic() + _REPORT_GRACE_S
    chain = [f"rank {rank}: {own.removeprefix(f'rank {rank}: ')}"]
    seen, guilty = {rank}, peer
    while True:
        report = _read_report(group.store, guilty, deadline)
        if report is None:
            headline = (
                f"rank {guilty} ({group.devices[guilty]}) hung or died during {what}: no rank heard from it within the "
                f"time limit{group.describe_rank(guilty)}"
            )
            break
        if report["peer"] is None or report["peer"] in seen:
            headline = f"rank {guilty} ({group.devices[guilty]}) failed during {what}: {report['message']}"
            break
        chain.append(f"rank {guilty}: {report['message'].removeprefix(f'rank {guilty}: ')}")
        seen.add(guilty)
        guilty = report["peer"]
    return DistributedError(headline + "\nwhile " + "\nwhile ".join(chain))


def _describe(error: BaseException) -> str:
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    return f"{type(error).__name__}: {error}\n{''.join(frames[-6:])}"
