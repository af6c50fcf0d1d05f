"""Large-neighbourhood search: re-optimise windows of a schedule with the MILP, keep what the simulator confirms.

A graph too large for one MILP is improved a window at a time. Tasks are taken in the order
they start in the current schedule; a window frees a run of consecutive ones. Everything that
starts before the window is fixed (its finish times, the transfers already under way and when
every device and link becomes free are constants); everything after it keeps its device and is
summarised by tails: for each free task and device, how long the current schedule still has to
run after that task finishes (through its consumers, with the transfer the device choice
implies, and through the next task on that device), from a backward pass over the schedule.
The window's MILP minimises the largest finish-plus-tail, starting from the current schedule.

Windows are centred on critical tasks (no slack in the backward pass), the only places a
shorter makespan can come from. Several windows far apart on the critical path are solved
against the same schedule and merged into the plan together: tasks and transfers a window
re-timed are ordered (on their device, on their link) by their new start times, all others by
their old ones, device orders repaired to one topological order. The whole plan is then
re-simulated and kept only if the simulator's makespan improves, so the search never returns
anything worse than its start. When a batch fails, its windows are tried alone, largest gain
first. The batch size grows with the cost of a simulation (large graphs), so judging stays a
small share of the time.

The neighbourhood grows when it finds nothing, so that the budget and not the neighbourhood ends the search.
Each size's windows are the critical ones, and beyond the first size those around the critical tasks' producers and
consumers that are not critical themselves (a branch beside the critical path can hold the device or link it waits
for). When every
window of a size has been solved against the current schedule without one being kept, the size grows by
:data:`WINDOW_GROWTH` (larger windows, sparser, each with a time limit in proportion) up to
:data:`MAX_WINDOW_TASKS`; at the largest size, windows whose solve ran out of time are solved again with twice the
time. An improvement takes the search back to the first size: the schedule changed, and small windows are cheap.

The deadline is an upper limit. The search stops earlier when the makespan is within the solver's relative gap of
a proven lower bound, or when every window of every size up to the largest has been solved since the last
improvement, each proven to hold no gain (none ran out of time): the schedule no longer changes, so solving them
again would give the same answers (``StopReason.NO_IMPROVING_WINDOW``).

Windows of 8 tasks gave the largest gains in a fixed time on random layered graphs of 300 and
3,000 tasks (8 beat 5 and 12), so the search starts there.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from moirai.errors import PlanError
from moirai.planning.objective import LATENCY, Objective
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import StopReason, gap_closed
from moirai.planning.schedule.transfers import transfer_duration_s
from moirai.planning.simulate import Timeline, simulate
from moirai.planning.solve.model import MilpModel, build_model
from moirai.planning.solve.solver import MilpSolution, SolverSettings, progress_text, solve_model
from moirai.planning.solve.warm_start import plan_from_times, transfer_starts
from moirai.planning.solve.window import Window

logger = logging.getLogger(__name__)
DEFAULT_WINDOW_TASKS = 8
MAX_WINDOW_TASKS = 48  # windows beyond this seldom solve within seconds ([Note: growing windows] in docs/design.md)
WINDOW_GROWTH = 1.5
_WINDOW_TIME_LIMIT_S = 1.0  # for a window of the first size; a larger one gets as much more as it has tasks
IMPROVEMENT = 1e-9  # relative makespan gain that counts as progress (the chain moves' too)
_MAX_BATCH = 16


@dataclass
class SearchResult:
    plan: Plan
    timeline: Timeline
    stop_reason: StopReason = StopReason.TIME_LIMIT
    windows_tried: int = 0
    windows_improved: int = 0
    windows_unproven: int = 0  # solves stopped by their time limit before finding or ruling out a gain
    window_tasks: int = DEFAULT_WINDOW_TASKS  # the window size it reached, where a resumed search goes on
    history: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, objective)


def window_sizes(first_tasks: int, num_tasks: int) -> tuple[int, ...]:
    """The window sizes the search goes through: ``first_tasks``, then :data:`WINDOW_GROWTH` times larger up to
    :data:`MAX_WINDOW_TASKS` (never more than the problem's tasks, never fewer than 2)."""
    largest = min(num_tasks, max(first_tasks, MAX_WINDOW_TASKS))
    sizes = [max(2, min(first_tasks, num_tasks))]
    while sizes[-1] < largest:
        sizes.append(min(largest, int(np.ceil(sizes[-1] * WINDOW_GROWTH))))
    return tuple(sizes)


def improve_by_windows(
    problem: Problem,
    plan: Plan,
    timeline: Timeline,
    deadline: float,
    settings: SolverSettings,
    window_tasks: int = DEFAULT_WINDOW_TASKS,
    report: Callable[[str], None] | None = None,
    lower_bound_s: float = 0.0,
    objective: Objective = LATENCY,
    resume_tasks: int | None = None,
    grow: bool = True,
    best_so_far_s: float = math.inf,
) -> SearchResult:
    """Improve ``plan`` (whose simulation is ``timeline``) until ``deadline`` (a ``time.perf_counter`` value).

    Windows of ``window_tasks`` tasks (of ``resume_tasks``, a size a stopped search had reached, if given) are
    chosen on and beside the critical path and re-solved for their finish-plus-tail; a merged plan is kept when
    ``objective`` says it improves. The windows grow while they find nothing (:func:`window_sizes`; with ``grow``
    False they keep their first size, a quick descent to a local optimum of small windows). Stops earlier
    when the objective is within ``settings.mip_gap`` of ``lower_bound_s`` (a proven bound on it), or when every
    window of every size has been proven not to improve the plan since the last improvement: the plan is then a
    local optimum of this neighbourhood. ``best_so_far_s``: the best a caller's earlier searches found, which the
    status lines give as the incumbent where this search's plan is not yet as good.
    """
    started = time.perf_counter()
    result = SearchResult(plan, timeline, history=[(0.0, objective.value_s(timeline))])
    sizes = window_sizes(window_tasks, problem.num_tasks)[: None if grow else 1]
    level = int(np.searchsorted(sizes, resume_tasks)) if resume_tasks is not None else 0
    level = min(level, len(sizes) - 1)
    time_factor = 1.0  # doubles at the largest size while windows there run out of time
    unproven_here = False  # a window of this size ran out of time since the size was taken
    cursor = 0.0  # fraction of the makespan from which the next batch takes its windows
    judge_s, window_s, build_s = 0.0, 0.1, 0.0
    schedule = _ScheduleIndex(problem, timeline, sizes[level], sparse=level > 0)
    tried: set[int] = set()  # windows (by first position) solved against the current schedule
    while True:
        result.window_tasks = sizes[level]
        if gap_closed(objective.value_s(result.timeline), lower_bound_s, settings.mip_gap):
            result.stop_reason = StopReason.GAP_CLOSED
            break
        untried = [first for first in schedule.windows if first not in tried]
        if not untried:
            if level + 1 < len(sizes):
                level += 1
            elif unproven_here:
                time_factor *= 2
            else:
                result.stop_reason = StopReason.NO_IMPROVING_WINDOW
                break
            logger.debug("window search: every window tried, now %d tasks, time x%g", sizes[level], time_factor)
            schedule = _ScheduleIndex(problem, result.timeline, sizes[level], sparse=True)
            tried.clear()
            unproven_here, cursor = False, 0.0
            continue
        window_limit_s = _WINDOW_TIME_LIMIT_S * time_factor * sizes[level] / sizes[0]
        batch_size = int(np.clip(np.ceil(judge_s / window_s), 1, _MAX_BATCH))
        batch, cursor = schedule.spread_windows(untried, cursor, batch_size)
        improved: list[tuple[float, MilpModel, MilpSolution]] = []
        for first in batch:
            window_started = time.perf_counter()
            if deadline - window_started - judge_s - build_s < 0.2:
                break
            window = schedule.window_at(first)
            built = build_model(problem, window)
            limit = min(window_limit_s, deadline - time.perf_counter() - 0.1 - judge_s)
            solution = solve_model(built, replace(settings, time_limit_s=limit, report=None), result.timeline)
            tried.add(first)
            result.windows_tried += 1
            build_s = max(build_s, built.size.build_s)
            window_s = 0.8 * window_s + 0.2 * (time.perf_counter() - window_started)
            if solution.has_solution and solution.objective_s < window.horizon_s * (1 - IMPROVEMENT):
                improved.append((window.horizon_s - solution.objective_s, built, solution))
            else:
                if not solution.optimal:
                    result.windows_unproven += 1
                    unproven_here = True
                logger.debug(
                    "window at %d rejected: the solver (%s) found nothing shorter than %.6g s",
                    first,
                    solution.status,
                    window.horizon_s,
                )
        if not tried.issuperset(batch) or (improved and time.perf_counter() > deadline - 0.1 - judge_s):
            break  # out of time
        if improved:
            judge_started = time.perf_counter()
            kept, simulations = _keep_confirmed(
                problem, result, improved, plan.placer, deadline - 0.1 - judge_s, objective
            )
            judge_s = (time.perf_counter() - judge_started) / simulations
            if kept:
                result.history.append((time.perf_counter() - started, objective.value_s(result.timeline)))
                level, time_factor, unproven_here = 0, 1.0, False
                schedule = _ScheduleIndex(problem, result.timeline, sizes[level])
                tried.clear()
        if report is not None:
            incumbent_s = min(objective.value_s(result.timeline), best_so_far_s)
            report(
                f"{progress_text('window search', incumbent_s, lower_bound_s)}; "
                f"windows of {sizes[level]} tasks, {result.windows_tried} tried from this plan"
            )
    logger.debug(
        "window search stopped (%s): %d windows tried, %d kept, last size %d",
        result.stop_reason,
        result.windows_tried,
        result.windows_improved,
        result.window_tasks,
    )
    return result


def _keep_confirmed(
    problem: Problem,
    result: SearchResult,
    improved: list[tuple[float, MilpModel, MilpSolution]],
    placer: str,
    deadline: float,
    objective: Objective,
) -> tuple[bool, int]:
    """Put into ``result`` the first of (all improving windows merged, then each alone, largest gain first)
    that ``objective`` says improves the plan. Returns whether one was kept and how many were simulated.
    """
    alone = [[window] for window in sorted(improved, key=lambda w: w[0], reverse=True)]
    attempts = alone if len(improved) == 1 else [improved, *alone]
    for count, attempt in enumerate(attempts, start=1):
        candidate = _merged_plan(problem, result.timeline, [(built, sol) for _, built, sol in attempt], placer)
        try:
            candidate_timeline = simulate(problem, candidate)
        except PlanError:
            # Link orders taken from two schedules can contradict the device orders; first ready, first sent cannot.
            candidate = replace(candidate, transfer_order=None)
            candidate_timeline = simulate(problem, candidate)
        # Each window respects memory against the current plan; windows merged together may not.
        if objective.improves(candidate_timeline, result.timeline, IMPROVEMENT):
            result.plan, result.timeline = candidate, candidate_timeline
            result.windows_improved += len(attempt)
            return True, count
        logger.debug("%d window(s) rejected: the simulator does not confirm the solver's gain", len(attempt))
        if time.perf_counter() > deadline:
            return False, count
    return False, len(attempts)


def _merged_plan(
    problem: Problem, timeline: Timeline, windows: list[tuple[MilpModel, MilpSolution]], placer: str
) -> Plan:
    """The current schedule with each window's tasks and transfers moved to its solution's devices and times.

    Every task and transfer keeps its current start time as its priority unless a window
    re-timed it; device and link orders follow the priorities (device orders repaired to one
    topological order), so the links keep the order the current plan gave them.
    """
    placement = timeline.placement.copy()
    start = timeline.task_start.copy()
    transfer_priority = {(tr.tensor, tr.dst): tr.start for tr in timeline.transfers}
    for built, solution in windows:
        for i in built.window.free_tasks:
            placement[i] = solution.placement[i]
            start[i] = solution.start_s[i]
        for q in built.transfer_sources:
            transfer_priority.pop(q, None)
        transfer_priority.update(solution.transfer_start_s)
    needed = transfer_starts(problem, placement, start, transfer_priority)
    return plan_from_times(problem, placement, start, needed, placer)


class _ScheduleIndex:
    """One simulated schedule, indexed for cutting windows out of it quickly."""

    def __init__(self, problem: Problem, timeline: Timeline, window_tasks: int, sparse: bool = False) -> None:
        self.problem = problem
        self.timeline = timeline
        self.window_tasks = window_tasks
        # Start order (ties: finish, then topological position), so it is a topological order.
        self.by_start = np.lexsort((problem.topological_position, timeline.task_finish, timeline.task_start))
        self.position = np.empty(problem.num_tasks, int)
        self.position[self.by_start] = np.arange(problem.num_tasks)
        self.latest_start = latest_starts(problem, timeline)
        self.remaining = timeline.makespan_s - self.latest_start  # how long the plan runs on from each task
        slack = self.latest_start - timeline.task_start
        self.critical = np.flatnonzero(slack <= IMPROVEMENT * timeline.makespan_s)
        self.critical = self.critical[np.argsort(self.position[self.critical])]
        self.device_positions = [np.sort(self.position[list(seq)]) for seq in timeline.device_order()]
        links: dict[tuple[int, int], list] = {}
        for transfer in timeline.transfers:
            links.setdefault((transfer.src, transfer.dst), []).append((transfer.start, transfer.finish))
        self.link_starts = {}
        self.link_finish_max = {}
        for link, spans in links.items():
            spans.sort()
            self.link_starts[link] = np.array([s for s, _ in spans])
            self.link_finish_max[link] = np.maximum.accumulate([f for _, f in spans])
        self.arrival = {(tr.tensor, tr.dst): (tr.start, tr.finish) for tr in timeline.transfers}

        # The windows worth solving: one around each critical task (by its first position in start order); beyond the
        # first size (``sparse``: a quarter window apart), then one around each of their producers and consumers off
        # the critical path.
        on_path = set(self.critical.tolist())
        beside = (
            sorted(
                {int(j) for i in on_path for j in (*problem.predecessors[i], *problem.successors[i])} - on_path,
                key=lambda j: self.position[j],
            )
            if sparse
            else []
        )
        spacing = max(1, window_tasks // 4) if sparse else 1
        windows: dict[int, None] = {}  # ordered, without repeats
        last_bound = problem.num_tasks - window_tasks
        for tasks in (self.critical, np.array(beside, int)):
            taken: list[int] = []
            for first in np.unique(np.clip(self.position[tasks] - window_tasks // 3, 0, last_bound)).tolist():
                if not taken or first - taken[-1] >= spacing:
                    taken.append(first)
            windows.update(dict.fromkeys(taken))
        self.windows = tuple(windows)

    def spread_windows(self, candidates: list[int], cursor: float, count: int) -> tuple[list[int], float]:
        """Up to ``count`` of the ``candidates`` windows, at least two windows apart, those starting from
        ``cursor`` (a fraction of the makespan) on first; and the next cursor.
        """
        makespan = self.timeline.makespan_s
        begins = {
            first: self.timeline.task_start[self.by_start[first]] / makespan if makespan > 0 else 0.0
            for first in candidates
        }
        chosen: list[int] = []
        for first in sorted(candidates, key=lambda f: (begins[f] < cursor, f)):
            if all(abs(first - other) >= 2 * self.window_tasks for other in chosen):
                chosen.append(first)
                if len(chosen) == count:
                    break
        last = begins[chosen[-1]]
        return chosen, (last + 1e-9 if last < 1.0 and len(chosen) == count else 0.0)

    def window_at(self, first: int) -> Window:
        """The window that frees the tasks at positions ``first``, ``first + 1``, ... in start order."""
        problem, timeline, window_tasks = self.problem, self.timeline, self.window_tasks
        n, k = problem.num_tasks, problem.num_devices
        end = first + window_tasks
        free = tuple(int(i) for i in self.by_start[first:end])
        placement = timeline.placement
        before = self.by_start[:first]
        window_start = float(timeline.task_start[list(free)].min())
        fixed_finish = np.full(n, np.nan)
        fixed_finish[before] = timeline.task_finish[before]
        device_ready = problem.costs.header_s.copy()  # a device no fixed task uses still waits for its header
        for d, positions in enumerate(self.device_positions):
            count = int(np.searchsorted(positions, first))
            if count:
                device_ready[d] = timeline.task_finish[self.by_start[positions[count - 1]]]
        link_ready = np.zeros((k, k))
        for (a, b), starts in self.link_starts.items():
            count = int(np.searchsorted(starts, window_start, side="left"))
            if count:
                link_ready[a, b] = self.link_finish_max[a, b][count - 1]
        arrived: dict[tuple[int, int], float] = {}
        for i in free:
            for t in problem.input_tensors[i]:
                for b in range(k):
                    sent = self.arrival.get((t, b))
                    if sent is not None and sent[0] < window_start:
                        arrived[t, b] = sent[1]
        # Tails: through the next later task on each device, and through every later consumer.
        next_on_device = np.zeros(k)
        for d, positions in enumerate(self.device_positions):
            later = int(np.searchsorted(positions, end))
            if later < positions.size:
                next_on_device[d] = self.remaining[self.by_start[positions[later]]]
        tail = np.tile(next_on_device, (len(free), 1))
        free_set = set(free)
        for f, i in enumerate(free):
            for t in problem.output_tensors[i]:
                for c in problem.tensor_consumers[t]:
                    if c in free_set:
                        continue
                    via = transfer_duration_s(problem, t, np.arange(problem.num_devices), placement[c])
                    via[placement[c]] = 0.0
                    tail[f] = np.maximum(tail[f], via + self.remaining[c])
        tail = np.minimum(tail, 10.0 * timeline.makespan_s)  # a missing link: effectively forbidden, not infinite
        current_tail = tail[np.arange(len(free)), placement[list(free)]]
        horizon = float(np.max(timeline.task_finish[list(free)] + current_tail))
        return Window(
            free_tasks=free,
            placement=placement.copy(),
            fixed_finish_s=fixed_finish,
            arrived_s=arrived,
            device_ready_s=device_ready,
            link_ready_s=link_ready,
            tail_s=tail,
            horizon_s=horizon,
            deadline_s=timeline.makespan_s,
        )


def latest_starts(problem: Problem, timeline: Timeline) -> np.ndarray:
    """Latest start of every task that keeps the makespan, with the schedule's orders fixed (backward pass)."""
    n = problem.num_tasks
    transfers = timeline.transfers
    # Schedule graph: tasks 0..n-1, transfers n..; edges follow data, device order and link order.
    successors: list[list[int]] = [[] for _ in range(n + len(transfers))]
    placement = timeline.placement.tolist()
    for sequence in timeline.device_order():
        for a, b in zip(sequence, sequence[1:], strict=False):
            successors[a].append(b)
    by_link: dict[tuple[int, int], list[tuple[float, int]]] = {}
    sent_to: dict[tuple[int, int], int] = {}
    for q, transfer in enumerate(transfers):
        node = n + q
        successors[int(problem.tensor_producer[transfer.tensor])].append(node)
        by_link.setdefault((transfer.src, transfer.dst), []).append((transfer.start, node))
        sent_to[transfer.tensor, transfer.dst] = node
    for queue in by_link.values():
        queue.sort()
        for (_, a), (_, b) in zip(queue, queue[1:], strict=False):
            successors[a].append(b)
    for t, consumers in enumerate(problem.tensor_consumers):
        u = int(problem.tensor_producer[t])
        for c in consumers:
            successors[sent_to.get((t, placement[c]), u)].append(c)
    node_duration = (timeline.task_finish - timeline.task_start).tolist() + [tr.finish - tr.start for tr in transfers]
    latest = [0.0] * len(successors)
    # A task's outputs for the model must still reach device 0 by the makespan.
    output_s = problem.costs.output_s[np.arange(n), timeline.placement].tolist()
    for node in reversed(_topological(successors)):
        finish = timeline.makespan_s - (output_s[node] if node < n else 0.0)
        for s in successors[node]:
            finish = min(finish, latest[s])
        latest[node] = finish - node_duration[node]
    return np.array(latest[:n])


def _topological(successors: list[list[int]]) -> list[int]:
    indegree = [0] * len(successors)
    for targets in successors:
        for s in targets:
            indegree[s] += 1
    order = [v for v, d in enumerate(indegree) if d == 0]
    for v in order:
        for s in successors[v]:
            indegree[s] -= 1
            if indegree[s] == 0:
                order.append(s)
    return order
