"""Properties every registered placer has, parametrised over the registry (a new placer is tested by registering)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest

from moirai.errors import InfeasibleError
from moirai.planning.placers import get_placer, list_placers, place, specs
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate
from moirai.testing import brute_force_optimum, random_problem

# Solver-based placers get a small budget here; their own tests give them more.
OPTIONS = {"pesto": {"time_limit_s": 2.0, "target_tasks": 10}, "milp": {"time_limit_s": 2.0}}
# Placers that ignore memory (round_robin splits by work), as their specs say: they may beat a bound that respects it.
MEMORY_BLIND = {s.name for s in specs() if not s.respects_memory}
GB = 1e9


def test_the_registry_lists_every_placer_module():
    assert {"heft", "m_etf", "m_sct", "getf", "pesto", "milp", "single", "round_robin"} <= set(list_placers())


@pytest.mark.parametrize("placer", list_placers())
def test_plans_are_complete_simulate_as_reported_and_respect_the_bound(placer):
    rng = np.random.default_rng(7)
    for _ in range(3):
        problem = random_problem(rng, 12, 3)
        plan = place(problem, placer, **OPTIONS.get(placer, {}))
        plan.check(problem)
        timeline = simulate(problem, plan)
        assert plan.makespan_s == timeline.makespan_s == plan.objective_s
        assert plan.placer == placer
        assert plan.makespan_s >= plan.lower_bound_s - 1e-9 >= 0
        if plan.report.predicted_makespan_s is not None:
            # The simulator replays a placer's own schedule.
            assert timeline.makespan_s == pytest.approx(plan.report.predicted_makespan_s)


# The placers that build their schedule with moirai.planning.schedule.ScheduleBuilder and report its makespan.
LIST_SCHEDULERS = ["heft", "m_etf", "m_sct", "getf"]


@pytest.mark.parametrize("contention", [True, False])
@pytest.mark.parametrize("placer", LIST_SCHEDULERS)
def test_list_schedulers_predict_the_simulated_makespan_when_messages_take_device_time(placer, contention):
    # Sends lengthen a producer booked before anyone asked for its tensor, a consumer booked later can take over a
    # receive, devices wait for headers and outputs travel to the driver: the simulator times the plan all the same.
    for seed in range(25):
        problem = random_problem(
            seed, 10 + seed % 6, 2 + seed % 3, send_cpu_s=1.0, recv_cpu_s=1.0, header_s=0.5, output_s=1.0
        )
        plan = get_placer(placer)(problem, contention=contention)
        simulated = simulate(problem, plan, contention).makespan_s
        assert math.isclose(plan.report.predicted_makespan_s, simulated, rel_tol=1e-9), (seed, simulated)


@pytest.mark.parametrize("placer", sorted(set(list_placers()) - MEMORY_BLIND))
def test_memory_is_respected_or_the_placer_says_it_cannot(placer):
    rng = np.random.default_rng(11)
    for _ in range(4):
        problem = random_problem(rng, 10, 3, task_memory_bytes=1.0, capacity_bytes=float(rng.integers(3, 8)))
        try:
            plan = place(problem, placer, **OPTIONS.get(placer, {}))
        except InfeasibleError as error:
            assert "needs" in str(error) or "memory" in str(error) or "fits" in str(error)
            continue
        assert simulate(problem, plan).fits_memory


@pytest.mark.parametrize("placer", sorted(set(list_placers()) - MEMORY_BLIND))
def test_a_model_larger_than_the_cluster_is_refused_with_the_numbers(placer):
    problem = random_problem(0, 6, 2, task_memory_bytes=GB, capacity_bytes=2 * GB)  # 6 GB of tasks, 4 GB of devices
    with pytest.raises(InfeasibleError, match=r"needs 6\.0 GB"):
        place(problem, placer, **OPTIONS.get(placer, {}))


def test_pesto_never_sends_a_tensor_between_devices_without_a_link():
    """Infinite transfer times (no link) went into the Pesto ILP's coefficients, and HiGHS refused the model with a
    raw RuntimeError; a row now forbids such a crossing."""
    problem = random_problem(2, num_tasks=6, num_devices=3)
    transfer_s = problem.transfer_s.copy()
    transfer_s[:, 0, 1] = transfer_s[:, 1, 0] = np.inf
    problem = dataclasses.replace(problem, transfer_s=transfer_s)
    plan = place(problem, "pesto", **OPTIONS["pesto"])
    assert plan.objective_s == pytest.approx(simulate(problem, plan).makespan_s)
    assert plan.objective_s == pytest.approx(brute_force_optimum(problem))


@pytest.mark.parametrize(("seed", "a", "b"), [(0, 0, 1), (3, 1, 2), (5, 0, 2)])
def test_pipeline_prices_a_missing_link_without_nan_and_never_sends_across_it(seed, a, b):
    """The running sum of cut prices subtracted Infinity (no link) from Infinity: numpy warned 'invalid value' and
    the cuts' prices were NaN."""
    problem = random_problem(seed, num_tasks=8, num_devices=3)
    transfer_s = problem.transfer_s.copy()
    transfer_s[:, a, b] = transfer_s[:, b, a] = np.inf
    problem = dataclasses.replace(problem, transfer_s=transfer_s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = place(problem, "pipeline", objective="throughput")
    for t, consumers in enumerate(problem.tensor_consumers):
        for c in consumers:
            ends = {int(plan.placement[problem.tensor_producer[t]]), int(plan.placement[c])}
            assert ends != {a, b}, (t, c)
    simulate(problem, plan)  # refuses a plan that sends across a missing link


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_every_placer_places_a_problem_of_no_tasks_as_the_empty_plan(objective):
    """contiguous and pipeline called it infeasible, every other placer returned the empty plan."""
    problem = Problem.from_dict({"devices": [{"name": "d0"}, {"name": "d1"}], "tasks": []})
    for placer in list_placers():
        plan = place(problem, placer, objective=objective, **OPTIONS.get(placer, {}))
        assert plan.placement.size == 0 and plan.objective_s == 0.0, placer


@pytest.mark.parametrize("placer", list_placers())
@pytest.mark.parametrize("problem_of", ["a missing link", "tasks each on one device"])
def test_a_placer_that_finds_no_plan_the_problem_allows_raises_infeasible_not_a_plan_error(placer, problem_of):
    """round_robin, hash, expert and pieces put a tensor between devices with no link (a plan milp finds exists),
    and seven placers a task where it cannot run where no plan exists: each was a PlanError, as if the user's plan
    were wrong. Every placer gives a plan the simulator accepts or an InfeasibleError."""
    no_link = [[0.0, math.inf, 0.1], [math.inf, 0.0, 0.1], [0.1, 0.1, 0.0]]
    no_way = [[0.0, math.inf], [math.inf, 0.0]]
    description = {
        "a missing link": {
            "devices": [{"name": d} for d in "abc"],
            "tasks": [
                {"name": "x", "compute_s": [1, 2, 2]},
                {"name": "y", "compute_s": [3, 1, 3]},
                {"name": "z", "compute_s": [3, 3, 1]},
            ],
            "edges": [{"src": "x", "dst": "y", "transfer_s": no_link}, {"src": "y", "dst": "z", "transfer_s": no_link}],
        },
        "tasks each on one device": {
            "devices": [{"name": d} for d in "ab"],
            "tasks": [{"name": "x", "compute_s": [1, math.inf]}, {"name": "y", "compute_s": [math.inf, 1]}],
            "edges": [{"src": "x", "dst": "y", "transfer_s": no_way}],
        },
    }[problem_of]
    problem = Problem.from_dict(description)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = place(problem, placer, **OPTIONS.get(placer, {}))
        except InfeasibleError:
            return
    simulate(problem, plan)  # the plan is one the problem allows
    assert problem_of == "a missing link", f"{placer} placed a problem no plan fits"
