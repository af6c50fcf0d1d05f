"""``moirai calibrate``: measure what transfers and requests cost in the runtime; write a cluster file and the
calibration compile reads."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from rich.console import Console
from rich.table import Table

from moirai import progress
from moirai.cluster.calibration.across_hosts import measure_across_hosts
from moirai.cluster.calibration.cache import cached_host_links, cached_links, calibration_cache_path, write_calibration
from moirai.cluster.calibration.cluster import measured_cluster, rank_devices
from moirai.cluster.calibration.fit import HostLink, TransferCost, costs_by_kind, link_kind
from moirai.cluster.calibration.measure import (
    DEFAULT_MAX_SIZE_BYTES,
    DEFAULT_REPEATS,
    measure_link_kinds,
    measure_transfer_costs,
    sizes_up_to,
)
from moirai.cluster.calibration.request_cost import measure_request_cost_spread
from moirai.cluster.files import read_cluster_devices
from moirai.cluster.hardware import Device
from moirai.cluster.kinds import CPU, backends, kind_for_backend
from moirai.environment import torchrun_world
from moirai.errors import ClusterError
from moirai.user_files import check_output_path, same_file


def _transport(backend: str) -> str:
    """What carries the messages of ranks that talk over ``backend``: the host's transport where they are staged
    through host memory."""
    from moirai.runtime import shm

    return backend if kind_for_backend(backend).messages_in_device_memory else shm.host_transport()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``moirai calibrate``."""
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of local ranks, one device each (default: --base's, or 2; under torchrun, its ranks on every "
        "host)",
    )
    parser.add_argument("--backend", choices=backends(), default=CPU.backend)
    parser.add_argument(
        "--max-size-mb", type=float, default=DEFAULT_MAX_SIZE_BYTES / 2**20, help="largest message of the sweep (MiB)"
    )
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument(
        "--base",
        help="cluster file whose devices (one per rank, in rank order) to keep; its links, if any, are replaced by "
        "the measured ones",
    )
    parser.add_argument("--output", default="cluster.toml", help="cluster file to write")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--save", default=None, help="calibration file to write the transfer and request costs to")
    where.add_argument(
        "--update-cache",
        action="store_true",
        help="replace this machine's cached calibration, which every later compile on local devices reads "
        "(measure on an idle machine); by default it is left alone",
    )


# The largest message a sweep may send: each rank holds a few of them at once.
_MAX_SWEEP_MB = 4096


def _sweep_sizes(max_size_mb: float, repeats: int) -> tuple[int, ...]:
    """The sweep's sizes for ``--max-size-mb``, checked before any rank starts: at least two sizes (a latency and a
    bandwidth need both), no message larger than :data:`_MAX_SWEEP_MB`, and ``--repeats`` at least one."""
    if repeats < 1:
        raise ClusterError(f"--repeats {repeats}: give at least 1 (timings per size; default {DEFAULT_REPEATS})")
    sizes = sizes_up_to(max_size_mb * 2**20) if math.isfinite(max_size_mb) else ()
    if len(sizes) < 2 or max_size_mb > _MAX_SWEEP_MB:
        raise ClusterError(
            f"--max-size-mb {max_size_mb:g}: give a number of MiB from {4 * 1024 / 2**20:g} (two message sizes, "
            f"1 and 4 KiB: the fit needs a latency and a bandwidth) to {_MAX_SWEEP_MB}"
        )
    return sizes


class _Measured(NamedTuple):
    """What one calibration run measured: the ranks' devices, the cost of every pair of ranks, the local link
    kinds' and the host links' costs, and a row (label, cost) per measured pair."""

    devices: tuple[Device, ...]
    costs: dict[tuple[int, int], TransferCost]
    by_kind: dict[str, TransferCost]
    host_links: dict[HostLink, TransferCost]
    rows: list[tuple[str, TransferCost]]
    transport: str


def run(args: argparse.Namespace, console: Console) -> int:
    """``moirai calibrate``: measure what transfers cost between local ranks, or under torchrun between and within
    its hosts; write a cluster file and the calibration compile reads."""
    # A minute of measuring says what it does, as compile's calibration does: a line per stage on stderr.
    with progress.shown():
        return _calibrate(args, console)


