"""Run a :class:`~moirai.split.SplitProgram` with one process per device and torch.distributed send/recv.

Part ``k`` runs on rank ``k``. Point-to-point ``isend``/``irecv`` move the tensors, into receive
buffers allocated from the traced shapes (no shape handshake). Between two CUDA ranks the
tensors go over NCCL straight from device memory; a link with a CPU (or any other non-CUDA)
end goes over gloo, staged through host memory. The process group is ``gloo`` on a CPU-only
world, ``nccl`` on a CUDA-only one and ``cpu:gloo,cuda:nccl`` on a mixed one (torch dispatches
each operation by the device of its tensor).

Input flow: only rank 0 (the driver) is given the flat inputs; it sends each rank the inputs
its part reads, once, before running its own part. After the parts have run, every rank sends
the flat outputs it produced to rank 0, which returns all of them.

Ordering: each part posts its sends and receives in one global order shared by all ranks
(see :mod:`moirai.split`), inputs first and outputs last, so both ends of every link see the
same sequence of operations: NCCL matches point-to-point operations by order (tags are
ignored), gloo by tag (the transfer index).

Failure: every wait has the timeout given (gloo) or the process group's timeout (NCCL). A rank
whose peer died or hung fails with :class:`moirai.DistributedError` naming the peer and the
tensor, within the timeout, never a hang; a rank whose peer exited fails at once (its
connection closes).

Launching:

- :func:`run_distributed` (one shot) and :class:`DistributedRunner` (workers kept alive between
  calls; several programs can use one set of workers) spawn one process per device with
  ``torch.multiprocessing`` and a process group on a free port of 127.0.0.1. A rank that fails
  makes the caller raise :class:`moirai.DistributedError` with the rank and its error; the
  workers are then stopped and the next call starts new ones.
- Under ``torchrun``, every rank calls :func:`run_rank` itself with the same program (for
  example loaded from one pickle file, ``torch.save(program, path)`` then
  ``torch.load(path, weights_only=False)``)::

      # serve.py, run as: torchrun --nproc-per-node 3 serve.py
      rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
      inputs = traced.flatten_inputs(args, kwargs) if rank == 0 else None
      outputs = run_rank(program, rank, world_size, inputs, ["cuda:0", "cuda:1", "cpu"])
      # rank 0 gets the flat outputs, the other ranks None; call run_rank again for the next request
      torch.distributed.destroy_process_group()

  ``run_rank`` initialises the default process group from torchrun's environment
  (``MASTER_ADDR``/``MASTER_PORT``) if it is not initialised yet. Ranks beyond the program's
  devices take no part in a call.
"""

from __future__ import annotations

import datetime
import itertools
import multiprocessing
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moirai.errors import DistributedError, InputError
from moirai.progress import stage
from moirai.runtime.local import check_inputs, place_part
from moirai.split import SplitProgram, TensorTransfer, concrete_shape
from moirai.trace import TensorSpec

_REPORT_GRACE_S = 10.0
_SECONDARY_WAIT_S = 2.0


def run_distributed(
    program: SplitProgram, flat_inputs: Sequence[torch.Tensor], torch_devices: Sequence[str], timeout_s: float = 60.0
) -> list[torch.Tensor]:
    """Run ``program`` once on ``len(torch_devices)`` spawned processes; outputs on ``torch_devices[0]``."""
    with DistributedRunner(torch_devices, timeout_s=timeout_s) as runner:
        return runner.run(program, flat_inputs)


def backend_for(torch_devices: Sequence[str]) -> str:
    """The process-group backend for a world with these devices (see the module docstring)."""
    kinds = {torch.device(d).type for d in torch_devices}
    if kinds == {"cuda"}:
        return "nccl"
    return "cpu:gloo,cuda:nccl" if "cuda" in kinds else "gloo"


def init_rank(
    rank: int, world_size: int, torch_devices: Sequence[str], timeout_s: float, init_method: str = "env://"
) -> None:
    """Join the default process group (``env://`` reads torchrun's MASTER_ADDR/MASTER_PORT)."""
    device = torch.device(torch_devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(torch_devices)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        # Eager NCCL initialisation spans every rank, so only an all-CUDA world may ask for it; in a
        # mixed world the two-rank NCCL communicators are created on the first send between two GPUs.
        device_id=device if backend == "nccl" else None,
    )


