"""Chain moves: a run of tasks moved to another device at once, kept only when the simulator confirms a gain."""

from __future__ import annotations

import time

import numpy as np
import pytest

from moirai.planning.objective import LATENCY
from moirai.planning.placers import place
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate
from moirai.planning.solve.chain_moves import improve_by_chains
from moirai.testing import random_layered_problem


def chain_problem(fast_device_capacity_bytes: float = np.inf) -> Problem:
    """a -> b -> c -> d: 1 s each on device 0, 2 s on device 1; every tensor takes 5 s to cross."""
    n = 4
    transfer = np.full((n - 1, 2, 2), 5.0)
    transfer[:, [0, 1], [0, 1]] = 0.0
    return Problem(
        device_names=("fast", "slow"),
        memory_capacity_bytes=np.array([fast_device_capacity_bytes, np.inf]),
        task_names=tuple("abcd"),
        compute_s=np.tile([1.0, 2.0], (n, 1)),
        memory_bytes=np.ones(n),
        tensor_names=("a", "b", "c"),
        tensor_producer=np.arange(n - 1),
        tensor_consumers=((1,), (2,), (3,)),
        transfer_s=transfer,
    )


def all_on_slow_device(problem: Problem) -> tuple[Plan, object]:
    plan = Plan(np.ones(problem.num_tasks, int), problem.device_names, placer="start")
    return plan, simulate(problem, plan)


def test_a_whole_chain_moves_where_no_single_task_gains():
    problem = chain_problem()
    plan, timeline = all_on_slow_device(problem)
    assert timeline.makespan_s == 8.0
    for i in range(problem.num_tasks):  # each task alone on the fast device pays two crossings (one at an end)
        alone = timeline.placement.copy()
        alone[i] = 0
        assert simulate(problem, Plan(alone, problem.device_names)).makespan_s > 8.0
    result = improve_by_chains(problem, plan, timeline, time.perf_counter() + 10, LATENCY)
    assert result.timeline.makespan_s == 4.0
    assert result.moves_kept >= 1 and result.converged
    assert result.timeline.makespan_s == simulate(problem, result.plan).makespan_s


def test_chain_moves_keep_plans_within_memory():
    problem = chain_problem(fast_device_capacity_bytes=3.0)  # the whole chain no longer fits the fast device
    plan, timeline = all_on_slow_device(problem)
    result = improve_by_chains(problem, plan, timeline, time.perf_counter() + 10, LATENCY)
    assert result.timeline.fits_memory
    assert result.timeline.makespan_s == 8.0  # three on the fast device and one crossing: 3 + 5 + 2


@pytest.mark.parametrize("seed", range(3))
def test_chain_moves_never_return_a_worse_plan(seed):
    problem = random_layered_problem(120, 3, seed, cpu_ratio=0.3)
    plan = place(problem, "heft")
    timeline = simulate(problem, plan)
    result = improve_by_chains(problem, plan, timeline, time.perf_counter() + 0.5, LATENCY)
    assert result.timeline.makespan_s <= timeline.makespan_s
    assert result.timeline.makespan_s == simulate(problem, result.plan).makespan_s
