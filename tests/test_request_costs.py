"""RequestCosts, the one value of a problem's per-request runtime costs, and PERIOD_TERMS, its charge rules."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from moirai.errors import MoiraiError, ProblemError
from moirai.planning.costs import PERIOD_TERMS, RequestCosts
from moirai.planning.objective import Latency, Objective, Throughput
from moirai.planning.placers import get_placer
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.schedule import runtime_cpu_s
from moirai.planning.simulate import simulate
from moirai.planning.solve.model import build_model
from moirai.planning.solve.solver import SolverSettings, solve_model
from moirai.planning.solve.window import whole_problem
from moirai.testing import random_problem


def _charged_before(problem: Problem, placement: np.ndarray) -> np.ndarray:
    """The charge rule as runtime_cpu_s spelled it out before the terms (the reference the terms must match)."""
    costs, k = problem.costs, problem.num_devices
    taking_part = np.bincount(placement, minlength=k) > 0
    taking_part[0] = True
    tasks = np.arange(problem.num_tasks)
    seconds = np.where(taking_part, costs.request_cpu_s, 0.0)
    seconds[0] += costs.driver_part_cpu_s[1:][taking_part[1:]].sum()
    seconds += np.bincount(placement, weights=costs.output_send_cpu_s[tasks, placement], minlength=k)
    seconds[0] += costs.output_recv_cpu_s[tasks, placement].sum()
    for j, readers in enumerate(costs.input_readers):  # once per model input and device that reads it
        for d in set(placement[list(readers)].tolist()):
            seconds[d] += costs.input_recv_cpu_s[j, d]
            seconds[0] += costs.input_send_cpu_s[j, d]
    return seconds


def _costly(seed: int) -> Problem:
    return random_problem(
        seed, header_s=1.0, output_s=1.0, request_cpu_s=0.5, output_cpu_s=0.5, input_s=1.0, driver_part_cpu_s=0.5
    )


def test_a_problem_round_trips_its_costs_through_json(tmp_path):
    problem = _costly(3)
    path = tmp_path / "problem.json"
    problem.to_json(path)
    again = Problem.from_json(path)
    for name, value in problem.costs.to_arrays().items():
        assert getattr(again.costs, name).tolist() == value.tolist(), name
    assert again.costs.input_readers == problem.costs.input_readers and problem.costs.num_inputs == 2
    assert "request_costs" in json.loads(path.read_text())


def test_old_problem_files_with_flat_keys_still_load():
    old = {
        "devices": [{"name": "a", "header_s": 0.0, "request_cpu_s": 0.1}, {"name": "b", "header_s": 0.75}],
        "tasks": [
            {"name": "x", "compute_s": [1.0, 1.0], "output_s": [0.0, 0.5], "output_recv_cpu_s": [0.0, 0.25]},
            {"name": "y", "compute_s": [1.0, 1.0]},
        ],
        "edges": [{"src": "x", "dst": "y", "transfer_s": [[0, 1], [1, 0]]}],
    }
    costs = Problem.from_dict(old).costs
    assert costs.header_s.tolist() == [0.0, 0.75]
    assert costs.request_cpu_s.tolist() == [0.1, 0.0]
    assert costs.output_s.tolist() == [[0.0, 0.5], [0.0, 0.0]]
    assert costs.output_recv_cpu_s.tolist() == [[0.0, 0.25], [0.0, 0.0]]
    assert not costs.output_send_cpu_s.any()


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"header_s": [0.0, -1.0]}, "header_s"),
        ({"request_cpu_s": [0.0, np.nan]}, "request_cpu_s"),
        ({"output_s": [[0.0, np.inf], [0.0, 0.0], [0.0, 0.0]]}, "output_s"),
        ({"output_send_cpu_s": [0.0, 1.0]}, "output_send_cpu_s must hold 3 x 2"),
        ({"header_seconds": [0.0, 1.0]}, "unknown per-request costs"),
    ],
)
def test_bad_costs_are_problem_errors_that_name_the_cost(given, message):
    with pytest.raises(ProblemError, match=message):
        RequestCosts.build(3, 2, **given)


def test_costs_for_another_shape_of_problem_are_refused():
    problem = random_problem(0, num_tasks=5, num_devices=2)
    with pytest.raises(ProblemError, match="costs are for 4 tasks on 2 devices"):
        dataclasses.replace(problem, costs=RequestCosts.zeros(4, 2))


def test_merge_and_stream_copies_keep_what_they_must():
    costs = _costly(5).costs
    merged = costs.merge([[0, 1], list(range(2, costs.num_tasks))])
    assert merged.output_s.tolist() == [costs.output_s[:2].sum(0).tolist(), costs.output_s[2:].sum(0).tolist()]
    assert merged.header_s.tolist() == costs.header_s.tolist()
    stream = costs.for_stream(3)
    assert stream.output_s.tolist() == np.tile(costs.output_s, (3, 1)).tolist()
    assert not stream.request_cpu_s.any() and not stream.output_recv_cpu_s.any()


@pytest.mark.parametrize("seed", range(6))
def test_the_terms_charge_what_the_rule_charged_before(seed):
    problem = _costly(seed)
    assert problem.costs.output_recv_cpu_s.any() and problem.costs.request_cpu_s.any()
    for placement in itertools.product(range(problem.num_devices), repeat=problem.num_tasks):
        placement = np.array(placement)
        np.testing.assert_allclose(runtime_cpu_s(problem, placement), _charged_before(problem, placement), rtol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_the_milp_period_rows_charge_what_the_simulator_charges(seed):
    """With every task fixed to a placement, the MILP's least device period equals the simulator's, charges
    included (links carry nothing, so the busiest device sets the period)."""
    problem = _costly(seed)
    problem = dataclasses.replace(problem, transfer_s=np.zeros_like(problem.transfer_s))
    for placement in [np.zeros(problem.num_tasks, int), np.arange(problem.num_tasks) % problem.num_devices]:
        timeline = simulate(problem, Plan(placement, problem.device_names))
        built = build_model(problem, whole_problem(problem, 10 * timeline.makespan_s + 10), objective=Throughput())
        for (i, k), var in built.model.x.items():
            built.model.constraints.add(var == float(placement[i] == k))
        solution = solve_model(built, SolverSettings(time_limit_s=60.0, mip_gap=1e-9), timeline)
        assert solution.objective_s == pytest.approx(timeline.period_s, rel=1e-6)


def test_the_pipeline_dp_charges_the_outputs_receive_on_device_0():
    problem = Problem.from_dict(
        {
            "devices": [{"name": "d0"}, {"name": "d1"}],
            "tasks": [{"name": "a", "compute_s": [1.0, 1.0]}, {"name": "b", "compute_s": [1.0, 1.0]}],
            "edges": [{"src": "a", "dst": "b", "transfer_s": [[0, 0], [0, 0]]}],
        }
    ).with_costs(output_recv_cpu_s=[[0.0, 0.0], [0.0, 5.0]])
    plan = get_placer("pipeline")(problem)
    timeline = simulate(problem, plan)
    # Putting b on d1 would charge d0 5 s per request for its output: the DP sees it and keeps b on d0.
    assert plan.placement[1] == 0
    assert plan.report.notes["dp_period_s"] == pytest.approx(timeline.period_s)


def test_period_terms_are_small_classes_of_one_rule_each():
    assert len({type(term) for term in PERIOD_TERMS}) == len(PERIOD_TERMS)
    total = sum(
        (term.charges(_costly(1).costs) for term in PERIOD_TERMS[1:]), PERIOD_TERMS[0].charges(_costly(1).costs)
    )
    charges = _costly(1).costs.charges
    assert charges.input_readers == total.input_readers
    for mine, summed in zip(charges[:-1], total[:-1], strict=True):
        assert mine.tolist() == summed.tolist()


def test_an_objective_without_milp_rows_says_so():
    class Energy(Latency):
        name = "energy"

        def milp_rows(self):  # an objective that has not written its rows yet
            return Objective.milp_rows(self)

    with pytest.raises(MoiraiError, match="no rows for objective 'energy'"):
        build_model(_costly(0), whole_problem(_costly(0), 100.0), objective=Energy())


def test_no_caller_branches_on_the_objective_name():
    pattern = r'objective.name ==\|\.name == "latency"\|\.name == "throughput"\|hasattr(m, "P")'
    root = Path(__file__).resolve().parents[1]
    found = subprocess.run(["grep", "-rn", pattern, "moirai"], cwd=root, capture_output=True, text=True).stdout
    found = found.splitlines()
    assert [line for line in found if not line.startswith("moirai/planning/objective.py")] == []


def test_the_driver_is_charged_for_another_device_only_when_that_device_takes_part():
    """A plan on device 0 alone sends no header and takes no status: the driver's work for another rank
    (driver_part_cpu_s) is charged to device 0 once per other device with a task, never for device 0 itself."""
    problem = random_problem(0, num_tasks=4, num_devices=3).with_costs(
        request_cpu_s=[0.5, 0.25, 0.125], driver_part_cpu_s=[9.0, 1.0, 2.0]
    )
    assert runtime_cpu_s(problem, np.array([0, 0, 0, 0])).tolist() == [0.5, 0.0, 0.0]
    assert runtime_cpu_s(problem, np.array([0, 1, 1, 0])).tolist() == [1.5, 0.25, 0.0]
    assert runtime_cpu_s(problem, np.array([2, 1, 1, 2])).tolist() == [3.5, 0.25, 0.125]