def run_rank(
    program: SplitProgram,
    rank: int,
    world_size: int,
    flat_inputs: Sequence[torch.Tensor] | None,
    torch_devices: Sequence[str],
    timeout_s: float = 60.0,
) -> list[torch.Tensor] | None:
    """Run this rank's part; rank 0 passes the flat inputs and gets the flat outputs, others pass and get None."""
    if len(torch_devices) != world_size or world_size < program.num_devices:
        raise InputError(
            f"give one torch device per rank ({world_size} ranks, {len(torch_devices)} devices); the program "
            f"needs at least {program.num_devices} ranks"
        )
    if (flat_inputs is None) != (rank != 0):
        raise InputError(f"rank 0, and only rank 0, takes the flat inputs; rank {rank} was given {flat_inputs!r:.40}")
    if not dist.is_initialized():
        init_rank(rank, world_size, torch_devices, timeout_s)
    if rank >= program.num_devices:
        return None
    device = torch.device(torch_devices[rank])
    link = _Link(rank, [torch.device(d) for d in torch_devices], datetime.timedelta(seconds=timeout_s))
    link.symbol_values = _exchange_symbol_values(program, rank, flat_inputs, link)
    part = program.parts[rank]
    local_inputs = _exchange_inputs(program, rank, flat_inputs, link)
    module = place_part(part, device)
    transport = _Transport(program.transfers, link)
    with torch.no_grad():
        part_outputs = module(transport, *(t.to(device) for t in local_inputs))
    outputs = _gather_outputs(program, rank, part_outputs, link)
    link.wait_sends()
    return outputs


class DistributedRunner:
    """One worker process per device, kept alive between calls; use as a context manager or close().

    ``run(program, flat_inputs)`` sends a program to the workers the first time it is used
    (several programs with at most ``len(torch_devices)`` parts can share one runner) and
    returns its flat outputs on ``torch_devices[0]``. Workers start on the first call.
    """

    def __init__(self, torch_devices: Sequence[str], timeout_s: float = 60.0, start_timeout_s: float = 180.0) -> None:
        self.torch_devices = [str(torch.device(d)) for d in torch_devices]
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._workers: list[multiprocessing.Process] = []
        self._commands: list[Any] = []
        self._results: Any = None
        self._loaded: SplitProgram | None = None
        self._call_ids = itertools.count()

    def __enter__(self) -> DistributedRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run(
        self, program: SplitProgram, flat_inputs: Sequence[torch.Tensor], timeout_s: float | None = None
    ) -> list[torch.Tensor]:
        """The flat outputs; every wait of this call is bounded by ``timeout_s`` (default: the runner's)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if program.num_devices > len(self.torch_devices):
            raise InputError(
                f"the program has {program.num_devices} parts but this runner has {len(self.torch_devices)} devices"
            )
        check_inputs(program, flat_inputs)
        if not self._workers:
            self._start()
        if program is not self._loaded:
            payload = pickle.dumps(program)
            for commands in self._commands:
                commands.put(("load", payload))
            self._loaded = program
        call_id = next(self._call_ids)
        cpu_inputs = [t.detach().cpu() for t in flat_inputs]
        for rank, commands in enumerate(self._commands):
            commands.put(("run", call_id, timeout_s, cpu_inputs if rank == 0 else None))
        # Ranks time out on their own first and say which tensor they waited for; the grace lets that arrive.
        replies = self._collect("done", time.monotonic() + timeout_s + _REPORT_GRACE_S, f"call {call_id}")
        return [t.to(self.torch_devices[0]) for t in replies[0]]

    def close(self) -> None:
        """Stop the workers (they finish the call in progress, if any, within a few seconds)."""
        for commands in self._commands:
            commands.put(("close",))
        self._stop(grace_s=5.0)

    @stage("start workers")
    def _start(self) -> None:
        context = torch.multiprocessing.get_context("spawn")
        port = _free_loopback_port()
        self._results = context.Queue()
        self._commands = [context.Queue() for _ in self.torch_devices]
        self._workers = [
            context.Process(
                target=_worker_main,
                args=(rank, self.torch_devices, port, self.timeout_s, self._commands[rank], self._results),
                daemon=True,
                name=f"moirai-rank{rank}",
            )
            for rank in range(len(self.torch_devices))
        ]
        for worker in self._workers:
            worker.start()
        self._collect("ready", time.monotonic() + self.start_timeout_s, "start-up")

    def _collect(self, kind: str, deadline: float, what: str) -> dict[int, Any]:
        """One ``kind`` reply per rank, or DistributedError naming the first rank that failed."""
        replies: dict[int, Any] = {}
        while len(replies) < len(self._workers):
            try:
                message = self._results.get(timeout=0.2)
            except queue.Empty:
                self._check_alive(deadline, what, missing=[r for r in range(len(self._workers)) if r not in replies])
                continue
            if message[0] == "error":
                self._fail_with_reports(message, what)
            if message[0] == kind:
                replies[message[1]] = message[2]
        return replies

    def _check_alive(self, deadline: float, what: str, missing: list[int]) -> None:
        dead = [rank for rank, worker in enumerate(self._workers) if not worker.is_alive()]
        if dead:
            # A worker reports its error before exiting; give the report a moment to arrive.
            while True:
                try:
                    message = self._results.get(timeout=1.0)
                except queue.Empty:
                    break
                if message[0] == "error":
                    self._fail_with_reports(message, what)
            codes = ", ".join(f"rank {r} exit code {self._workers[r].exitcode}" for r in dead)
            self._fail(f"worker process(es) died during {what} without reporting an error ({codes})")
        if time.monotonic() > deadline:
            self._fail(f"timed out during {what}: rank(s) {missing} did not answer within the time limit")

    def _fail_with_reports(self, first: tuple, what: str) -> None:
        """Raise naming the rank whose own error (not a failed wait on a peer) started the failure.

        A rank whose peer died reports a secondary error, sometimes before the peer's own report
        arrives; secondary reports wait a moment for a primary one.
        """
        reports = [first]
        waited_until = time.monotonic() + _SECONDARY_WAIT_S
        while all(r[3] for r in reports) and len(reports) < len(self._workers) and time.monotonic() < waited_until:
            try:
                message = self._results.get(timeout=0.1)
            except queue.Empty:
                continue
            if message[0] == "error":
                reports.append(message)
        reports.sort(key=lambda r: r[3])
        _, rank, description, _ = reports[0]
        others = "".join(f"\nalso rank {r[1]}: {r[2].splitlines()[0]}" for r in reports[1:])
        self._fail(f"rank {rank} ({self.torch_devices[rank]}) failed during {what}: {description}{others}")

    def _fail(self, message: str) -> None:
        self._stop(grace_s=0.0)
        raise DistributedError(message)

    def _stop(self, grace_s: float) -> None:
        for worker in self._workers:
            worker.join(timeout=grace_s)
        for worker in self._workers:
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5.0)
        for channel in [*self._commands, self._results]:
            if channel is not None:
                channel.close()
                channel.cancel_join_thread()
        self._workers, self._commands, self._results, self._loaded = [], [], None, None


def _worker_main(
    rank: int, torch_devices: list[str], port: int, timeout_s: float, commands: Any, results: Any
) -> None:
    """A spawned rank: join the group on loopback, then load programs and run calls until told to close."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    world_size = len(torch_devices)
    try:
        init_rank(rank, world_size, torch_devices, timeout_s, init_method=f"tcp://127.0.0.1:{port}")
        results.put(("ready", rank, None))
        program = None
        while (command := _next_command(commands)) is not None:
            if command[0] == "load":
                program = pickle.loads(command[1])
                continue
            _, _call_id, call_timeout_s, flat_inputs = command
            outputs = run_rank(program, rank, world_size, flat_inputs, torch_devices, call_timeout_s)
            results.put(("done", rank, None if outputs is None else [t.detach().cpu() for t in outputs]))
    except Exception as error:
        # A DistributedError here is a failed wait: a consequence of another rank's failure or hang.
        results.put(("error", rank, _describe(error), isinstance(error, DistributedError)))
        return
    dist.destroy_process_group()


