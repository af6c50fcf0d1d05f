"""``contiguous``: the best split of the graph into contiguous stages, one device each, by dynamic programming
(Tarnawski et al., NeurIPS 2020, "Efficient algorithms for device placement of DNN graph operators", Section 4).

A state is a downward-closed set of tasks (an ideal: every predecessor of a task in it is in it) when the graph
has at most :data:`IDEAL_LIMIT` of them and their number times the combinations of used devices times the devices is
at most :data:`IDEAL_WORK_LIMIT`, else a prefix of the topological order. A stage is the difference of two
nested states, placed on one device; every device takes at most one stage and must hold it in memory. Devices of
one kind (:func:`moirai.planning.solve.window.identical_device_groups`) are interchangeable: a stage goes to the
first unused device of its kind. Over prefixes, or with more combinations of used devices than :data:`SUBSET_LIMIT`,
the devices take stages in one fixed order (fastest first), any of them skipped.

Prices are the simulator's and the stream's (:mod:`moirai.planning.schedule.transfers`): a tensor crosses once to
every later stage that reads it, occupying its link, its sender's device (``send_cpu_s``) and its receiver's
(``recv_cpu_s``); every device pays its share of :attr:`moirai.planning.costs.RequestCosts.charges`, device 0 the
driver's. For ``throughput`` the DP minimises the period, the busiest device's or link's time per request
(:attr:`moirai.planning.simulate.Timeline.period_s`). For ``latency`` it minimises the time of the chain of
stages: a stage starts when the one before it has finished, its header has come, and its inputs have crossed
(each source's sends and transfers one after another on its link); a request is done when the last stage has
finished and every output is back on device 0. The simulator overlaps stages that do not read each other, so for
latency over ideals, where the splits are few, the best split by the simulator is
searched for ([Note: the chain model] in :func:`_best_simulated`). The simulator judges the returned plan either way.

A partial split is a label: what its devices and links have been charged so far, and which device holds every
tensor still to be read. Sends of a stage's tensors are charged when a later stage reads them, so a device's load
is open while it holds such tensors; labels of one state are kept while no other beats them in every open load
(Pareto), at most the :data:`IDEAL_LABELS` best by value per state and used devices: exact over ideals while no
state has more, a heuristic beyond. Over prefixes only the :data:`PREFIX_LABELS` best labels of a state and last
device are kept, so that it stays about ``O(n^2 k^2)``. Either way a label is dropped once its value, or a lower
bound on any completion of it (the remaining tasks' fastest compute, in one chain for latency, shared by the free
devices for throughput), reaches the best split found, which loses nothing; and before any split is found, once it
reaches a cap a little above the lower bound, raised until some split is under it ([Note: a capped search] in
docs/design.md).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from moirai.errors import InfeasibleError
from moirai.planning.objective import LATENCY, Objective
from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import PlacerReport
from moirai.planning.schedule import recv_cpu_s, send_cpu_s, transfer_duration_s

IDEAL_LIMIT = 100  # the most ideals the DP enumerates; beyond, prefixes of the topological order
IDEAL_WORK_LIMIT = 2000  # the most ideals times device combinations times devices it searches; beyond, prefixes
SUBSET_LIMIT = 128  # the most combinations of used devices the DP tells apart; beyond, a fixed device order
PREFIX_LABELS = 1  # labels kept per state and last device over prefixes
IDEAL_LABELS = 8  # Pareto labels kept per state and used devices over ideals, the best by value
# The capped searches: the first cap this far above the lower bound, each next one this much higher, then none.
CAP_FIRST = 1.02
CAP_GROWTH = 1.25
CAP_STEPS = 6
# For latency over ideals ([Note: the chain model]): the most splits times tasks listed and bounded, and the most
# simulations times tasks spent on them (a small graph's splits are all judged; a larger one keeps the DP's split).
LISTED_SPLIT_TASKS = 100_000
SIMULATED_SPLIT_TASKS = 10_000


class _Label(NamedTuple):
    """A partial split: its value so far (a lower bound on any completion), its open loads, its tensors still to
    be read and their devices, and how it was reached."""

    value_s: float
    closed_s: float  # throughput: the largest closed device or link load; latency: when its last stage finished
    open_s: tuple[float, ...]  # throughput: the open loads (devices in ``holders`` order); latency: outputs' arrival
    holders: tuple[int, ...]
    pending: tuple[tuple[int, int], ...]  # (tensor, device holding it), by tensor
    used: int  # bit mask of used devices (subset mode) or the rank of the last used device (ordered mode)
    state: int
    parent: _Label | None
    device: int
    # throughput: by device, the load its stage's outputs put on its link to device 0, open while a later stage may
    # still go to device 0 and receive tensors on that link too (the simulator adds the two; Timeline.link_busy_s)
    to_zero_s: tuple[float, ...] = ()


class _Pricing:
    """The problem's numbers as Python lists, read task by task while a stage grows."""

    def __init__(self, problem: Problem) -> None:
        k = problem.num_devices
        charges = problem.costs.charges
        self.compute = problem.compute_s.tolist()
        self.own = charges.own_s.tolist()
        self.driver = charges.driver_s.tolist()
        self.output = problem.costs.output_s.tolist()
        self.output_link = problem.costs.output_link_s.tolist()
        self.release = problem.costs.release_s.tolist()
        self.model_inputs = problem.costs.inputs_of_task
        self.input_own = charges.input_own_s.tolist()
        self.input_driver = charges.input_driver_s.tolist()
        self.input_link = problem.costs.input_link_s.tolist()
        self.always = charges.always_s.tolist()
        self.taking_part = charges.taking_part_s.tolist()
        self.driver_taking_part = charges.driver_taking_part_s.tolist()
        self.memory = problem.memory_bytes.tolist()
        self.capacity = problem.memory_capacity_bytes.tolist()
        tensors, devices = np.arange(problem.num_tensors)[:, None, None], np.arange(k)
        src, dst = devices[None, :, None], devices[None, None, :]
        self.transfer = transfer_duration_s(problem, tensors, src, dst).tolist()
        self.send = send_cpu_s(problem, tensors, src, dst).tolist()
        self.recv = recv_cpu_s(problem, tensors, src, dst).tolist()
        self.inputs = [sorted(set(ts)) for ts in problem.input_tensors]


