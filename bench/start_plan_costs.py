"""Measure how long the milp placer's start plans take here and write ``moirai/data/start_plan_costs.toml``.

Run: ``python bench/start_plan_costs.py [--sizes 1000,3000] [--devices 4] [--out PATH]`` on the machine that
places (a few minutes on 2 cores; ``pipeline`` dominates). Every placer that is a start plan for some objective
(its spec's ``start_plan``) places random layered DAGs (:func:`moirai.testing.random_layered_problem`)
of each size; its cost is the largest, over the sizes, of its seconds per (1,000 tasks) ** 1.4, times a margin.
The simulator's seconds per task and one lookahead round's seconds per 1,000 tasks are measured alike. The milp
placer reads the file (:mod:`moirai.planning.solve.costs`) to start only what its budget has time for.
"""

from __future__ import annotations

import argparse
import importlib.resources
import time
from collections.abc import Callable
from pathlib import Path

from moirai.planning.objective import OBJECTIVES
from moirai.planning.placers import get_placer, start_plans
from moirai.planning.problem import Problem
from moirai.planning.schedule.heft import heft_schedule, upward_rank_mean_costs
from moirai.planning.simulate import simulate
from moirai.planning.solve.costs import COSTS_FILE, SIZE_EXPONENT
from moirai.planning.solve.start_plans import placement_tail
from moirai.testing import random_layered_problem

MARGIN = 1.2  # measured times vary from run to run; a start plan predicted too fast could overrun the budget
ROUND_MARGIN = 1.5  # a round that overruns eats into the window search, so a wider margin


def seconds(work: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    work(*args)
    return time.perf_counter() - started


def lookahead_round_s(problem: Problem) -> float:
    """One lookahead round as :func:`moirai.planning.solve.start_plans.improve_start_plan` runs it."""
    start = simulate(problem, get_placer("heft")(problem))
    priority = upward_rank_mean_costs(problem)
    tail = placement_tail(problem, start.placement)
    return seconds(lambda: simulate(problem, heft_schedule(problem, priority, 0.8 * tail)))


def measure(sizes: list[int], devices: int) -> dict[str, object]:
    names = sorted({s.name: s.start_plan for o in OBJECTIVES for s in start_plans(o)}.items(), key=lambda x: x[1])
    per_placer: dict[str, float] = {}
    simulate_s = round_s = 0.0
    for n in sizes:
        problem = random_layered_problem(n, devices, seed=n)
        scale = (n / 1000) ** SIZE_EXPONENT
        for name, _ in names:
            plan_s = seconds(get_placer(name), problem)
            per_placer[name] = max(per_placer.get(name, 0.0), plan_s / scale)
            print(f"{n} tasks: {name} {plan_s:.3f} s")
        plan = get_placer("heft")(problem)
        simulate_s = max(simulate_s, seconds(simulate, problem, plan) / n)
        round_s = max(round_s, lookahead_round_s(problem) / (n / 1000))
    return {
        "simulate_s_per_task": float(f"{simulate_s * MARGIN:.2g}"),
        "lookahead_round_s_per_1000_tasks": float(f"{round_s * ROUND_MARGIN:.2g}"),
        "start_plan_s": {name: float(f"{s * MARGIN:.2g}") for name, s in per_placer.items()},
    }


def toml_text(costs: dict[str, object], sizes: list[int], devices: int) -> str:
    """The data file: flat numbers and one table of numbers by placer (all TOML this needs)."""
    lines = [
        "# Measured times of the milp placer's start plans, written by bench/start_plan_costs.py (do not edit by hand:",
        "# rerun it on the machine that places). Read by moirai/planning/solve/costs.py.",
        f"# Measured on {time.strftime('%Y-%m-%d')}: random layered graphs of {sizes} tasks on {devices} devices,",
        f"# times a margin of {MARGIN} ({ROUND_MARGIN} for lookahead rounds).",
        "",
        "# Seconds one simulation takes per task.",
        f"simulate_s_per_task = {costs['simulate_s_per_task']!r}",
        "# Seconds one lookahead round (a HEFT schedule with a tail and its simulation) takes per 1,000 tasks.",
        f"lookahead_round_s_per_1000_tasks = {costs['lookahead_round_s_per_1000_tasks']!r}",
        "",
        "# Seconds per (1,000 tasks)^1.4 each start-plan placer takes; a placer missing here is assumed instant.",
        "[start_plan_s]",
        *(f"{name} = {value!r}" for name, value in costs["start_plan_s"].items()),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,3000", help="tasks per measured graph, comma-separated")
    parser.add_argument("--devices", type=int, default=4)
    default_out = Path(str(importlib.resources.files("moirai").joinpath("data", COSTS_FILE)))
    parser.add_argument("--out", type=Path, default=default_out, help=f"default: {default_out}")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    args.out.write_text(toml_text(measure(sizes, args.devices), sizes, args.devices), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
