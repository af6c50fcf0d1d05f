"""What a placement minimises: the one class that says so.

An :class:`Objective` judges a simulated :class:`~moirai.planning.simulate.Timeline` and bounds the best
value any plan could reach. :func:`moirai.place`, the milp placer's choice among its start plans,
the lookahead rounds and the window search all compare plans through it, and it carries everything else its
callers need, so that none of them asks which objective it is (its start plans are the placers whose spec
serves it): whether the critical-path searches serve it (:attr:`Objective.windows_apply`),
its latency limit (:attr:`Objective.latency_limit_s`), the makespan its MILP may assume
(:meth:`Objective.makespan_horizon_s`), its MILP rows, variable and warm-start value
(:meth:`Objective.milp_rows`, a :class:`moirai.planning.solve.rows.MilpRows`) and how a report names its value and
its bound (:attr:`Objective.value_label`, :attr:`Objective.bound_label`).

:class:`Latency` minimises the time of one request; :class:`Throughput` the steady-state period the runtime serves
a stream of pipelined requests at (the busiest device or link per request, or a longer round trip a part holds its
device for), optionally under ``max_latency_s``.
Another objective is one more subclass here plus its rows in the MILP (:mod:`moirai.planning.solve.rows`).
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from moirai.errors import MoiraiError, did_you_mean

if TYPE_CHECKING:
    from moirai.planning.colocation import Contraction
    from moirai.planning.problem import Problem
    from moirai.planning.simulate import Timeline
    from moirai.planning.solve.rows import MilpRows


class Objective(ABC):
    """A figure of merit of a plan, in seconds; smaller is better."""

    name: ClassVar[str]
    # How a report names this objective's value, shown next to its bound (None: the value is the latency it shows).
    value_label: ClassVar[str | None]
    bound_label: ClassVar[str]  # how a report names this objective's lower bound
    # Whether lookahead rounds and the window search, which shorten a schedule's critical path, serve it.
    windows_apply: ClassVar[bool] = False
    # Whether it judges the steady state of pipelined requests (a period) rather than one request's time.
    steady_state: ClassVar[bool] = False
    # What a report's rate counts (rate_per_s): requests, or for generation decode steps, each its own thing.
    rate_unit: ClassVar[str] = "req/s"
    # How a report names the plan's simulated latency, shown first: one request's, or for generation one decode
    # step's (a reader took generation's "predicted" for the value the bound and gap after it are of).
    latency_label: ClassVar[str] = "predicted"

    def rate_per_s(self, timeline: Timeline) -> float:
        """What the plan serves per second, in :attr:`rate_unit`: requests pipelined, one per served period, the
        period or a longer round trip a part holds its device for (0: none)."""
        served_s = timeline.served_period_s
        return 1 / served_s if served_s > 0 else 0.0

    @property
    def latency_limit_s(self) -> float | None:
        """The longest one request may take in an acceptable plan (None: no limit)."""
        return None

    @property
    def limit(self) -> str | None:
        """What an acceptable plan must meet besides memory, as the user wrote it (None: memory alone)."""
        return None if self.latency_limit_s is None else f"max_latency_s={self.latency_limit_s:g} s"

    @property
    def plans_like(self) -> str:
        """The objective, by name, whose placers make the plans worth starting from for this one (the placer specs'
        ``objectives`` name it; the milp placer's start plans are theirs)."""
        return self.name

    def makespan_horizon_s(self, start: Timeline | None) -> float | None:
        """A makespan the plans worth modelling stay within, given the best start plan (None: none known)."""
        return self.latency_limit_s

    def milp_rows(self) -> MilpRows:
        """Its rows, minimised variable and warm-start value in the MILP."""
        raise MoiraiError(f"the MILP has no rows for objective {self.name!r}; it models 'latency' and 'throughput'")

    @property
    def milp_models_value(self) -> bool:
        """Whether the variable the MILP minimises is this objective's value (else its optimality says nothing of
        the value, and its bound nothing unless :attr:`milp_bounds_value`)."""
        return True

    @property
    def milp_bounds_value(self) -> bool:
        """Whether the MILP's lower bound of its variable bounds this objective's value (so where it models it)."""
        return self.milp_models_value

    @abstractmethod
    def value_s(self, timeline: Timeline) -> float:
        """The plan's figure of merit, from its simulated timeline."""

    @abstractmethod
    def lower_bound_s(self, problem: Problem, deadline: float | None = None) -> float:
        """A value no plan that respects memory can beat; by ``deadline`` (a ``time.perf_counter`` value), where
        one is given, perhaps a weaker one (:func:`moirai.planning.bounds.lower_bounds`)."""

    def acceptable(self, timeline: Timeline) -> bool:
        """Whether the plan meets the objective's side conditions (memory always; a latency limit, say)."""
        return timeline.fits_memory

    def contracted(self, contraction: Contraction) -> Objective:
        """This objective for the contracted problem a placer sees (:mod:`moirai.planning.colocation`): itself,
        unless it holds problems of its own to contract alike."""
        return self

    def tie_break_s(self, timeline: Timeline) -> float:
        """Between plans of one value, the one of less of this is better (nothing, unless an objective says)."""
        return 0.0

    def rank(self, timeline: Timeline) -> tuple[bool, float, float]:
        """Sort key: acceptable plans first, then by value, then by :meth:`tie_break_s`."""
        return not self.acceptable(timeline), self.value_s(timeline), self.tie_break_s(timeline)

    def improves(self, candidate: Timeline, current: Timeline, relative: float = 0.0) -> bool:
        """Whether ``candidate`` is acceptable and better than ``current`` by more than ``relative`` of its value, or,
        with ``relative`` 0, of the same value (to a part in 10^9) and better by :meth:`tie_break_s`."""
        if not self.acceptable(candidate):
            return False
        value, other = self.value_s(candidate), self.value_s(current)
        if relative == 0.0 and math.isclose(value, other, rel_tol=1e-9):
            return self.tie_break_s(candidate) < self.tie_break_s(current) * (1.0 - 1e-9)
        return value < other * (1.0 - relative)

    def worsens(self, candidate: Timeline, current: Timeline) -> bool:
        """Whether ``candidate``'s value is above ``current``'s by more than a part in 10^9 (a search's step may
        keep the value and still be taken for what else it lowers)."""
        return self.value_s(candidate) > self.value_s(current) * (1.0 + 1e-9)


@dataclass(frozen=True)
class Latency(Objective):
    """The time one request takes through the plan: the simulated makespan."""

    name: ClassVar[str] = "latency"
    value_label: ClassVar[str | None] = None
    bound_label: ClassVar[str] = "bound"
    windows_apply: ClassVar[bool] = True

    def value_s(self, timeline: Timeline) -> float:
        return timeline.makespan_s

    def makespan_horizon_s(self, start: Timeline | None) -> float | None:
        return None if start is None else self.value_s(start)

    def milp_rows(self) -> MilpRows:
        from moirai.planning.solve.rows import LATENCY_ROWS

        return LATENCY_ROWS

    def lower_bound_s(self, problem: Problem, deadline: float | None = None) -> float:
        from moirai.planning.bounds import lower_bound

        return lower_bound(problem, deadline)


@dataclass(frozen=True)
class Throughput(Objective):
    """The period the runtime serves a stream of requests pipelined through the plan at (1 / requests per second):
    the busiest device's or link's time per request, or the longest round trip a part holds its device for, whichever
    is longer (:attr:`moirai.planning.simulate.Timeline.served_period_s`: the runtime runs a part whole, request after
    request, so a plan that goes to another device and back cannot pipeline). Between plans of one served period, the
    one of the shorter ``max(period, driver hold)`` is better (the tie-break: less busy, and a part 0 that waits for
    another device no longer than a period). A plan whose latency exceeds ``max_latency_s`` is not acceptable.

    The MILP's rows, the DPs and the period search price the period alone, a lower bound of the value: the period
    bound and a solver's bound stay bounds of it, but a solver's optimality is not the value's
    (:attr:`milp_models_value`)."""

    name: ClassVar[str] = "throughput"
    value_label: ClassVar[str | None] = "period"
    steady_state: ClassVar[bool] = True
    bound_label: ClassVar[str] = "period bound"
    max_latency_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_latency_s", time_limit_s(self.max_latency_s, "Throughput", "max_latency_s"))

    @property
    def latency_limit_s(self) -> float | None:
        return self.max_latency_s

    def value_s(self, timeline: Timeline) -> float:
        return timeline.served_period_s

    def tie_break_s(self, timeline: Timeline) -> float:
        # Of two plans of one served period, the less busy one, and the one whose part 0 does not wait for another
        # device (mirror images of a split: ending on device 0 served 8-10% slower across two hosts, as fast on one,
        # [Note: end on rank 0]).
        return max(timeline.period_s, timeline.driver_hold_s)

    @property
    def milp_models_value(self) -> bool:  # type: ignore[override]
        return False  # the MILP minimises the period; a round trip it does not price may hold a part longer

    @property
    def milp_bounds_value(self) -> bool:  # type: ignore[override]
        return True  # no plan serves faster than its period, so the solver's bound of the period bounds the value

    def milp_rows(self) -> MilpRows:
        from moirai.planning.solve.rows import THROUGHPUT_ROWS

        return THROUGHPUT_ROWS

    def acceptable(self, timeline: Timeline) -> bool:
        latency_ok = self.max_latency_s is None or timeline.makespan_s <= self.max_latency_s * (1 + 1e-9)
        return timeline.fits_memory and latency_ok

    def lower_bound_s(self, problem: Problem, deadline: float | None = None) -> float:
        # Every request's work must run somewhere: the busiest device does at least the load bound's share; the
        # driver on device 0 works on every request.
        from moirai.planning.bounds import load_bound_s

        return max(load_bound_s(problem), problem.costs.charges.driver_floor_s())


@dataclass(frozen=True, eq=False)
class Generation(Objective):
    """Serving a causal LM: a prompt's prefill, then one decode step per new token, with ``sequences`` sequences
    in flight (moirai.generation). The problem placed is the decode step's; ``prefill`` is the same graph priced at
    a typical prompt, so one placement serves both phases and both are judged:

    - one sequence (``sequences == 1``): the time to answer it, TTFT + ``new_tokens`` x TPOT, where TTFT is the
      prefill's simulated makespan and TPOT the decode step's (the plan's order and placement for both);
    - several: the time per decode step in the steady state, the longer of the busiest device's or link's time per
      step (the period) and one step's latency over the sequences in flight (a sequence's next step waits for its
      token); decode tokens/s is the step's batch over that. A plan whose TTFT exceeds ``max_ttft_s`` is not
      acceptable.

    The MILP models the decode step (latency rows for one sequence, period rows for several); every plan it
    considers is judged here, both phases simulated.
    """

    name: ClassVar[str] = "generation"
    rate_unit: ClassVar[str] = "decode steps/s"  # a step is not a request: one token for each sequence in it
    latency_label: ClassVar[str] = "decode step"
    prefill: Problem | None = None
    new_tokens: int = 64
    sequences: int = 1
    max_ttft_s: float | None = None
    prefill_chunks: int = 1  # a prompt longer than a chunk goes in this many chunks of the prefill's size

    def contracted(self, contraction: Contraction) -> Generation:
        return self if self.prefill is None else replace(self, prefill=contraction.of(self.prefill))

    def __post_init__(self) -> None:
        if self.new_tokens < 1 or self.sequences < 1 or self.prefill_chunks < 1:
            raise MoiraiError(
                f"Generation needs new_tokens, sequences and prefill_chunks >= 1, got {self.new_tokens}, "
                f"{self.sequences} and {self.prefill_chunks}"
            )
        object.__setattr__(self, "max_ttft_s", time_limit_s(self.max_ttft_s, "Generation", "max_ttft_s"))

    @property
    def value_label(self) -> str:  # type: ignore[override]
        return f"TTFT + {self.new_tokens} TPOT" if self.sequences == 1 else f"step ({self.sequences} in flight)"

    @property
    def bound_label(self) -> str:  # type: ignore[override]
        return "bound"

    @property
    def windows_apply(self) -> bool:  # type: ignore[override]
        return self.sequences == 1

    @property
    def plans_like(self) -> str:
        return "latency" if self.sequences == 1 else "throughput"

    @property
    def steady_state(self) -> bool:  # type: ignore[override]
        return self.sequences > 1

    def ttft_s(self, timeline: Timeline) -> float:
        """The prefill's simulated makespan under the decode plan's placement and order, once per chunk (0 without
        a prefill)."""
        if self.prefill is None:
            return 0.0
        from moirai.planning.plan import Plan
        from moirai.planning.simulate import simulate

        plan = Plan(timeline.placement, tuple(self.prefill.device_names), order=timeline.execution_sequences)
        return self.prefill_chunks * simulate(self.prefill, plan).makespan_s

    def step_s(self, timeline: Timeline) -> float:
        """Time per decode step in the steady state with ``sequences`` in flight (TPOT for one sequence): the period,
        the longest round trip a part waits for inside itself (:func:`moirai.planning.simulate.round_trip_s`: the
        next step's part waits for it), part 0's hold of the driver (:func:`moirai.planning.simulate.driver_hold_s`:
        a sequence's next step is made only after its token came back, so no step is queued for the driver to send
        on), or one step's latency shared by the steps in flight, whichever is longest."""
        if self.sequences == 1:
            return timeline.makespan_s
        return max(timeline.served_period_s, timeline.driver_hold_s, timeline.makespan_s / self.sequences)

    def value_s(self, timeline: Timeline) -> float:
        if self.sequences == 1:
            return self.ttft_s(timeline) + self.new_tokens * timeline.makespan_s
        return self.step_s(timeline)

    def rate_per_s(self, timeline: Timeline) -> float:
        step_s = self.step_s(timeline)
        return 1 / step_s if step_s > 0 else 0.0

    def acceptable(self, timeline: Timeline) -> bool:
        if not timeline.fits_memory:
            return False
        return self.max_ttft_s is None or self.ttft_s(timeline) <= self.max_ttft_s * (1 + 1e-9)

    @property
    def limit(self) -> str | None:
        return None if self.max_ttft_s is None else f"max_ttft_s={self.max_ttft_s:g} s"

    def milp_rows(self) -> MilpRows:
        return (LATENCY if self.sequences == 1 else Throughput()).milp_rows()

    @property
    def milp_models_value(self) -> bool:  # type: ignore[override]
        return False  # the MILP models the decode step (its latency or period), not TTFT nor the steady state

    def makespan_horizon_s(self, start: Timeline | None) -> float | None:
        return LATENCY.makespan_horizon_s(start) if self.sequences == 1 else None

    def lower_bound_s(self, problem: Problem, deadline: float | None = None) -> float:
        if self.sequences > 1:
            return Throughput().lower_bound_s(problem, deadline)
        prefill_s = 0.0 if self.prefill is None else self.prefill_chunks * LATENCY.lower_bound_s(self.prefill, deadline)
        return prefill_s + self.new_tokens * LATENCY.lower_bound_s(problem, deadline)


def time_limit_s(value: float | None, owner: str, field: str) -> float | None:
    """An objective's limit on a time as given (``max_latency_s``): None or infinity is no limit (None), else a
    positive finite number of seconds; anything else (a negative, NaN, text) is a :class:`MoiraiError`, since a plan
    judged against it would be silently unacceptable or the MILP's rows would lose their bound."""
    if value is None or (isinstance(value, numbers.Real) and value == math.inf):
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise MoiraiError(
            f"{owner}({field}={value!r}): a limit is a positive number of seconds; give None (or math.inf) for none"
        )
    return float(value)


LATENCY = Latency()
OBJECTIVES: dict[str, Objective] = {LATENCY.name: LATENCY, Throughput.name: Throughput()}
# Every name a plan's objective can have: a generation objective has parameters, so no name alone makes it.
OBJECTIVE_NAMES: tuple[str, ...] = (*OBJECTIVES, Generation.name)


def as_objective(objective: str | Objective) -> Objective:
    """The objective named ``objective`` (or ``objective`` itself)."""
    if isinstance(objective, Objective):
        return objective
    try:
        return OBJECTIVES[objective]
    except KeyError:
        raise MoiraiError(
            f"unknown objective {objective!r}{did_you_mean(objective, OBJECTIVES)}; "
            f"choose one of {', '.join(sorted(OBJECTIVES))}"
        ) from None
