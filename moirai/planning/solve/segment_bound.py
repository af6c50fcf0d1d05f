"""A latency lower bound from the graph's cut tasks: the pieces between them solved exactly, chained by device.

A cut task is one every other task leads to, follows, or is a dead end or a side input beside (an inception block's
concatenation, a pooling between blocks; a layer of one task in a layered graph; a decoder layer's residual add,
beside the rotary table and mask every layer reads). For any chain of tasks
``c_1, c_2, ...``, each following the one before, the tasks between ``c_i`` and ``c_{i+1}`` (those that follow
``c_i`` and lead to ``c_{i+1}``) start after ``c_i`` finishes and finish before ``c_{i+1}`` starts. So the piece
between ``c_i`` on device ``d`` and ``c_{i+1}`` on ``d'`` (``c_i`` done, its compute 0; the tasks between;
``c_{i+1}`` with its compute) is a small problem of its own whose optimum, on devices free at its start, is a lower
bound on ``finish(c_{i+1}) - finish(c_i)``: the whole plan, cut to that piece, is one of its plans (tasks outside
it, such as the dead ends, only ever take devices and links away). Each piece is solved by the whole MILP
(moirai.planning.solve.model), whose proven bound is taken, for every pair of devices, and a DP over the cut tasks'
devices adds the pieces up: ``F_{i+1}(d') = max(min_d F_i(d) + piece_i(d, d'), critical-path finish of c_{i+1} on
d')``, from the critical-path bound's earliest finish of ``c_1``, up to the last cut task and the piece after it
(its model outputs' time to device 0 included). The chain is the cut tasks: their dead ends, left out, hold at
most :data:`MAX_DROPPED_SHARE` of the work.

The pieces drop what only makes a plan slower: memory limits, colocation, headers, the CPU time of sends and
receives, and tensors from before the piece (they count as there already), so the bound holds for every plan the
simulator runs with link contention, as the MILP models it (tests/test_segment_bound.py checks it against brute
force). It is far tighter than the per-task critical path where the pieces are parallel branches on a few devices
(a branch sent elsewhere has to share that device and its link with the others), and costs a MILP per piece and
device pair: a bench's bound, not the one every plan prints (:func:`moirai.planning.bounds.lower_bound`, which this
one is never below).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from moirai.planning.bounds import earliest_finish_s, lower_bound
from moirai.planning.costs import RequestCosts
from moirai.planning.problem import Problem
from moirai.planning.schedule.heft import heft_schedule, upward_rank_mean_costs
from moirai.planning.simulate import simulate
from moirai.planning.solve.model import build_model
from moirai.planning.solve.solver import SolverSettings, solve_model
from moirai.planning.solve.window import identical_device_groups, whole_problem

MAX_TASKS = 3000  # the cut tasks come from an n x n reachability matrix
MAX_PIECE_TASKS = 24  # a larger piece is bounded by its critical path alone, as a whole MILP would not solve it
MAX_DROPPED_SHARE = 0.25  # of the work, at most, in the dead ends a cut task leaves out of the pieces


@dataclass(frozen=True)
class SegmentBound:
    bound_s: float  # never below lower_bound(problem)
    cuts: int  # cut tasks found
    pieces_solved: int  # (piece, device pair) MILPs solved
    pieces_optimal: int  # of those, solved to optimality (the rest give the solver's proven bound)


def segment_lower_bound(problem: Problem, time_limit_s: float = 60.0) -> SegmentBound:
    """The cut-task bound of ``problem``'s latency (seconds), within about ``time_limit_s`` of MILP time (pieces
    not reached in time are bounded by their critical path alone, which keeps the bound valid)."""
    base = lower_bound(problem)
    n, k = problem.num_tasks, problem.num_devices
    if n > MAX_TASKS or n < 2:
        return SegmentBound(base, 0, 0, 0)
    reach = problem.reachable()
    cuts = cut_tasks(problem, reach)
    if not cuts:
        return SegmentBound(base, 0, 0, 0)
    deadline = time.perf_counter() + time_limit_s
    interchangeable = identical_device_groups(problem) == (tuple(range(k)),) if k > 1 else True
    solved = optimal = 0
    earliest = earliest_finish_s(problem)
    finish = earliest[cuts[0]]  # F_1: the first cut task's earliest finish on each device
    for first, last in [*zip(cuts, cuts[1:], strict=False), (cuts[-1], None)]:
        between = reach[first] & (reach[:, last] if last is not None else True)
        tasks = [first, *(v for v in problem.topological_order if between[v] and v != last)]
        if last is not None:
            tasks.append(last)
        piece = np.full((k, k), np.inf)  # [first's device, last's device] (the tail: by first's device only)
        solves: dict[tuple[int, int | None], float] = {}
        for d in np.flatnonzero(np.isfinite(finish)):
            for e in range(k) if last is not None else [None]:
                # On interchangeable devices a piece's bound depends only on whether its ends share a device.
                key = (0, None if e is None else int(e != d)) if interchangeable else (int(d), e)
                if key not in solves:
                    sub = _piece_problem(problem, tasks, *key)
                    value, proven = _piece_bound_s(sub, deadline) if sub is not None else (np.inf, True)
                    solves[key] = value
                    solved, optimal = solved + (sub is not None), optimal + (sub is not None and proven)
                piece[d, slice(None) if e is None else e] = solves[key]
        finish = (finish[:, None] + piece).min(axis=0)
        if last is not None:  # the critical-path bound on the cut task's finish holds as well
            finish = np.maximum(finish, earliest[last])
    return SegmentBound(max(base, float(finish.min())), len(cuts), solved, optimal)


def cut_tasks(problem: Problem, reach: np.ndarray) -> list[int]:
    """The cut tasks, in topological order, each following the one before: tasks every other task leads to, follows,
    or is beside, those beside holding at most :data:`MAX_DROPPED_SHARE` of the work (each task at its fastest) and
    each either a dead end (leads to none of the cut task's descendants) or a side input (follows neither the cut task
    before nor, for the first, any of its ancestors: computed from the model's inputs alone, as a decoder layer's
    rotary table or mask is).

    Any chain of tasks gives a valid bound; these rules choose a chain whose pieces keep the branches that matter
    together: a task with a branch beside it that follows the cut before (a query projection beside its key and
    value projections) is no cut, as the branch would be left out of every piece ([Note: side inputs])."""
    related = reach | reach.T
    np.fill_diagonal(related, True)
    work = np.where(problem.fits, problem.compute_s, np.inf).min(axis=1)
    cuts: list[int] = []
    for c in problem.topological_order:
        if cuts and not reach[cuts[-1], c]:
            continue
        beside = ~related[c]
        if work[beside].sum() > MAX_DROPPED_SHARE * work.sum():
            continue
        beside_tasks = np.flatnonzero(beside)
        side_inputs = beside_tasks[reach[np.ix_(beside_tasks, np.flatnonzero(reach[c]))].any(axis=1)]
        before = [cuts[-1]] if cuts else np.flatnonzero(reach[:, c])  # the first cut: its ancestors
        if side_inputs.size and reach[np.ix_(before, side_inputs)].any():
            continue
        cuts.append(c)
    return cuts


def _piece_problem(problem: Problem, tasks: list[int], first_device: int, last_device: int | None) -> Problem | None:
    """The piece ``tasks`` (its first task done on ``first_device``; its last, if ``last_device`` is given, on
    that device), without what only slows a plan down; None when its last task cannot run there."""
    k = problem.num_devices
    index = {v: j for j, v in enumerate(tasks)}
    compute = problem.compute_s[tasks].copy()
    compute[0] = np.inf
    compute[0, first_device] = 0.0
    output = problem.costs.output_s[tasks].copy()
    if last_device is not None:
        if not np.isfinite(compute[-1, last_device]):
            return None
        pinned = np.full(k, np.inf)
        pinned[last_device] = compute[-1, last_device]
        compute[-1] = pinned
        output[:] = 0.0  # only the tail's outputs end the request
    kept = problem.tensors_among(tasks)
    m = len(tasks)
    return Problem(
        device_names=problem.device_names,
        memory_capacity_bytes=np.full(k, np.inf),
        task_names=tuple(problem.task_names[v] for v in tasks),
        compute_s=compute,
        memory_bytes=np.zeros(m),
        tensor_names=tuple(problem.tensor_names[t] for t, _ in kept),
        tensor_producer=np.array([index[int(problem.tensor_producer[t])] for t, _ in kept], int),
        tensor_consumers=tuple(consumers for _, consumers in kept),
        transfer_s=problem.transfer_s[[t for t, _ in kept]].reshape(len(kept), k, k),
        tensor_bytes=problem.tensor_bytes[[t for t, _ in kept]],
        costs=RequestCosts.build(m, k, output_s=output),
    )


def _piece_bound_s(sub: Problem, deadline: float) -> tuple[float, bool]:
    """A lower bound on ``sub``'s best makespan, and whether the MILP proved it optimal."""
    floor = lower_bound(sub)
    left = deadline - time.perf_counter()
    if sub.num_tasks > MAX_PIECE_TASKS or left <= 0:
        return floor, False
    horizon = simulate(sub, heft_schedule(sub, upward_rank_mean_costs(sub))).makespan_s  # a plan's: an upper bound
    if horizon <= floor:
        return floor, True
    built = build_model(sub, whole_problem(sub, horizon))
    solution = solve_model(built, SolverSettings(time_limit_s=min(left, 10.0), mip_gap=1e-6))
    if not solution.has_solution or solution.bound_s is None:  # not even the heuristic's plan: trust only the floor
        return floor, False
    return max(floor, solution.bound_s), solution.optimal
