"""What a placer says about how it found its plan (``Plan.report``), typed instead of a free-form dict."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from moirai.errors import PlanError
from moirai.file_numbers import float_fault, int_fault


class StopReason(enum.Enum):
    """Why a solver-based search ended."""

    GAP_CLOSED = "gap closed"  # within the relative gap of a proven lower bound
    NO_IMPROVING_WINDOW = "no improving window"  # every critical window re-solved without gain
    NO_IMPROVING_MOVE = "no improving move"  # a full pass of the period search's moves kept none
    TIME_LIMIT = "time limit"
    SOLVER_STATUS = "solver status"  # the solver ended otherwise; ``solver_status`` says how
    # The MILP of part of the objective (a generation's decode step) was solved within its gap; the objective's own
    # gap to its bound is not closed.
    PART_SOLVED = "modelled part solved"
    # The gap was closed for the problem with every colocation group merged into one task
    # (:mod:`moirai.planning.colocation`), whose plans the original's can beat: no gap of the original is closed.
    GAP_CLOSED_GROUPED = "gap closed with colocated tasks grouped"


def gap_closed(value_s: float, lower_bound_s: float, mip_gap: float) -> bool:
    """The objective is within the relative gap ``mip_gap`` of a proven lower bound: nothing worth finding is left."""
    return value_s - lower_bound_s <= mip_gap * value_s


class BoundSource(enum.Enum):
    """Where a plan's ``lower_bound_s`` comes from."""

    BOUNDS = "bounds"  # moirai.planning.bounds: critical path and load LP
    SOLVER = "solver"  # the MILP's proven bound, when it is stronger


@dataclass
class PlacerReport:
    """What every placer may say: the makespan of the schedule it built itself (list schedulers, HEFT: the
    simulator replays it exactly), the link model it assumed, and placer-specific facts for people."""

    predicted_makespan_s: float | None = None
    contention: bool | None = None
    # The objective's lower bound with the ops ungrouped (moirai.compile sets it when coarsening grouped any):
    # a bound on every plan of the coarsened problem too, so the gap to it includes what coarsening may cost.
    unfused_lower_bound_s: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name, value in d.items():
            if isinstance(value, enum.Enum):
                d[name] = value.value
        return {"kind": type(self).__name__, **d}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PlacerReport:
        """The report ``to_dict`` wrote, every field of the type it declares (a plan file's ``"x"`` for a number was
        read, then failed the summary); else a :class:`PlanError` naming the field."""
        kinds = {cls.__name__: cls for cls in (PlacerReport, SolverReport)}
        kind_name = d.get("kind", "PlacerReport")
        kind = kinds.get(kind_name) if isinstance(kind_name, str) else None
        if kind is None:
            raise PlanError(f"the report's 'kind' is {str(kind_name)[:40]!r}, not one of {sorted(kinds)}")
        values = {f.name: d[f.name] for f in fields(kind) if f.name in d}
        for f in fields(kind):
            holds, expected = _FIELD_TYPES[f.type]
            if f.name in values and not holds(values[f.name]):
                raise PlanError(f"the report's {f.name!r} is {str(values[f.name])[:60]!r}, not {expected}")
        if values.get("stop_reason") is not None:
            values["stop_reason"] = StopReason(values["stop_reason"])
        if "bound_source" in values:
            values["bound_source"] = BoundSource(values["bound_source"])
        return kind(**values)


