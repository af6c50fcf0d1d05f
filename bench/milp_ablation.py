"""The Moirai MILP, measured: paper-literal vs strong formulation, whole model vs window search, and scale.

Run: ``python bench/milp_ablation.py [--time-limit 20] [--scale-sizes 3000,20000,50000] [--scale-budget 120]``.

1. Formulations: the same instances and warm start (the best heuristic plan), ``paper`` and
   ``strong``: binaries, constraints, build time, and the solve's time to optimum or its gap
   at the time limit; every plan's simulated makespan next to the solver's objective.
2. Whole model vs window search at equal budget on growing graphs: where one model stops
   paying (``FULL_MODEL_MAX_TASKS`` in :mod:`moirai.placers.milp`).
3. Scale: the ``milp`` placer on large random layered graphs: wall time, peak memory, and its
   makespan against the best heuristic's.

Instances are random layered DAGs (:func:`random_layered_problem`): layers of 1 to ``2 width``
tasks, each reading the output of 1-3 tasks of the layer before (one tensor per task, sent
once to each device that reads it); devices differ in speed and per-task affinity; transfer
times are ``communication_ratio`` times the mean compute time on average.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from moirai.placers import get_placer, place
from moirai.problem import Problem
from moirai.simulate import simulate
from moirai.solve.milp import SolverSettings, build_model, plan_from_times, solve_model, whole_problem


def random_layered_problem(
    num_tasks: int, num_devices: int, seed: int = 0, width: int = 3, communication_ratio: float = 1.0
) -> Problem:
    """A random layered DAG on heterogeneous devices (see the module docstring)."""
    rng = np.random.default_rng(seed)
    layers: list[list[int]] = []
    placed = 0
    while placed < num_tasks:
        size = int(min(rng.integers(1, 2 * width), num_tasks - placed))
        layers.append(list(range(placed, placed + size)))
        placed += size
    consumers: list[list[int]] = [[] for _ in range(num_tasks)]
    for previous, layer in zip(layers, layers[1:], strict=False):
        for v in layer:
            for u in rng.choice(previous, size=min(len(previous), int(rng.integers(1, 4))), replace=False):
                consumers[int(u)].append(v)
    producers = [u for u in range(num_tasks) if consumers[u]]
    speed = rng.uniform(1.0, 3.0, num_devices)
    base = rng.uniform(1e-4, 1e-3, num_tasks)
    compute = base[:, None] / speed[None, :] * rng.uniform(0.7, 1.3, (num_tasks, num_devices))
    bandwidth = rng.uniform(0.5, 2.0, (num_devices, num_devices))
    size = rng.uniform(0.2, 1.8, len(producers)) * compute.mean() * communication_ratio
    transfer = size[:, None, None] / bandwidth[None]
    transfer[:, np.arange(num_devices), np.arange(num_devices)] = 0.0
    return Problem(
        device_names=tuple(f"dev{d}" for d in range(num_devices)),
        memory_capacity_bytes=np.full(num_devices, np.inf),
        task_names=tuple(f"task{i}" for i in range(num_tasks)),
        compute_s=compute,
        memory_bytes=np.zeros(num_tasks),
        tensor_names=tuple(f"out{u}" for u in producers),
        tensor_producer=np.array(producers, int),
        tensor_consumers=tuple(tuple(consumers[u]) for u in producers),
        transfer_s=transfer,
    )


def formulation_table(sizes: list[int], devices: int, time_limit_s: float) -> Table:
    table = Table(title=f"paper vs strong formulation (HiGHS, {time_limit_s:.0f} s limit, same warm start)")
    for column in (
        "tasks",
        "formulation",
        "binaries",
        "constraints",
        "build s",
        "solve s",
        "status",
        "objective ms",
        "bound ms",
        "gap",
        "simulated ms",
    ):
        table.add_column(column, justify="left" if column in ("formulation", "status") else "right")
    for n in sizes:
        problem = random_layered_problem(n, devices, seed=n)
        start = get_placer("heft")(problem)
        timeline = simulate(problem, start)
        for formulation in ("paper", "strong"):
            built = build_model(problem, whole_problem(problem, timeline.makespan), formulation)
            solution = solve_model(built, SolverSettings(time_limit_s=time_limit_s, mip_gap=1e-6), timeline)
            simulated = "-"
            if solution.has_solution:
                placement = np.array([solution.placement[i] for i in range(n)])
                starts = np.array([solution.start_s[i] for i in range(n)])
                plan = plan_from_times(problem, placement, starts, solution.transfer_start_s, "milp")
                simulated = f"{simulate(problem, plan).makespan * 1e3:.4f}"
            objective = solution.objective_s
            bound = max(solution.bound_s or 0.0, 0.0)
            gap = f"{(objective - bound) / objective:.1%}" if objective else "-"
            table.add_row(
                str(n),
                formulation,
                f"{built.size.binaries:,}",
                f"{built.size.constraints:,}",
                f"{built.size.build_s:.2f}",
                f"{solution.solve_s:.1f}",
                solution.status,
                f"{objective * 1e3:.4f}" if objective else "-",
                f"{bound * 1e3:.4f}",
                gap,
                simulated,
            )
    return table


def strategy_table(sizes: list[int], devices: int, time_limit_s: float) -> Table:
    table = Table(title=f"whole MILP vs window search, {time_limit_s:.0f} s each")
    for column in ("tasks", "best heuristic ms", "whole MILP ms", "window search ms", "lower bound ms"):
        table.add_column(column, justify="right")
    for n in sizes:
        problem = random_layered_problem(n, devices, seed=n)
        plans = {
            strategy: place(problem, "milp", time_limit_s=time_limit_s, strategy=strategy, progress=False)
            for strategy in ("full", "windows")
        }
        best = min(plans["full"].info["heuristics"].values())
        table.add_row(
            str(n),
            f"{best * 1e3:.4f}",
            f"{plans['full'].makespan_s * 1e3:.4f}",
            f"{plans['windows'].makespan_s * 1e3:.4f}",
            f"{max(p.lower_bound_s for p in plans.values()) * 1e3:.4f}",
        )
    return table


def scale_table(sizes: list[int], devices: int, budget_s: float) -> Table:
    table = Table(title=f"milp placer at scale: random layered DAGs, {devices} devices, {budget_s:.0f} s budget")
    for column in (
        "tasks",
        "best heuristic",
        "best heuristic ms",
        "milp ms",
        "gain",
        "windows tried / kept",
        "wall s",
        "peak RSS GB",
    ):
        table.add_column(column, justify="right")
    for n in sizes:
        problem = random_layered_problem(n, devices, seed=n)
        started = time.perf_counter()
        plan = place(problem, "milp", time_limit_s=budget_s, progress=False)
        wall = time.perf_counter() - started
        heuristics = plan.info["heuristics"]
        best_name = min(heuristics, key=heuristics.get)
        best = heuristics[best_name]
        table.add_row(
            f"{n:,}",
            best_name,
            f"{best * 1e3:.3f}",
            f"{plan.makespan_s * 1e3:.3f}",
            f"{(1 - plan.makespan_s / best):.2%}",
            f"{plan.info.get('windows_tried', '-')} / {plan.info.get('windows_improved', '-')}",
            f"{wall:.1f}",
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per formulation solve")
    parser.add_argument("--formulation-sizes", default="8,12,16,24")
    parser.add_argument("--strategy-sizes", default="20,40,80")
    parser.add_argument("--scale-sizes", default="3000,20000,50000")
    parser.add_argument("--scale-budget", type=float, default=120.0)
    parser.add_argument("--devices", type=int, default=3)
    args = parser.parse_args()

    def sizes(text: str) -> list[int]:
        return [int(s) for s in text.split(",") if s]

    console = Console(width=160)
    if sizes(args.formulation_sizes):
        console.print(formulation_table(sizes(args.formulation_sizes), args.devices, args.time_limit))
    if sizes(args.strategy_sizes):
        console.print(strategy_table(sizes(args.strategy_sizes), args.devices, args.time_limit))
    if sizes(args.scale_sizes):
        console.print(scale_table(sizes(args.scale_sizes), args.devices + 1, args.scale_budget))


if __name__ == "__main__":
    main()
