"""The strong MILP formulation: every row it adds is valid, and its LP bound is no weaker than the paper's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyomo.environ as pyo
import pytest

from moirai.errors import InfeasibleError
from moirai.planning.bounds import lower_bound
from moirai.planning.highs import run_highs
from moirai.planning.placers import place
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.simulate import Timeline, simulate
from moirai.planning.solve.model import MilpModel, build_model
from moirai.planning.solve.solver import SolverSettings, solve_model
from moirai.planning.solve.warm_start import plan_from_times, warm_start_values
from moirai.planning.solve.window import whole_problem
from moirai.testing import random_layered_problem, random_problem

TOLERANCE = 1e-6  # model time units (the horizon is 1000)


def random_plans(problem: Problem, count: int, seed: int) -> list[Plan]:
    """HEFT's plan, everything on one device (for each device), and ``count`` random placements,
    list-scheduled by the simulator."""
    rng = np.random.default_rng(seed)
    plans = [place(problem, "heft")]
    plans += [Plan(np.full(problem.num_tasks, k), problem.device_names) for k in range(problem.num_devices)]
    for _ in range(count):
        placement = rng.integers(0, problem.num_devices, problem.num_tasks)
        plans.append(Plan(placement, problem.device_names))
    return plans


def violated_rows(built: MilpModel, timeline: Timeline) -> list[str]:
    """Rows and variable bounds of ``built`` that the schedule in ``timeline`` breaks."""
    m = built.model
    values = warm_start_values(built, timeline)
    for var, value in values.items():
        var.set_value(value, skip_validation=True)
    broken = []
    for var in m.component_data_objects(pyo.Var):
        if var.value is None:
            broken.append(f"{var.name} has no value")
        elif (var.lb is not None and var.value < var.lb - TOLERANCE) or (
            var.ub is not None and var.value > var.ub + TOLERANCE
        ):
            broken.append(f"{var.name}={var.value} outside [{var.lb}, {var.ub}]")
    for row in m.component_data_objects(pyo.Constraint):
        body = pyo.value(row.body)
        if (row.has_lb() and body < pyo.value(row.lower) - TOLERANCE) or (
            row.has_ub() and body > pyo.value(row.upper) + TOLERANCE
        ):
            broken.append(f"{row.expr} at {body}")
    return broken


@pytest.mark.parametrize("formulation", ["strong", "paper"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("instances", ["small", "layered", "small_with_send_cpu", "layered_with_send_cpu"])
def test_every_feasible_schedule_satisfies_every_row(formulation, seed, instances):
    """A cut, window or fixed variable that removes a schedule within the horizon would be invalid (also when
    transfers keep their sender busy, which lengthens producers and which the bounds leave out)."""
    if instances.startswith("small"):
        problem = random_problem(seed + 20, send_cpu_s=1.0 if instances.endswith("send_cpu") else 0.0)
    else:
        problem = random_layered_problem(12, 3, seed=seed)
        if instances.endswith("send_cpu"):
            sender = np.random.default_rng(seed).uniform(0.0, 0.3, problem.transfer_s.shape) * (problem.transfer_s > 0)
            problem = replace(problem, send_cpu_s=sender)
    for plan in random_plans(problem, 6, seed):
        timeline = simulate(problem, plan)
        for slack in (1.0, 1.3):  # the horizon equal to the schedule's makespan, and above it
            built = build_model(problem, whole_problem(problem, timeline.makespan_s * slack), formulation)
            assert violated_rows(built, timeline) == [], (seed, plan.placement)


def lp_bound_s(problem: Problem, formulation: str) -> float:
    horizon = simulate(problem, place(problem, "heft")).makespan_s
    built = build_model(problem, whole_problem(problem, horizon), formulation)
    pyo.TransformationFactory("core.relax_integer_vars").apply_to(built.model)
    outcome = run_highs(built.model, None, time_limit_s=30, threads=1)
    assert outcome.optimal, outcome.status
    return outcome.value(built.model.T) * built.unit_s


def test_strong_lp_bound_is_at_least_the_papers_and_the_combinatorial_bound(monkeypatch):
    """The combinatorial bound here counts each task's producers only: the term over all its ancestors
    (bounds._Ancestors) can go beyond the LP, as on (24, 1)."""
    import moirai.planning.bounds as bounds

    gains = []
    for n, seed in ((12, 0), (16, 1), (24, 0), (24, 1)):
        problem = random_layered_problem(n, 3, seed=seed)
        strong, paper = lp_bound_s(problem, "strong"), lp_bound_s(problem, "paper")
        assert strong >= paper * (1 - 1e-6), (n, seed)
        with monkeypatch.context() as patch:
            patch.setattr(bounds, "_ANCESTORS_MAX_TASKS", 0)
            producers_only = max(
                bounds._critical_path_bound(problem, bounds.earliest_finish_s(problem)), bounds._load_bound(problem)
            )
        assert strong >= producers_only * (1 - 1e-6), (n, seed)
        assert lower_bound(problem) >= producers_only
        gains.append(strong / paper)
    assert max(gains) > 1.01  # the cuts raise the bound somewhere, not just keep it


def optimum_s(problem: Problem, formulation: str) -> float:
    timeline = simulate(problem, place(problem, "heft"))
    built = build_model(problem, whole_problem(problem, timeline.makespan_s), formulation)
    solution = solve_model(built, SolverSettings(time_limit_s=60, mip_gap=0.0, threads=1), timeline)
    assert solution.optimal, solution.status
    return solution.objective_s


@pytest.mark.parametrize("seed", range(3))
def test_chain_load_cuts_and_device_fixing_keep_the_optimum(monkeypatch, seed):
    """Too large for brute force: the strong optimum equals the paper's and the one without the cuts."""
    problem = random_layered_problem(10, 3, seed=seed)
    strong = optimum_s(problem, "strong")
    assert strong == pytest.approx(optimum_s(problem, "paper"), rel=1e-6)
    import moirai.planning.solve.cuts as cuts
    import moirai.planning.solve.formulation as formulation

    monkeypatch.setattr(cuts, "add_chain_load_cuts", lambda *args: None)
    monkeypatch.setattr(formulation, "devices_in_time", lambda problem, allowed, *windows: allowed)
    monkeypatch.setattr(cuts, "add_device_load_cuts", lambda *args: None)
    assert strong == pytest.approx(optimum_s(problem, "strong"), rel=1e-6)