@dataclass
class SolverReport(PlacerReport):
    """What a solver-based placer (milp, pesto) did: solver, how the search went and why it stopped."""

    solver: str = ""
    time_limit_s: float | None = None  # the budget the placer was given
    elapsed_s: float | None = None  # what it used, by its own clock, from its start to its plan
    formulation: str = ""
    strategy: str = ""  # "full" (one model), "windows" (the window search) or "period search" (throughput)
    stop_reason: StopReason | None = None
    solver_status: str = ""
    bound_source: BoundSource = BoundSource.BOUNDS
    heuristics: dict[str, float] = field(default_factory=dict)  # objective of every start-plan heuristic
    solver_objective_s: float | None = None
    solver_bound_s: float | None = None
    solve_s: float | None = None
    binaries: int | None = None
    constraints: int | None = None
    build_s: float | None = None
    solver_log_tail: list[str] = field(default_factory=list)
    lookahead_rounds: int = 0
    lookahead_improved: int = 0
    lookahead_objective_s: float | None = None
    window_tasks: int | None = None  # the largest window size the latency search reached
    window_starts: int = 0
    windows_tried: int = 0
    windows_improved: int = 0
    windows_unproven: int = 0
    moves_tried: int = 0  # the period search's moves priced, or the latency search's chain moves simulated
    moves_kept: int = 0
    kicks: int = 0  # the period search's kicks from its local optima (iterated local search), and those kept
    kicks_kept: int = 0
    windows: int = 0  # the period search's window programs (moirai.planning.solve.period_windows), and those kept
    windows_kept: int = 0
    history: list[tuple[float, float]] = field(default_factory=list)  # (seconds, objective) of the winning search
    # Seconds each phase took, where a budget went: "start plans", "bound", "search" and "finishing" in turn, and
    # within the latency search on a large problem its "lookahead", "contiguous" and first "chains".
    phases_s: dict[str, float] = field(default_factory=dict)

    def keep_gap_claim_true(self, value_s: float, lower_bound_s: float, mip_gap: float) -> None:
        """Say "gap closed" only of a plan within ``mip_gap`` of its bound: a claim that the plan returned (its
        objective ``value_s``) does not meet becomes :attr:`StopReason.SOLVER_STATUS`, with the numbers. A solver
        can call a start optimal that it priced wrongly ([Note: HiGHS's presolve and a start] in docs/design.md),
        and a plan may be changed after the claim was made."""
        if self.stop_reason is not StopReason.GAP_CLOSED or gap_closed(value_s, lower_bound_s, mip_gap):
            return
        self.stop_reason = StopReason.SOLVER_STATUS
        self.solver_status = (
            f"{self.solver_status or 'gap closed'}, but the plan returned ({value_s:.6g} s) is not within "
            f"{mip_gap:g} of its bound ({lower_bound_s:.6g} s)"
        )


def _is_float(value: Any, infinite: bool = False) -> bool:
    return type(value) in (int, float) and float_fault(value, negative=True, infinite=infinite) is None


def _is_int(value: Any) -> bool:
    return type(value) is int and int_fault(value) is None


def _is_pair_of_floats(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_is_float, value))


def _is_enum_value(enum_type: type[enum.Enum]) -> Callable[[Any], bool]:
    return lambda value: value in {member.value for member in enum_type}


# What each field's declared type (its annotation, as text) holds in JSON, and that in words for a PlanError.
_FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "float | None": (lambda v: v is None or _is_float(v), "null or a finite number"),
    "bool | None": (lambda v: v is None or isinstance(v, bool), "null, true or false"),
    "int | None": (lambda v: v is None or _is_int(v), "null or a whole number"),
    "int": (_is_int, "a whole number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict[str, Any]": (lambda v: isinstance(v, dict), "an object"),
    # A start plan's objective: Infinity where a heuristic's plan could not run.
    "dict[str, float]": (
        lambda v: isinstance(v, dict) and all(_is_float(x, infinite=True) for x in v.values()),
        "an object of numbers",
    ),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "list[tuple[float, float]]": (
        lambda v: isinstance(v, list) and all(_is_pair_of_floats(x) for x in v),
        "a list of [seconds, objective] pairs",
    ),
    "StopReason | None": (
        lambda v: v is None or _is_enum_value(StopReason)(v),
        f"null or one of {[r.value for r in StopReason]}",
    ),
    "BoundSource": (_is_enum_value(BoundSource), f"one of {[b.value for b in BoundSource]}"),
}
