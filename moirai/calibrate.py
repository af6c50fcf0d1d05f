"""Calibrate links: time send/recv between real ranks and fit ``latency + bytes / bandwidth`` per link.

Every directed pair ``a -> b`` of ranks is timed on ``a``: send a message of ``size`` bytes, then
wait for a 4-byte acknowledgement from ``b``; warm-up, then the fastest of the repeats (the link's
capacity: other traffic and the scheduler only ever add time), for a sweep of sizes. A
least-squares fit of ``time = intercept + size / bandwidth`` gives the link's bandwidth; the
intercept holds the latency of the message and of the acknowledgement, so the link's latency is
half of it.

Example::

    cluster = calibrate(world_size=2)            # two gloo processes on 127.0.0.1
    cluster.to_file("cluster.toml")

or ``python -m moirai.calibrate --world-size 2 --output cluster.toml``. With ``backend="nccl"``
rank ``r`` uses ``cuda:r``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from moirai.device_kinds import kind_for_backend
from moirai.devices import Cluster, Link
from moirai.errors import ClusterError, DistributedError

# 1 KiB .. 16 MiB: small sizes pin the latency, large ones the bandwidth.
DEFAULT_SIZES_BYTES = tuple(1024 * 4**k for k in range(8))
_ACK_ELEMENTS = 1


@dataclasses.dataclass(frozen=True)
class LinkFit:
    """The fitted numbers of one directed link and the measurements behind them."""

    src: int
    dst: int
    latency_s: float
    bandwidth_bytes_per_s: float
    sizes_bytes: tuple[int, ...]
    times_s: tuple[float, ...]


def fit_link(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """``(latency_s, bandwidth_bytes_per_s)`` of ``time = 2 * latency + size / bandwidth``."""
    sizes, times = np.asarray(sizes_bytes, float), np.asarray(times_s, float)
    if len(sizes) < 2 or np.ptp(sizes) == 0:
        raise ClusterError("fitting a link needs timings of at least two different message sizes")
    design = np.stack([np.ones_like(sizes), sizes], axis=1)
    (intercept, seconds_per_byte), *_ = np.linalg.lstsq(design, times, rcond=None)
    if not seconds_per_byte > 0:
        raise ClusterError(
            f"transfer time does not grow with size (slope {seconds_per_byte:.3g} s/byte); "
            "the timings are noise: use larger sizes or more repeats"
        )
    return max(float(intercept) / 2, 0.0), 1.0 / float(seconds_per_byte)


def measure_links(
    world_size: int = 2,
    backend: str = "gloo",
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = 5,
    warmup: int = 2,
    timeout_s: float = 300.0,
) -> list[LinkFit]:
    """Start ``world_size`` local processes, time every directed pair and fit each link."""
    sizes = tuple(int(s) for s in sizes_bytes)
    fits = []
    for (src, dst), times in time_links(world_size, backend, sizes, repeats, warmup, timeout_s).items():
        latency, bandwidth = fit_link(sizes, times)
        fits.append(LinkFit(src, dst, latency, bandwidth, sizes, times))
    return fits


def time_links(
    world_size: int = 2,
    backend: str = "gloo",
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = 5,
    warmup: int = 2,
    timeout_s: float = 300.0,
) -> dict[tuple[int, int], tuple[float, ...]]:
    """Fastest time (message + acknowledgement) per size, for every directed pair of local ranks."""
    if world_size < 2:
        raise ClusterError("calibration needs at least two ranks (world_size >= 2)")
    kind = kind_for_backend(backend)
    if kind.accelerator and kind.count() < world_size:
        available = kind.count()
        raise ClusterError(f"backend {backend!r} needs {world_size} {kind.name} devices, this machine has {available}")
    sizes = tuple(int(s) for s in sizes_bytes)
    with tempfile.TemporaryDirectory(prefix="moirai-calibrate-") as results_dir:
        settings = (world_size, backend, _free_port(), sizes, repeats, warmup, timeout_s, results_dir)
        try:
            mp.start_processes(_rank_main, args=settings, nprocs=world_size, start_method="spawn")
        except mp.ProcessRaisedException as error:
            raise DistributedError(f"a calibration rank failed: {str(error).strip().splitlines()[-1]}") from error
        reports = [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("rank*.json"))]
    return {(pair["src"], pair["dst"]): tuple(pair["times_s"]) for report in reports for pair in report}


def calibrate(
    world_size: int = 2,
    backend: str = "gloo",
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = 5,
    base: Cluster | None = None,
    output: str | Path | None = None,
) -> Cluster:
    """A cluster whose links are measured between ``world_size`` local ranks (rank r = device r).

    ``base`` supplies the devices (one per rank, in rank order); by default they are detected
    (``cpu`` for gloo, ``cuda:r`` for nccl). ``output`` writes the result as a cluster file.
    """
    if base is not None and len(base) != world_size:
        raise ClusterError(f"base cluster has {len(base)} devices, calibration runs {world_size} ranks")
    if base is None:
        kind = kind_for_backend(backend)
        local = [f"{kind.name}:{r}" if kind.accelerator else kind.name for r in range(world_size)]
        host = socket.gethostname()
        devices = tuple(
            dataclasses.replace(d, name=f"rank{r}", host=host, rank=r)
            for r, d in enumerate(Cluster.from_devices(local).devices)
        )
    else:
        devices = base.devices
    fits = measure_links(world_size, backend, sizes_bytes, repeats)
    links = [
        Link(devices[f.src].name, devices[f.dst].name, f.bandwidth_bytes_per_s, f.latency_s) for f in fits
    ]
    cluster = Cluster.from_links(devices, links, name=base.name if base is not None else f"calibrated-{backend}")
    if output is not None:
        cluster.to_file(output)
    return cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    sizes: tuple[int, ...],
    repeats: int,
    warmup: int,
    timeout_s: float,
    results_dir: str,
) -> None:
    """One rank: take part in every pair in the same order; the sender of a pair records times."""
    kind = kind_for_backend(backend)
    device = torch.device(f"{kind.name}:{rank}" if kind.accelerator else kind.name)
    kind.set_current(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    def synchronize() -> None:
        kind.synchronize(device)

    ack = torch.zeros(_ACK_ELEMENTS, device=device)
    results = []
    try:
        for src in range(world_size):
            for dst in range(world_size):
                if src == dst or rank not in (src, dst):
                    continue
                fastest = []
                for size in sizes:
                    message = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
                    times = []
                    for run in range(warmup + repeats):
                        synchronize()
                        start = time.perf_counter()
                        if rank == src:
                            dist.send(message, dst)
                            dist.recv(ack, dst)
                        else:
                            dist.recv(message, src)
                            dist.send(ack, src)
                        synchronize()
                        if run >= warmup:
                            times.append(time.perf_counter() - start)
                    fastest.append(min(times))
                if rank == src:
                    results.append({"src": src, "dst": dst, "times_s": fastest})
        Path(results_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``moirai calibrate``."""
    parser.add_argument("--world-size", type=int, default=2, help="number of local ranks (one device each)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--max-size-mb", type=float, default=16.0, help="largest message of the sweep (MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--base", help="cluster file whose devices (one per rank, in rank order) to keep")
    parser.add_argument("--output", default="cluster.toml", help="cluster file to write")


def run(args: argparse.Namespace, console: Console) -> int:
    """``moirai calibrate``: measure the links between local ranks and write a cluster file."""
    sizes = tuple(s for s in (1024 * 4**k for k in range(16)) if s <= args.max_size_mb * 2**20)
    base = Cluster.from_file(args.base) if args.base else None
    cluster = calibrate(args.world_size, args.backend, sizes, args.repeats, base, args.output)
    table = Table(title=f"links measured with {args.backend}, written to {args.output}")
    for column in ("link", "bandwidth Gbps", "latency us"):
        table.add_column(column, justify="right")
    for link in cluster.links:
        table.add_row(f"{link.src} -> {link.dst}", f"{link.bandwidth_bytes_per_s * 8 / 1e9:.2f}",
                      f"{link.latency_s * 1e6:.1f}")
    console.print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moirai.calibrate", description=run.__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv), Console())


if __name__ == "__main__":
    sys.exit(main())