def _next_command(commands: Any) -> tuple | None:
    """The next command, or None on close or when the parent process is gone."""
    while True:
        try:
            command = commands.get(timeout=1.0)
        except queue.Empty:
            parent = multiprocessing.parent_process()
            if parent is not None and not parent.is_alive():
                return None
            continue
        return None if command[0] == "close" else command


def _describe(error: BaseException) -> str:
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    return f"{type(error).__name__}: {error}\n{''.join(frames[-6:])}"


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class _PendingReceive:
    work: Any
    buffer: torch.Tensor
    what: str
    src: int


class _Link:
    """Point-to-point messages of one rank: staging for gloo links, timeouts, readable failures."""

    def __init__(self, rank: int, devices: Sequence[torch.device], timeout: datetime.timedelta) -> None:
        self.rank = rank
        self.devices = devices
        self.timeout = timeout
        self.symbol_values: Mapping[str, int] = {}  # this call's dynamic dimensions: receive buffers' sizes
        self._sends: list[tuple[Any, torch.Tensor, str]] = []

    def wire_device(self, peer: int) -> torch.device:
        """Where a message to or from ``peer`` lives: device memory between CUDA ranks (NCCL), else host (gloo)."""
        mine = self.devices[self.rank]
        return mine if mine.type == "cuda" and self.devices[peer].type == "cuda" else torch.device("cpu")

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> None:
        staged = tensor.detach().to(self.wire_device(dst)).contiguous()
        self._sends.append((dist.isend(staged, dst, tag=tag), staged, f"sending {what} to rank {dst}"))

    def post_recv(self, spec: TensorSpec, src: int, tag: int, what: str) -> _PendingReceive:
        buffer = torch.empty(concrete_shape(spec, self.symbol_values), dtype=spec.dtype, device=self.wire_device(src))
        return _PendingReceive(dist.irecv(buffer, src, tag=tag), buffer, f"receiving {what} from rank {src}", src)

    def wait_recv(self, pending: _PendingReceive) -> torch.Tensor:
        self._wait(pending.work, pending.what, pending.buffer.device)
        return pending.buffer.to(self.devices[self.rank])

    def wait_sends(self) -> None:
        for work, staged, what in self._sends:
            self._wait(work, what, staged.device)
        self._sends.clear()

    def _wait(self, work: Any, what: str, wire: torch.device) -> None:
        try:
            # NCCL waits are asynchronous (the compute stream waits); the process group's timeout bounds them.
            if wire.type == "cuda":
                work.wait()
            else:
                work.wait(self.timeout)
        except Exception as error:
            raise DistributedError(
                f"rank {self.rank}: {what} failed ({type(error).__name__}: {str(error).strip()[:300]}); "
                "the peer rank failed, hung or never sent it: see its report"
            ) from error


