"""The placer registry: a placer is a function ``(problem, **options) -> Plan`` and its :class:`PlacerSpec`.

Add one by writing a module here with one function decorated ``@register("name", minimises=...,
respects_memory=..., ...)``: the registry imports every module of this package (names not starting with
``_``), and everything else asks :func:`spec` for the placer's traits. :func:`list_placers` names them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import pkgutil
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from moirai.errors import (
    InfeasibleError,
    MoiraiError,
    MoiraiWarning,
    OverMemoryWarning,
    PlacerOptionError,
    PlanError,
    did_you_mean,
    user_stacklevel,
)
from moirai.file_numbers import is_integer, is_number
from moirai.planning.objective import Objective, as_objective
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem, check_problem
from moirai.planning.report import SolverReport
from moirai.progress import LONG_STAGE_S, format_seconds, stage

if TYPE_CHECKING:
    from moirai.planning.simulate import Timeline

Placer = Callable[..., Plan]
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlacerSpec:
    """What the rest of moirai knows about a placer, declared once by :func:`register` beside its function.

    ``minimises``: it searches for a good plan (False: a rule-based split, returned as it is, never replaced
    by the single-device plan). ``respects_memory``: its plans fit every device's memory or it raises
    :class:`moirai.errors.InfeasibleError`; the registry refuses a model no placement can fit before calling it.
    ``objectives``: the objectives its plans are built for (None: every one); the milp placer starts from its
    plan only for these. ``start_plan``: its rank among the milp placer's start plans (lower first), None if
    never one; how long it takes is measured, in ``moirai/data/start_plan_costs.toml``. ``keeps_sets``: where it
    says so for a problem and the options, the placer keeps every colocated set on one device itself and is given the
    problem as it is (None: always the contracted problem, :mod:`moirai.planning.colocation`). ``choices``: the
    values an option of its own may take, by option (``{"solver": ("highs", "gurobi")}``), checked with the others
    before any work (:func:`check_options`).
    """

    name: str
    function: Placer
    minimises: bool
    respects_memory: bool
    objectives: frozenset[str] | None = None
    start_plan: int | None = None
    keeps_sets: Callable[[Problem, dict[str, Any]], bool] | None = None
    choices: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def takes(self, option: str) -> bool:
        """Whether its function takes the option ``option`` (``"time_limit_s"``)."""
        names, any_option = option_names(self.function)
        return any_option or option in names

    def serves(self, objective: str) -> bool:
        """Whether its plans are built for ``objective`` (a name)."""
        return self.objectives is None or objective in self.objectives

    @functools.cached_property
    def checked(self) -> Placer:
        """The function behind the registry's preconditions: tasks kept off the devices no link lets them use (and a
        refusal where that leaves a task none); memory fits, for a placer that respects it; a problem with colocated
        tasks is contracted, placed and its plan expanded (:mod:`moirai.planning.colocation`)."""
        from moirai.planning.bounds import check_memory_feasible, without_unlinked_devices
        from moirai.planning.colocation import contract

        @functools.wraps(self.function)
        def placer(problem: Problem, **options: Any) -> Plan:
            problem = without_unlinked_devices(problem)
            keeps_sets = bool(problem.colocated) and self.keeps_sets is not None and self.keeps_sets(problem, options)
            if self.respects_memory:
                check_memory_feasible(problem, grouped=not keeps_sets)
            if problem.colocated and not keeps_sets:
                contraction = contract(problem)
                if isinstance(options.get("objective"), Objective):
                    options = {**options, "objective": options["objective"].contracted(contraction)}
                return contraction.expand(self.function(contraction.problem, **options))
            return self.function(problem, **options)

        return placer


_SPECS: dict[str, PlacerSpec] = {}


def register(
    name: str,
    *,
    minimises: bool,
    respects_memory: bool,
    objectives: Iterable[str] | None = None,
    start_plan: int | None = None,
    keeps_sets: Callable[[Problem, dict[str, Any]], bool] | None = None,
    choices: dict[str, tuple[str, ...]] | None = None,
) -> Callable[[Placer], Placer]:
    """Register the decorated function as placer ``name`` with its traits (:class:`PlacerSpec`)."""

    def add(function: Placer) -> Placer:
        chosen = None if objectives is None else frozenset(objectives)
        _SPECS[name] = PlacerSpec(
            name, function, minimises, respects_memory, chosen, start_plan, keeps_sets, dict(choices or {})
        )
        return function

    return add


def list_placers() -> list[str]:
    """Names of every registered placer."""
    _load_all()
    return sorted(_SPECS)


def spec(name: str) -> PlacerSpec:
    """The traits of placer ``name``."""
    _load_all()
    try:
        return _SPECS[name]
    except KeyError:
        hint = did_you_mean(name, _SPECS)
        raise MoiraiError(f"unknown placer {name!r}{hint}; choose one of {', '.join(sorted(_SPECS))}") from None


def specs() -> list[PlacerSpec]:
    """Every registered placer's spec, by name."""
    return [spec(name) for name in list_placers()]