def test_a_device_too_slow_to_finish_inside_the_horizon_is_never_offered():
    problem = random_layered_problem(8, 3, seed=2)
    horizon = simulate(problem, place(problem, "heft")).makespan_s
    compute = problem.compute_s.copy()
    compute[3, 1] = 2 * horizon
    slow = Problem(
        device_names=problem.device_names,
        memory_capacity_bytes=problem.memory_capacity_bytes,
        task_names=problem.task_names,
        compute_s=compute,
        memory_bytes=problem.memory_bytes,
        tensor_names=problem.tensor_names,
        tensor_producer=problem.tensor_producer,
        tensor_consumers=problem.tensor_consumers,
        transfer_s=problem.transfer_s,
    )
    strong = build_model(slow, whole_problem(slow, horizon), "strong")
    paper = build_model(slow, whole_problem(slow, horizon), "paper")
    assert (3, 1) not in strong.model.x
    assert (3, 1) in paper.model.x
    assert optimum_s(slow, "strong") == pytest.approx(optimum_s(slow, "paper"), rel=1e-6)


def test_the_papers_optimal_schedule_satisfies_every_strong_row():
    """Optimal schedules are where an invalid cut bites: the paper's optimum must be feasible for the strong model."""
    for seed in range(20, 40):
        problem = random_problem(seed)
        start = simulate(problem, place(problem, "heft"))
        built = build_model(problem, whole_problem(problem, start.makespan_s), "paper")
        solution = solve_model(built, SolverSettings(time_limit_s=30, mip_gap=0.0, threads=1), start)
        assert solution.optimal, (seed, solution.status)
        n = problem.num_tasks
        placement = np.array([solution.placement[i] for i in range(n)])
        starts = np.array([solution.start_s[i] for i in range(n)])
        optimum = simulate(problem, plan_from_times(problem, placement, starts, solution.transfer_start_s, "paper"))
        for horizon in (optimum.makespan_s, start.makespan_s):  # a horizon above the optimum keeps more devices
            strong = build_model(problem, whole_problem(problem, horizon), "strong")
            assert violated_rows(strong, optimum) == [], seed


def test_a_horizon_that_narrowing_leaves_a_task_no_device_under_is_infeasible():
    """A round of narrowing can empty a task's devices; the next round must not run (it took a minimum over none)."""
    problem = random_problem(47, num_tasks=5, num_devices=2, slowdown=1.5)  # latency optimum about 5.82 s
    for horizon in np.linspace(2.5, 5.8, 34):
        with pytest.raises(InfeasibleError, match="cannot finish on any device within the horizon"):
            build_model(problem, whole_problem(problem, horizon), "strong")
