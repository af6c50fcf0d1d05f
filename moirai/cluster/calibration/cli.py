"""``moirai calibrate``: measure what transfers and requests cost in the runtime; write a cluster file and the
calibration compile reads."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moirai.cluster.calibration.cache import cached_links, calibration_cache_path, write_calibration
from moirai.cluster.calibration.cluster import measured_cluster, rank_devices
from moirai.cluster.calibration.fit import costs_by_kind, link_kind
from moirai.cluster.calibration.measure import measure_link_kinds, measure_transfer_costs
from moirai.cluster.calibration.request_cost import measure_request_cost
from moirai.cluster.files import read_cluster_devices
from moirai.cluster.kinds import CPU, backends, kind_for_backend


def _transport(backend: str) -> str:
    """What carries the messages of ranks that talk over ``backend``: the host's transport where they are staged
    through host memory."""
    from moirai.runtime import shm

    return backend if kind_for_backend(backend).messages_in_device_memory else shm.host_transport()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``moirai calibrate``."""
    parser.add_argument(
        "--world-size", type=int, default=None, help="number of local ranks, one device each (default: --base's, or 2)"
    )
    parser.add_argument("--backend", choices=backends(), default=CPU.backend)
    parser.add_argument("--max-size-mb", type=float, default=16.0, help="largest message of the sweep (MiB)")
    parser.add_argument("--repeats", type=int, default=15)
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


def run(args: argparse.Namespace, console: Console) -> int:
    """``moirai calibrate``: measure what transfers cost between local ranks; write a cluster file and the
    calibration compile reads."""
    sizes = tuple(s for s in (1024 * 4**k for k in range(16)) if s <= args.max_size_mb * 2**20)
    base, base_name = read_cluster_devices(args.base) if args.base else (None, "")
    world_size = args.world_size or (len(base) if base is not None else 2)
    devices = rank_devices(world_size, args.backend, base)
    costs = measure_transfer_costs([d.torch_device for d in devices], sizes, args.repeats)
    transport = _transport(args.backend)
    name = base_name or f"calibrated-{transport}"  # the base's, else what carried the messages, e.g. shm
    cluster = measured_cluster(devices, costs, name, args.output)
    by_kind = costs_by_kind([d.torch_device for d in devices], costs)
    saved = Path(args.save) if args.save else calibration_cache_path() if args.update_cache else None
    previous = cached_links(saved) if saved is not None else {}  # kinds measured before and not now
    links = {**previous, **by_kind}
    host_link = link_kind(CPU.name, CPU.name)
    if host_link not in links:  # the request cost's program runs on two CPU ranks
        links.update(measure_link_kinds((CPU.name, CPU.name)))
    requests = measure_request_cost(links[host_link])
    if saved is not None:
        write_calibration(saved, links, requests)
    table = Table(
        title=f"transfers measured in the runtime ({transport}, ranks pinned to their share of the cores)",
        caption=f"cluster file: {args.output}; calibration: "
        + (str(saved) if saved is not None else "not saved (--save FILE, or --update-cache for this machine's)"),
    )
    for column in ("link", "latency us", "bandwidth GB/s", "sender CPU us + ns/KiB", "receiver CPU us + ns/KiB"):
        table.add_column(column, justify="right")
    for (a, b), cost in costs.items():
        table.add_row(
            f"{cluster.names[a]} -> {cluster.names[b]}",
            f"{cost.latency_s * 1e6:.1f}",
            f"{cost.bandwidth_bytes_per_s / 1e9:.2f}",
            f"{cost.sender_cpu_s * 1e6:.1f} + {cost.sender_cpu_s_per_byte * 1024e9:.0f}",
            f"{cost.receiver_cpu_s * 1e6:.1f} + {cost.receiver_cpu_s_per_byte * 1024e9:.0f}",
        )
    console.print(table)
    console.print(
        f"the runtime's own work per request (through its server): driver (rank 0) "
        f"{requests.driver_cpu_s * 1e6:.0f} us, another rank {requests.worker_cpu_s * 1e6:.0f} us"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moirai.cluster.calibration.cli", description=run.__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv), Console())


if __name__ == "__main__":
    sys.exit(main())
