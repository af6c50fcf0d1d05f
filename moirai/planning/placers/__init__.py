"""The placer registry: a placer is a function ``(problem, **options) -> Plan``.

Add one by writing a module here with a function decorated ``@register("name")`` and
listing the module in ``_PLACER_MODULES``. :func:`list_placers` names them all.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import numbers
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from moirai.errors import MoiraiError, OverMemoryWarning, PlacerOptionError
from moirai.planning.objective import Objective, as_objective
from moirai.planning.problem import Plan, Problem
from moirai.progress import stage

if TYPE_CHECKING:
    from moirai.planning.simulate import Timeline

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


# A plan on several devices must be predicted this much better than the best single device, or that one replaces it.
MIN_SPLIT_GAIN = 0.01

# Baselines that place by a rule, not by minimising anything: their plans are returned as they are.
_RULE_BASED_PLACERS = frozenset({"round_robin", "hash", "expert", "m_topo", "single"})


@stage("place")
def place(problem: Problem, placer: str = "heft", objective: str | Objective = "latency", **options: Any) -> Plan:
    """Place ``problem`` with the named placer for ``objective`` (:mod:`moirai.planning.objective`).

    The plan's makespan and objective value are the simulator's. A placer that compares plans (milp) takes
    the objective as an option; the others build one schedule their own way. A placer that minimises
    never returns a plan worse than the best single-device plan that fits: that plan replaces it
    (``plan.report.notes["replaced_by_single_device_s"]`` keeps the placer's own value).
    """
    from moirai.planning.simulate import simulate

    function = get_placer(placer)
    check_options(placer, function, options)
    chosen = as_objective(objective)
    if "objective" in inspect.signature(function).parameters:
        options = {**options, "objective": chosen}
    start = time.perf_counter()
    plan = function(problem, **options)
    plan.placement_time_s = time.perf_counter() - start
    plan.placer = plan.placer or placer
    plan.check(problem)
    if placer not in _RULE_BASED_PLACERS:
        plan = _as_the_runtime_prefers(problem, plan, chosen)
    timeline = simulate(problem, plan)
    if placer not in _RULE_BASED_PLACERS:
        plan, timeline = _no_worse_than_one_device(problem, plan, timeline, chosen)
    plan.makespan_s = timeline.makespan_s
    plan.objective, plan.objective_s = chosen.name, chosen.value_s(timeline)
    # A placer may prove a stronger bound (the MILP's); keep the better of the two.
    plan.lower_bound_s = max(plan.lower_bound_s or 0.0, chosen.lower_bound_s(problem))
    _warn_if_over_memory(problem, plan, timeline)
    return plan


def _as_the_runtime_prefers(problem: Problem, plan: Plan, objective: Objective) -> Plan:
    """Of ``plan`` and the plans that only relabel devices it cannot otherwise tell apart, the one the runtime
    runs best.

    * Devices that differ only in the header the driver sends them: the plan that relabels the device of the
      last task as the first device (rank 0, which drives every request and gathers the outputs) replaces
      ``plan`` unless the model predicts it worse. The model charges outputs sent back to rank 0
      (:attr:`RequestCosts.output_s`) and headers; where they tie (no outputs, no headers), ending on rank 0 saves
      the driver a receive (two_branch_mlp's milp plan, the mirror image of heft's, sent its 1 MB sum back and
      ran 10-15% slower before outputs were charged).
    * A plan that puts every task on one device runs them in the graph's own order: on one device the order
      changes no prediction, and the traced order is the one eager runs (inception_v4 on one CPU rank ran 7%
      slower in the order a milp plan gave it).
    """
    from moirai.planning.placers.single import one_device_plan
    from moirai.planning.simulate import simulate
    from moirai.planning.solve.window import identical_device_groups

    if not problem.num_tasks:
        return plan
    last_device = int(plan.placement[problem.topological_order[-1]])
    group = next((g for g in identical_device_groups(problem, ignoring_driver=True) if 0 in g), ())
    if last_device != 0 and last_device in group:
        swap = np.arange(problem.num_devices)
        swap[0], swap[last_device] = last_device, 0
        order = None if plan.order is None else tuple(plan.order[swap[d]] for d in range(problem.num_devices))
        transfer_order = (
            None
            if plan.transfer_order is None
            else {(int(swap[a]), int(swap[b])): tensors for (a, b), tensors in plan.transfer_order.items()}
        )
        relabelled = dataclasses.replace(
            plan, placement=swap[plan.placement], order=order, transfer_order=transfer_order
        )
        if not objective.improves(simulate(problem, plan), simulate(problem, relabelled), relative=1e-9):
            plan = relabelled
    used = np.unique(plan.placement)
    if used.size == 1:
        plan = dataclasses.replace(plan, order=one_device_plan(problem, int(used[0])).order, transfer_order=None)
    return plan


def _no_worse_than_one_device(
    problem: Problem, plan: Plan, timeline: Timeline, objective: Objective
) -> tuple[Plan, Timeline]:
    """``plan`` and its timeline, or the best single-device plan that fits and its timeline unless ``plan`` is
    predicted better by more than :data:`MIN_SPLIT_GAIN`: what the model leaves out (the inputs the driver
    sends other devices, a worker's own work per request) only adds to a split plan. swin's milp plan, 0.06%
    faster than one device by the model with six ops on the second, ran 7% slower in one run and as fast in
    another; gpt2's, 0.14% faster, ran 0.5% slower twice."""
    from moirai.errors import InfeasibleError
    from moirai.planning.placers.single import place_single
    from moirai.planning.simulate import simulate

    try:
        single = place_single(problem)
    except InfeasibleError:
        return plan, timeline
    single_timeline = simulate(problem, single)
    if len(np.unique(plan.placement)) == 1:
        keep = not objective.improves(single_timeline, timeline)  # another device may be the better one
    else:
        keep = not objective.acceptable(single_timeline) or objective.improves(
            timeline, single_timeline, relative=MIN_SPLIT_GAIN
        )
    if keep:
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


# What a value of an option, whichever placer takes it, must be.
_OPTION_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    # 0 is a real choice: no search, the placer's start plan.
    "time_limit_s": (lambda v: _is_number(v) and v >= 0, "a non-negative number of seconds"),
    "mip_gap": (lambda v: _is_number(v) and 0 <= v < 1, "a relative gap in [0, 1), e.g. 1e-4"),
    "threads": (lambda v: v is None or (_is_integer(v) and v >= 1), "None or an integer of at least 1"),
    "window_tasks": (lambda v: _is_integer(v) and v >= 1, "an integer of at least 1"),
    "target_tasks": (lambda v: _is_integer(v) and v >= 1, "an integer of at least 1"),
    "seed": (lambda v: _is_integer(v), "an integer"),
    "contention": (lambda v: isinstance(v, bool), "True or False"),
    "integral": (lambda v: isinstance(v, bool), "True or False"),
    "uniform": (lambda v: isinstance(v, bool), "True or False"),
    "progress": (lambda v: v is None or isinstance(v, bool), "None, True or False"),
}


def check_options(name: str, function: Placer, options: dict[str, Any]) -> None:
    """Raise :class:`PlacerOptionError` for an option ``function`` does not take or a value out of its range."""
    parameters = list(inspect.signature(function).parameters.values())[1:]  # the first is the problem
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    valid = [p.name for p in parameters]
    for option, value in options.items():
        if option not in valid:
            close = difflib.get_close_matches(option, valid, n=1)
            raise PlacerOptionError(
                f"placer {name!r} has no option {option!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + (f"; its options are {', '.join(valid)}" if valid else "; it takes no options")
            )
        rule = _OPTION_RULES.get(option)
        if rule is not None and not rule[0](value):
            raise PlacerOptionError(f"placer {name!r}: option {option}={value!r} must be {rule[1]}")


def devices_over_memory(problem: Problem, plan: Plan) -> list[int]:
    """The devices on which ``plan`` places more memory than the problem gives them."""
    held = np.bincount(plan.placement, weights=problem.memory_bytes, minlength=problem.num_devices)
    return [int(k) for k in np.flatnonzero(held > problem.memory_capacity_bytes)]


def _warn_if_over_memory(problem: Problem, plan: Plan, timeline: Timeline) -> None:
    """Placers that ignore memory (round_robin...) may exceed it: mark the plan and warn, with the numbers."""
    from moirai.planning.bounds import format_bytes

    held = timeline.memory_bytes
    over = [int(k) for k in np.flatnonzero(held > timeline.memory_capacity_bytes)]
    if not over:
        return
    plan.report.notes["over_memory_devices"] = [problem.device_names[k] for k in over]
    amounts = ", ".join(
        f"{problem.device_names[k]} holds {format_bytes(float(held[k]))} of "
        f"{format_bytes(float(problem.memory_capacity_bytes[k]))}"
        for k in over
    )
    warnings.warn(
        OverMemoryWarning(
            f"the {plan.placer!r} plan puts more on a device than it can hold ({amounts}); {plan.placer!r} ignores "
            "memory: use a placer that respects it ('milp', 'heft', 'm_etf', 'm_sct', 'hash', 'expert') or add memory"
        ),
        stacklevel=3,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _load_all() -> None:
    for module in _PLACER_MODULES:
        importlib.import_module(f"moirai.planning.placers.{module}")