def start_plans(objective: str) -> list[PlacerSpec]:
    """The placers the milp placer starts from for ``objective`` (a name), in the order it tries them."""
    chosen = [s for s in specs() if s.start_plan is not None and s.serves(objective)]
    return sorted(chosen, key=lambda s: (s.start_plan, s.name))


def get_placer(name: str) -> Placer:
    """Placer ``name`` with the registry's preconditions applied (memory, for one that respects it)."""
    return spec(name).checked


# A plan on several devices must be predicted this much better than the best single device, or that one replaces it.
MIN_SPLIT_GAIN = 0.01


def place(problem: Problem, placer: str = "heft", objective: str | Objective = "latency", **options: Any) -> Plan:
    """Place ``problem`` with the named placer for ``objective`` (:mod:`moirai.planning.objective`).

    The plan's makespan and objective value are the simulator's. A placer that compares plans (milp) takes
    the objective as an option; the others build one schedule their own way. A placer that minimises
    never returns a plan worse than the best single-device plan that fits: that plan replaces it
    (``plan.report.notes["replaced_by_single_device_s"]`` keeps the placer's own value). Every colocated set of
    tasks (:attr:`Problem.colocated`) ends on one device, whichever the placer (:attr:`PlacerSpec.checked`).
    """
    check_problem(problem, "moirai.place's problem")
    traits = spec(placer)
    check_options(traits, options)  # before the stage opens: no progress line before the error
    as_objective(objective)  # likewise
    with stage("place", _long_placement(placer, options)):
        return _place(problem, placer, objective, **options)


def _long_placement(placer: str, options: dict[str, Any]) -> str | None:
    """``"milp, limit 1 min"`` for a placer whose time limit (given, or its default) may make the stage long."""
    limit_s = _option_value(spec(placer).function, options, "time_limit_s")
    if not isinstance(limit_s, (int, float)) or limit_s < LONG_STAGE_S:
        return None
    return f"{placer}, limit {format_seconds(limit_s)}"


def _option_value(function: Placer, options: dict[str, Any], name: str) -> Any:
    """The value option ``name`` has in this call: given, else ``function``'s default (None if it takes none)."""
    parameter = inspect.signature(function).parameters.get(name)
    return options.get(name, parameter.default if parameter is not None else None)


def _place(problem: Problem, placer: str, objective: str | Objective, **options: Any) -> Plan:
    from moirai.planning.simulate import simulate

    traits = spec(placer)
    function = traits.checked
    chosen = as_objective(objective)
    if not traits.serves(chosen.plans_like):
        logger.debug(
            "placer %r is not meant for the %r objective; its plan is judged by it all the same", placer, chosen.name
        )
    if "objective" in inspect.signature(traits.function).parameters:
        options = {**options, "objective": chosen}
    start = time.perf_counter()
    with _placers_plan_refused(placer):
        plan = function(problem, **options)
        plan.placement_time_s = time.perf_counter() - start
        plan.placer = plan.placer or placer
        plan.check(problem)
        if traits.minimises and problem.colocated:
            plan = unbundled_if_better(problem, plan, chosen)
        if traits.minimises:
            plan = _as_the_runtime_prefers(problem, plan, chosen)
        timeline = simulate(problem, plan)
    if traits.minimises:
        plan, timeline = no_worse_than_one_device(problem, plan, timeline, chosen)
    plan.makespan_s = timeline.makespan_s
    plan.objective, plan.objective_s = chosen.name, chosen.value_s(timeline)
    # A placer may prove a stronger bound (the MILP's); keep the better of the two. A placer with a budget has
    # spent it: the bound here gets no more time than was left of it (none: the quick, maybe weaker bound).
    time_limit_s = _option_value(traits.function, options, "time_limit_s")
    bound_by = start + time_limit_s if is_number(time_limit_s) else None
    plan.lower_bound_s = max(plan.lower_bound_s or 0.0, chosen.lower_bound_s(problem, bound_by))
    mip_gap = _option_value(traits.function, options, "mip_gap")
    if isinstance(plan.report, SolverReport) and is_number(mip_gap):
        plan.report.keep_gap_claim_true(plan.objective_s, plan.lower_bound_s, mip_gap)
    _warn_if_over_memory(problem, plan, timeline)
    _warn_if_over_the_limit(plan, timeline, chosen)
    return plan


