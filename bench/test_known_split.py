"""The layered family whose best throughput is known: the split it is built around reaches the load bound."""

from __future__ import annotations

import pytest

from bench.known_split import STAGE_S, known_split_problem
from moirai.planning.objective import Throughput
from moirai.planning.placers import place


@pytest.mark.parametrize(("num_tasks", "num_devices", "seed"), [(200, 4, 0), (500, 14, 1), (2000, 9, 2)])
def test_the_built_split_meets_the_load_bound_so_it_is_optimal(num_tasks, num_devices, seed):
    family = known_split_problem(num_tasks, num_devices, seed)
    assert family.problem.num_tasks == num_tasks
    assert sorted(set(family.split.placement.tolist())) == list(range(num_devices))
    assert family.optimum_s == pytest.approx(STAGE_S, rel=1e-9)
    assert Throughput().lower_bound_s(family.problem) == pytest.approx(family.optimum_s, rel=1e-6)


def test_contiguous_finds_the_known_optimum():
    family = known_split_problem(120, 4, seed=3)
    plan = place(family.problem, "contiguous", objective="throughput")
    assert plan.objective_s == pytest.approx(family.optimum_s, rel=1e-9)


def test_contiguous_finds_the_known_optimum_of_a_thousand_tasks_on_eight_devices_under_its_first_cap():
    """The optimum is the lower bound, so the first capped search finds it (the DP without caps took 76 s)."""
    family = known_split_problem(1000, 8, seed=0)
    plan = place(family.problem, "contiguous", objective="throughput")
    assert plan.objective_s == pytest.approx(family.optimum_s, rel=1e-9)
    assert plan.report.notes["searches"] == 1