class _Stage:
    """One stage on one device, grown task by task after ``label``: what it costs and what it charges others."""

    __slots__ = (
        "busy_s",
        "device",
        "driver_s",
        "input_link_s",
        "link_s",
        "memory_bytes",
        "model_inputs",
        "output_link_s",
        "output_s",
        "own_s",
        "pending",
        "release_s",
        "sent_s",
    )

    def __init__(self, pending: dict[int, int], device: int) -> None:
        self.pending, self.device = pending, device
        self.busy_s = self.own_s = self.driver_s = self.memory_bytes = self.output_s = 0.0
        self.release_s = self.output_link_s = self.input_link_s = 0.0
        self.model_inputs: set[int] = set()  # the model inputs the driver sends the stage
        self.link_s: dict[int, float] = {}  # by source device: transfers into the stage
        self.sent_s: dict[int, float] = {}  # by source device: its sends to the stage

    def add(self, p: _Pricing, task: int, received: set[int]) -> None:
        d = self.device
        self.busy_s += p.compute[task][d]
        self.own_s += p.own[task][d]
        self.driver_s += p.driver[task][d]
        self.memory_bytes += p.memory[task]
        self.output_s = max(self.output_s, p.output[task][d])
        self.output_link_s += p.output_link[task][d]
        self.release_s = max(self.release_s, p.release[task][d])
        for j in p.model_inputs[task]:
            if j not in self.model_inputs:
                self.model_inputs.add(j)
                self.own_s += p.input_own[j][d]
                self.driver_s += p.input_driver[j][d]
                self.input_link_s += p.input_link[j][d]
        for t in p.inputs[task]:
            a = self.pending.get(t)
            if a is None or t in received:  # made in this stage, or already here
                continue
            received.add(t)
            self.busy_s += p.recv[t][a][d]
            self.link_s[a] = self.link_s.get(a, 0.0) + p.transfer[t][a][d]
            self.sent_s[a] = self.sent_s.get(a, 0.0) + p.send[t][a][d]


class _Space(NamedTuple):
    """The DP's states (ideals as bit masks, or prefixes) in order of size and the tensors read beyond each."""

    masks: list[int] | None  # None: prefixes, state ``s`` is the first ``s`` tasks of ``order``
    order: list[int]
    crossing: list[list[int]]  # tensors made in the state and read outside it
    size: list[int]


