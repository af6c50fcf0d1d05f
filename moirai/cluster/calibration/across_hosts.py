"""Calibration under torchrun: what a message costs between the ranks of every pair of hosts, and within each host.

``moirai calibrate`` started by torchrun on every host, two ranks or more (:func:`moirai.environment.torchrun_world`),
measures in the ranks torchrun started, set up as the runtime sets up its ranks under torchrun
(:func:`moirai.runtime.distributed.torchrun_group`: gloo over TCP between hosts, shared memory within one): for every
ordered pair of hosts, the first rank of one to the first of the other, and within a host of two ranks or more, its
first two both ways. Two hosts' clocks differ, so a pair of hosts times its messages after estimating the offset between
them (:func:`moirai.cluster.calibration.measure.measure_pairs`). Rank 0 collects the medians through the store and fits
them (:class:`HostsCalibration`); ``compile`` on rank 0 prices the links between the hosts with them
(:func:`moirai.cluster.calibration.cluster.local_cluster`). ``compile`` with ``calibration="auto"`` measures them itself
where rank 0's cached calibration lacks them, every rank taking part before rank 0 plans (:func:`measure_host_links`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moirai.cluster.calibration.cache import MEASURED_CALIBRATIONS, cache_host_links, local_host_links
from moirai.cluster.calibration.fit import HostLink, TransferCost, TransferTimings, fit_between_hosts, link_kind
from moirai.cluster.calibration.measure import (
    DEFAULT_REPEATS,
    DEFAULT_SIZES_BYTES,
    DEFAULT_WARMUP,
    leave_together,
    measure_pairs,
    warn_if_cores_were_busy,
)
from moirai.errors import DistributedError
from moirai.progress import stage

_PREFIX = "moirai/calibration"
_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class HostsCalibration:
    """What rank 0 of a torchrun world measured: every rank's device and host, and the fitted cost of each measured
    directed pair of ranks."""

    torch_devices: tuple[str, ...]
    hosts: tuple[str, ...]
    timings: dict[tuple[int, int], TransferTimings]

    @property
    def costs(self) -> dict[tuple[int, int], TransferCost]:
        """Pairs within a host fitted as a local calibration fits them, pairs of two hosts as a network
        (:func:`~moirai.cluster.calibration.fit.fit_between_hosts`)."""
        return {
            (a, b): timings.fit() if self.hosts[a] == self.hosts[b] else fit_between_hosts(timings)
            for (a, b), timings in self.timings.items()
        }

    def host_links(self) -> dict[HostLink, TransferCost]:
        """The measured pairs by the hosts of their ends and their kind."""
        return {self.host_link(src, dst): cost for (src, dst), cost in self.costs.items()}

    def host_link(self, src: int, dst: int) -> HostLink:
        return HostLink(self.hosts[src], self.hosts[dst], link_kind(self.torch_devices[src], self.torch_devices[dst]))

    def local_links(self) -> dict[str, TransferCost]:
        """The links measured within rank 0's host, by kind (what a calibration on that host alone measures)."""
        return {link.kind: cost for link, cost in self.host_links().items() if link.src_host == link.dst_host}


def host_pairs(hosts: Sequence[str]) -> list[tuple[int, int]]:
    """The pairs of ranks measured (every rank computes the same): the first ranks of every ordered pair of hosts,
    then within each host of two ranks or more its first two, both ways."""
    ranks_of: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks_of.setdefault(host, []).append(rank)
    firsts = [ranks[0] for ranks in ranks_of.values()]
    pairs = [(a, b) for a in firsts for b in firsts if a != b]
    for ranks in ranks_of.values():
        if len(ranks) >= 2:
            pairs += [(ranks[0], ranks[1]), (ranks[1], ranks[0])]
    return pairs


