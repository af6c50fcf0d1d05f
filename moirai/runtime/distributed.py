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
  and spawns ranks 1..N-1 (:mod:`moirai.runtime.runner`).
- Under ``torchrun`` the ranks are torchrun's (``RANK``; the default process group is
  initialised from its environment if needed): rank ``k`` serves the plan's device ``k``, and
  the world size must equal the number of devices. Either every rank calls :func:`run_rank`
  once per request, or rank 0 serves requests through a :class:`moirai.runtime.server.Server`
  (``compiled.server()``, backed by :func:`torchrun_driver`) while the others call
  :func:`serve_rank` until rank 0 closes it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from moirai.cluster import kinds as device_kinds
from moirai.cluster.hardware import LOCAL_HOST, Device
from moirai.cluster.kinds import kind_of
from moirai.environment import TorchrunWorld, require_torchrun_world
from moirai.errors import DistributedError, InputError
from moirai.runtime import shm
from moirai.runtime.agreement import check_same_program
from moirai.runtime.blame import blamed, wait_for_ranks
from moirai.runtime.driver import DEFAULT_TIMEOUT_S, Driver, check_timeout
from moirai.runtime.groups import Group, gloo_links, placed_part
from moirai.runtime.hosts import host_ranks, rank_hosts, torchrun_layout
from moirai.runtime.local import check_inputs
from moirai.runtime.network import choose_gloo_interface
from moirai.runtime.protocol import Header, Messages, receive_header, run_part, send_header, send_inputs, serve
from moirai.runtime.resources import RankResources, apply_resources, pin_io_threads, rank_resources
from moirai.runtime.runner import DistributedRunner, torch_device
from moirai.runtime.split import SplitProgram
from moirai.runtime.store import RUN_SECRET_ENV, RunStore
from moirai.runtime.written_state import returning_state, write_back

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


