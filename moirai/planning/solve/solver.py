"""Running a built MILP: solver settings, HiGHS or Gurobi, progress lines, and the solution in seconds."""

from __future__ import annotations

import io
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyomo.common.collections import ComponentMap
from pyomo.contrib.solver.common.results import SolutionStatus, TerminationCondition

from moirai.errors import MoiraiWarning, user_stacklevel
from moirai.planning.highs import SolverOutcome, run_highs
from moirai.planning.simulate import Timeline
from moirai.planning.solve.model import MilpModel
from moirai.planning.solve.warm_start import warm_start_values

SOLVERS = ("highs", "gurobi")
_LOG_LINES_KEPT = 40


@dataclass(frozen=True)
class SolverSettings:
    solver: str = "highs"
    time_limit_s: float = 60.0
    mip_gap: float = 1e-4
    threads: int | None = None
    report: Callable[[str], None] | None = None  # receives status lines: incumbent, bound and gap in ms


@dataclass
class MilpSolution:
    """What a solve returned, in seconds; ``placement``/``start_s`` cover the window's free tasks."""

    status: str
    solver: str
    objective_s: float | None
    bound_s: float | None
    optimal: bool = False
    placement: dict[int, int] = field(default_factory=dict)
    start_s: dict[int, float] = field(default_factory=dict)
    transfer_start_s: dict[tuple[int, int], float] = field(default_factory=dict)
    solve_s: float = 0.0
    log_tail: list[str] = field(default_factory=list)

    @property
    def has_solution(self) -> bool:
        return self.objective_s is not None


def progress_text(stage: str, incumbent_s: float | None, bound_s: float | None) -> str:
    """``stage: incumbent 1.2345 ms, bound 1.1000 ms, gap 10.9%``: a status line in the problem's own time."""
    has_incumbent = incumbent_s is not None and math.isfinite(incumbent_s)
    has_bound = bound_s is not None and math.isfinite(bound_s)
    incumbent = f"{incumbent_s * 1e3:.4f} ms" if has_incumbent else "none yet"
    bound = f"{bound_s * 1e3:.4f} ms" if has_bound else "none yet"
    gap = "?"
    if has_incumbent and has_bound and incumbent_s > 0:
        gap = f"{max(0.0, incumbent_s - bound_s) / incumbent_s:.2%}"
    return f"{stage}: incumbent {incumbent}, bound {bound}, gap {gap}"


class _LogStream(io.TextIOBase):
    """Keeps the last lines of the solver's log; passes Gurobi's progress lines on to ``progress``.

    A Gurobi progress line ends its columns with ``... Incumbent BestBd Gap% ...``.
    """

    def __init__(self, progress: Callable[[float, float], None] | None) -> None:
        self.lines: list[str] = []
        self._partial = ""
        self._progress = progress

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._partial += text
        *complete, self._partial = self._partial.split("\n")
        for line in complete:
            if line.strip():
                self.lines.append(line.rstrip())
                del self.lines[:-_LOG_LINES_KEPT]
                if self._progress is not None:
                    self._pass_on_progress(line.split())
        return len(text)

    def _pass_on_progress(self, words: list[str]) -> None:
        gap_at = next((n for n, word in enumerate(words) if word.endswith("%")), None)
        if gap_at is None or gap_at < 2:
            return
        try:
            incumbent, bound = float(words[gap_at - 2]), float(words[gap_at - 1])
        except ValueError:
            return  # a "-" where no incumbent exists yet, or a line that is not a progress line
        self._progress(incumbent, bound)


def _progress_in_seconds(report: Callable[[str], None] | None, unit_s: float) -> Callable[[float, float], None] | None:
    """Turns the solver's (incumbent, bound) in model units into a status line for ``report``."""
    if report is None:
        return None
    return lambda incumbent, bound: report(progress_text("MILP", incumbent * unit_s, bound * unit_s))


