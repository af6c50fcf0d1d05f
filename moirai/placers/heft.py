"""``heft``: Heterogeneous Earliest Finish Time (Topcuoglu, Hariri and Wu, IEEE TPDS 2002), insertion-based.

Task prioritising: upward rank from average costs, ``rank(i) = w̄_i + max_j (c̄_ij + rank(j))``,
where ``w̄_i`` is the task's mean time over the devices that can run it and ``c̄_ij`` the mean
transfer time of the tensor over every ordered pair of distinct devices. Tasks are taken by
decreasing rank (ties: topological position, so the list is a topological order).

Processor selection: each task goes to the device where it finishes earliest, starting in the
earliest idle slot of that device long enough for it after its inputs arrive (insertion
policy); ties go to the lower device index. Two extensions make the schedule the simulator's:

* communication follows :mod:`moirai.simulate`: a tensor crosses to a device once (a later
  consumer there reuses it), and with ``contention=True`` (the default) a transfer also needs
  an idle slot on its directed link, found with the same insertion rule (inputs of one task on
  one link are booked in the order their producers finish). ``contention=False`` is the paper's
  model: a transfer starts as soon as its producer finishes.
* memory: a device is a candidate only while it has room for the task (static memory model).

:func:`heft_schedule` takes the priority and an optional lookahead (a per task and device time added
to the finish time when choosing the device), so the milp placer's start plans
(:mod:`moirai.solve.start_plans`) are this same schedule with a tail added.

The plan carries every device's order and, with contention, every link's transfer order, so
the simulator replays the schedule HEFT built: its makespan equals ``info["predicted_makespan_s"]``
under the same ``contention`` setting.
"""

from __future__ import annotations

import heapq

import numpy as np

from moirai.bounds import check_memory_feasible
from moirai.placers import register
from moirai.placers._list_scheduling import memory_error
from moirai.problem import Plan, Problem
from moirai.schedule import ScheduleBuilder


def upward_rank_mean_costs(problem: Problem) -> np.ndarray:
    """HEFT's ``rank_u`` from mean compute and mean transfer times."""
    finite = np.isfinite(problem.compute_s)
    mean_compute = np.where(finite, problem.compute_s, 0.0).sum(axis=1) / np.maximum(finite.sum(axis=1), 1)
    k = problem.num_devices
    off_diagonal = ~np.eye(k, dtype=bool)
    mean_transfer = problem.transfer_s[:, off_diagonal].mean(axis=1) if k > 1 else np.zeros(problem.num_tensors)
    rank = np.zeros(problem.num_tasks)
    for u in reversed(problem.topological_order):
        tail = max(
            (mean_transfer[t] + rank[c] for t in problem.output_tensors[u] for c in problem.tensor_consumers[t]),
            default=0.0,
        )
        rank[u] = mean_compute[u] + tail
    return rank


@register("heft")
def place_heft(problem: Problem, contention: bool = True) -> Plan:
    check_memory_feasible(problem)
    return heft_schedule(problem, upward_rank_mean_costs(problem), contention=contention)


def heft_schedule(
    problem: Problem,
    priority: np.ndarray,
    lookahead_s: np.ndarray | None = None,
    contention: bool = True,
    placer: str = "heft",
) -> Plan:
    """Insertion list scheduling: the ready task (all its producers placed) of highest ``priority`` first
    (ties: topological position), each on the device, among those with room for it, minimising its finish
    time plus ``lookahead_s[task, device]`` (none: HEFT's choice).

    Raises :class:`InfeasibleError` when a task fits on no device any more (memory only fills up).
    """
    n, k = problem.num_tasks, problem.num_devices
    position = np.empty(n, int)
    position[list(problem.topological_order)] = np.arange(n)
    schedule = ScheduleBuilder(problem, insertion=True, contention=contention)
    compute = problem.compute_s.tolist()
    lookahead = np.zeros((n, k)).tolist() if lookahead_s is None else lookahead_s.tolist()
    missing_inputs = [len(p) for p in problem.predecessors]
    ready = [(-priority[u], position[u], u) for u in range(n) if not missing_inputs[u]]
    heapq.heapify(ready)
    while ready:
        u = heapq.heappop(ready)[2]
        best: tuple[float, int] | None = None
        for d in range(k):
            if not schedule.fits(u, d):
                continue
            seconds = compute[u][d]
            start = schedule.device_slot(d, schedule.data_ready_s(u, d), seconds)[0]
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
        info={"predicted_makespan_s": schedule.makespan_s, "contention": contention},
    )