def run_distributed(
    program: SplitProgram,
    flat_inputs: Sequence[torch.Tensor],
    torch_devices: Sequence[str | Device],
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[torch.Tensor]:
    """Run ``program`` once on ``len(torch_devices)`` processes (this one is rank 0); outputs on device 0.

    As the local runner: a buffer or flat input that a rank other than 0 writes in place is copied back into the
    program's buffer or the caller's tensor (:mod:`moirai.runtime.written_state`), so the next call starts from it.
    """
    returning, states = returning_state(program)
    with DistributedRunner(torch_devices, timeout_s=timeout_s) as runner:
        outputs = runner.run(returning, flat_inputs)
    return write_back(program, states, outputs, flat_inputs)


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
    timeout = datetime.timedelta(seconds=timeout_s)
    raw, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    raw.set_timeout(timeout)
    store = dist.PrefixStore("default_pg", raw)  # as init_process_group names the default group's keys
    _wait_until_joined(RunStore(store, torchrun_secret()), rank, world_size, timeout_s)
    dist.init_process_group(
        device_kinds.default_group_backend(torch_devices),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def _wait_until_joined(store: RunStore, rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank says it is here before the process group connects them: a rank that never joins (or failed before,
    :func:`moirai.runtime.blame.report_setup_failure`) is named, where the group's own connecting would raise a
    timeout naming a key."""
    store.set(f"moirai/joined/{rank}", b"1")
    if rank == 0:
        others = {k: f"moirai/joined/{k}" for k in range(1, world_size)}
        wait_for_ranks(store, others, "joining the process group", timeout_s)


def run_rank(
    program: SplitProgram,
    rank: int,
    world_size: int,
    flat_inputs: Sequence[torch.Tensor] | None,
    torch_devices: Sequence[str | Device],
    timeout_s: float = DEFAULT_TIMEOUT_S,
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
    check_same_program(group, program, timeout_s)
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


def serve_rank(
    program: SplitProgram, torch_devices: Sequence[str | Device], timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Under torchrun, on every rank but 0: run this rank's part of each request rank 0's server sends, until it closes.

    Raises :class:`moirai.DistributedError` naming the guilty rank if a rank fails or hangs.
    """
    timeout_s = check_timeout(timeout_s)
    world = require_torchrun_world("serve_rank")
    rank, world_size = world.rank, world.world_size
    if rank == 0:
        raise InputError("rank 0 is the driver: serve requests there with compiled.server(), not serve_rank")
    group = _torchrun_group(program, rank, world_size, torch_devices, timeout_s)
    try:
        check_same_program(group, program, timeout_s)
        serve(group, {0: program}, timeout_s)
    except DistributedError as error:
        raise blamed(group, error, "serving") from error
    finally:
        group.close()  # its shared-memory links and spill owner, whose lock file would stay in /dev/shm


def torchrun_driver(
    program: SplitProgram, torch_devices: Sequence[str | Device], timeout_s: float, max_in_flight: int
) -> Driver:
    """Rank 0's driver under torchrun (the others call :func:`serve_rank` with the same program)."""
    world = require_torchrun_world("a server for torchrun's ranks")
    rank, world_size = world.rank, world.world_size
    if rank != 0:
        raise InputError(
            f"this is rank {rank}: only rank 0 serves requests; call moirai.serve_rank(compiled) on the other ranks"
        )
    group = _torchrun_group(program, rank, world_size, torch_devices, timeout_s)
    check_same_program(group, program, timeout_s)
    helper_cores = _torchrun_resources(torch_devices, rank)[0].helper_cores
    return Driver(group, timeout_s, max_in_flight, preloaded=program, helper_cores=helper_cores)


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


def torchrun_store(
    world: TorchrunWorld, torch_devices: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> RunStore | None:
    """In ``world`` (:func:`moirai.environment.torchrun_world`) with one rank per device of ``torch_devices``, the
    run's store (joining the default process group, as the first request would, if not yet joined); None otherwise."""
    if world.world_size != len(torch_devices):
        return None
    if not dist.is_initialized():
        init_rank(world.rank, world.world_size, torch_devices, check_timeout(timeout_s))
    return RunStore(dist.distributed_c10d._get_default_store(), torchrun_secret())


_TORCHRUN_GROUP: Group | None = None


def _torchrun_group(
    program: SplitProgram, rank: int, world_size: int, devices: Sequence[str | Device], timeout_s: float
) -> Group:
    """The default process group (initialised from torchrun's environment if needed), once per process."""
    global _TORCHRUN_GROUP
    torch_devices = [torch_device(d) for d in devices]
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
    torch_devices = [torch_device(d) for d in devices]
    if not dist.is_initialized():
        init_rank(rank, world_size, torch_devices, timeout_s)
    resources, neighbours = _torchrun_resources(devices, rank)
    apply_resources(resources, str(devices[rank]))
    pin_io_threads(resources)
    default = dist.distributed_c10d._get_default_group()
    store = RunStore(dist.distributed_c10d._get_default_store(), torchrun_secret())
    # Before the links: every rank says it got here, so one that failed before (its compile) is named.
    hosts = rank_hosts(store, rank, world_size, f"{shm_prefix}/host", timeout_s)
    links = shm.connect(rank, world_size, store, timeout_s, shm_prefix, neighbours)
    gloo = gloo_links(rank, lambda name: _gloo_group(timeout_s))
    group = Group(rank, [torch.device(d) for d in torch_devices], gloo, default, store, shared_memory=links)
    if len(set(hosts)) > 1:  # a rank that went silent is named with its host: a host may have gone away
        group.describe_rank = lambda peer: f"; it ran on host {hosts[peer]}"
    return group


def _gloo_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of the whole world with connections of its own (a collective: every rank creates it)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _torchrun_resources(devices: Sequence[str | Device], rank: int) -> tuple[RankResources, range]:
    """This rank's share of its host, split among its host's devices only, and the ranks on its host
    (:mod:`moirai.runtime.hosts`: torchrun's layout, checked against the plan's hosts)."""
    plan_hosts = [d.host if isinstance(d, Device) else LOCAL_HOST for d in devices]
    neighbours = host_ranks(plan_hosts, rank, torchrun_layout())
    return rank_resources([devices[k] for k in neighbours])[rank - neighbours.start], neighbours