class _Transport:
    """What a part's send/post_recv/wait_recv nodes call (see :class:`moirai.split.Transport`)."""

    def __init__(self, transfers: Sequence[TensorTransfer], link: _Link) -> None:
        self._transfers = transfers
        self._link = link

    def send(self, tensor: torch.Tensor, transfer_index: int) -> None:
        transfer = self._transfers[transfer_index]
        self._link.send(tensor, transfer.dst, transfer.index, f"tensor {transfer.tensor}")

    def post_recv(self, transfer_index: int) -> _PendingReceive:
        transfer = self._transfers[transfer_index]
        return self._link.post_recv(transfer.spec, transfer.src, transfer.index, f"tensor {transfer.tensor}")

    def wait_recv(self, pending: _PendingReceive) -> torch.Tensor:
        return self._link.wait_recv(pending)

    @property
    def symbol_values(self) -> Mapping[str, int]:
        return self._link.symbol_values


def _exchange_symbol_values(
    program: SplitProgram, rank: int, flat_inputs: Sequence[torch.Tensor] | None, link: _Link
) -> dict[str, int]:
    """Rank 0 checks the inputs and sends every rank the sizes of the dynamic dimensions, before anything else."""
    if flat_inputs is not None:
        values = check_inputs(program, flat_inputs)
        if program.dynamic_dims:
            sizes = torch.tensor([values[dim.symbol] for dim in program.dynamic_dims], dtype=torch.int64)
            for other in program.parts[1:]:
                link.send(sizes, other.device, _symbols_tag(program), "the dynamic dimensions' sizes")
        return values
    if not program.dynamic_dims:
        return {}
    spec = TensorSpec((len(program.dynamic_dims),), torch.int64)
    sizes = link.wait_recv(link.post_recv(spec, 0, _symbols_tag(program), "the dynamic dimensions' sizes"))
    return {dim.symbol: int(size) for dim, size in zip(program.dynamic_dims, sizes.tolist(), strict=True)}


def _symbols_tag(program: SplitProgram) -> int:
    return len(program.transfers) + len(program.input_specs) + len(program.outputs)


def _exchange_inputs(
    program: SplitProgram, rank: int, flat_inputs: Sequence[torch.Tensor] | None, link: _Link
) -> list[torch.Tensor]:
    """Rank 0 sends each part the inputs it reads; the others receive theirs. Tags follow the transfers'."""
    first_tag = len(program.transfers)
    part = program.parts[rank]
    if flat_inputs is not None:
        for other in program.parts[1:]:
            for index in other.input_indices:
                link.send(flat_inputs[index], other.device, first_tag + index, f"flat input {index}")
        return [flat_inputs[index] for index in part.input_indices]
    pending = [
        link.post_recv(program.input_specs[index], 0, first_tag + index, f"flat input {index}")
        for index in part.input_indices
    ]
    return [link.wait_recv(p) for p in pending]


def _gather_outputs(
    program: SplitProgram, rank: int, part_outputs: Sequence[Any], link: _Link
) -> list[torch.Tensor] | None:
    """Every rank sends its flat outputs to rank 0, in output order; rank 0 returns all of them."""
    first_tag = len(program.transfers) + len(program.input_specs)
    if rank != 0:
        for position, location in enumerate(program.outputs):
            if location.device == rank:
                link.send(part_outputs[location.index], 0, first_tag + position, f"flat output {position}")
        return None
    pending = {
        position: link.post_recv(
            program.parts[location.device].output_specs[location.index], location.device, first_tag + position,
            f"flat output {position}",
        )
        for position, location in enumerate(program.outputs)
        if location.device != 0
    }
    return [
        link.wait_recv(pending[position]) if position in pending else part_outputs[location.index]
        for position, location in enumerate(program.outputs)
    ]
