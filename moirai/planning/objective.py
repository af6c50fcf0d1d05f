"""What a placement minimises: the one class that says so.

An :class:`Objective` judges a simulated :class:`~moirai.planning.simulate.Timeline` and bounds the best
value any plan could reach. :func:`moirai.place`, the milp placer's choice among its start plans,
the lookahead rounds and the window search all compare plans through it, and the MILP builds its
objective rows from its :attr:`Objective.name` (:mod:`moirai.planning.solve.model`).

:class:`Latency` minimises the time of one request; :class:`Throughput` the steady-state period of a
stream of pipelined requests (the busiest device or link per request), optionally under ``max_latency_s``.
Another objective is one more subclass here plus its rows in the MILP.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from moirai.errors import MoiraiError

if TYPE_CHECKING:
    from moirai.planning.problem import Problem
    from moirai.planning.simulate import Timeline


class Objective(ABC):
    """A figure of merit of a plan, in seconds; smaller is better."""

    name: ClassVar[str]

    @abstractmethod
    def value_s(self, timeline: Timeline) -> float:
        """The plan's figure of merit, from its simulated timeline."""

    @abstractmethod
    def lower_bound_s(self, problem: Problem) -> float:
        """A value no plan that respects memory can beat."""

    def acceptable(self, timeline: Timeline) -> bool:
        """Whether the plan meets the objective's side conditions (memory always; a latency limit, say)."""
        return timeline.fits_memory

    def rank(self, timeline: Timeline) -> tuple[bool, float]:
        """Sort key: acceptable plans first, then by value."""
        return not self.acceptable(timeline), self.value_s(timeline)

    def improves(self, candidate: Timeline, current: Timeline, relative: float = 0.0) -> bool:
        """Whether ``candidate`` is acceptable and better than ``current`` by more than ``relative`` of its value."""
        return self.acceptable(candidate) and self.value_s(candidate) < self.value_s(current) * (1.0 - relative)


@dataclass(frozen=True)
class Latency(Objective):
    """The time one request takes through the plan: the simulated makespan."""

    name: ClassVar[str] = "latency"

    def value_s(self, timeline: Timeline) -> float:
        return timeline.makespan_s

    def lower_bound_s(self, problem: Problem) -> float:
        from moirai.planning.bounds import lower_bound

        return lower_bound(problem)


@dataclass(frozen=True)
class Throughput(Objective):
    """The period of a stream of requests pipelined through the plan (1 / requests per second): the busiest
    device's or link's time per request (:attr:`moirai.planning.simulate.Timeline.period_s`). A plan whose latency
    exceeds ``max_latency_s`` is not acceptable."""

    name: ClassVar[str] = "throughput"
    max_latency_s: float | None = None

    def value_s(self, timeline: Timeline) -> float:
        return timeline.period_s

    def acceptable(self, timeline: Timeline) -> bool:
        latency_ok = self.max_latency_s is None or timeline.makespan_s <= self.max_latency_s * (1 + 1e-9)
        return timeline.fits_memory and latency_ok

    def lower_bound_s(self, problem: Problem) -> float:
        # Every request's work must run somewhere: the busiest device does at least the load bound's share; the
        # driver on device 0 works on every request.
        from moirai.planning.bounds import lower_bounds

        return max(lower_bounds(problem).load_s, float(problem.request_cpu_s[0]))


LATENCY = Latency()
OBJECTIVES: dict[str, Objective] = {LATENCY.name: LATENCY, Throughput.name: Throughput()}


def as_objective(objective: str | Objective) -> Objective:
    """The objective named ``objective`` (or ``objective`` itself)."""
    if isinstance(objective, Objective):
        return objective
    try:
        return OBJECTIVES[objective]
    except KeyError:
        raise MoiraiError(f"unknown objective {objective!r}; choose one of {sorted(OBJECTIVES)}") from None
