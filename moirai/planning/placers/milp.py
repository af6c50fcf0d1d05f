"""``milp``: the Moirai MILP (paper §III-D), anytime: never worse than the best heuristic, within its budget.

1. Every fast heuristic places the problem; the simulator judges them; the best is the start
   plan and its makespan the horizon (a valid big-M and upper bound for the model).
2. A problem small enough for one model (``FULL_MODEL_MAX_TASKS``, measured with
   ``bench/milp_ablation.py``) is solved whole by :mod:`moirai.planning.solve.model`, warm-started from
   the best plan, with whatever time the budget has left after the heuristics and the build.
3. A larger one first gets a better start: HEFT re-run with a lookahead (how long the best plan
   so far runs on after each task, on each device) while the simulator confirms a shorter makespan
   (:mod:`moirai.planning.solve.start_plans`; at that size it gains more per second than windows,
   [Note: lookahead before windows] in docs/design.md); then the window search of
   :mod:`moirai.planning.solve.search`: windows of the schedule re-solved as small MILPs, each kept only if
   the simulator confirms a shorter makespan, with chain moves (:mod:`moirai.planning.solve.chain_moves`: runs of
   tasks moved to another device at once) before it and wherever it reaches a local optimum.

The budget is an upper limit, not a target: the search returns as soon as the makespan is within
``mip_gap`` of the proven lower bound, or (window search) when no critical window improves the
plan any more. ``report.stop_reason`` (:class:`moirai.planning.report.StopReason`) says which.

The returned plan carries the placement, every device's order and every link's transfer
order, so the simulator replays the schedule found; ``lower_bound_s`` is the best proven bound
(the solver's, or the objective's own bound), ``report`` (a :class:`moirai.planning.report.SolverReport`) says what
ran and how it ended. Every comparison of plans is the ``objective``'s (:mod:`moirai.planning.objective`).
A solver that fails or cannot take the model (Gurobi's size-limited licence) leaves a warning
and the best plan found so far, never a traceback.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import numpy as np

from moirai import progress as progress_lines
from moirai.errors import InfeasibleError, MoiraiError, MoiraiWarning, user_stacklevel
from moirai.planning.bounds import format_bytes
from moirai.planning.objective import LATENCY, Objective
from moirai.planning.placers import register, start_plans, unbundled_if_better
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import BoundSource, SolverReport, StopReason
from moirai.planning.simulate import Timeline, simulate
from moirai.planning.solve.chain_moves import improve_by_chains
from moirai.planning.solve.costs import measured_costs
from moirai.planning.solve.formulation import FORMULATIONS, formulation_named
from moirai.planning.solve.model import build_model
from moirai.planning.solve.period_search import PeriodSearchResult, improve_period, kicked_search
from moirai.planning.solve.period_windows import window_search
from moirai.planning.solve.search import DEFAULT_WINDOW_TASKS, gap_closed, improve_by_windows, window_sizes
from moirai.planning.solve.solver import SOLVERS, MilpSolution, SolverSettings, progress_text, solve_model
from moirai.planning.solve.start_plans import improve_start_plan
from moirai.planning.solve.warm_start import plan_from_times, relabel_identical_devices
from moirai.planning.solve.window import whole_problem

logger = logging.getLogger(__name__)
_SIMULATE_S_PER_TASK = measured_costs().simulate_s_per_task
FULL_MODEL_MAX_TASKS = 24
STRATEGIES = ("auto", "full", "windows")
_HEURISTIC_SHARE = 0.3  # of the budget, at most, for start plans on a large problem
# Of what is left after them, at most, for the lower bound's ancestor counting (beyond it the bound is weaker).
_BOUND_SHARE = 0.25
# Of what is left after the heuristics, at most, for lookahead rounds, which stop earlier when they stall: on large
# graphs they gain more than windows do ([Note: lookahead share] in docs/design.md).
_LOOKAHEAD_SHARE = 0.9
_SAFETY_S = 0.05
_MIN_SEARCH_S = 0.3  # the window search needs more than this to solve a window
# The least turn a window search gets while time is left: an equal share of a budget's last second among several
# searches is too short to solve a window, and they would take turns doing nothing until the deadline.
_MIN_TURN_S = 1.0
_CONTIGUOUS_SHARE = 0.3  # of what the start plans left, at most, for the contiguous DP's predicted time
_CONTIGUOUS_MEASURED_DEVICES = 4  # its measured time is for this many devices; it grows about as their square
FAR_START = 1.5  # the period search descends from start plans within this factor of the best start's value
# Of what the lookahead left, at most, for chain moves before the first descent ([Note: chain moves] in docs/design.md).
_CHAIN_SHARE = 0.3
_WINDOW_STARTS = 4  # the most start plans the latency window search starts from ([Note: window restarts])
# Of the time left, at most, for the latency search that looks for a start plan under a latency limit no heuristic met.
_LATENCY_START_SHARE = 0.5


def _solves_whole(problem: Problem, options: dict[str, Any]) -> bool:
    """Whether the milp placer solves ``problem`` as one model with these options: then its rows keep every
    colocated set on one device, without grouping the tasks between members (the registry's contraction)."""
    strategy = options.get("strategy", "auto")
    return strategy == "full" or (strategy == "auto" and problem.num_tasks <= FULL_MODEL_MAX_TASKS)


@register(
    "milp",
    minimises=True,
    respects_memory=True,
    keeps_sets=_solves_whole,
    choices={"solver": SOLVERS, "formulation": FORMULATIONS, "strategy": STRATEGIES},
)
def place_milp(
    problem: Problem,
    solver: str = "highs",
    time_limit_s: float = 60.0,
    mip_gap: float = 1e-4,
    threads: int | None = None,
    formulation: str = "strong",
    strategy: str = "auto",
    window_tasks: int = DEFAULT_WINDOW_TASKS,
    progress: bool | None = None,
    objective: Objective = LATENCY,
) -> Plan:
    """Place and schedule ``problem`` with the MILP within ``time_limit_s`` seconds of wall time.

    ``solver``: ``"highs"`` or ``"gurobi"`` (falls back to HiGHS with a warning when Gurobi cannot
    take the model). ``mip_gap``: relative gap to the proven lower bound at which the search stops. ``threads``:
    solver threads (solver default if None). ``formulation``: ``"strong"`` or the paper's literal
    ``"paper"``. ``strategy``: ``"auto"`` (whole model up to ``FULL_MODEL_MAX_TASKS`` tasks, window
    search beyond), ``"full"`` or ``"windows"``. ``window_tasks``: tasks freed per window.
    ``progress``: a rich status line on stderr (default: as the caller's progress says, else when stderr is a
    terminal; inside compile, the ``place`` stage's line shows the search). ``objective``: what
    the plan minimises (:func:`moirai.place` passes it).
    """
    deadline = time.perf_counter() + time_limit_s
    show, status = _status_line(progress)
    with status if status is not None else nullcontext():
        report = status.update if status is not None else progress_lines.update if show else (lambda _: None)
        settings = SolverSettings(solver, time_limit_s, mip_gap, threads, report if show else None)
        phases_s: dict[str, float] = {}
        start_plan, timeline, heuristics, starts = _best_heuristic(problem, deadline, report, objective)
        lap = _lap(phases_s, "start plans", deadline - time_limit_s)
        finish_by = deadline - _finishing_time(problem)
        bound_s = objective.lower_bound_s(problem, deadline=lap + _BOUND_SHARE * (finish_by - lap))
        lap = _lap(phases_s, "bound", lap)
        whole = _solves_whole(problem, {"strategy": strategy})
        info = SolverReport(solver=solver, formulation=formulation, heuristics=heuristics, phases_s=phases_s)
        if whole and timeline is not None and gap_closed(objective.value_s(timeline), bound_s, mip_gap):
            plan, info.strategy, info.stop_reason = start_plan, "full", StopReason.GAP_CLOSED
        elif whole and (objective.milp_models_value or problem.colocated):
            # (Colocated sets: the whole MILP keeps them itself, which neither contiguous nor the period search do.)
            plan, timeline = _solve_whole(problem, start_plan, timeline, settings, finish_by, info, objective)
        elif whole:
            plan, timeline = _solve_whole_then_judge(
                problem, starts, start_plan, timeline, settings, finish_by, report, bound_s, info, objective
            )
        elif not objective.windows_apply:
            # Lookahead rounds and windows shorten a schedule's critical path: the period gets its own search.
            plan, timeline = _search_period(
                problem, starts, finish_by, settings, window_tasks, report, bound_s, info, objective
            )
        elif start_plan is None:
            raise InfeasibleError(
                f"no heuristic found a placement that {_acceptable_words(objective)} and the graph is too large "
                "for one MILP "
                f"(model needs {format_bytes(float(problem.memory_bytes.sum()))}, cluster has "
                f"{format_bytes(float(problem.memory_capacity_bytes.sum()))}); {_remedy(objective)}"
            )
        else:
            plan, timeline = _search_large(
                problem,
                starts,
                start_plan,
                timeline,
                finish_by,
                settings,
                window_tasks,
                report,
                bound_s,
                info,
                objective,
            )
    lap = _lap(phases_s, "search", lap)
    if not timeline.fits_memory:
        # The model and the search enforce memory; this guards the promise, never a silent overflow.
        warnings.warn(
            MoiraiWarning("the MILP search produced a plan over memory; using the best heuristic plan"),
            stacklevel=user_stacklevel(),
        )
        plan, timeline = _fallback(problem, start_plan, start_plan and simulate(problem, start_plan), objective)
    final = _with_transfer_order(problem, plan, timeline)
    final.placer = "milp"
    final.lower_bound_s = bound_s
    solver_bound_s = info.solver_bound_s if objective.milp_bounds_value else None  # else not a bound of the value
    if solver_bound_s is not None and solver_bound_s > bound_s:
        final.lower_bound_s, info.bound_source = solver_bound_s, BoundSource.SOLVER
    if info.stop_reason is StopReason.PART_SOLVED and gap_closed(
        objective.value_s(timeline), final.lower_bound_s, mip_gap
    ):
        info.stop_reason = StopReason.GAP_CLOSED  # closed by the objective's own bound
    info.keep_gap_claim_true(objective.value_s(timeline), final.lower_bound_s, mip_gap)
    _lap(phases_s, "finishing", lap)
    info.time_limit_s, info.elapsed_s = time_limit_s, time.perf_counter() - (deadline - time_limit_s)
    final.report = info
    logger.info(
        "milp: %s search stopped (%s) after %.2f s of %.2f s, %s bound %.6g s",
        info.strategy,
        info.stop_reason,
        info.elapsed_s,
        time_limit_s,
        objective.name,
        final.lower_bound_s,
    )
    return final


def _lap(phases_s: dict[str, float], phase: str, since: float) -> float:
    """Add the seconds from ``since`` (a ``time.perf_counter`` value) to now to ``phases_s[phase]``; returns now."""
    now = time.perf_counter()
    phases_s[phase] = phases_s.get(phase, 0.0) + now - since
    return now


def _status_line(progress: bool | None) -> tuple[bool, Any]:
    """Whether to report, and a status line of the placer's own (None: the running stage's, or none).

    ``progress=None`` follows the caller: silent under ``progress=False``, the stage's line where one reports
    (compile's ``place``), else a line of its own in a terminal.
    """
    if progress is False or (progress is None and progress_lines.silenced()):
        return False, None
    if progress_lines.showing():
        return True, None
    show = progress or sys.stderr.isatty()
    return show, _status() if show else None


def _status() -> Any:
    from rich.console import Console

    # Solvers may capture the process's stderr while they run; draw on a copy of it.
    console = Console(file=os.fdopen(os.dup(2), "w"), stderr=True)
    return console.status("[bold]milp[/] start plans")


def _best_heuristic(
    problem: Problem, deadline: float, report: Any, objective: Objective
) -> tuple[Plan | None, Timeline | None, dict[str, float], dict[str, tuple[Plan, Timeline]]]:
    """The acceptable heuristic plan (memory first) best by ``objective``, every heuristic's objective value, and
    every acceptable heuristic plan by name.

    The heuristics are the placers whose spec names a start-plan rank and serves ``objective``, most promising
    (lowest rank) first; one whose measured time (:mod:`moirai.planning.solve.costs`) does not fit what is left
    of the start-plan budget is not started."""
    started = time.perf_counter()
    budget = (deadline - started) * _HEURISTIC_SHARE
    best: tuple[Plan, Timeline] | None = None
    values: dict[str, float] = {}
    plans: dict[str, tuple[Plan, Timeline]] = {}
    for heuristic in start_plans(objective.plans_like):
        name = heuristic.name
        predicted = measured_costs().start_plan_time_s(name, problem.num_tasks)
        if best is not None and time.perf_counter() - started + predicted > budget:
            logger.debug("start plan %s skipped: predicted %.3g s, more than the budget has left", name, predicted)
            continue
        report(f"start plan: {name}")
        try:
            # The registry's memory check has passed for the milp placer; colocated sets here (the milp keeps them
            # itself) need the registry's contraction for a heuristic.
            plan = (heuristic.checked if problem.colocated else heuristic.function)(problem)
            plan = unbundled_if_better(problem, plan, objective)  # as place() makes of the heuristic's own plan
            timeline = simulate(problem, plan)
        except MoiraiError as error:
            logger.debug("start plan %s skipped: %s", name, error)  # e.g. a heuristic that cannot respect memory here
            continue
        except Exception as error:  # noqa: BLE001 - one broken heuristic must not stop the MILP
            warnings.warn(
                MoiraiWarning(f"heuristic {name!r} failed ({type(error).__name__}: {error}); skipping it"),
                stacklevel=user_stacklevel(),
            )
            continue
        if not objective.acceptable(timeline):
            logger.debug("start plan %s skipped: not acceptable to the %s objective", name, objective.name)
            continue
        values[name] = objective.value_s(timeline)
        plans[name] = (plan, timeline)
        if best is None or objective.improves(timeline, best[1]):
            best = (plan, timeline)
    if best is None:
        return None, None, values, plans
    return best[0], best[1], values, plans


def _with_contiguous(
    problem: Problem,
    starts: dict[str, tuple[Plan, Timeline]],
    deadline: float,
    report: Any,
    info: SolverReport,
    objective: Objective,
) -> dict[str, tuple[Plan, Timeline]]:
    """``starts`` with the ``contiguous`` placer's plan added where its predicted time fits
    ``_CONTIGUOUS_SHARE`` of the time left (and it finds an acceptable plan)."""
    starts = dict(starts)
    predicted_s = measured_costs().start_plan_time_s("contiguous", problem.num_tasks)
    predicted_s *= max(1.0, problem.num_devices / _CONTIGUOUS_MEASURED_DEVICES) ** 2  # measured on 4 devices
    if predicted_s > _CONTIGUOUS_SHARE * (deadline - time.perf_counter()):
        logger.debug("start plan contiguous skipped: predicted %.3g s, more than its share of the budget", predicted_s)
        return starts
    report("start plan: contiguous")
    from moirai.planning.placers.contiguous import place_contiguous

    try:
        plan = place_contiguous(problem, objective=objective)
        timeline = simulate(problem, plan)
    except InfeasibleError as error:
        logger.debug("start plan contiguous skipped: %s", error)
        return starts
    if objective.acceptable(timeline):
        starts["contiguous"] = (plan, timeline)
        info.heuristics["contiguous"] = objective.value_s(timeline)
    return starts


def _distinct_best_first(plans: list[tuple[Plan, Timeline]], objective: Objective) -> list[tuple[Plan, Timeline]]:
    """``plans`` best first by ``objective``, each placement once (the best of those sharing it)."""
    return _distinct_first(sorted(plans, key=lambda pt: objective.rank(pt[1])))


def _search_period(
    problem: Problem,
    starts: dict[str, tuple[Plan, Timeline]],
    deadline: float,
    settings: SolverSettings,
    window_tasks: int,
    report: Any,
    bound_s: float,
    info: SolverReport,
    objective: Objective,
) -> tuple[Plan, Timeline]:
    """The period search (:mod:`moirai.planning.solve.period_search`) from the start plans, ``contiguous`` among
    them where its predicted time fits its share of the budget, best first, each distinct placement within
    :data:`FAR_START` of the best start's value in turn with an equal share of the time left (a search that stops
    early leaves its time to the others; the best start's alone runs escape passes), then windows and kicks from the
    best while time is left. The best plan wins. Under a latency limit no start meets, the latency search first
    looks for one (:func:`_start_under_the_limit`)."""
    starts = _with_contiguous(problem, starts, deadline, report, info, objective)
    if not starts and objective.latency_limit_s is not None:
        starts = _start_under_the_limit(problem, deadline, settings, window_tasks, report, info, objective)
    if not starts:
        raise InfeasibleError(
            f"no heuristic found a placement that {_acceptable_words(objective)}; {_remedy(objective)}"
        )
    pending = _distinct_best_first(list(starts.values()), objective)
    best = pending[0]
    # A start far from the best is not descended: each move a descent keeps is simulated (period_search.py, [Note:
    # moves judged by the value]), and from HEFT's 2.9x plan a descent took 0.5 s to end at 2.6x.
    pending = [start for start in pending if objective.value_s(start[1]) <= FAR_START * objective.value_s(best[1])]
    info.strategy, info.window_starts = "period search", len(pending)
    info.history = [(0.0, objective.value_s(best[1]))]
    while pending:
        escapes = len(pending) == info.window_starts  # the best start alone: an escape pass simulates every move
        plan, timeline = pending.pop(0)
        until = time.perf_counter() + (deadline - time.perf_counter()) / (len(pending) + 1)
        report(progress_text("period search", objective.value_s(best[1]), bound_s))
        search = improve_period(problem, plan, timeline, until, bound_s, settings.mip_gap, objective, escapes)
        best = _shorter_of(search, best, info, objective)
        if search.stop_reason is StopReason.GAP_CLOSED:
            info.stop_reason = StopReason.GAP_CLOSED
            return best
    # Time left (a start whose share ran out left the others theirs, which they may not have used): windows and kicks
    # from the best, in turn, while either gains.
    stopped_by_time = time.perf_counter() >= deadline
    searches = itertools.cycle([("windows", window_search), ("kicks", kicked_search)])
    stalled = 0
    while not stopped_by_time and stalled < 2:
        name, search_from = next(searches)
        report(progress_text(f"period search, {name}", objective.value_s(best[1]), bound_s))
        search = search_from(problem, *best, deadline, bound_s, settings.mip_gap, objective)
        stalled = 0 if objective.improves(search.timeline, best[1]) else stalled + 1
        best = _shorter_of(search, best, info, objective)
        if search.stop_reason is StopReason.GAP_CLOSED:
            info.stop_reason = StopReason.GAP_CLOSED
            return best
        stopped_by_time = search.stop_reason is StopReason.TIME_LIMIT
    info.stop_reason = StopReason.TIME_LIMIT if stopped_by_time else StopReason.NO_IMPROVING_MOVE
    return best


def _start_under_the_limit(
    problem: Problem,
    deadline: float,
    settings: SolverSettings,
    window_tasks: int,
    report: Any,
    info: SolverReport,
    objective: Objective,
) -> dict[str, tuple[Plan, Timeline]]:
    """A start plan that meets ``objective``'s latency limit where no heuristic's does: the latency search the milp
    placer runs for objective latency (lookahead, chain moves, windows), with ``_LATENCY_START_SHARE`` of the time
    left, stopping once its makespan is within the limit. Raises InfeasibleError when it finds none: the limit may
    still be reachable, with more time."""
    limit_s = float(objective.latency_limit_s)
    search_by = time.perf_counter() + _LATENCY_START_SHARE * (deadline - time.perf_counter())
    start_plan, timeline, _, starts = _best_heuristic(problem, search_by, report, LATENCY)
    if start_plan is not None and not objective.acceptable(timeline):
        # A makespan within the limit closes the gap to this "bound" (value - bound <= gap * value: value <= limit).
        stop_at_s = limit_s * (1.0 - settings.mip_gap)
        latency_info = SolverReport(solver=info.solver, formulation=info.formulation)
        start_plan, timeline = _search_large(
            problem,
            starts,
            start_plan,
            timeline,
            search_by,
            settings,
            window_tasks,
            report,
            stop_at_s,
            latency_info,
            LATENCY,
        )
        info.heuristics["latency search"] = objective.value_s(timeline)
    if start_plan is None or not objective.acceptable(timeline):
        raise InfeasibleError(
            f"no plan found within the time limit that {_acceptable_words(objective)} (the latency search's "
            f"shortest: {timeline.makespan_s:g} s); raise the limit or the time limit"
            if timeline is not None
            else f"no heuristic found a placement that fits memory; {_remedy(objective)}"
        )
    return {"latency search": (start_plan, timeline)}


def _shorter_of(
    search: PeriodSearchResult, best: tuple[Plan, Timeline], info: SolverReport, objective: Objective
) -> tuple[Plan, Timeline]:
    """``best``, or the search's plan where ``objective`` prefers it (its history then the report's); the search's
    moves and kicks counted in ``info``."""
    info.moves_tried += search.moves_tried
    info.moves_kept += search.moves_kept
    info.kicks += search.kicks
    info.kicks_kept += search.kicks_kept
    info.windows += search.windows
    info.windows_kept += search.windows_kept
    if not objective.improves(search.timeline, best[1]):
        return best
    info.history = search.history
    return search.plan, search.timeline


def _search_large(
    problem: Problem,
    starts: dict[str, tuple[Plan, Timeline]],
    start_plan: Plan,
    timeline: Timeline,
    deadline: float,
    settings: SolverSettings,
    window_tasks: int,
    report: Any,
    bound_s: float,
    info: SolverReport,
    objective: Objective,
) -> tuple[Plan, Timeline]:
    """Lookahead rounds from the best heuristic plan, chain moves from its result (at most ``_CHAIN_SHARE`` of the
    time left), then the window search from several starts, sharing the time: that plan and the best heuristic
    plan; each time a descent (windows of the first size only) reaches its local optimum, chain moves go on from
    it, and if they keep one a new descent starts from theirs; else the next start joins, ``contiguous``'s where
    its predicted time fits and then the next best heuristic plans, up to ``_WINDOW_STARTS`` distinct placements,
    and the stalled search goes on with growing windows. Each search not yet at a local optimum gets an equal share
    of what is left (at least ``_MIN_TURN_S`` of it), in turn, and resumes where it stopped (its plan, its window
    size); a search that stops early leaves its time to the others. The shortest plan found wins.

    Why several: neither the lookahead's nor the heuristic's start reaches the better local optimum on every
    graph ([Note: windows from both starts] in docs/design.md).
    """
    report("start plan: HEFT with lookahead")
    lap = time.perf_counter()
    lookahead_by = lap + _LOOKAHEAD_SHARE * (deadline - lap)
    lookahead = improve_start_plan(problem, start_plan, timeline, lookahead_by, objective)
    lap = _lap(info.phases_s, "lookahead", lap)
    others = _with_contiguous(problem, starts, deadline, report, info, objective)
    lap = _lap(info.phases_s, "contiguous", lap)
    firsts = [(lookahead.plan, lookahead.timeline), (start_plan, timeline)]
    ranked = _distinct_best_first(list(others.values()), objective)
    if "contiguous" in others:  # a different shape of plan from the list schedulers': always among the starts
        ranked.insert(0, others["contiguous"])
    # Searches not at a local optimum yet, in turn (the window size to resume at; None: a descent, not grown yet):
    # the lookahead's and the best heuristic's first; each descent that stalls brings in the next start.
    chosen = _distinct_first(firsts + ranked)[:_WINDOW_STARTS]
    pending: list[tuple[Plan, Timeline, int | None]] = [(plan, plan_timeline, None) for plan, plan_timeline in chosen]
    first = len(_distinct_first(firsts))  # one where the lookahead kept the heuristic's plan
    later, pending = pending[first:], pending[:first]
    info.strategy = "windows"
    info.lookahead_rounds, info.lookahead_improved = lookahead.rounds, lookahead.improved
    info.lookahead_objective_s = objective.value_s(lookahead.timeline)
    info.window_tasks, info.window_starts = window_tasks, 0
    info.history = [(0.0, info.lookahead_objective_s)]
    best: tuple[Plan, Timeline] | None = None  # the first search's result (never worse than its start), or shorter
    if _CHAIN_SHARE > 0 and pending:
        plan, plan_timeline, _ = pending[0]
        chains_by = time.perf_counter() + _CHAIN_SHARE * (deadline - time.perf_counter())
        chains = improve_by_chains(problem, plan, plan_timeline, chains_by, objective)
        info.moves_tried += chains.moves_tried
        info.moves_kept += chains.moves_kept
        pending[0] = (chains.plan, chains.timeline, None)
        _lap(info.phases_s, "chains", lap)
    gap_is_closed = False
    can_grow = len(window_sizes(window_tasks, problem.num_tasks)) > 1
    while (pending or later) and not gap_is_closed and deadline - time.perf_counter() > _MIN_SEARCH_S:
        if not pending:
            pending.append(later.pop(0))
        plan, start_timeline, resume_tasks = pending.pop(0)
        info.window_starts += resume_tasks is None
        now = time.perf_counter()
        until = now + max((deadline - now) / (len(pending) + 1), min(deadline - now, _MIN_TURN_S))
        report("window search")
        search_started = time.perf_counter()
        search = improve_by_windows(
            problem,
            plan,
            start_timeline,
            until,
            settings,
            window_tasks,
            lambda text: report(f"{text}; {max(0.0, deadline - time.perf_counter()):.0f} s left"),
            bound_s,
            objective,
            resume_tasks,
            grow=resume_tasks is not None,
            best_so_far_s=math.inf if best is None else objective.value_s(best[1]),
        )
        info.windows_tried += search.windows_tried
        info.windows_improved += search.windows_improved
        info.windows_unproven += search.windows_unproven
        info.window_tasks = max(info.window_tasks, search.window_tasks)
        if best is None or objective.improves(search.timeline, best[1]):
            best = (search.plan, search.timeline)
            info.history = search.history
        gap_is_closed = search.stop_reason == StopReason.GAP_CLOSED
        stalled = search.stop_reason == StopReason.NO_IMPROVING_WINDOW
        if stalled and resume_tasks is None:
            # Windows of this size are at a local optimum: moving whole chains may leave it for a better descent.
            chains_by = time.perf_counter() + (deadline - time.perf_counter()) / (len(pending) + 1)
            chains = improve_by_chains(problem, search.plan, search.timeline, chains_by, objective)
            info.moves_tried += chains.moves_tried
            info.moves_kept += chains.moves_kept
            if chains.moves_kept:
                if objective.improves(chains.timeline, best[1]):
                    best = (chains.plan, chains.timeline)
                    info.history = [*search.history, (time.perf_counter() - search_started, objective.value_s(best[1]))]
                pending.append((chains.plan, chains.timeline, None))  # a new descent from where the moves got
                info.window_starts -= 1  # the same start, going on
                continue
        if stalled and resume_tasks is None and later:
            pending.append(later.pop(0))  # a restart, before this search's larger windows
        if search.stop_reason == StopReason.TIME_LIMIT or (stalled and resume_tasks is None and can_grow):
            pending.append((search.plan, search.timeline, search.window_tasks))
    if best is None:
        best = (lookahead.plan, lookahead.timeline)
    info.stop_reason = (
        StopReason.GAP_CLOSED
        if gap_is_closed
        else StopReason.TIME_LIMIT
        if pending or later
        else StopReason.NO_IMPROVING_WINDOW
    )
    report(
        f"{progress_text('window search', objective.value_s(best[1]), bound_s)}; "
        f"{info.windows_tried} windows from {info.window_starts} start plan(s)"
    )
    return best[0], best[1]


def _distinct_first(plans: list[tuple[Plan, Timeline]]) -> list[tuple[Plan, Timeline]]:
    """``plans`` in their order, each placement once (its first)."""
    distinct, seen = [], set()
    for plan, timeline in plans:
        if timeline.placement.tobytes() not in seen:
            seen.add(timeline.placement.tobytes())
            distinct.append((plan, timeline))
    return distinct


def _solve_whole_then_judge(
    problem: Problem,
    starts: dict[str, tuple[Plan, Timeline]],
    start_plan: Plan | None,
    timeline: Timeline | None,
    settings: SolverSettings,
    deadline: float,
    report: Any,
    bound_s: float,
    info: SolverReport,
    objective: Objective,
) -> tuple[Plan, Timeline]:
    """The full MILP for an objective whose value its rows do not price (the served period: they price the period),
    from the best start by the value, ``contiguous`` among the starts, then the period search from the better of
    the two while time is left: the MILP's optimum may send work there and back, and a start or a move from it may
    serve faster (on 7-task problems, milp once returned pipeline's 4.80 s where contiguous served at 3.64)."""
    starts = _with_contiguous(problem, starts, deadline, report, info, objective)
    if starts:
        start_plan, timeline = _distinct_best_first(list(starts.values()), objective)[0]
    plan, timeline = _solve_whole(problem, start_plan, timeline, settings, deadline, info, objective)
    if time.perf_counter() >= deadline or gap_closed(objective.value_s(timeline), bound_s, settings.mip_gap):
        return plan, timeline
    search = improve_period(problem, plan, timeline, deadline, bound_s, settings.mip_gap, objective, escapes=True)
    if objective.improves(search.timeline, timeline):
        info.moves_tried, info.moves_kept = search.moves_tried, search.moves_kept
        return search.plan, search.timeline
    return plan, timeline


def _solve_whole(
    problem: Problem,
    start_plan: Plan | None,
    timeline: Timeline | None,
    settings: SolverSettings,
    deadline: float,
    info: SolverReport,
    objective: Objective,
) -> tuple[Plan, Timeline]:
    """The full MILP, warm-started from ``start_plan``; falls back to it if the solver finds nothing better or
    nothing ``objective`` accepts (the model need not hold its limit: TTFT), and raises InfeasibleError when there
    is no start plan to fall back to."""
    if start_plan is not None and formulation_named(info.formulation).breaks_symmetry:
        start_plan, timeline = _relabeled(problem, start_plan)
    horizon = _horizon_s(problem, timeline, objective)
    try:
        built = build_model(problem, whole_problem(problem, horizon), info.formulation, objective)
    except InfeasibleError as error:  # the horizon (a latency limit) admits no plan
        info.stop_reason, info.solver_status = StopReason.SOLVER_STATUS, str(error)
        return _fallback(problem, start_plan, timeline, objective)
    remaining = deadline - time.perf_counter() - _SAFETY_S
    info.strategy = "full"
    info.binaries, info.constraints, info.build_s = built.size.binaries, built.size.constraints, built.size.build_s
    if remaining <= 0.05:
        warnings.warn(
            MoiraiWarning("the time budget ran out building the MILP; returning the best heuristic plan"),
            stacklevel=user_stacklevel(),
        )
        info.stop_reason = StopReason.TIME_LIMIT
        return _fallback(problem, start_plan, timeline, objective)
    settings = replace(settings, time_limit_s=remaining)
    solution = solve_model(built, settings, timeline)
    info.stop_reason = _stop_reason(solution, objective)
    info.solver_status = solution.status
    info.solver = solution.solver
    info.solver_objective_s, info.solver_bound_s = solution.objective_s, solution.bound_s
    info.solve_s, info.solver_log_tail = solution.solve_s, solution.log_tail[-8:]
    if not solution.has_solution:
        if solution.status.startswith(("error", "unavailable")):
            warnings.warn(
                MoiraiWarning(f"the MILP solver failed ({solution.status}); using the best heuristic plan"),
                stacklevel=user_stacklevel(),
            )
        return _fallback(problem, start_plan, timeline, objective)
    placement = np.array([solution.placement[i] for i in range(problem.num_tasks)])
    start = np.array([solution.start_s[i] for i in range(problem.num_tasks)])
    plan = plan_from_times(problem, placement, start, solution.transfer_start_s, "milp")
    solved = simulate(problem, plan)
    if not objective.acceptable(solved):  # a limit the model does not hold (TTFT): the start, else none
        return _fallback(problem, start_plan, timeline, objective)
    if timeline is not None and objective.improves(timeline, solved):
        return start_plan, timeline
    return plan, solved


def _stop_reason(solution: MilpSolution, objective: Objective) -> StopReason:
    """Why the whole-model solve ended, in the terms the window search uses where they apply."""
    if solution.optimal and not objective.milp_models_value:
        return StopReason.PART_SOLVED  # optimal for the part the MILP models, which is not the objective's value
    if solution.optimal:
        return StopReason.GAP_CLOSED  # the solver proved the gap at most ``mip_gap``
    if "timelimit" in solution.status.lower().replace(" ", ""):  # HiGHS: "Time limit reached"; Gurobi: maxTimeLimit
        return StopReason.TIME_LIMIT
    return StopReason.SOLVER_STATUS


def _acceptable_words(objective: Objective) -> str:
    """What an acceptable plan must do, in words: fit memory, and meet the objective's limit where it has one."""
    return "fits memory" if objective.limit is None else f"fits memory and meets {objective.limit}"


def _remedy(objective: Objective) -> str:
    if objective.limit is None:
        return "add memory or devices"
    return f"raise the limit ({objective.limit}; the objective without it finds the shortest), or add devices"


def _fallback(
    problem: Problem, start_plan: Plan | None, timeline: Timeline | None, objective: Objective = LATENCY
) -> tuple[Plan, Timeline]:
    if start_plan is None and objective.limit is not None:
        raise InfeasibleError(
            f"neither the heuristics nor the MILP found a plan that {_acceptable_words(objective)}; "
            f"{_remedy(objective)}"
        )
    if start_plan is None:
        raise InfeasibleError(
            "neither the heuristics nor the MILP found a placement that fits memory "
            f"(model needs {format_bytes(float(problem.memory_bytes.sum()))}, cluster has "
            f"{format_bytes(float(problem.memory_capacity_bytes.sum()))} over {problem.num_devices} devices); "
            "add memory or devices, or give the MILP more time"
        )
    return start_plan, timeline


def _relabeled(problem: Problem, plan: Plan) -> tuple[Plan, Timeline]:
    """The same plan with identical devices renamed to obey the model's symmetry-breaking rows."""
    mapping = relabel_identical_devices(problem, plan.placement)
    order = None
    if plan.order is not None:
        by_device = [()] * problem.num_devices
        for old, tasks in enumerate(plan.order):
            by_device[mapping[old]] = tasks
        order = tuple(by_device)
    transfer_order = None
    if plan.transfer_order is not None:
        transfer_order = {(int(mapping[a]), int(mapping[b])): q for (a, b), q in plan.transfer_order.items()}
    relabeled = Plan(mapping[plan.placement], plan.device_names, order, transfer_order, plan.placer)
    return relabeled, simulate(problem, relabeled)


def _with_transfer_order(problem: Problem, plan: Plan, timeline: Timeline) -> Plan:
    """The plan (simulated as ``timeline``) with every device's and link's order written out as it ran."""
    order = plan.order if plan.order is not None else timeline.device_order()
    explicit = Plan(plan.placement, plan.device_names, order, timeline.transfer_order(), plan.placer)
    explicit.makespan_s = simulate(problem, explicit).makespan_s
    if explicit.makespan_s != timeline.makespan_s:  # a tie on a link replayed differently: keep the plan as it was
        return replace(plan, makespan_s=timeline.makespan_s)
    return explicit


def _horizon_s(problem: Problem, timeline: Timeline | None, objective: Objective) -> float:
    """An upper bound on the makespan of the plans worth modelling: the objective's
    (:meth:`moirai.planning.objective.Objective.makespan_horizon_s`), else a makespan every placement can reach."""
    horizon = objective.makespan_horizon_s(timeline)
    return float(horizon) if horizon is not None else _serial_upper_bound(problem)


def _serial_upper_bound(problem: Problem) -> float:
    """A makespan and a period every placement reaches: every cost of a request one after another, from the latest
    release (headers, model inputs, the driver's own work) to the slowest output's way back, with every possible
    transfer (its send and receive included) and every per-request charge in between."""
    return _serial_makespan_s(problem) + _charges_upper_bound_s(problem)


def _serial_makespan_s(problem: Problem) -> float:
    """All work and every possible transfer one after another, after the latest release and before the slowest
    output: a schedule every placement has."""
    per_transfer = problem.transfer_s + problem.send_cpu_s + problem.recv_cpu_s
    transfers = _finite_max(per_transfer, axis=(1, 2)).sum() * problem.num_devices
    costs = problem.costs
    release_s = float(_finite_max(costs.release_s, axis=(0, 1)))
    output_s = float(_finite_max(costs.output_s, axis=(0, 1)))
    return release_s + float(_finite_max(problem.compute_s, axis=1).sum() + transfers) + output_s


def _charges_upper_bound_s(problem: Problem) -> float:
    """Every per-request charge (the runtime's work, the messages' CPU and link time) summed: more than any
    placement adds to a device's or link's load per request."""
    costs = problem.costs
    arrays = (*costs.charges[:-1], costs.input_link_s, costs.output_link_s)
    return float(sum(np.where(np.isfinite(a), a, 0.0).sum() for a in arrays))


def _finite_max(values: np.ndarray, axis: int | tuple[int, ...]) -> np.ndarray:
    """The largest finite value along ``axis`` (0 where there is none)."""
    return np.where(np.isfinite(values), values, 0.0).max(axis=axis, initial=0.0)


def _finishing_time(problem: Problem) -> float:
    """Time kept back for writing out the plan's orders and simulating it twice (here and in ``place``)."""
    return 0.05 + 2 * _SIMULATE_S_PER_TASK * problem.num_tasks