def measure_across_hosts(
    torch_devices: Sequence[str],
    sizes_bytes: Sequence[int],
    repeats: int,
    warmup: int = DEFAULT_WARMUP,
    timeout_s: float = _TIMEOUT_S,
    prefix: str = _PREFIX,
) -> HostsCalibration | None:
    """Under torchrun, on every rank (a collective): measure the links between and within the hosts; rank 0 gets
    the result, the others None. Rank ``r`` runs on ``torch_devices[r]``; ``prefix`` names the store keys, one per
    measurement of a run."""
    from moirai.environment import require_torchrun_world
    from moirai.runtime.distributed import torchrun_group
    from moirai.runtime.hosts import rank_hosts

    world = require_torchrun_world("measuring the links between hosts")
    rank, world_size = world.rank, world.world_size
    if len(torch_devices) != world_size:
        raise DistributedError(
            f"torchrun runs {world_size} ranks but {len(torch_devices)} devices were given; give one device per rank"
        )
    group = torchrun_group(rank, world_size, list(torch_devices), timeout_s, f"{prefix}/shm")
    try:
        hosts = rank_hosts(group.store, rank, world_size, f"{prefix}/host", timeout_s)
        pairs = host_pairs(hosts)
        sizes = tuple(int(s) for s in sizes_bytes)
        for index, medians in measure_pairs(group, pairs, sizes, repeats, warmup, timeout_s, prefix, hosts):
            group.store.set(f"{prefix}/result/{index}", json.dumps(medians))
        leave_together(group.store, rank, world_size, prefix)
    finally:
        group.close()
    if rank != 0:
        return None
    timings = {}
    for index, pair in enumerate(pairs):
        medians = _medians(group.store, f"{prefix}/result/{index}", pair, len(sizes))
        stream, share = medians.get("stream_bytes_per_s"), medians.get("core_share")
        timings[pair] = TransferTimings(
            sizes, *(tuple(medians[key]) for key in _MEDIANS), stream_bytes_per_s=stream, core_share=share
        )
    warn_if_cores_were_busy([str(d) for d in torch_devices], timings)
    return HostsCalibration(tuple(str(d) for d in torch_devices), tuple(hosts), timings)


_MEDIANS = ("delay_s", "sender_cpu_s", "receiver_cpu_s")


def measure_host_links(
    store: Any,
    rank: int,
    torch_devices: Sequence[str],
    hosts: Sequence[str],
    calibration: str | Path,
    prefix: str,
    cache_dir: str | Path | None = None,
) -> None:
    """Under torchrun with ranks on several ``hosts``, on every rank before rank 0 plans (a collective): with
    ``calibration="auto"`` where rank 0's cached calibration lacks a link between hosts that
    :func:`measure_across_hosts` measures, or with ``"remeasure"``, every rank measures them and rank 0 adds them to
    its cache; a calibration file or ``"none"`` measures nothing. Rank 0 decides, and says so under ``prefix``."""
    from moirai.runtime.store import wait_for_key

    decision, missing = f"{prefix}/measure", []
    if rank == 0:
        cached = local_host_links(calibration, cache_dir) if calibration in MEASURED_CALIBRATIONS else {}
        missing = sorted(str(link) for link in _links_measured(torch_devices, hosts) - set(cached))
        measure = calibration == "remeasure" or (calibration == "auto" and bool(missing))
        store.set(decision, "1" if measure else "0")
    else:
        wait_for_key(store, decision, f"rank 0 (host {hosts[0]})", "reading its calibration", _TIMEOUT_S)
        measure = store.get(decision) == b"1"
    if not measure:
        return
    why = f"{', '.join(missing)}: not in this machine's calibration" if missing else f"calibration={calibration!r}"
    with stage("measure links between hosts", why):
        measured = measure_across_hosts(torch_devices, DEFAULT_SIZES_BYTES, DEFAULT_REPEATS, prefix=prefix)
    if measured is not None:
        cache_host_links(measured.host_links(), cache_dir)


def _links_measured(torch_devices: Sequence[str], hosts: Sequence[str]) -> set[HostLink]:
    """The links between two hosts that :func:`measure_across_hosts` measures (its pairs' ends and kinds)."""
    return {
        HostLink(hosts[a], hosts[b], link_kind(torch_devices[a], torch_devices[b]))
        for a, b in host_pairs(hosts)
        if hosts[a] != hosts[b]
    }


def _medians(store: object, key: str, pair: tuple[int, int], num_sizes: int) -> dict[str, list[float]]:
    """A pair's medians as its sender set them, checked (the store is the network's)."""
    from moirai.runtime.store import get_json

    def valid(medians: Any) -> bool:
        if not (isinstance(medians, dict) and [medians.get("src"), medians.get("dst")] == list(pair)):
            return False
        stream, share = medians.get("stream_bytes_per_s"), medians.get("core_share")
        return (
            (share is None or (type(share) in (int, float) and 0 <= share <= 2))
            and all(
                isinstance(medians.get(k), list)
                and len(medians[k]) == num_sizes
                and all(type(v) in (int, float) for v in medians[k])
                for k in _MEDIANS
            )
            and (stream is None or (type(stream) in (int, float) and 0 < stream < float("inf")))
        )

    return get_json(store, key, f"timings of ranks {pair[0]} -> {pair[1]}", valid)