@register("contiguous", minimises=True, respects_memory=True, start_plan=None)
def place_contiguous(problem: Problem, objective: Objective = LATENCY) -> Plan:
    """The best split into contiguous stages, one device each, for ``objective`` (see the module docstring)."""
    if problem.num_tasks == 0:
        return Plan(np.zeros(0, int), problem.device_names)  # no stage to split, as every placer places no task
    throughput = objective.steady_state
    p = _Pricing(problem)
    space = _states(problem)
    exact = space.masks is not None
    devices = _Devices(problem, ordered=not exact)
    remaining = _remaining_s(problem, space)
    # [Note: a capped search] first with a cap a little above a lower bound, raised until a split is found under it.
    floor_s = remaining[0] / problem.num_devices if throughput else remaining[0]
    for searches, cap_s in enumerate([*(floor_s * CAP_FIRST * CAP_GROWTH**k for k in range(CAP_STEPS)), math.inf], 1):
        best = _search(problem, p, space, devices, remaining, throughput, cap_s)
        if best is not None:
            plan = _plan(problem, space, best, throughput, exact, searches)
            # Objectives whose value is one request's critical path (latency; a generation's TTFT and TPOT is not).
            judged = not throughput and exact and objective.windows_apply
            return _best_simulated(problem, space, objective, plan) if judged else plan
    raise InfeasibleError(
        "contiguous finds no split into contiguous stages that fit the devices' memory and run every task "
        "where it can run; try 'heft' or 'milp'"
    )


def _search(
    problem: Problem,
    p: _Pricing,
    space: _Space,
    devices: _Devices,
    remaining: list[float],
    throughput: bool,
    cap_s: float,
) -> _Label | None:
    """The DP over ``space``'s states: the best split whose value is under ``cap_s``, or None if none is."""
    exact = space.masks is not None
    buckets: list[dict[int, list[_Label]]] = [{} for _ in space.size]
    start = _Label(
        max(p.always, default=0.0) if throughput else 0.0,
        max(p.always, default=0.0) if throughput else 0.0,
        (p.always[0],) if throughput else (0.0,),
        (0,) if throughput else (),
        (),
        0,
        0,
        None,
        -1,
        (0.0,) * len(p.always) if throughput else (),
    )
    buckets[0][0] = [start]
    best: _Label | None = None
    limit_s = cap_s  # what a split must beat: the cap, then the best split found
    full = len(space.size) - 1

    def bound_s(label: _Label) -> float:
        """A lower bound on the value of every completion of ``label``."""
        if throughput:
            free = devices.free(label.used)
            rest = remaining[label.state] / free if free else math.inf
            return max(label.value_s, rest if remaining[label.state] > 0 else 0.0)
        return max(label.value_s, label.closed_s + remaining[label.state])

    for s in range(len(space.size)):
        for labels in list(buckets[s].values()):
            for label in labels:
                if bound_s(label) >= limit_s:
                    continue
                pending = dict(label.pending)
                for d in devices.allowed(label.used):
                    used = devices.use(label.used, d)
                    free = devices.free(used)
                    for target, stage in _grow(problem, p, space, s, pending, d):
                        # cheap bounds before the label is built
                        if not throughput and label.closed_s + stage.busy_s + remaining[target] >= limit_s:
                            if exact:
                                continue
                            break  # a prefix's stage only grows, by at least what the rest loses
                        if throughput and remaining[target] > 0 and remaining[target] >= limit_s * free:
                            continue
                        new = _close(p, space, label, stage, target, used, throughput, devices.may_take(used, 0))
                        if new is None:
                            continue
                        if new.value_s >= limit_s:
                            if exact:
                                continue
                            break  # a prefix's stage only grows, and its value with it
                        if target == full:
                            best, limit_s = new, new.value_s
                        elif bound_s(new) < limit_s:
                            _keep(buckets[target], new, IDEAL_LABELS if exact else PREFIX_LABELS)
    return best