def solve_model(built: MilpModel, settings: SolverSettings, warm_start: Timeline | None = None) -> MilpSolution:
    """Solve a built model within ``settings.time_limit_s``; never raises for solver trouble."""
    if settings.solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {settings.solver!r}")
    values = warm_start_values(built, warm_start) if warm_start is not None else None
    if settings.solver == "gurobi":
        solution = _solve_with(built, settings, values, "gurobi")
        if solution.status.startswith("unavailable"):
            warnings.warn(
                MoiraiWarning(f"Gurobi cannot solve this model ({solution.status}); using HiGHS"),
                stacklevel=user_stacklevel(),
            )
        else:
            return solution
    return _solve_with(built, settings, values, "highs")


def _solve_with(
    built: MilpModel, settings: SolverSettings, values: ComponentMap | None, solver_name: str
) -> MilpSolution:
    progress = _progress_in_seconds(settings.report, built.unit_s)
    # HiGHS reports its bounds through a callback; Gurobi's only come in its log.
    log = _LogStream(progress if solver_name == "gurobi" else None)
    started = time.perf_counter()
    run = _run_highs if solver_name == "highs" else _run_gurobi
    try:
        outcome = run(built, settings, values, log, progress)
    except Exception as error:  # noqa: BLE001 - a failing solver must fall back, never crash the placer
        kind = "unavailable" if _is_licence_or_missing(error) else "error"
        message = f"{kind}: {type(error).__name__}: {error}".splitlines()[0]
        return MilpSolution(message, solver_name, None, None, log_tail=log.lines)
    unit = built.unit_s
    bound_s = outcome.bound * unit if outcome.bound is not None and math.isfinite(outcome.bound) else None
    solution = MilpSolution(
        outcome.status,
        solver_name,
        None,
        bound_s,
        optimal=outcome.optimal,
        solve_s=time.perf_counter() - started,
        log_tail=log.lines,
    )
    if outcome.value is None:
        return solution
    value = outcome.value
    m = built.model
    solution.objective_s = value(built.objective_var) * unit
    for i in built.window.free_tasks:
        solution.placement[i] = max((k for (j, k) in m.x if j == i), key=lambda k: value(m.x[i, k]))
        solution.start_s[i] = value(m.S[i]) * unit
    for q in built.transfer_sources:
        if value(m.y[q]) > 0.5:
            solution.transfer_start_s[q] = value(m.R[q]) * unit
    return solution


def _run_highs(
    built: MilpModel,
    settings: SolverSettings,
    values: ComponentMap | None,
    log: _LogStream,
    progress: Callable[[float, float], None] | None,
) -> SolverOutcome:
    return run_highs(built.model, values, settings.time_limit_s, settings.mip_gap, settings.threads, log, progress)


def _run_gurobi(
    built: MilpModel,
    settings: SolverSettings,
    values: ComponentMap | None,
    log: _LogStream,
    progress: Callable[[float, float], None] | None,  # fed from the log instead
) -> SolverOutcome:
    from pyomo.contrib.solver.solvers.gurobi.gurobi_direct import GurobiDirect

    solver = GurobiDirect()
    if not solver.available():
        raise RuntimeError(f"gurobipy is not usable here ({solver.available()})")
    options: dict[str, Any] = {
        "tee": [log],
        "time_limit": max(settings.time_limit_s, 0.01),
        "rel_gap": settings.mip_gap,
        "abs_gap": 0.0,  # the relative gap only, as for HiGHS: model units can make any absolute gap too coarse
        "load_solutions": False,
        "raise_exception_on_nonoptimal_result": False,
    }
    if settings.threads is not None:
        options["threads"] = settings.threads
    if values is not None:
        for var, value in values.items():
            var.set_value(value, skip_validation=True)
        options["warmstart_discrete_vars"] = True
    results = solver.solve(built.model, **options)
    status = results.termination_condition.name
    optimal = results.termination_condition == TerminationCondition.convergenceCriteriaSatisfied
    bound = results.objective_bound
    if results.solution_status not in (SolutionStatus.feasible, SolutionStatus.optimal):
        return SolverOutcome(status, optimal, bound, None)
    results.solution_loader.load_vars()
    return SolverOutcome(status, optimal, bound, lambda var: float(var.value))


def _is_licence_or_missing(error: Exception) -> bool:
    text = str(error).lower()
    return any(word in text for word in ("licen", "size-limited", "too large", "not usable", "no module"))
