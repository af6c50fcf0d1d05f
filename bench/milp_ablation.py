"""The Moirai MILP, measured: paper-literal vs strong formulation, whole model vs window search, and scale.

Run: ``python bench/milp_ablation.py [--formulation-sizes 12,16,20,24,32] [--formulation-seeds 3]
[--formulation-time-limit 10] [--time-limit 20] [--scale-sizes 3000,20000,50000] [--scale-budget 120]``
(about 12 minutes on 2 cores with the defaults).

1. Formulations: ``paper`` and ``strong`` on the same instances (several seeds per size) and
   the same warm start (HEFT's plan), one HiGHS thread: binaries, constraints, time to optimum
   or the gap left at the time limit, and a summary per size (solved count, mean gap, geometric
   mean of paper's time over strong's); the strong plan's simulated makespan next to its objective.
2. Whole model vs window search at equal budget on growing graphs: where one model stops
   paying (``FULL_MODEL_MAX_TASKS`` in :mod:`moirai.planning.placers.milp`).
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
from typing import NamedTuple

import numpy as np
from rich.console import Console
from rich.table import Table

from moirai.planning.placers import get_placer, place
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate
from moirai.planning.solve.model import build_model
from moirai.planning.solve.solver import SolverSettings, solve_model
from moirai.planning.solve.warm_start import plan_from_times
from moirai.planning.solve.window import whole_problem
from moirai.testing import random_layered_problem


class FormulationRun(NamedTuple):
    binaries: int
    constraints: int
    solve_s: float
    optimal: bool
    objective_s: float
    bound_s: float
    simulated_s: float

    @property
    def gap(self) -> float:
        return max(0.0, self.objective_s - self.bound_s) / self.objective_s

    def outcome(self) -> str:
        """``3.2 s`` when solved to optimality, else the gap left at the time limit."""
        return f"{self.solve_s:.1f} s" if self.optimal else f"gap {self.gap:.1%}"


def run_formulation(problem: Problem, formulation: str, time_limit_s: float) -> FormulationRun:
    """Solve the whole model in ``formulation`` from HEFT's plan (one thread); simulate the plan it returns."""
    start = simulate(problem, get_placer("heft")(problem))
    built = build_model(problem, whole_problem(problem, start.makespan_s), formulation)
    settings = SolverSettings(time_limit_s=time_limit_s, mip_gap=1e-6, threads=1)
    solution = solve_model(built, settings, start)
    n = problem.num_tasks
    placement = np.array([solution.placement[i] for i in range(n)])
    starts = np.array([solution.start_s[i] for i in range(n)])
    plan = plan_from_times(problem, placement, starts, solution.transfer_start_s, "milp")
    return FormulationRun(
        built.size.binaries,
        built.size.constraints,
        min(solution.solve_s, time_limit_s),
        solution.optimal,
        solution.objective_s,
        max(solution.bound_s or 0.0, 0.0),
        simulate(problem, plan).makespan_s,
    )


def formulation_table(sizes: list[int], seeds: int, devices: int, time_limit_s: float) -> Table:
    """Paper vs strong on ``seeds`` instances per size: time to optimum, or the gap left at the limit.

    The summary rows give the geometric mean of paper's time over strong's (an unsolved run counts
    as the time limit, so the ratio understates the winner's lead) and the mean gap at the limit.
    """
    table = Table(
        title=f"paper vs strong formulation: HiGHS, 1 thread, {time_limit_s:.0f} s limit, HEFT warm start; "
        "time to optimum or gap left"
    )
    for column in (
        "tasks",
        "seed",
        "binaries paper/strong",
        "rows paper/strong",
        "paper",
        "strong",
        "time paper/strong",
        "objective ms paper/strong",
        "strong simulated ms",
    ):
        table.add_column(column, justify="right")
    all_runs: list[tuple[FormulationRun, FormulationRun]] = []
    for n in sizes:
        runs = []
        for seed in range(seeds):
            problem = random_layered_problem(n, devices, seed=seed)
            paper, strong = (run_formulation(problem, f, time_limit_s) for f in ("paper", "strong"))
            runs.append((paper, strong))
            table.add_row(
                str(n),
                str(seed),
                f"{paper.binaries:,} / {strong.binaries:,}",
                f"{paper.constraints:,} / {strong.constraints:,}",
                paper.outcome(),
                strong.outcome(),
                f"{paper.solve_s / strong.solve_s:.2f}",
                f"{paper.objective_s * 1e3:.4f} / {strong.objective_s * 1e3:.4f}",
                f"{strong.simulated_s * 1e3:.4f}",
            )
        table.add_row(*_summary_cells(f"{n}: all", runs), end_section=True)
        all_runs += runs
    table.add_row(*_summary_cells("all sizes", all_runs), style="bold")
    return table


def _summary_cells(label: str, runs: list[tuple[FormulationRun, FormulationRun]]) -> list[str]:
    ratios = [paper.solve_s / strong.solve_s for paper, strong in runs]
    paper_gap = float(np.mean([paper.gap for paper, _ in runs]))
    strong_gap = float(np.mean([strong.gap for _, strong in runs]))
    return [
        label,
        "",
        "",
        "",
        f"{sum(p.optimal for p, _ in runs)}/{len(runs)} solved, gap {paper_gap:.1%}",
        f"{sum(s.optimal for _, s in runs)}/{len(runs)} solved, gap {strong_gap:.1%}",
        f"{np.exp(np.mean(np.log(ratios))):.2f} geo. mean",
        "",
        "",
    ]


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
        best = min(plans["full"].report.heuristics.values())
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
        heuristics = plan.report.heuristics
        best_name = min(heuristics, key=heuristics.get)
        best = heuristics[best_name]
        table.add_row(
            f"{n:,}",
            best_name,
            f"{best * 1e3:.3f}",
            f"{plan.makespan_s * 1e3:.3f}",
            f"{(1 - plan.makespan_s / best):.2%}",
            f"{plan.report.windows_tried} / {plan.report.windows_improved}",
            f"{wall:.1f}",
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve")
    parser.add_argument("--formulation-sizes", default="12,16,20,24,32")
    parser.add_argument("--formulation-seeds", type=int, default=3, help="instances per size")
    parser.add_argument("--formulation-time-limit", type=float, default=10.0, help="seconds per formulation solve")
    parser.add_argument("--strategy-sizes", default="20,40,80")
    parser.add_argument("--scale-sizes", default="3000,20000,50000")
    parser.add_argument("--scale-budget", type=float, default=120.0)
    parser.add_argument("--devices", type=int, default=3)
    args = parser.parse_args()

    def sizes(text: str) -> list[int]:
        return [int(s) for s in text.split(",") if s]

    console = Console(width=160)
    if sizes(args.formulation_sizes):
        console.print(
            formulation_table(
                sizes(args.formulation_sizes), args.formulation_seeds, args.devices, args.formulation_time_limit
            )
        )
    if sizes(args.strategy_sizes):
        console.print(strategy_table(sizes(args.strategy_sizes), args.devices, args.time_limit))
    if sizes(args.scale_sizes):
        console.print(scale_table(sizes(args.scale_sizes), args.devices + 1, args.scale_budget))


if __name__ == "__main__":
    main()
