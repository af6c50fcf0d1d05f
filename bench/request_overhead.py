"""What the runtime itself costs per request, outside the model's ops and the messages the model prices.

Run: ``python -m bench.request_overhead [--requests 2000] [--width 16]``.

A chain of twelve ``Linear(width, width)`` + ReLU layers (a few microseconds of compute each) on two
logical CPU devices, served through ``compiled.server()`` three ways: every layer on device 0 (rank 0
drives and computes; rank 1 idles), the first half on device 0 and the rest on device 1, and the
reverse. For each: the median latency of requests served alone, the period of requests pipelined with
``server.map``, and the CPU time per pipelined request of each rank's process (every thread: rank 0's
caller, dispatcher and completer). The last columns subtract from each rank's CPU time what the model
books on its device (``Timeline.busy_s``: its ops' profiled compute and the send and receive time of
its transfers by the calibration; the driver's header and the outputs' way back are delays, not
work, in the model): what remains is the runtime's own work per request, with the header's and the
outputs' handling, the term the cost model does not have yet (docs/design.md, "The driver's
messages").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import moirai
from bench.serving import pinned
from moirai.planning.plan import Plan
from moirai.planning.simulate import simulate
from moirai.runtime.rank_processes import started_ranks
from moirai.runtime.resources import rank_resources

DEVICES = ["cpu", "cpu"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--width", type=int, default=16)
    options = parser.parse_args()
    torch.manual_seed(0)
    layers = [m for _ in range(12) for m in (torch.nn.Linear(options.width, options.width), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers).eval()
    x = torch.randn(1, options.width)
    with pinned(rank_resources(DEVICES)[0], DEVICES[0]):  # where rank 0 runs in the server
        compiled = moirai.compile(model, DEVICES, (x,), cost="measured", placer="single", progress=False)
        problem = compiled.problem
        order = np.array(problem.topological_order)
        halves = np.zeros(problem.num_tasks, int)
        halves[order[len(order) // 2 :]] = 1
        plans = {
            "one device": compiled.plan,
            "device 0 then 1": Plan(halves, problem.device_names, placer="halves"),
            "device 1 then 0": Plan(1 - halves, problem.device_names, placer="halves"),
        }
        with torch.no_grad():
            for _ in range(200):
                model(x)
            started = time.perf_counter()
            for _ in range(options.requests):
                model(x)
            eager_s = (time.perf_counter() - started) / options.requests
        table = Table(title=f"the runtime's own work per request on {DEVICES}: eager {eager_s * 1e6:.0f} us")
        for column in (
            "plan",
            "latency alone us",
            "period us",
            "rank 0 CPU us",
            "rank 1 CPU us",
            "model books us (0 / 1)",
            "runtime's own us (0 / 1)",
        ):
            table.add_column(column, justify="left" if column == "plan" else "right")
        for name, plan in plans.items():
            with compiled.with_plan(plan).server() as server, torch.no_grad():
                for _ in range(200):
                    server.submit(x).result()
                alone = []
                for _ in range(500):
                    started = time.perf_counter()
                    server.submit(x).result()
                    alone.append(time.perf_counter() - started)
                (worker,) = started_ranks()
                cpu_0, cpu_1 = time.process_time(), sum(worker.cpu_times()[:2])
                started = time.perf_counter()
                list(server.map([x] * options.requests))
                period_s = (time.perf_counter() - started) / options.requests
                cpu_per_request = (
                    np.array([time.process_time() - cpu_0, sum(worker.cpu_times()[:2]) - cpu_1]) / options.requests
                )
            booked = simulate(problem, plan).busy_s
            own = cpu_per_request - booked
            table.add_row(
                name,
                f"{statistics.median(alone) * 1e6:.0f}",
                f"{period_s * 1e6:.0f}",
                f"{cpu_per_request[0] * 1e6:.0f}",
                f"{cpu_per_request[1] * 1e6:.0f}",
                f"{booked[0] * 1e6:.0f} / {booked[1] * 1e6:.0f}",
                f"{own[0] * 1e6:.0f} / {own[1] * 1e6:.0f}",
            )
        Console(width=140).print(table)


if __name__ == "__main__":
    main()