def _calibrate(args: argparse.Namespace, console: Console) -> int:
    world = torchrun_world()
    if world is None or world.rank == 0:  # where the results go, checked before a second is spent measuring them
        check_output_path(args.output, "the cluster file", ClusterError)
        if args.save is not None:  # --save "" too: refused, not a calibration measured and dropped
            check_output_path(args.save, "the calibration", ClusterError, folder_made=True)
            if same_file(args.save, args.output):
                raise ClusterError(
                    f"--output {args.output!r} and --save {args.save!r} name one file: the calibration would replace "
                    "the cluster file; name two files"
                )
    sizes = _sweep_sizes(args.max_size_mb, args.repeats)
    base, base_name = read_cluster_devices(args.base) if args.base else (None, "")
    if world is not None and args.world_size not in (None, world.world_size):
        raise ClusterError(f"--world-size {args.world_size}, but torchrun runs {world.world_size} ranks: leave it out")
    if world is not None:
        world_size = world.world_size
    elif args.world_size is not None:  # 0 too: rank_devices refuses fewer than two ranks
        world_size = args.world_size
    else:
        world_size = len(base) if base is not None else 2
    devices = rank_devices(world_size, args.backend, base, local=world is None)  # local: no more than it hosts
    transport = _transport(args.backend)
    with progress.stage("measure transfers", f"{len(devices)} ranks, every directed pair, {len(sizes)} sizes"):
        measured = (
            _measure_local(devices, sizes, args.repeats, transport)
            if world is None
            else _measure_hosts(devices, sizes, args.repeats, transport)
        )
    if measured is None:
        return 0  # a torchrun rank other than 0: rank 0 writes and prints what every rank measured
    name = base_name or f"calibrated-{transport}"  # the base's, else what carried the messages, e.g. shm
    measured_cluster(measured.devices, measured.costs, name, args.output)
    saved = Path(args.save) if args.save else calibration_cache_path() if args.update_cache else None
    previous = cached_links(saved) if saved is not None else {}  # kinds measured before and not now
    links = {**previous, **measured.by_kind}
    host_link = link_kind(CPU.name, CPU.name)
    if host_link not in links:  # the request cost's program runs on two CPU ranks
        with progress.stage("measure links", "cpu <-> cpu, which the request cost's ranks use"):
            links.update(measure_link_kinds((CPU.name, CPU.name)))
    with progress.stage("measure requests", "the runtime's own work per request, through its server"):
        measured_requests = measure_request_cost_spread(links[host_link])
    requests = measured_requests.cost
    if saved is not None:
        host_links = {**cached_host_links(saved), **measured.host_links}  # host pairs measured before and not now
        write_calibration(saved, links, requests, host_links, private=not args.save)  # --update-cache: the cache
    table = Table(
        title=f"transfers measured in the runtime ({measured.transport}, ranks pinned to their share of the cores)",
        caption=f"cluster file: {args.output}; calibration: "
        + (str(saved) if saved is not None else "not saved (--save FILE, or --update-cache for this machine's)"),
    )
    for column in ("link", "latency us", "bandwidth GB/s", "sender CPU us + ns/KiB", "receiver CPU us + ns/KiB"):
        table.add_column(column, justify="right")
    for label, cost in measured.rows:
        table.add_row(
            label,
            f"{cost.latency_s * 1e6:.1f}",
            f"{cost.bandwidth_bytes_per_s / 1e9:.3f}",
            f"{cost.sender_cpu_s * 1e6:.1f} + {cost.sender_cpu_s_per_byte * 1024e9:.0f}",
            f"{cost.receiver_cpu_s * 1e6:.1f} + {cost.receiver_cpu_s_per_byte * 1024e9:.0f}",
        )
    console.print(table)
    if measured.host_links:
        console.print("hosts: " + ", ".join(f"{d.name} on {d.host}" for d in measured.devices))
    console.print(
        f"the runtime's own work per request (through its server): driver (rank 0) "
        f"{requests.driver_cpu_s * 1e6:.0f} us with another rank working ({requests.driver_alone_cpu_s * 1e6:.0f} us "
        f"alone), another rank {requests.worker_cpu_s * 1e6:.0f} us (its rounds spread over "
        f"{measured_requests.spread.driver_cpu_s * 1e6:.0f}, {measured_requests.spread.driver_alone_cpu_s * 1e6:.0f} "
        f"and {measured_requests.spread.worker_cpu_s * 1e6:.0f} us)"
    )
    return 0


def _measure_local(devices: tuple[Device, ...], sizes: tuple[int, ...], repeats: int, transport: str) -> _Measured:
    """Every directed pair of local ranks, spawned here."""
    costs = measure_transfer_costs([d.torch_device for d in devices], sizes, repeats)
    by_kind = costs_by_kind([d.torch_device for d in devices], costs)
    rows = [(f"{devices[a].name} -> {devices[b].name}", cost) for (a, b), cost in costs.items()]
    return _Measured(devices, costs, by_kind, {}, rows, transport)


def _measure_hosts(
    devices: tuple[Device, ...], sizes: tuple[int, ...], repeats: int, transport: str
) -> _Measured | None:
    """Under torchrun, the links between every pair of its hosts and within each (None on ranks other than 0)."""
    measured = measure_across_hosts([d.torch_device for d in devices], sizes, repeats)
    if measured is None:
        return None
    devices = tuple(dataclasses.replace(d, host=host) for d, host in zip(devices, measured.hosts, strict=True))
    host_links = measured.host_links()
    # Every pair of ranks costs what the measured pair of its hosts and kind costs.
    pairs = [(a, b) for a in range(len(devices)) for b in range(len(devices)) if a != b]
    costs = {pair: host_links[measured.host_link(*pair)] for pair in pairs if measured.host_link(*pair) in host_links}
    rows = [(f"{devices[a].name} -> {devices[b].name}", cost) for (a, b), cost in measured.costs.items()]
    return _Measured(
        devices, costs, measured.local_links(), host_links, rows, f"gloo between hosts, {transport} within"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moirai.cluster.calibration.cli", description=run.__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv), Console())


if __name__ == "__main__":
    sys.exit(main())