@contextlib.contextmanager
def _placers_plan_refused(placer: str) -> Iterator[None]:
    """A :class:`PlanError` of the plan a placer made (a task on a device where it cannot run, a tensor between two
    devices with no link: placers such as round_robin, hash and expert do not look) as an :class:`InfeasibleError`
    saying that this placer found no plan the problem allows: the user chose the placer, and the problem was valid."""
    try:
        yield
    except PlanError as error:
        others = " or ".join(repr(p) for p in ("milp", "heft") if p != placer)
        raise InfeasibleError(
            f"placer {placer!r} found no plan this problem allows: {error}; use a placer that keeps every task to "
            f"the devices it runs on and every tensor to the links there are ({others}), or give the problem the "
            "missing links"
        ) from None


def unbundled_if_better(problem: Problem, plan: Plan, objective: Objective) -> Plan:
    """``plan`` or, if ``objective`` prefers it, its placement list-scheduled by the simulator: what
    :func:`moirai.place` makes of a minimising placer's plan, and the milp placer of each heuristic start plan.

    A placer of the contracted problem (:func:`moirai.planning.colocation.contract`) ordered every colocation group
    as one task, which waits for all of its inputs; list-scheduled, each member runs as soon as its own inputs are
    there, between other tasks.
    """
    from moirai.planning.simulate import simulate

    if not problem.colocated or plan.order is None:
        return plan
    unbundled = dataclasses.replace(plan, order=None, transfer_order=None)
    if objective.improves(simulate(problem, unbundled), simulate(problem, plan)):
        logger.debug("%s plan: colocated tasks list-scheduled, between other tasks", plan.placer)
        return unbundled
    return plan


