"""The throughput search's windows: each program's optimum is the best placement of its tasks (brute force, every
cost the period counts), and the window search never returns a plan worse than its start."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from moirai.planning.objective import OBJECTIVES
from moirai.planning.placers import get_placer, place
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import StopReason
from moirai.planning.simulate import simulate
from moirai.planning.solve import period_windows
from moirai.planning.solve.period_search import Loads
from moirai.planning.solve.period_windows import (
    Window,
    devices_acyclic,
    period_lower_bound,
    window_placement,
    window_search,
)
from moirai.testing import EVERY_COST, random_layered_problem, random_problem

THROUGHPUT = OBJECTIVES["throughput"]


def _small(seed: int) -> Problem:
    """Every cost the period counts; odd seeds also hold memory (3 tasks of 1 GB a device at most) and have tasks
    one device cannot run."""
    if seed % 2:
        limits = {"task_memory_bytes": 1e9, "capacity_bytes": 3e9, "forbid_fraction": 0.3}
        return random_problem(seed, 7, 3, **EVERY_COST, **limits)
    return random_problem(seed, 7, 3, **EVERY_COST)


def _placements(problem: Problem, free: list[int], devices: list[int], start: np.ndarray):
    for choice in itertools.product(devices, repeat=len(free)):
        placement = start.copy()
        placement[free] = choice
        runs = np.all(np.isfinite(problem.compute_s[np.arange(problem.num_tasks), placement]))
        held = np.bincount(placement, weights=problem.memory_bytes, minlength=problem.num_devices)
        if runs and np.all(held <= problem.memory_capacity_bytes):
            yield placement


@pytest.mark.parametrize("seed", range(6))
def test_a_window_of_every_task_finds_the_shortest_period(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(period_windows, "_TIE", 0.0)  # the period alone: brute force has no tie to break
    monkeypatch.setattr(period_windows, "WATCHED_LINK_SHARE", 0.0)  # every link counted
    problem = _small(seed)
    start = get_placer("heft")(problem).placement
    loads = Loads(problem, start)
    everything = list(range(problem.num_tasks))
    best_s = min(Loads(problem, p).period_s for p in _placements(problem, everything, [0, 1, 2], start))
    found = window_placement(loads, Window(tuple(everything), None), time_limit_s=30.0)
    assert found.optimal
    assert Loads(problem, found.placement).period_s == pytest.approx(best_s, rel=1e-7)
    assert found.cost_bound * loads.period_s == pytest.approx(best_s, rel=1e-5)  # _TIE is 0 here


@pytest.mark.parametrize("seed", range(8))
def test_the_period_bound_is_never_above_the_shortest_period_and_equals_it_where_proven(seed: int) -> None:
    # The program's tie weight on the loads stays in: the bound divides it out ([Note: the period bound]).
    problem = _small(seed)
    start = get_placer("heft")(problem).placement
    everything = list(range(problem.num_tasks))
    best_s = min(
        simulate(problem, Plan(p, problem.device_names)).period_s
        for p in _placements(problem, everything, [0, 1, 2], start)
    )
    found = period_lower_bound(problem, start, time_limit_s=30.0)
    assert found.optimal
    assert THROUGHPUT.lower_bound_s(problem) * (1 - 1e-12) <= found.bound_s <= best_s * (1 + 1e-12)
    assert found.bound_s == pytest.approx(best_s, rel=1e-3)  # 3 devices: the tie costs at most 0.03%
    assert found.period_s == pytest.approx(best_s, rel=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_the_acyclic_period_bound_is_the_shortest_period_without_a_cycle_between_devices(seed: int) -> None:
    problem = _small(seed)
    start = place(problem, "contiguous", objective="throughput").placement
    assert devices_acyclic(problem, start)
    everything = list(range(problem.num_tasks))
    acyclic = [p for p in _placements(problem, everything, [0, 1, 2], start) if devices_acyclic(problem, p)]
    best_s = min(simulate(problem, Plan(p, problem.device_names)).period_s for p in acyclic)
    found = period_lower_bound(problem, start, time_limit_s=30.0, acyclic=True)
    assert found.optimal and devices_acyclic(problem, found.placement)
    assert found.bound_s <= best_s * (1 + 1e-12) and found.bound_s == pytest.approx(best_s, rel=1e-3)
    timeline = simulate(problem, Plan(found.placement, problem.device_names))
    assert timeline.period_s == pytest.approx(best_s, rel=1e-5)
    assert timeline.served_period_s == timeline.period_s  # no path leaves a device and comes back
    assert found.bound_s >= period_lower_bound(problem, start, time_limit_s=30.0).bound_s * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_devices_acyclic_is_whether_tensors_cross_both_ways_between_two_devices(seed: int) -> None:
    problem = random_problem(seed, 9, 2)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        placement = rng.integers(0, 2, problem.num_tasks)
        crossings = {
            (int(placement[problem.tensor_producer[t]]), int(placement[c]))
            for t, consumers in enumerate(problem.tensor_consumers)
            for c in consumers
        }
        assert devices_acyclic(problem, placement) is not ({(0, 1), (1, 0)} <= crossings)


def test_a_period_bound_stopped_by_its_time_limit_still_holds() -> None:
    problem = random_layered_problem(120, 4, seed=1, cpu_ratio=0.5)
    start = get_placer("pipeline")(problem).placement
    stopped = period_lower_bound(problem, start, time_limit_s=0.05)
    longer = period_lower_bound(problem, start, time_limit_s=3.0)
    plans = [place(problem, placer, objective="throughput") for placer in ("pipeline", "contiguous", "heft")]
    shortest_s = min(simulate(problem, plan).period_s for plan in plans)
    assert stopped.bound_s >= THROUGHPUT.lower_bound_s(problem) * (1 - 1e-12)
    assert stopped.bound_s <= longer.bound_s * (1 + 1e-9) <= min(shortest_s, longer.period_s) * (1 + 1e-9)
    assert longer.period_s <= simulate(problem, Plan(start, problem.device_names)).period_s * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_a_window_between_two_devices_evens_them_and_holds_the_third(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(period_windows, "_TIE", 0.0)
    monkeypatch.setattr(period_windows, "WATCHED_LINK_SHARE", 0.0)
    problem = _small(seed)
    start = get_placer("heft")(problem).placement
    loads = Loads(problem, start)
    a, b = 0, 1
    free = np.flatnonzero((start == a) | (start == b)).tolist()
    if not free:
        pytest.skip("heft left both devices empty")

    def pair_s(placement: np.ndarray) -> float | None:  # the program's objective, None where it holds no bound
        fresh = Loads(problem, placement)
        others = [fresh.device_s[2], *fresh.link_s[[0, 1, 2, 2], [2, 2, 0, 1]]]
        if max(others) > loads.period_s * (1 + 1e-9):
            return None
        return max(fresh.device_s[a], fresh.device_s[b], fresh.link_s[a, b], fresh.link_s[b, a])

    values = [pair_s(p) for p in _placements(problem, free, [a, b], start)]
    best_s = min(v for v in values if v is not None)
    placement, optimal, _ = window_placement(loads, Window(tuple(free), (a, b)), time_limit_s=30.0)
    assert optimal
    assert set(placement[free].tolist()) <= {a, b} and np.array_equal(
        np.delete(placement, free), np.delete(start, free)
    )
    assert pair_s(placement) == pytest.approx(best_s, rel=1e-7)


@pytest.mark.parametrize("seed", range(3))
def test_the_window_search_never_returns_a_longer_period(seed: int) -> None:
    problem = random_layered_problem(60, 4, seed=seed, cpu_ratio=0.5)
    plan = get_placer("pipeline")(problem)
    timeline = simulate(problem, plan)
    result = window_search(problem, plan, timeline, time.perf_counter() + 60.0, 0.0, 0.0, THROUGHPUT)
    assert result.windows > 0
    assert result.timeline.period_s <= timeline.period_s * (1 + 1e-12)
    assert Loads(problem, result.timeline.placement).period_s == pytest.approx(result.timeline.period_s, rel=1e-9)
    # Small pairs solve in well under the deadline: the search stops on a round that keeps nothing.
    assert result.stop_reason is StopReason.NO_IMPROVING_MOVE, result.stop_reason


def test_milp_for_throughput_reports_its_windows() -> None:
    problem = random_layered_problem(80, 4, seed=3, cpu_ratio=0.5)
    plan = place(problem, "milp", objective="throughput", time_limit_s=4.0, progress=False)
    report = plan.report
    assert report.strategy == "period search" and report.windows > 0
    # Judged by the served period, the objective's value (pipeline's plan is one of milp's starts).
    assert THROUGHPUT.value_s(simulate(problem, plan)) <= THROUGHPUT.value_s(
        simulate(problem, Plan(get_placer("pipeline")(problem).placement, problem.device_names))
    ) * (1 + 1e-12)
