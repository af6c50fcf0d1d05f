"""How fast the simulator judges a large plan: a random layered DAG of 50,000 tasks on 4 devices.

Run: ``python bench/simulate_speed.py [--tasks 50000] [--devices 4]``. Prints a rich table of the
time ``simulate`` takes with a given order per device and with list scheduling, with and
without link contention (the problem, its cached topological order and the plans are built
before the clock starts).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate


def random_problem(num_tasks: int, num_devices: int, seed: int = 0) -> Problem:
    """A DAG where each task reads one to three tensors of recent tasks (like a deep network with skips)."""
    rng = np.random.default_rng(seed)
    producers, consumers = [], []
    for v in range(1, num_tasks):
        sources = np.unique(v - 1 - rng.integers(0, min(v, 20), size=rng.integers(1, 4)))
        for u in sources:
            producers.append(int(u))
            consumers.append((v,))
    speed = rng.uniform(1.0, 4.0, num_devices)
    bandwidth = rng.uniform(1e9, 1e10, (num_devices, num_devices))
    tensor_bytes = rng.uniform(1e4, 1e7, len(producers))
    transfer = 1e-5 + tensor_bytes[:, None, None] / bandwidth[None]
    transfer[:, np.arange(num_devices), np.arange(num_devices)] = 0.0
    return Problem(
        device_names=tuple(f"dev{d}" for d in range(num_devices)),
        memory_capacity_bytes=np.full(num_devices, 1e12),
        task_names=tuple(f"task{i}" for i in range(num_tasks)),
        compute_s=rng.uniform(1e-5, 1e-3, num_tasks)[:, None] / speed[None, :],
        memory_bytes=rng.uniform(0, 1e6, num_tasks),
        tensor_names=tuple(f"tensor{t}" for t in range(len(producers))),
        tensor_producer=np.array(producers),
        tensor_consumers=tuple(consumers),
        transfer_s=transfer,
        tensor_bytes=tensor_bytes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=50_000)
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args()

    problem = random_problem(args.tasks, args.devices)
    placement = np.random.default_rng(1).integers(0, args.devices, args.tasks)
    unordered = Plan(placement, problem.device_names)
    ordered = Plan(placement, problem.device_names, order=simulate(problem, unordered).device_order())

    table = Table(title=f"simulate: {args.tasks:,} tasks, {problem.num_tensors:,} tensors, {args.devices} devices")
    for column in ("plan", "contention", "transfers", "makespan (s)", "simulate time (s)"):
        table.add_column(column, justify="right" if column != "plan" else "left")
    for label, plan in (("order per device", ordered), ("list-scheduled", unordered)):
        for contention in (True, False):
            start = time.perf_counter()
            timeline = simulate(problem, plan, contention=contention)
            elapsed = time.perf_counter() - start
            table.add_row(
                label, str(contention), f"{len(timeline.transfers):,}", f"{timeline.makespan_s:.4f}", f"{elapsed:.2f}"
            )
    Console().print(table)


if __name__ == "__main__":
    main()
