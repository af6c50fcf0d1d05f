"""The placer registry: a placer is a function ``(problem, **options) -> Plan``.

Add one by writing a module here with a function decorated ``@register("name")`` and
listing the module in ``_PLACER_MODULES``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

from moirai.errors import MoiraiError
from moirai.problem import Plan, Problem
from moirai.progress import stage

Placer = Callable[..., Plan]

_REGISTRY: dict[str, Placer] = {}
_PLACER_MODULES = (
    "round_robin",
    "single",
    "expert",
    "hash",
    "heft",
    "cp_pct",
    "m_topo",
    "m_etf",
    "m_sct",
    "getf",
    "pesto",
    "milp",
)


def register(name: str) -> Callable[[Placer], Placer]:
    def add(function: Placer) -> Placer:
        _REGISTRY[name] = function
        return function

    return add


def placers() -> list[str]:
    """Names of every registered placer."""
    _load_all()
    return sorted(_REGISTRY)


def get_placer(name: str) -> Placer:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise MoiraiError(f"unknown placer {name!r}; choose one of {sorted(_REGISTRY)}") from None


@stage("place")
def place(problem: Problem, placer: str = "heft", **options: Any) -> Plan:
    """Place ``problem`` with the named placer; the plan's makespan is the simulator's."""
    from moirai.bounds import lower_bound
    from moirai.simulate import simulate

    start = time.perf_counter()
    plan = get_placer(placer)(problem, **options)
    plan.placement_time_s = time.perf_counter() - start
    plan.placer = plan.placer or placer
    plan.check(problem)
    plan.makespan_s = simulate(problem, plan).makespan
    # A placer may prove a stronger bound (the MILP's); keep the better of the two.
    plan.lower_bound_s = max(plan.lower_bound_s or 0.0, lower_bound(problem))
    return plan


def _load_all() -> None:
    for module in _PLACER_MODULES:
        importlib.import_module(f"moirai.placers.{module}")
