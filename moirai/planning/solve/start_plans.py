"""Start plans for the milp placer's search: HEFT with a lookahead, repeated while it improves.

HEFT (the strongest baseline) puts every task on the device where it finishes earliest. When a
transfer costs about as much as a task, that greedy choice often moves a task away from where its
consumers will run and pays the transfer later, on the critical path. :func:`moirai.planning.placers.heft.heft_schedule`
with a lookahead keeps HEFT's insertion list scheduling (its task priority, and the communication model of
:mod:`moirai.planning.simulate`: a tensor crosses to a device once, transfers on one directed link do not
overlap, static memory) but puts a task on the device minimising

    finish time + weight * tail[task, device],

where the tail is how long the schedule still runs after the task on that device, through its
consumers, placed where the best plan so far put them (transfers included): :func:`placement_tail`
takes the consumers' longest paths under that placement, :func:`schedule_tail` how long the
simulated schedule runs on from each consumer (device queues and link contention included). The
result becomes the next best plan if the simulator says it is shorter, and the tail is taken again
from it. Each round costs about one HEFT run and one simulation, so it scales to 50,000 tasks.

The rounds cycle through :data:`TAIL_WEIGHTS` (no one weight is best on every graph), each from the best plan
so far, until a whole cycle brings nothing; then they switch to the other tail (neither tail is better on every
graph), and so on until neither improves. PEFT's optimistic cost table as the lookahead was worse than HEFT, so it
is not used. The measurements behind these choices: [Note: lookahead weights and tails] in docs/design.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from moirai.errors import InfeasibleError
from moirai.planning.objective import LATENCY, Objective
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.schedule.heft import DeadlinePassed, heft_schedule, upward_rank_mean_costs
from moirai.planning.schedule.transfers import transfer_duration_s
from moirai.planning.simulate import Timeline, simulate, upward_rank
from moirai.planning.solve.costs import measured_costs
from moirai.planning.solve.search import latest_starts

TAIL_WEIGHTS = (0.8, 1.0, 0.5, 0.65, 1.3)
logger = logging.getLogger(__name__)


def placement_tail(problem: Problem, placement: np.ndarray) -> np.ndarray:
    """``tail[i, d]``: how long the schedule runs after task ``i`` finishes on device ``d`` when every other
    task is where ``placement`` puts it: the longest path through its consumers, transfers included.
    """
    return _through_consumers(problem, placement, upward_rank(problem, placement))


def schedule_tail(problem: Problem, timeline: Timeline) -> np.ndarray:
    """``tail[i, d]`` as :func:`placement_tail`, but each consumer runs on for as long as the simulated
    schedule ``timeline`` makes it (its device's later tasks and its links' queues included).
    """
    return _through_consumers(problem, timeline.placement, timeline.makespan_s - latest_starts(problem, timeline))


def _through_consumers(problem: Problem, placement: np.ndarray, runs_on_s: np.ndarray) -> np.ndarray:
    """``tail[i, d]``: the largest, over the consumers ``c`` of task ``i``, of the transfer from ``d`` to
    ``c``'s device (0 on the same device) plus ``runs_on_s[c]`` (how long the schedule runs from ``c``'s start).
    """
    tail = np.zeros((problem.num_tasks, problem.num_devices))
    devices = np.arange(problem.num_devices)
    for t, consumers in enumerate(problem.tensor_consumers):
        u = int(problem.tensor_producer[t])
        for c in consumers:
            np.maximum(tail[u], transfer_duration_s(problem, t, devices, placement[c]) + runs_on_s[c], out=tail[u])
    return tail


@dataclass
class StartPlanResult:
    plan: Plan
    timeline: Timeline
    rounds: int = 0
    improved: int = 0
    history: list[float] = field(default_factory=list)  # objective of every round's schedule


def improve_start_plan(
    problem: Problem, plan: Plan, timeline: Timeline, deadline: float, objective: Objective = LATENCY
) -> StartPlanResult:
    """Lookahead rounds from ``plan`` (simulated as ``timeline``), cycling through :data:`TAIL_WEIGHTS`, each
    from the best plan so far, with :func:`placement_tail` until a whole cycle improves nothing, then with
    :func:`schedule_tail`, and so on, until neither improves the plan or the next round would end after
    ``deadline`` (a ``time.perf_counter`` value; a round that passes it all the same is abandoned). Returns the
    best acceptable plan (``plan`` if none is better), as ``objective`` judges the simulated plans.
    """
    result = StartPlanResult(plan, timeline)
    if problem.num_devices < 2 or problem.num_tasks == 0:
        return result
    priority = upward_rank_mean_costs(problem)
    # A round predicted to end after the deadline is not started: predicted by the measured cost, or by the
    # longest round so far where this machine runs slower now; one that overruns all the same is abandoned.
    round_s = measured_costs().lookahead_round_s_per_1000_tasks * problem.num_tasks / 1000
    tails = (lambda best: placement_tail(problem, best.placement), lambda best: schedule_tail(problem, best))
    kind, since_improvement, stalled_kinds = 0, 0, 0
    while stalled_kinds < len(tails) and time.perf_counter() + round_s < deadline:
        weight = TAIL_WEIGHTS[since_improvement]
        result.rounds += 1
        since_improvement += 1
        round_started = time.perf_counter()
        try:
            candidate = heft_schedule(
                problem, priority, weight * tails[kind](result.timeline), placer=plan.placer, deadline=deadline
            )
        except InfeasibleError:  # this round's greedy choices filled memory: keep the plan we have
            logger.debug("lookahead round %d (weight %g) filled memory; plan kept", result.rounds, weight)
            candidate = None
        except DeadlinePassed as stopped:
            logger.debug("lookahead round %d abandoned at the deadline (%s)", result.rounds, stopped)
            break
        if time.perf_counter() > deadline:  # done past it: simulating the plan would overrun further
            logger.debug("lookahead round %d finished past the deadline; its plan is not judged", result.rounds)
            break
        if candidate is not None:
            candidate_timeline = simulate(problem, candidate)
            result.history.append(objective.value_s(candidate_timeline))
            if objective.improves(candidate_timeline, result.timeline):
                result.plan, result.timeline = candidate, candidate_timeline
                result.improved += 1
                since_improvement, stalled_kinds = 0, 0
        round_s = max(round_s, time.perf_counter() - round_started)
        if since_improvement == len(TAIL_WEIGHTS):
            kind, since_improvement, stalled_kinds = (kind + 1) % len(tails), 0, stalled_kinds + 1
    logger.debug(
        "lookahead: %d rounds, %d improved, stopped by %s",
        result.rounds,
        result.improved,
        "stalling" if stalled_kinds >= len(tails) else "the deadline",
    )
    return result
