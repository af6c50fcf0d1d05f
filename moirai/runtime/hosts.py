"""Which ranks share a host under torchrun: the plan's hosts checked against torchrun's layout.

torchrun numbers ranks host by host in ``--node-rank`` order, so the ranks of one host are contiguous: this rank's
host holds ranks ``RANK - LOCAL_RANK`` up to ``+ LOCAL_WORLD_SIZE``, and it is host number ``GROUP_RANK``. A plan whose
devices name several hosts (``host`` in the cluster file) must put them the same way; a plan on one host (no hosts
named, e.g. ``["cpu", "cpu"]``) runs on whatever hosts torchrun gives it. A rank's cores and threads come from its own
host's devices only, and shared memory joins only ranks of one host. Rank 0 learns every rank's host through the
store (:func:`rank_hosts`), to plan and to calibrate with the links between hosts.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moirai.environment import integer_variable, torchrun_world
from moirai.errors import InputError

# torchrun's variables of where a rank is on its host; RANK and WORLD_SIZE are torchrun_world's to read.
_LAYOUT_VARIABLES = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


@dataclass(frozen=True)
class TorchrunLayout:
    """Where torchrun put this rank: ``node_rank`` is its host's ``--node-rank`` (``GROUP_RANK``)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @property
    def host_ranks(self) -> range:
        first = self.rank - self.local_rank
        return range(first, first + self.local_world_size)

    def __str__(self) -> str:
        return (
            f"torchrun runs rank {self.rank} on node {self.node_rank} with ranks {_ranks(self.host_ranks)} "
            f"(GROUP_RANK {self.node_rank}, LOCAL_RANK {self.local_rank}, LOCAL_WORLD_SIZE {self.local_world_size})"
        )


def torchrun_layout(environment: Mapping[str, str] | None = None) -> TorchrunLayout | None:
    """This rank's layout: its rank and world from :func:`moirai.environment.torchrun_world` (the one reading of
    ``RANK`` and ``WORLD_SIZE``), its place on its host from torchrun's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
    ``GROUP_RANK``; None outside a world of two ranks or more, or where one of those is missing (a group the user
    set up)."""
    environment = os.environ if environment is None else environment
    world = torchrun_world(environment)
    if world is None or not all(environment.get(name) for name in _LAYOUT_VARIABLES):
        return None
    local_rank, local_world_size, node_rank = (integer_variable(environment, n) for n in _LAYOUT_VARIABLES)
    layout = TorchrunLayout(world.rank, world.world_size, local_rank, local_world_size, node_rank)
    ranks = layout.host_ranks
    if not (0 <= local_rank < local_world_size and 0 <= ranks.start and ranks.stop <= world.world_size):
        raise InputError(f"torchrun's layout does not add up: {layout} in a world of {world.world_size}")
    return layout


def plan_host_blocks(hosts: Sequence[str]) -> list[tuple[str, range]]:
    """The plan's hosts in rank order, each with its ranks; a host whose ranks are not contiguous is an error."""
    blocks: list[tuple[str, range]] = []
    for rank, host in enumerate(hosts):
        if blocks and blocks[-1][0] == host:
            blocks[-1] = (host, range(blocks[-1][1].start, rank + 1))
            continue
        if any(name == host for name, _ in blocks):
            raise InputError(
                f"the plan puts devices of host {host!r} at ranks that are not contiguous ({describe_blocks(hosts)}); "
                "torchrun numbers a host's ranks one after the other, so order the cluster file's devices host by host"
            )
        blocks.append((host, range(rank, rank + 1)))
    return blocks


def host_ranks(plan_hosts: Sequence[str], rank: int, layout: TorchrunLayout | None) -> range:
    """The ranks on this rank's host: torchrun's, checked against the plan's where the plan names several hosts."""
    blocks = plan_host_blocks(plan_hosts)
    if layout is None:
        return next(ranks for _, ranks in blocks if rank in ranks)
    if len(blocks) == 1:
        return layout.host_ranks
    index, (host, ranks) = next((i, block) for i, block in enumerate(blocks) if rank in block[1])
    if ranks != layout.host_ranks or index != layout.node_rank:
        raise InputError(
            f"the plan's hosts and torchrun's layout differ: the plan puts rank {rank} on host {host!r}, host "
            f"{index} of {describe_blocks(plan_hosts)}, but {layout}; start torchrun on host {index} with "
            f"--node-rank {index} and --nproc-per-node {len(ranks)}, or fix the hosts in the cluster file"
        )
    return ranks


def describe_blocks(hosts: Sequence[str]) -> str:
    """``a: ranks 0-1, b: ranks 2-3``."""
    parts: list[str] = []
    for rank, host in enumerate(hosts):
        if parts and hosts[rank - 1] == host:
            continue
        last = rank
        while last + 1 < len(hosts) and hosts[last + 1] == host:
            last += 1
        parts.append(f"{host}: ranks {_ranks(range(rank, last + 1))}")
    return ", ".join(parts)


def _ranks(ranks: range) -> str:
    return str(ranks.start) if len(ranks) == 1 else f"{ranks.start}-{ranks.stop - 1}"


def rank_hosts(store: Any, rank: int, world_size: int, prefix: str, timeout_s: float) -> list[str]:
    """The host of every rank (a collective: every rank calls it with one ``prefix``): its hostname, and where two
    hosts share a name but not their identity (:func:`moirai.runtime.shm_files.host_identity`: boot, /dev/shm) the
    name with ``#n``, ``n`` counting those hosts in rank order."""
    from moirai.runtime.blame import wait_for_ranks
    from moirai.runtime.shm_files import host_identity

    store.set(f"{prefix}/{rank}", json.dumps({"hostname": socket.gethostname(), "identity": host_identity()}))
    keys = [f"{prefix}/{k}" for k in range(world_size)]
    others = {k: key for k, key in enumerate(keys) if k != rank}
    wait_for_ranks(store, others, f"saying which host it is on ({prefix})", timeout_s)
    return host_labels([_host_entry(store, key) for key in keys])


def _host_entry(store: Any, key: str) -> tuple[str, str]:
    from moirai.runtime.store import get_json

    def valid(entry: Any) -> bool:
        return isinstance(entry, dict) and all(isinstance(entry.get(f), str) for f in ("hostname", "identity"))

    entry = get_json(store, key, "host", valid, '{"hostname": a string, "identity": a string}')
    return entry["hostname"], entry["identity"]


def host_labels(hosts: Sequence[tuple[str, str]]) -> list[str]:
    """Per rank, a name for its host from its ``(hostname, identity)``: the hostname, with ``#n`` where hosts of
    different identities share it (two containers named alike)."""
    identities: dict[str, list[str]] = {}
    for hostname, identity in hosts:
        seen = identities.setdefault(hostname, [])
        if identity not in seen:
            seen.append(identity)
    return [
        hostname if len(identities[hostname]) == 1 else f"{hostname}#{identities[hostname].index(identity)}"
        for hostname, identity in hosts
    ]
