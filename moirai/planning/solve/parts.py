"""What the row groups of one MILP share while it is built: the window, its bounds in seconds, the Pyomo model
and the finish expressions (:mod:`moirai.planning.solve.model` builds it, the formulation, rows and cuts add to it).

Times inside the model are in units of ``horizon / 1000`` so the solver sees numbers near 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyomo.environ as pyo

from moirai.planning.problem import Problem
from moirai.planning.solve.window import Window

MODEL_TIME_SCALE = 1000.0  # the horizon, in model time units


@dataclass
class ModelParts:
    """The window, its bounds (seconds) and the Pyomo model that every row group of one model reads and adds to."""

    problem: Problem
    window: Window
    unit_s: float
    allowed: dict[int, tuple[int, ...]]
    earliest_s: dict[int, float]
    latest_finish_s: dict[int, float]
    fastest_s: dict[int, float]
    head_s: dict[tuple[int, int], float]
    tail_s: dict[tuple[int, int], float]
    descendants: dict[int, set[int]]
    m: pyo.ConcreteModel
    finish: dict[int, Any] = field(default_factory=dict)  # finish time of every free task (model units)
    transfer_sources: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    receive_terms: list[tuple[int, int, int]] = field(default_factory=list)  # (tensor, receiver, device) of m.r

    @property
    def free(self) -> tuple[int, ...]:
        return self.window.free_tasks

    def scaled(self, seconds: float) -> float:
        return seconds / self.unit_s

    def add(self, row: Any) -> None:
        self.m.constraints.add(row)


@dataclass
class Transfers:
    """The transfer rows' results that the order rows and the objective's rows read."""

    sources: dict[tuple[int, int], tuple[int, ...]]  # (tensor, destination) -> possible source devices
    duration: dict[tuple[int, int], Any]  # model units, an expression of the link chosen
    earliest_s: dict[tuple[int, int], float]
    latest_s: dict[tuple[int, int], float]
