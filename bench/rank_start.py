"""How long a spawned world takes to start its ranks: forked from the fork server against spawned interpreters.

Run: ``python -m bench.rank_start [--repeats 5]``.

A two-layer model split over 2 and 3 logical CPU devices (round robin); each start opens a
``DistributedRunner``, serves one request (the ranks must have joined and loaded their parts) and closes. The
first start of a process that forks its ranks also starts the fork server (it imports torch and the runtime once);
the table shows that first start, then the median of the starts after it, with ``MOIRAI_RANK_START`` set to each
method in turn in this one process (docs/design.md, "Starting ranks").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
from rich.console import Console
from rich.table import Table

import moirai
from moirai.errors import OversubscriptionWarning
from moirai.runtime import DistributedRunner
from moirai.runtime.rank_processes import START_METHOD_ENV

METHODS = ("fork-server", "spawn")


def _start_s(compiled: moirai.CompiledModel, x: torch.Tensor, world_size: int) -> float:
    started = time.perf_counter()
    with DistributedRunner(["cpu"] * world_size) as runner:
        runner.run(compiled.program, [x])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    warnings.simplefilter("ignore", OversubscriptionWarning)  # 3 logical devices on 2 cores: start-up only
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
    x = torch.randn(4, 64)
    table = Table(title="Starting a spawned world: open, one request, close (s)")
    for column in ("ranks", *(f"{m} first" for m in METHODS), *(f"{m} median" for m in METHODS), "spawn / fork"):
        table.add_column(column, justify="right")
    for world_size in (2, 3):
        compiled = moirai.compile(
            model, ["cpu"] * world_size, (x,), placer="round_robin", calibration="none", progress=False
        )
        firsts, medians = {}, {}
        for method in METHODS:
            os.environ[START_METHOD_ENV] = method
            times = [_start_s(compiled, x, world_size) for _ in range(options.repeats + 1)]
            firsts[method], medians[method] = times[0], statistics.median(times[1:])
        table.add_row(
            str(world_size),
            *(f"{firsts[m]:.2f}" for m in METHODS),
            *(f"{medians[m]:.2f}" for m in METHODS),
            f"{medians['spawn'] / medians['fork-server']:.1f}x",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
