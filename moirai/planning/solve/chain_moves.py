"""Chain moves: move a run of tasks to another device at once, where moving any one of them alone loses.

A window re-solves a few consecutive tasks; when a transfer costs several tasks' time, moving part of a chain
that talks to itself adds two transfers, so no window of the local optimum gains, while moving the whole chain
removes the transfers that made it slow. The moves here, on and around the critical path of the simulated schedule:

* a run of consecutive tasks of one device (in its order, holding a critical task) to another device;
* a run of consecutive critical tasks (in start order, whatever their devices) onto one device;

runs of 2, 4, 8, ... tasks, each start half a run apart. Every moved task keeps its start time as its priority
in the new device orders (:func:`moirai.planning.solve.warm_start.plan_from_times`), every other task too, and
the simulator judges the plan: the first move it confirms as better is kept and the critical path taken again,
until a whole pass keeps nothing or the deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from moirai.errors import PlanError
from moirai.planning.objective import Objective
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.simulate import Timeline, simulate
from moirai.planning.solve.search import IMPROVEMENT, latest_starts
from moirai.planning.solve.warm_start import plan_from_times, transfer_starts

logger = logging.getLogger(__name__)


@dataclass
class ChainResult:
    plan: Plan
    timeline: Timeline
    moves_tried: int = 0
    moves_kept: int = 0
    converged: bool = False  # a whole pass kept nothing: a local optimum of these moves


def improve_by_chains(
    problem: Problem, plan: Plan, timeline: Timeline, deadline: float, objective: Objective
) -> ChainResult:
    """Keep the first chain move ``objective`` confirms, again and again, until a pass keeps none or ``deadline``
    (a ``time.perf_counter`` value)."""
    result = ChainResult(plan, timeline)
    moves = _moves(problem, timeline)
    position, since_kept = 0, 0
    while since_kept < len(moves):
        if time.perf_counter() >= deadline:
            break
        run, target = moves[position % len(moves)]
        position, since_kept = position + 1, since_kept + 1
        result.moves_tried += 1
        placement = result.timeline.placement.copy()
        placement[run] = target
        try:
            candidate = _plan_with(problem, result.timeline, placement, plan.placer)
            candidate_timeline = _simulated(problem, candidate)
        except PlanError:  # a colocated set split: not a move this problem allows
            continue
        if objective.improves(candidate_timeline, result.timeline, IMPROVEMENT):
            result.plan, result.timeline = candidate, candidate_timeline
            result.moves_kept += 1
            # The critical path moved: the moves are taken again, going on from the same place in the list.
            moves, position, since_kept = _moves(problem, result.timeline), position % len(moves), 0
            if not moves:
                break
    result.converged = since_kept >= len(moves)
    logger.debug("chain moves: %d tried, %d kept", result.moves_tried, result.moves_kept)
    return result


def _simulated(problem: Problem, plan: Plan) -> Timeline:
    try:
        return simulate(problem, plan)
    except PlanError:
        # Link orders by start time can contradict the new device orders; first ready, first sent cannot.
        return simulate(problem, replace(plan, transfer_order=None))


def _moves(problem: Problem, timeline: Timeline) -> list[tuple[np.ndarray, int]]:
    """The chain moves from ``timeline``'s placement, ``(tasks, device)``, shortest runs first."""
    slack = latest_starts(problem, timeline) - timeline.task_start
    critical = slack <= IMPROVEMENT * timeline.makespan_s
    by_start = np.lexsort((problem.topological_position, timeline.task_finish, timeline.task_start))
    on_path = by_start[critical[by_start]]
    orders = [np.array(sequence, int) for sequence in timeline.device_order()]
    devices = np.arange(problem.num_devices)
    longest = max(len(on_path), *(len(sequence) for sequence in orders))
    moves: list[tuple[np.ndarray, int]] = []
    length = 2
    while length <= longest:
        for d, sequence in enumerate(orders):
            for run in _runs(sequence, length):
                if critical[run].any():
                    moves += [(run, int(k)) for k in devices[problem.fits[run].all(axis=0)] if k != d]
        for run in _runs(on_path, length):
            moves += [
                (run, int(k)) for k in devices[problem.fits[run].all(axis=0)] if (timeline.placement[run] != k).any()
            ]
        length *= 2
    return moves


def _runs(sequence: np.ndarray, length: int) -> Iterator[np.ndarray]:
    if len(sequence) < length:
        return
    for first in range(0, len(sequence) - length + 1, max(1, length // 2)):
        yield sequence[first : first + length]


def _plan_with(problem: Problem, timeline: Timeline, placement: np.ndarray, placer: str) -> Plan:
    """``placement`` with every task and transfer in its current start order (a new transfer: its producer's start)."""
    sent = {(tr.tensor, tr.dst): tr.start for tr in timeline.transfers}
    needed = transfer_starts(problem, placement, timeline.task_start, sent)
    return plan_from_times(problem, placement, timeline.task_start, needed, placer)
