"""This rank's connections to the others: shared memory on one host, gloo between hosts, NCCL between two GPUs,
the store for failure reports.

A message goes through a :class:`Link` (the point-to-point surface that gloo's and NCCL's process
groups and :class:`moirai.runtime.shm.SharedMemoryLinks` share), picked per peer by :meth:`Group.link`.
A spawned world (:class:`moirai.runtime.distributed.DistributedRunner`) joins process groups of
its own on loopback (:func:`local_group`), leaving the default process group to the user; under
torchrun the default group serves (:mod:`moirai.runtime.distributed`).
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.fx as fx

from moirai.cluster.kinds import device_memory_kind, host_device, kind_of
from moirai.errors import DistributedError
from moirai.runtime import shm
from moirai.runtime.local import place_part
from moirai.runtime.split import SplitProgram
from moirai.runtime.store import RunStore


@runtime_checkable
class Work(Protocol):
    """A posted send or receive: ``wait`` returns once it completed (gloo's and shared memory's within ``timeout``;
    NCCL's at once, the compute stream waits)."""

    def wait(self, timeout: datetime.timedelta = ..., /) -> bool: ...


@runtime_checkable
class Link(Protocol):
    """What carries this rank's messages to and from a peer: a process group's send and recv of one tensor, matched
    by tag (gloo, shared memory) or by order (NCCL)."""

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int, /) -> Work: ...

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int, /) -> Work: ...


@dataclass(frozen=True)
class GlooLinks:
    """Gloo with three connections between two ranks ([Note: a connection per direction]): data from a lower rank
    to a higher one through ``to_higher``, the other way through ``to_lower``, and request headers through
    ``control``, so that neither the word a receiver sends to say it has posted a receive nor the header that tells
    it what to post waits behind a request's data on the same connection."""

    rank: int
    to_higher: Link
    to_lower: Link
    control: Link

    def _between(self, sender: int, receiver: int) -> Link:
        return self.to_higher if sender < receiver else self.to_lower

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int, /) -> Work:
        return self._between(self.rank, dst).send(tensors, dst, tag)

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int, /) -> Work:
        return self._between(src, self.rank).recv(tensors, src, tag)


def gloo_links(rank: int, connect: Callable[[str], Link]) -> GlooLinks:
    """This rank's :class:`GlooLinks`, each connection a gloo group of the whole world made by ``connect(name)``
    (a collective: every rank makes them, in this order)."""
    return GlooLinks(rank, connect("to-higher"), connect("to-lower"), connect("control"))


@dataclass
class Group:
    """This rank's connections: host memory through shared memory (ranks of one host) or gloo, device memory
    through NCCL between GPUs, the store for failure reports."""

    rank: int
    devices: list[torch.device]
    gloo: GlooLinks
    nccl: Link | None  # None: no two of the world's devices exchange messages in device memory
    store: RunStore
    describe_rank: Callable[[int], str] = lambda rank: ""
    shared_memory: shm.SharedMemoryLinks | None = None

    def __post_init__(self) -> None:
        self.requests = itertools.count()

    @property
    def secret(self) -> bytes | None:
        """The run's secret: authenticates rank 0's headers (None: torchrun's store, no secret given)."""
        return self.store.secret

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def wire_device(self, peer: int) -> torch.device:
        """Where a message to or from ``peer`` lives: device memory between CUDA ranks (NCCL), else host (gloo)."""
        mine = self.devices[self.rank]
        in_device_memory = kind_of(mine).messages_in_device_memory and self.devices[peer].type == mine.type
        return mine if in_device_memory else host_device()

    def link(self, wire: torch.device, peer: int, control: bool = False) -> Link:
        """What carries a message on ``wire`` (:meth:`wire_device`) to or from ``peer``; ``control``: a request
        header, which over gloo has a connection of its own."""
        if kind_of(wire).messages_in_device_memory:
            if self.nccl is None:
                raise DistributedError(
                    f"rank {self.rank} has no process group for messages in {wire} memory, so none to rank {peer}"
                )
            return self.nccl
        if self.shared_memory is not None and peer in self.shared_memory.peers:
            return self.shared_memory
        return self.gloo.control if control else self.gloo

    def close(self) -> None:
        if self.shared_memory is not None:
            self.shared_memory.close()

    def hang_up(self) -> None:
        """Close this rank's shared-memory links, so that every rank waiting on one fails now, not at its time limit
        (gloo's connections close only when this process exits: gloo's abort leaves them open)."""
        self.close()


def local_group(
    rank: int,
    torch_devices: Sequence[str],
    store: RunStore | dist.Store,
    join_timeout_s: float,
    shared_memory: bool | None = None,
) -> Group:
    """Process groups of our own on loopback (not the default group, which stays the user's).

    ``store``: the run's :class:`moirai.runtime.store.RunStore` (a bare torch store carries no secret: its
    ranks take no program from the driver). ``shared_memory``: whether host-memory messages go through shared
    memory (default: unless ``MOIRAI_SHARED_MEMORY=0``); every rank of the world must be given the same.
    """
    if not isinstance(store, RunStore):
        store = RunStore(store, None)
    timeout = datetime.timedelta(seconds=join_timeout_s)
    world_size = len(torch_devices)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    gloo = gloo_links(
        rank,
        lambda name: dist.ProcessGroupGloo(store.prefix_store(f"moirai/gloo/{name}/"), rank, world_size, options),
    )
    nccl = None
    # NCCL carries only messages between two GPUs (see Group.wire_device), so only a world with two needs it.
    memory_kind = device_memory_kind(torch_devices)
    if memory_kind is not None:
        device = torch.device(torch_devices[rank])
        kind_of(device).set_current(device)
        nccl = memory_kind.device_group(store.prefix_store(f"moirai/{memory_kind.backend}/"), rank, world_size)
    use_shared_memory = shm.enabled() if shared_memory is None else shared_memory
    links = shm.connect(rank, world_size, store, join_timeout_s, "moirai/shm") if use_shared_memory else None
    return Group(rank, [torch.device(d) for d in torch_devices], gloo, nccl, store, shared_memory=links)


def placed_part(program: SplitProgram, group: Group) -> fx.GraphModule:
    """This rank's part on its device (placed by the first call, :func:`moirai.runtime.local.place_part`)."""
    return place_part(program.parts[group.rank], group.devices[group.rank])
