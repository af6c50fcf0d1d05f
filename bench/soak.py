"""Soak: many requests through one server, watching every rank's memory and fds, /dev/shm and throughput.

Run: ``python -m bench.soak [--requests 100000] [--every 10000]``.

A small MLP split over two logical CPU devices (``["cpu", "cpu"]``, placed ``round_robin`` so both ranks
work on every request) serves ``--requests`` requests through one ``compiled.server()`` via ``server.map``,
cycling through a few distinct inputs; every output is checked against eager's for its input. After the
warm-up and then every ``--every`` requests it prints one row: the requests so far, the throughput of the
last block (requests/s), each rank's resident memory (MB) and open file descriptors, and the bytes that
moirai's files (rings and spill files) hold in the shared-memory directory. A ring's file is unlinked once
its peer has opened it, so its memory shows in the ranks' RSS, not there: that column counts spills and
leftovers. A leak shows as a column that keeps growing from row to row; the first rows may grow while the
rings are touched for the first time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

import moirai
from moirai.runtime.rank_processes import started_ranks
from moirai.runtime.shm_files import shm_dir

DEVICES = ["cpu", "cpu"]
DISTINCT_INPUTS = 8
WARMUP_REQUESTS = 200


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()) for _ in range(4)]
    return torch.nn.Sequential(*layers).eval()


def _ranks() -> list[psutil.Process]:
    """This process (rank 0), then the server's ranks in rank order."""
    return [psutil.Process(), *started_ranks()]


def moirai_shm_bytes(directory: str | None = None) -> int:
    """Bytes allocated to moirai's files (``moirai*``, directories included) in the shared-memory directory."""
    total = 0
    for entry in Path(directory or shm_dir()).glob("moirai*"):
        paths = entry.rglob("*") if entry.is_dir() else [entry]
        for path in paths:
            try:
                total += path.lstat().st_blocks * 512
            except FileNotFoundError:  # a spill file taken while we looked
                pass
    return total


def _row(done: int, requests_per_s: float, ranks: list[psutil.Process]) -> str:
    rss = " / ".join(f"{rank.memory_info().rss / 2**20:.1f}" for rank in ranks)
    fds = " / ".join(str(rank.num_fds()) for rank in ranks)
    rate = f"{requests_per_s:,.0f}" if requests_per_s else "warm-up"
    return f"| {done:>9,} | {rate:>9} | {rss:>15} | {fds:>11} | {moirai_shm_bytes() / 2**20:>12.1f} |"


def _inputs(count: int, distinct: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    return itertools.islice(itertools.cycle(distinct), count)


def soak(requests: int, every: int, batch: int, max_in_flight: int) -> None:
    model = _model()
    distinct = [torch.randn(batch, 256) for _ in range(DISTINCT_INPUTS)]
    with torch.no_grad():
        expected = [model(x) for x in distinct]
    compiled = moirai.compile(model, DEVICES, (distinct[0],), placer="round_robin", progress=False)
    assert not any(part.idle for part in compiled.program.parts), "both ranks take part in every request"
    print(f"soak: {requests:,} requests of batch {batch} through one server on {DEVICES}, pid {os.getpid()}")
    print(f"shared-memory directory: {shm_dir()}; {os.cpu_count()} cores")
    with compiled.server(max_in_flight=max_in_flight) as server:
        for index, output in enumerate(server.map(_inputs(WARMUP_REQUESTS, distinct))):
            torch.testing.assert_close(output, expected[index % DISTINCT_INPUTS])
        ranks = _ranks()
        ranks_named = " / ".join(f"r{k}" for k in range(len(ranks)))
        print(
            f"| {'requests':>9} | {'req/s':>9} | {'RSS MB ' + ranks_named:>15} | {'fds ' + ranks_named:>11} "
            f"| {'/dev/shm MB':>12} |"
        )
        print(f"|{'-' * 11}|{'-' * 11}|{'-' * 17}|{'-' * 13}|{'-' * 14}|")
        print(_row(0, 0.0, ranks), flush=True)
        done = 0
        while done < requests:
            block = min(every, requests - done)
            started = time.perf_counter()
            for index, output in enumerate(server.map(_inputs(block, distinct))):
                torch.testing.assert_close(output, expected[index % DISTINCT_INPUTS])
            elapsed_s = time.perf_counter() - started
            done += block
            print(_row(done, block / elapsed_s, ranks), flush=True)
    print("every output equal to eager's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=10_000, help="print a row every this many requests")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-in-flight", type=int, default=8)
    args = parser.parse_args()
    soak(args.requests, args.every, args.batch, args.max_in_flight)


if __name__ == "__main__":
    main()
