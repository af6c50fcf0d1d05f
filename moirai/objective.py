"""What a placement minimises: the one class that says so.

An :class:`Objective` judges a simulated :class:`~moirai.simulate.Timeline` and bounds the best
value any plan could reach. :func:`moirai.place`, the milp placer's choice among its start plans,
the lookahead rounds and the window search all compare plans through it, and the MILP builds its
objective rows from its :attr:`Objective.name` (:mod:`moirai.solve.model`).

Only :class:`Latency` exists today. A throughput objective (the steady-state period of a stream of
requests: the busiest device or link per request, optionally under ``max_latency_s``) is one more
subclass here: ``value_s`` from the timeline's busy times, ``acceptable`` for the latency limit,
``lower_bound_s`` from :mod:`moirai.bounds`' load bound, and its rows in the MILP.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from moirai.errors import MoiraiError

if TYPE_CHECKING:
    from moirai.problem import Problem
    from moirai.simulate import Timeline


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
        from moirai.bounds import lower_bound

        return lower_bound(problem)


LATENCY = Latency()
OBJECTIVES: dict[str, Objective] = {LATENCY.name: LATENCY}


def as_objective(objective: str | Objective) -> Objective:
    """The objective named ``objective`` (or ``objective`` itself)."""
    if isinstance(objective, Objective):
        return objective
    try:
        return OBJECTIVES[objective]
    except KeyError:
        raise MoiraiError(f"unknown objective {objective!r}; choose one of {sorted(OBJECTIVES)}") from None