def _states(problem: Problem) -> _Space:
    """Every ideal of the graph by size when there are at most :data:`IDEAL_LIMIT`, else every prefix."""
    order = list(problem.topological_order)
    n = problem.num_tasks
    predecessors = [sum(1 << u for u in problem.predecessors[i]) for i in range(n)]
    seen, frontier = {0}, [0]
    while frontier and len(seen) <= IDEAL_LIMIT:
        grown = []
        for mask in frontier:
            for i in range(n):
                if not mask >> i & 1 and predecessors[i] & ~mask == 0 and mask | 1 << i not in seen:
                    seen.add(mask | 1 << i)
                    grown.append(mask | 1 << i)
        frontier = grown
    readers = [sum(1 << c for c in consumers) for consumers in problem.tensor_consumers]
    producer = problem.tensor_producer.tolist()
    if len(seen) <= IDEAL_LIMIT and len(seen) * _Devices(problem, ordered=False).work() <= IDEAL_WORK_LIMIT:
        masks = sorted(seen, key=lambda m: (m.bit_count(), m))
        crossing = [[t for t, r in enumerate(readers) if mask >> producer[t] & 1 and r & ~mask] for mask in masks]
        return _Space(masks, order, crossing, [m.bit_count() for m in masks])
    position = problem.topological_position
    last_read = [max(position[c] for c in consumers) for consumers in problem.tensor_consumers]
    crossing = [[] for _ in range(n + 1)]
    for t, u in enumerate(producer):
        for s in range(position[u] + 1, last_read[t] + 1):
            crossing[s].append(t)
    return _Space(None, order, crossing, list(range(n + 1)))


def _remaining_s(problem: Problem, space: _Space) -> list[float]:
    """Per state: the sum over the tasks not in it of their fastest compute time."""
    compute = np.where(np.isfinite(problem.compute_s), problem.compute_s, np.inf).min(axis=1)
    if space.masks is None:
        after = np.concatenate([np.cumsum(compute[space.order][::-1])[::-1], [0.0]])
        return after.tolist()
    tasks = range(problem.num_tasks)
    return [float(sum(compute[i] for i in tasks if not m >> i & 1)) for m in space.masks]


def _grow(
    problem: Problem, p: _Pricing, space: _Space, s: int, pending: dict[int, int], device: int
) -> Iterator[tuple[int, _Stage]]:
    """Every stage on ``device`` after state ``s``: (the state it reaches, the stage), by size for prefixes."""
    if space.masks is None:
        stage, received = _Stage(pending, device), set()
        for target in range(s + 1, len(space.size)):
            task = space.order[target - 1]
            stage.add(p, task, received)
            if not math.isfinite(stage.busy_s) or stage.memory_bytes > p.capacity[device]:
                return
            yield target, stage
        return
    for target, tasks in _supersets(space, s):
        stage, received = _Stage(pending, device), set()
        for task in tasks:
            stage.add(p, task, received)
        if math.isfinite(stage.busy_s) and stage.memory_bytes <= p.capacity[device]:
            yield target, stage