def _as_the_runtime_prefers(problem: Problem, plan: Plan, objective: Objective) -> Plan:
    """Of ``plan`` and the plans that only relabel devices it cannot otherwise tell apart, the one the runtime
    runs best.

    * Devices that differ only in the header the driver sends them: the plan that relabels the device of the
      last task as the first device (rank 0, which drives every request and gathers the outputs) replaces
      ``plan`` unless the model predicts it worse. The model charges outputs sent back to rank 0
      (:attr:`RequestCosts.output_s`), inputs sent from it and headers; where they tie (no outputs, no headers),
      ending on rank 0 saves the driver a receive ([Note: end on rank 0] in docs/design.md), unless the objective
      prefers the other (throughput: a part 0 that waits for another device served 8-10% slower across two
      hosts, which its tie-break counts).
    * A plan that puts every task on one device runs them in the graph's own order, the one eager runs ([Note:
      one device, traced order]), unless the model predicts that order worse: the driver's messages (an output's
      way to rank 0, a model input's or a header's) make the order count on one device too.
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
        if not objective.improves(simulate(problem, plan), simulate(problem, relabelled)):
            logger.debug("%s plan: devices 0 and %d swapped so the last task runs on rank 0", plan.placer, last_device)
            plan = relabelled
    used = np.unique(plan.placement)
    if used.size == 1:
        traced = dataclasses.replace(plan, order=one_device_plan(problem, int(used[0])).order, transfer_order=None)
        if not objective.improves(simulate(problem, plan), simulate(problem, traced)):
            plan = traced
    return plan


def no_worse_than_one_device(
    problem: Problem, plan: Plan, timeline: Timeline, objective: Objective
) -> tuple[Plan, Timeline]:
    """``plan`` and its timeline, or the single-device plan that fits and simulates best by ``objective`` (driver
    messages included) and its timeline unless ``plan`` is
    predicted better by more than :data:`MIN_SPLIT_GAIN`: what the model leaves out (the inputs the driver
    sends other devices, a worker's own work per request) only adds to a split plan ([Note: minimum split gain]
    in docs/design.md)."""
    from moirai.errors import InfeasibleError
    from moirai.planning.placers.single import best_single_device

    try:
        single, single_timeline = best_single_device(problem, objective)
    except InfeasibleError:
        return plan, timeline
    if len(np.unique(plan.placement)) == 1:
        keep = not objective.improves(single_timeline, timeline)  # another device may be the better one
    else:
        keep = not objective.acceptable(single_timeline) or objective.improves(
            timeline, single_timeline, relative=MIN_SPLIT_GAIN
        )
    if keep:
        return plan, timeline
    logger.info(
        "%s plan replaced by the single-device plan on %s: %s %.6g s against %.6g s on one device "
        "(a split must gain more than %g)",
        plan.placer,
        problem.device_names[int(single.placement[0])] if problem.num_tasks else "-",
        objective.name,
        objective.value_s(timeline),
        objective.value_s(single_timeline),
        MIN_SPLIT_GAIN,
    )
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
    "time_limit_s": (lambda v: is_number(v) and v >= 0, "a non-negative number of seconds"),
    "mip_gap": (lambda v: is_number(v) and 0 <= v < 1, "a relative gap in [0, 1), e.g. 1e-4"),
    "threads": (lambda v: v is None or (is_integer(v) and v >= 1), "None or an integer of at least 1"),
    "window_tasks": (lambda v: is_integer(v) and v >= 1, "an integer of at least 1"),
    "target_tasks": (lambda v: is_integer(v) and v >= 1, "an integer of at least 1"),
    "seed": (lambda v: is_integer(v), "an integer"),
    "contention": (lambda v: isinstance(v, bool), "True or False"),
    "integral": (lambda v: isinstance(v, bool), "True or False"),
    "uniform": (lambda v: isinstance(v, bool), "True or False"),
    "progress": (lambda v: v is None or isinstance(v, bool), "None, True or False"),
    # getf's speed groups: each holds the devices within this factor of its fastest (1 or less groups none)
    "speed_ratio": (lambda v: is_number(v) and v > 1, "a number above 1"),
    "threshold": (lambda v: is_number(v) and v >= 0, "a non-negative number"),
}


def option_names(function: Placer) -> tuple[list[str], bool]:
    """The options a placer function takes by name (every parameter after the problem), and whether it takes any
    other (``**options``)."""
    parameters = list(inspect.signature(function).parameters.values())[1:]  # the first is the problem
    named = [p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return named, len(named) < len(parameters)


def check_options(traits: PlacerSpec, options: dict[str, Any]) -> None:
    """Raise :class:`PlacerOptionError` for an option the placer does not take or a value out of its range (the
    rules every placer shares, and its own choices)."""
    name = traits.name
    valid, any_option = option_names(traits.function)
    if any_option:
        return
    for option, value in options.items():
        if option not in valid:
            raise PlacerOptionError(
                f"placer {name!r} has no option {option!r}"
                + did_you_mean(option, valid)
                + (f"; its options are {', '.join(valid)}" if valid else "; it takes no options")
            )
        rule = _OPTION_RULES.get(option)
        if rule is not None and not rule[0](value):
            raise PlacerOptionError(f"placer {name!r}: option {option}={value!r} must be {rule[1]}")
        choices = traits.choices.get(option)
        if choices is not None and not (isinstance(value, str) and value in choices):
            raise PlacerOptionError(
                f"placer {name!r}: option {option}={value!r} must be one of {', '.join(map(repr, choices))}"
            )


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
    # As the summary shows them: the memory kept for activations counts on both sides (the device's own size).
    reserve = problem.memory_reserve_bytes
    amounts = ", ".join(
        f"{problem.device_names[k]} holds {format_bytes(float(held[k] + reserve[k]))} of "
        f"{format_bytes(float(problem.memory_capacity_bytes[k] + reserve[k]))}"
        for k in over
    )
    respecting = ", ".join(repr(s.name) for s in specs() if s.respects_memory and s.minimises)
    warnings.warn(
        OverMemoryWarning(
            f"the {plan.placer!r} plan puts more on a device than it can hold ({amounts}); {plan.placer!r} ignores "
            f"memory: use a placer that respects it ({respecting}) or add memory"
        ),
        stacklevel=user_stacklevel(),
    )


def _warn_if_over_the_limit(plan: Plan, timeline: Timeline, objective: Objective) -> None:
    """A placer that does not take the objective's limit (heft for a TTFT limit) may miss it: say so, as over
    memory is said, rather than hand back a plan the objective does not accept with nothing to say why."""
    if objective.limit is None or not timeline.fits_memory or objective.acceptable(timeline):
        return
    plan.report.notes["over_the_limit"] = objective.limit
    ignores = f"{plan.placer!r} does not take the limit into account: use placer='milp', which keeps it, or "
    warnings.warn(
        MoiraiWarning(
            f"the {plan.placer!r} plan does not meet {objective.limit}; "
            f"{ignores if plan.placer != 'milp' else ''}raise the limit"
        ),
        stacklevel=user_stacklevel(),
    )


@functools.cache
def _load_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
