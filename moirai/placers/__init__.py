"""The placer registry: a placer is a function ``(problem, **options) -> Plan``.

Add one by writing a module here with a function decorated ``@register("name")`` and
listing the module in ``_PLACER_MODULES``. :func:`list_placers` names them all.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moirai.errors import MoiraiError
from moirai.objective import Objective, as_objective
from moirai.problem import Plan, Problem

if TYPE_CHECKING:
    from moirai.simulate import Timeline

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
    "pipeline",
    "milp",
)


def register(name: str) -> Callable[[Placer], Placer]:
    def add(function: Placer) -> Placer:
        _REGISTRY[name] = function
        return function

    return add


def list_placers() -> list[str]:
    """Names of every registered placer."""
    _load_all()
    return sorted(_REGISTRY)


def get_placer(name: str) -> Placer:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise MoiraiError(f"unknown placer {name!r}; choose one of {sorted(_REGISTRY)}") from None


# Baselines that place by a rule, not by minimising anything: their plans are returned as they are.
_RULE_BASED_PLACERS = frozenset({"round_robin", "hash", "expert", "m_topo", "single"})


def place(problem: Problem, placer: str = "heft", objective: str | Objective = "latency", **options: Any) -> Plan:
    """Place ``problem`` with the named placer for ``objective`` (:mod:`moirai.objective`).

    The plan's makespan and objective value are the simulator's. A placer that compares plans (milp) takes
    the objective as an option; the others build one schedule their own way. A placer that minimises
    never returns a plan worse than the best single-device plan that fits: that plan replaces it
    (``plan.report.notes["replaced_by_single_device_s"]`` keeps the placer's own value).
    """
    from moirai.simulate import simulate

    chosen = as_objective(objective)
    function = get_placer(placer)
    if "objective" in inspect.signature(function).parameters:
        options = {**options, "objective": chosen}
    start = time.perf_counter()
    plan = function(problem, **options)
    plan.placement_time_s = time.perf_counter() - start
    plan.placer = plan.placer or placer
    plan.check(problem)
    timeline = simulate(problem, plan)
    if placer not in _RULE_BASED_PLACERS:
        plan, timeline = _no_worse_than_one_device(problem, plan, timeline, chosen)
    plan.makespan_s = timeline.makespan_s
    plan.objective, plan.objective_s = chosen.name, chosen.value_s(timeline)
    # A placer may prove a stronger bound (the MILP's); keep the better of the two.
    plan.lower_bound_s = max(plan.lower_bound_s or 0.0, chosen.lower_bound_s(problem))
    return plan


def _no_worse_than_one_device(
    problem: Problem, plan: Plan, timeline: Timeline, objective: Objective
) -> tuple[Plan, Timeline]:
    """``plan`` and its timeline, or the best single-device plan that fits and its timeline when that one is better."""
    from moirai.errors import InfeasibleError
    from moirai.placers.single import place_single
    from moirai.simulate import simulate

    try:
        single = place_single(problem)
    except InfeasibleError:
        return plan, timeline
    single_timeline = simulate(problem, single)
    if not objective.improves(single_timeline, timeline):
        return plan, timeline
    plan.report.notes["replaced_by_single_device_s"] = objective.value_s(timeline)
    replaced = dataclasses.replace(
        single,
        placer=plan.placer,
        report=plan.report,
        lower_bound_s=plan.lower_bound_s,
        placement_time_s=plan.placement_time_s,
    )
    return replaced, single_timeline


def _load_all() -> None:
    for module in _PLACER_MODULES:
        importlib.import_module(f"moirai.placers.{module}")


class _Package(types.ModuleType):
    """``moirai.placers`` is this package; calling it, as the listing function of that name once was, says so."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[str]:
        raise MoiraiError("moirai.placers() is now moirai.list_placers(); moirai.placers is the package of placers")


sys.modules[__name__].__class__ = _Package
