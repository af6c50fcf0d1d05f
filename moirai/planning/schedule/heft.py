"""HEFT's insertion list scheduling (the ``heft`` placer, :mod:`moirai.planning.placers.heft`), here so that the milp
placer's start plans (:mod:`moirai.planning.solve.start_plans`) use the same schedule without importing a placer."""

from __future__ import annotations

import heapq

import numpy as np

from moirai.planning.bounds import memory_error
from moirai.planning.clock import deadline_passed
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import PlacerReport
from moirai.planning.schedule.builder import ScheduleBuilder


class DeadlinePassed(Exception):  # noqa: N818 - not an error: the caller's budget ran out first
    """:func:`heft_schedule` stopped part way because its ``deadline`` passed."""


def upward_rank_mean_costs(problem: Problem) -> np.ndarray:
    """HEFT's ``rank_u`` from mean compute and mean transfer times."""
    tensor, _ = problem.consumer_pairs
    return problem.longest_path_to_sink_s(problem.mean_compute_s, problem.mean_transfer_s[tensor])


def heft_schedule(
    problem: Problem,
    priority: np.ndarray,
    lookahead_s: np.ndarray | None = None,
    contention: bool = True,
    placer: str = "heft",
    deadline: float | None = None,
) -> Plan:
    """Insertion list scheduling: the ready task (all its producers placed) of highest ``priority`` first
    (ties: topological position), each on the device, among those with room for it, minimising its finish
    time plus ``lookahead_s[task, device]`` (none: HEFT's choice).

    Raises :class:`InfeasibleError` when a task fits on no device any more (memory only fills up), and
    :class:`DeadlinePassed` when ``deadline`` (a ``time.perf_counter`` value) passes before the schedule is done: a
    search's round on a loaded machine can take several times its usual time, and its budget is the caller's.
    """
    n, k = problem.num_tasks, problem.num_devices
    position = problem.topological_position
    schedule = ScheduleBuilder(problem, insertion=True, contention=contention)
    lookahead = np.zeros((n, k)).tolist() if lookahead_s is None else lookahead_s.tolist()
    missing_inputs = [len(p) for p in problem.predecessors]
    ready = [(-priority[u], position[u], u) for u in range(n) if not missing_inputs[u]]
    heapq.heapify(ready)
    scheduled = 0
    while ready:
        scheduled += 1
        if deadline_passed(deadline, scheduled):
            raise DeadlinePassed(f"{scheduled - 1} of {n} tasks scheduled")
        u = heapq.heappop(ready)[2]
        best: tuple[float, int] | None = None
        for d in range(k):
            if not schedule.fits(u, d):
                continue
            ready_s, seconds = schedule.ready_and_busy_s(u, d)
            start = schedule.device_slot(d, ready_s, seconds)[0]
            score = start + seconds + lookahead[u][d]
            if best is None or score < best[0]:
                best = (score, d)
        if best is None:
            raise memory_error(problem, placer, u, np.array(schedule.memory_used_bytes))
        schedule.book(u, best[1])
        for successor in problem.successors[u]:
            missing_inputs[successor] -= 1
            if not missing_inputs[successor]:
                heapq.heappush(ready, (-priority[successor], position[successor], successor))
    return Plan(
        np.array(schedule.placement, int),
        problem.device_names,
        order=tuple(tuple(tasks) for tasks in schedule.order),
        transfer_order=schedule.transfer_order() if contention else None,
        placer=placer,
        report=PlacerReport(predicted_makespan_s=schedule.makespan_s, contention=contention),
    )