@functools.cache
def _supersets_of(masks: tuple[int, ...], order: tuple[int, ...], s: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    mask = masks[s]
    return tuple(
        (target, tuple(i for i in order if bigger >> i & 1 and not mask >> i & 1))
        for target, bigger in enumerate(masks[s + 1 :], s + 1)
        if not mask & ~bigger
    )


def _supersets(space: _Space, s: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Every larger ideal than state ``s`` and the tasks it adds, in topological order."""
    return _supersets_of(tuple(space.masks), tuple(space.order), s)


def _close(
    p: _Pricing,
    space: _Space,
    label: _Label,
    stage: _Stage,
    target: int,
    used: int,
    throughput: bool,
    zero_may_follow: bool = False,
) -> _Label | None:
    """The label of ``label`` followed by ``stage`` up to state ``target``, or None if a link is missing.
    ``zero_may_follow``: a later stage may still go to device 0 (``used`` leaves it free)."""
    d = stage.device
    holding = {t: stage.pending.get(t, d) for t in space.crossing[target]}
    pending = tuple(sorted(holding.items()))
    if throughput:
        loads = dict(zip(label.holders, label.open_s, strict=True))
        for a, seconds in stage.sent_s.items():
            loads[a] += seconds
        loads[0] += stage.driver_s + p.driver_taking_part[d]
        loads[d] = loads.get(d, p.always[d]) + p.taking_part[d] + stage.busy_s + stage.own_s
        from_driver = stage.link_s.get(0, 0.0) + stage.input_link_s
        links = dict(stage.link_s)
        to_zero = list(label.to_zero_s)
        if d == 0:  # the tensors it receives from a share a's link to device 0 with a's outputs: the loads add
            for a, seconds in enumerate(to_zero):
                links[a] = links.get(a, 0.0) + seconds
            to_zero = [0.0] * len(to_zero)
        elif zero_may_follow:
            to_zero[d] = stage.output_link_s
        closed = max(label.closed_s, from_driver, max(links.values(), default=0.0))
        if d != 0 and not zero_may_follow:
            closed = max(closed, stage.output_link_s)
        holders = tuple(sorted({0, *holding.values()}))
        closed = max([closed, *(load for a, load in loads.items() if a not in holders)])
        open_s = tuple(loads[a] for a in holders)
        value = max(closed, *open_s, *to_zero)
        return _Label(value, closed, open_s, holders, pending, used, target, label, d, tuple(to_zero))
    else:
        ready = max((label.closed_s + stage.link_s[a] + stage.sent_s[a] for a in stage.link_s), default=0.0)
        finish = max(label.closed_s, ready, stage.release_s) + stage.busy_s
        closed, holders = finish, ()
        open_s = (max(label.open_s[0], finish + stage.output_s),)
        value = max(finish, open_s[0])
    if not math.isfinite(value):
        return None
    return _Label(value, closed, open_s, holders, pending, used, target, label, d)


def _keep(bucket: dict[int, list[_Label]], new: _Label, limit: int | None) -> None:
    """Add ``new`` to its state's labels of the same used devices unless one as good in every load holds the same
    tensors; drop those it beats so; keep the ``limit`` best by value (None: all)."""
    labels = bucket.setdefault(new.used, [])
    vector = (new.closed_s, *new.open_s, *new.to_zero_s)
    kept = []
    for old in labels:
        if old.pending == new.pending:
            other = (old.closed_s, *old.open_s, *old.to_zero_s)
            if all(a <= b for a, b in zip(other, vector, strict=True)):
                return
            if all(b <= a for a, b in zip(other, vector, strict=True)):
                continue
        kept.append(old)
    kept.append(new)
    if limit is not None and len(kept) > limit:
        kept = sorted(kept, key=lambda label: label.value_s)[:limit]
    bucket[new.used] = kept


class _Devices:
    """Which device may take the next stage: the first unused one of each kind, or the next in a fixed order."""

    def __init__(self, problem: Problem, ordered: bool) -> None:
        from moirai.planning.solve.window import identical_device_groups

        k = problem.num_devices
        groups = {d: g for g in identical_device_groups(problem) for d in g}
        self.kinds = [groups.get(d, (d,)) for d in range(k) if d == groups.get(d, (d,))[0]]
        self.subsets = not ordered and math.prod(len(kind) + 1 for kind in self.kinds) <= SUBSET_LIMIT
        self.order = [int(d) for d in np.argsort(-problem.device_speed, kind="stable")]

    def allowed(self, used: int) -> Iterator[int]:
        if self.subsets:
            for kind in self.kinds:
                free = next((d for d in kind if not used >> d & 1), None)
                if free is not None:
                    yield free
        else:
            yield from self.order[used:]

    def work(self) -> int:
        """The combinations of used devices the DP tells apart, times the devices: its work per state."""
        return (math.prod(len(kind) + 1 for kind in self.kinds) if self.subsets else len(self.order)) * len(self.order)

    def free(self, used: int) -> int:
        """How many devices may still take a stage."""
        return len(self.order) - (used.bit_count() if self.subsets else used)

    def use(self, used: int, device: int) -> int:
        return used | 1 << device if self.subsets else self.order.index(device) + 1

    def may_take(self, used: int, device: int) -> bool:
        """Whether ``device`` may still take a stage after ``used``."""
        return not used >> device & 1 if self.subsets else self.order.index(device) >= used


def _plan(problem: Problem, space: _Space, best: _Label, throughput: bool, exact: bool, searches: int) -> Plan:
    placement = np.empty(problem.num_tasks, int)
    label: _Label | None = best
    stages = 0
    while label is not None and label.parent is not None:
        before, after = label.parent.state, label.state
        if space.masks is None:
            tasks = space.order[before:after]
        else:
            stage = space.masks[after] & ~space.masks[before]
            tasks = [i for i in range(problem.num_tasks) if stage >> i & 1]
        placement[tasks] = label.device
        stages += 1
        label = label.parent
    notes = {
        "dp_period_s" if throughput else "dp_chain_latency_s": best.value_s,
        "stages": stages,
        "states": "ideals" if exact else "prefixes",
        "searches": searches,  # capped searches until one found a split
    }
    return _ordered_plan(problem, space, placement, PlacerReport(notes=notes))


def _best_simulated(problem: Problem, space: _Space, objective: Objective, dp_plan: Plan) -> Plan:
    """[Note: the chain model] The latency DP prices a split as a chain, each stage after the one before; the
    simulator runs a stage as soon as its own inputs are there, so stages that do not read each other overlap and
    the best split by the simulator may be another. Where the splits are few (:data:`LISTED_SPLIT_TASKS`), the best
    by the simulator is searched for: splits in the order of a lower bound on their simulated latency
    (:func:`moirai.planning.bounds.placement_bound_s`), each simulated until the bound reaches the best found (the
    DP's split first) or the simulations reach :data:`SIMULATED_SPLIT_TASKS` (then the best so far: ``exhausted``
    in the notes)."""
    from moirai.planning.bounds import placement_bound_s
    from moirai.planning.simulate import simulate

    most = max(1, LISTED_SPLIT_TASKS // max(1, problem.num_tasks))
    splits = list(itertools.islice(all_contiguous_splits(problem), most + 1))
    if len(splits) > most:
        return dp_plan
    best_plan, best_s = dp_plan, objective.value_s(simulate(problem, dp_plan))
    tasks = np.arange(problem.num_tasks)
    runnable = [placement for placement in splits if problem.runs_on[tasks, placement].all()]
    bounds_s = [placement_bound_s(problem, placement) for placement in runnable]
    simulated, budget = 0, max(2, SIMULATED_SPLIT_TASKS // max(1, problem.num_tasks))
    exhausted = False
    for i in np.argsort(bounds_s, kind="stable"):
        if bounds_s[i] >= best_s:
            break
        if simulated >= budget:
            exhausted = True
            break
        # Each device's tasks in topological order, and in the order the simulator gives a plan without one.
        for plan in (
            _ordered_plan(problem, space, runnable[i], dp_plan.report),
            Plan(runnable[i], problem.device_names, placer="contiguous", report=dp_plan.report),
        ):
            timeline = simulate(problem, plan)
            simulated += 1
            if timeline.fits_memory and objective.value_s(timeline) < best_s:
                best_plan, best_s = plan, objective.value_s(timeline)
    stages = len(set(best_plan.placement.tolist()))
    best_plan.report.notes.update(
        contiguous_splits=len(splits), simulated_splits=simulated, exhausted=exhausted, stages=stages
    )
    return best_plan


def _ordered_plan(problem: Problem, space: _Space, placement: np.ndarray, report: PlacerReport) -> Plan:
    """``placement`` with each device's tasks in the space's topological order, as the DP's plans are."""
    order = tuple(tuple(i for i in space.order if placement[i] == d) for d in range(problem.num_devices))
    return Plan(placement, problem.device_names, order=order, placer="contiguous", report=report)


def all_contiguous_splits(problem: Problem) -> Iterator[np.ndarray]:
    """Every placement the DP over ideals searches (for checks on small graphs): chains of ideals, each difference
    on a device of its own."""
    space = _states(problem)
    if space.masks is None:
        raise InfeasibleError(f"more than {IDEAL_LIMIT} ideals: too many splits to list")
    masks, full = space.masks, len(space.masks) - 1

    def chains(s: int, stages_left: int) -> Iterator[list[int]]:
        """Chains of ideals from ``s`` to the full set in at most ``stages_left`` stages (one device each)."""
        if s == full:
            yield [s]
            return
        if stages_left == 0:
            return
        for target in range(s + 1, len(masks)):
            if not masks[s] & ~masks[target]:
                for rest in chains(target, stages_left - 1):
                    yield [s, *rest]

    for chain in chains(0, problem.num_devices):
        stages = [masks[b] & ~masks[a] for a, b in itertools.pairwise(chain)]
        for devices in itertools.permutations(range(problem.num_devices), len(stages)):
            placement = np.empty(problem.num_tasks, int)
            for stage, d in zip(stages, devices, strict=True):
                placement[[i for i in range(problem.num_tasks) if stage >> i & 1]] = d
            yield placement
