"""Lower bounds on the best makespan of a problem, so every plan can print its gap; memory feasibility.

Two bounds, each valid for every plan that respects memory, with or without link contention:

* critical path: the longest path when every task runs on its fastest device that can hold it, counting what its
  inputs must cost: for each task and device a head (the earliest it can start there), where each producer either
  runs on the same device, and those producers then run one at a time, or sends its tensor, which then takes at
  least the link's time from the producer's best other device; a task waits for its device's header and the model
  inputs it reads, and its model outputs take their time to device 0. Where transfers cost several tasks' time this
  is far above the longest path of compute alone (where they cost nothing, it is that path). The head also counts
  every ancestor, not only the producers: one on the same device runs there first (the one-machine bound over all
  of them), one elsewhere gets its result to the device at the earliest when it, or a later ancestor, finishes
  elsewhere and sends its cheapest tensor (:class:`_Ancestors`);
* load: the optimum of the LP "minimise T such that a fractional assignment of tasks to
  devices puts at most T seconds of work on every device and at most its capacity of memory".
  The number returned is not the solver's objective but the Lagrangian bound
  ``sum_i min_k (y_k p_ik + z_k m_i) - sum_k z_k capacity_k`` evaluated at the LP's duals
  (``y`` on the simplex, ``z >= 0``), which is valid for any ``y, z``: solver tolerances can
  only make it weaker, never invalid.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import NamedTuple

import highspy
import numpy as np

from moirai.errors import InfeasibleError
from moirai.planning.clock import deadline_passed
from moirai.planning.colocation import Contraction, colocated_sets, contract, names_of, no_common_device
from moirai.planning.highs import new_highs
from moirai.planning.problem import Problem, check_problem
from moirai.planning.schedule.transfers import implied_transfers, task_duration_s, transfer_duration_s


class LowerBounds(NamedTuple):
    critical_path_s: float
    load_s: float

    @property
    def best_s(self) -> float:
        return max(self.critical_path_s, self.load_s)


_CACHE: weakref.WeakKeyDictionary[Problem, LowerBounds] = weakref.WeakKeyDictionary()
# The last bound cut short per problem: for a caller whose own deadline has passed too (place, after a placer that
# spent its budget), never for one with time to count every ancestor.
_CUT_SHORT: weakref.WeakKeyDictionary[Problem, LowerBounds] = weakref.WeakKeyDictionary()
_LOAD_CACHE: weakref.WeakKeyDictionary[Problem, float] = weakref.WeakKeyDictionary()


def lower_bound(problem: Problem, deadline: float | None = None) -> float:
    """A makespan no plan that respects memory can beat (seconds); ``deadline`` as :func:`lower_bounds` takes it."""
    check_problem(problem, "moirai.lower_bound's problem")
    return lower_bounds(problem, deadline).best_s


def lower_bounds(problem: Problem, deadline: float | None = None) -> LowerBounds:
    """Both bounds, computed once per problem. Where ``deadline`` (a ``time.perf_counter`` value) passes before the
    critical path's ancestors are all counted, the tasks left count their producers only: a bound still, maybe a
    weaker one, kept only for callers whose deadline has passed too (a search's budget, not the problem, made it)."""
    if problem in _CACHE:
        return _CACHE[problem]
    if problem in _CUT_SHORT and deadline_passed(deadline, 0):
        return _CUT_SHORT[problem]  # no time to count more than the last caller cut short did
    finish, complete = _earliest_finish(problem, deadline)
    bounds = LowerBounds(_critical_path_bound(problem, finish), load_bound_s(problem))
    (_CACHE if complete else _CUT_SHORT)[problem] = bounds
    return bounds


def load_bound_s(problem: Problem) -> float:
    """The load bound alone, computed once per problem: what a period bound needs, without the critical path's
    pass over every task (seconds on thousands of tasks)."""
    if problem not in _LOAD_CACHE:
        _LOAD_CACHE[problem] = _load_bound(problem)
    return _LOAD_CACHE[problem]


def placement_bound_s(problem: Problem, placement: np.ndarray) -> float:
    """A makespan no order of ``placement``'s tasks and transfers can beat (seconds): the longest path of its tasks'
    busy times (compute, sends and receives) and its transfers, each task after its header, plus its outputs' way to
    device 0; and every device's busy time after its first header, plus its cheapest output."""
    n = problem.num_tasks
    if n == 0:
        return 0.0
    duration = task_duration_s(problem, placement, implied_transfers(problem, placement))
    release = problem.costs.release_s[np.arange(n), placement]
    output = problem.costs.output_s[np.arange(n), placement]
    finish = np.zeros(n)
    for v in problem.topological_order:
        start = float(release[v])
        for t in problem.input_tensors[v]:
            u = int(problem.tensor_producer[t])
            arrival = finish[u]
            if placement[u] != placement[v]:
                arrival += float(transfer_duration_s(problem, t, placement[u], placement[v]))
            start = max(start, arrival)
        finish[v] = start + duration[v]
    device_bound = max(
        float(release[on].min() + duration[on].sum() + output[on].min())
        for on in (placement == d for d in np.unique(placement))
    )
    return max(float((finish + output).max()), device_bound)


def format_bytes(num_bytes: float) -> str:
    """``31.2 GB``, ``512.0 MB``, ``unlimited`` (an infinite capacity): memory sizes for messages."""
    if num_bytes == np.inf:
        return "unlimited"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:g} B"


def check_memory_feasible(problem: Problem, grouped: bool = True) -> None:
    """Raise :class:`InfeasibleError` when no placement can fit the model's memory, saying by how much: in total,
    for a task, or for a colocation group (``grouped``: a colocated set with the tasks
    :func:`moirai.planning.colocation.contract` keeps with it, as every placer but one that keeps sets itself places
    it; else the set alone), whose tasks must share one device."""
    needed = float(problem.memory_bytes.sum())
    capacity = problem.memory_capacity_bytes
    if needed > capacity.sum():
        raise InfeasibleError(
            f"model needs {format_bytes(needed)}, cluster has {format_bytes(float(capacity.sum()))} free in total"
            f"{_reserve_words(capacity.sum(), problem.memory_reserve_bytes.sum(), ' ({})')}; add devices or memory, or "
            "use a smaller data type"
        )
    _fastest_holding_device_time(problem)
    if problem.colocated and grouped:
        _check_groups_fit(contract(problem))
    elif problem.colocated:
        _check_sets_fit(problem)


def without_unlinked_devices(problem: Problem) -> Problem:
    """``problem`` with every task kept off the devices no plan can put it on for want of links, or ``problem`` itself
    where that is none; :class:`InfeasibleError` where a task is left no device. Each task's devices are narrowed to
    those a tensor it makes or reads can cross to or from (arc consistency), colocated tasks sharing theirs, until
    none changes: a greedy placer then never takes a device from which the graph cannot go on (a task that reads
    from one device and feeds another, with links only through a third)."""
    linked = np.isfinite(problem.transfer_s)  # [tensor, source, destination]; the diagonal is 0
    if linked.all():
        return problem
    representative = np.arange(problem.num_tasks)
    allowed = problem.runs_on.copy()
    for members in colocated_sets(problem):
        representative[list(members)] = members[0]
        allowed[members[0]] = problem.runs_on[list(members)].all(axis=0)
    if not allowed[representative].any(axis=1).all():
        return problem  # a task or a set that can run nowhere: the memory check and the simulator say which
    crossings = [
        (t, int(representative[problem.tensor_producer[t]]), int(representative[c]))
        for t, consumers in enumerate(problem.tensor_consumers)
        for c in consumers
        if not linked[t].all()
    ]
    crossings = [(t, u, c) for t, u, c in crossings if u != c]
    changed = True
    while changed:
        changed = False
        for t, u, c in crossings:
            link = linked[t].astype(int)
            consumer = allowed[c] & (allowed[u].astype(int) @ link > 0)
            producer = allowed[u] & (link @ allowed[c].astype(int) > 0)
            if not consumer.any() or not producer.any():
                raise _no_link_between(problem, t, c, allowed[u], allowed[c])
            if (consumer != allowed[c]).any() or (producer != allowed[u]).any():
                allowed[c], allowed[u], changed = consumer, producer, True
    allowed = allowed[representative] & problem.runs_on
    if (allowed == problem.runs_on).all():
        return problem
    return dataclasses.replace(problem, compute_s=np.where(allowed, problem.compute_s, np.inf))


def _no_link_between(
    problem: Problem, tensor: int, consumer: int, producer_devices: np.ndarray, consumer_devices: np.ndarray
) -> InfeasibleError:
    """The refusal of a problem whose ``tensor`` can cross from no device its producer may use to none ``consumer``
    may use."""

    def names(devices: np.ndarray) -> str:
        return ", ".join(repr(problem.device_names[d]) for d in np.flatnonzero(devices)) or "none"

    producer = int(problem.tensor_producer[tensor])
    return InfeasibleError(
        f"no plan exists: tensor {problem.tensor_names[tensor]!r} goes from task {problem.task_names[producer]!r} "
        f"(which can run on {names(producer_devices)}) to task {problem.task_names[consumer]!r} (on "
        f"{names(consumer_devices)}), and no link joins those devices (infinite transfer time) nor do they share "
        "one; give the problem the missing link, or let the tasks run on a common device"
    )


def _check_sets_fit(problem: Problem) -> None:
    """Raise :class:`InfeasibleError` when a colocated set (its members only) has no device that can run all of its
    tasks and hold them together."""
    for members in colocated_sets(problem):
        runs_on = problem.runs_on[list(members)].all(axis=0)
        if not runs_on.any():
            raise no_common_device(names_of(problem, members))
        needed = float(problem.memory_bytes[list(members)].sum())
        if not (runs_on & (problem.memory_capacity_bytes >= needed)).any():
            largest = float(problem.memory_capacity_bytes[runs_on].max())
            raise _too_large_together(names_of(problem, members), needed, largest)


def _too_large_together(described: str, needed_bytes: float, largest_bytes: float, remedy: str = "") -> InfeasibleError:
    """The refusal of colocated tasks (``described``) whose memory together no device that runs them all holds."""
    return InfeasibleError(
        f"colocated tasks {described} must share one device and need {format_bytes(needed_bytes)} together, but no "
        f"device that can run them all has that much (largest: {format_bytes(largest_bytes)}); add memory or split "
        f"the set{remedy}"
    )


def _milp_remedy(contraction: Contraction, group: int) -> str:
    """Where a group holds tasks no set names: milp's ``strategy='full'`` keeps the set without them. (A placer that
    keeps sets itself never gets here: the registry checks its sets alone, not their groups.)"""
    named = {i for members in contraction.original.colocated for i in members}
    if named.issuperset(contraction.members[group]):
        return ""
    return (
        ", or place it with milp's strategy='full', which keeps a set on one device without the tasks between its "
        "members"
    )


def _check_groups_fit(contraction: Contraction) -> None:
    contracted = contraction.problem
    for c in contraction.groups:
        if contracted.fits[c].any():
            continue
        largest = float(contracted.memory_capacity_bytes[contracted.runs_on[c]].max())
        needed = float(contracted.memory_bytes[c])
        raise _too_large_together(contraction.describe(c), needed, largest, _milp_remedy(contraction, c))


def _reserve_words(capacity_bytes: float, reserve_bytes: float, form: str) -> str:
    """What a capacity in a memory message leaves out: the memory kept free beside the tasks' (the activations'
    peak a compiled model is priced with), which the devices' own sizes include, put in ``form``; '' where none is
    kept."""
    if reserve_bytes <= 0:
        return ""
    memory = format_bytes(float(capacity_bytes + reserve_bytes))
    return form.format(f"{format_bytes(float(reserve_bytes))} of its {memory} kept for activations")


def _fastest_holding_device_time(problem: Problem) -> np.ndarray:
    """Each task's time on its fastest device that could hold it alone; raise if there is none."""
    holds = problem.fits
    homeless = np.flatnonzero(~holds.any(axis=1))
    if homeless.size:
        i = int(homeless[0])
        if np.isinf(problem.compute_s[i]).all():
            raise InfeasibleError(
                f"task {problem.task_names[i]!r} can run on no device (its compute_s is Infinity on every one); give "
                "it a finite time on at least one device"
            )
        largest = int(np.argmax(problem.memory_capacity_bytes))
        free_bytes, reserve_bytes = problem.memory_capacity_bytes[largest], problem.memory_reserve_bytes[largest]
        raise InfeasibleError(
            f"task {problem.task_names[i]!r} needs {format_bytes(float(problem.memory_bytes[i]))}, but no device "
            f"that can run it has that much (largest free: {format_bytes(float(free_bytes))}"
            f"{_reserve_words(free_bytes, reserve_bytes, '; {}')})"
        )
    return np.where(holds, problem.compute_s, np.inf).min(axis=1)


_EXACT_SPLIT_MAX_PRODUCERS = 12  # beyond this many producers a task's head takes each one's cheaper way alone


def _critical_path_bound(problem: Problem, finish: np.ndarray) -> float:
    """The latest, over tasks, of the least head + compute + model-output time on any device that can hold it
    (``finish``: :func:`earliest_finish_s`'s numbers)."""
    output = np.asarray(problem.costs.output_s, float)
    return max(0.0, float(np.max(np.min(finish + output, axis=1), initial=0.0)))


def earliest_finish_s(problem: Problem) -> np.ndarray:
    """``[task, device]``: no plan finishes the task's compute on the device earlier (head + compute; ``inf`` where
    it cannot run), the critical-path bound's numbers; the sends and receives it books come on top."""
    return _earliest_finish(problem)[0]


def _earliest_finish(problem: Problem, deadline: float | None = None) -> tuple[np.ndarray, bool]:
    """:func:`earliest_finish_s`'s numbers, and whether every ancestor counted (``False``: ``deadline`` passed first
    and the tasks after it count their producers only: each head is a bound given its producers' bounds, so every
    number is still one)."""
    _fastest_holding_device_time(problem)  # raises for a task no device can hold
    n, k = problem.num_tasks, problem.num_devices
    compute = np.where(problem.fits, problem.compute_s, np.inf)
    release = np.asarray(problem.costs.release_s, float)  # its device's header and the model inputs it reads
    head = np.full((n, k), np.inf)
    finish = np.full((n, k), np.inf)  # head + compute: the earliest each task can finish on each device
    ancestors = _Ancestors(problem, compute) if n <= _ANCESTORS_MAX_TASKS else None
    complete = True
    for bounded, v in enumerate(problem.topological_order):
        if ancestors is not None and deadline_passed(deadline, bounded):
            ancestors, complete = None, False
        producers = problem.predecessors[v]
        head[v] = release[v] if not producers else np.maximum(release[v], _head_s(problem, v, producers, head, finish))
        if ancestors is not None:
            head[v] = np.maximum(head[v], ancestors.head_s(v, head, finish))
        finish[v] = head[v] + compute[v]
        if ancestors is not None:
            ancestors.finished(v, finish[v])
    return finish, complete


_ANCESTORS_MAX_TASKS = 3000  # the ancestor sets are an n x n matrix; beyond this the producers alone are counted
_ANCESTORS_KEPT = 32  # per task, the ancestors that can finish latest: fewer keep the bound valid, only weaker


class _Ancestors:
    """The head of a task on a device from all its ancestors, not only its producers.

    An ancestor ``u`` of ``v`` on ``v``'s device ``k`` runs there before ``v``; the ones there run one at a time (the
    one-machine bound over their earliest starts on ``k``). One elsewhere reaches ``v`` along a path whose last task
    off ``k``, ``a`` (``u`` or a descendant of it), sends a tensor to ``k``: that arrives no earlier than ``a``'s
    earliest finish off ``k`` plus the cheapest transfer of any of ``a``'s tensors into ``k``. ``arrival_s[u, k]``
    is the least of that over ``u`` and the descendants bounded so far (a superset of those on a path to ``v``, so
    never more than the truth). As for producers, every split that sends the ancestors arriving earliest is tried."""

    def __init__(self, problem: Problem, compute_s: np.ndarray) -> None:
        n, k = problem.num_tasks, problem.num_devices
        self.compute_s = compute_s
        into = problem.transfer_s.copy()  # [tensor, from, to]: the diagonal is no transfer
        into[:, np.arange(k), np.arange(k)] = np.inf
        self.cheapest_in_s = np.full((n, k), np.inf)  # [task, device]: its cheapest tensor into the device
        np.minimum.at(self.cheapest_in_s, problem.tensor_producer, into.min(axis=1))
        self.arrival_s = np.full((n, k), np.inf)
        self.of = np.zeros((n, n), bool)  # of[v]: v's ancestors
        self.problem = problem

    def head_s(self, v: int, head_s: np.ndarray, finish_s: np.ndarray) -> np.ndarray:
        """``v``'s earliest start on each device from its ancestors (bounded before it, in topological order)."""
        for u in self.problem.predecessors[v]:
            self.of[v] |= self.of[u]
            self.of[v, u] = True
        ancestors = np.flatnonzero(self.of[v])
        if ancestors.size > _ANCESTORS_KEPT:
            latest = np.argpartition(-finish_s[ancestors].min(axis=1), _ANCESTORS_KEPT)[:_ANCESTORS_KEPT]
            ancestors = ancestors[latest]
        if ancestors.size == 0:
            return np.zeros(self.problem.num_devices)
        return split_start_s(self.arrival_s[ancestors], head_s[ancestors], self.compute_s[ancestors])

    def finished(self, v: int, finish_s: np.ndarray) -> None:
        """Record ``v``'s earliest finishes: its result (and so its ancestors') can reach device ``k`` from then."""
        k = finish_s.size
        if k < 2:
            return
        two = np.partition(finish_s, 1)[:2]
        elsewhere = np.where(finish_s <= two[0], two[1], two[0])  # the earliest finish on another device
        reach = elsewhere + self.cheapest_in_s[v]
        rows = np.append(np.flatnonzero(self.of[v]), v)
        self.arrival_s[rows] = np.minimum(self.arrival_s[rows], reach)


def split_start_s(arrival_s: np.ndarray, local_start_s: np.ndarray, local_compute_s: np.ndarray) -> np.ndarray:
    """The earliest a task can start on each device (columns) given tasks it waits for (rows): each arrives from
    elsewhere no earlier than ``arrival_s``, or runs on the device from ``local_start_s`` for ``local_compute_s``
    before it, those one at a time. For each threshold ``θ`` (0 or an arrival), those arriving by ``θ`` are sent and
    the rest run on the device: ``max(θ, one-machine bound of the rest)``, the least over thresholds."""
    m, k = arrival_s.shape
    thresholds = np.vstack([np.zeros(k), np.sort(arrival_s, axis=0)])  # [split, device]
    by_start = np.argsort(-local_start_s, axis=0)
    start_s = np.take_along_axis(local_start_s, by_start, axis=0)
    compute_s = np.take_along_axis(local_compute_s, by_start, axis=0)
    arrives_s = np.take_along_axis(arrival_s, by_start, axis=0)
    local = arrives_s[None] > thresholds[:, None, :]  # [split, ancestor by latest start, device]
    busy = np.cumsum(np.where(local, compute_s[None], 0.0), axis=1)
    local_done = np.where(local, start_s[None] + busy, -np.inf).max(axis=1)
    return np.maximum(thresholds, local_done).min(axis=0)


def _head_s(problem: Problem, v: int, producers: tuple[int, ...], head: np.ndarray, finish: np.ndarray) -> np.ndarray:
    """The earliest task ``v`` can start on each device given its producers' earliest starts and finishes.

    A producer on the same device ``k`` finishes there, and those producers run one at a time (the one-machine
    bound: the latest start among any of them plus all their compute from it on); one elsewhere sends its
    tensors, which arrive at the earliest its best other device's finish plus the link's time. The best split
    sends exactly the producers whose tensors would arrive by some time: every such threshold is tried."""
    k = problem.num_devices
    rows = {u: row for row, u in enumerate(producers)}
    sent = [(rows[int(problem.tensor_producer[t])], t) for t in problem.input_tensors[v]]
    link = np.zeros((len(producers), k, k))  # [producer, a, b]: the longest of its tensors for v on link a -> b
    devices = np.arange(k)
    durations = transfer_duration_s(problem, np.array([t for _, t in sent])[:, None, None], devices[:, None], devices)
    np.maximum.at(link, [row for row, _ in sent], durations)
    through = finish[list(producers)][:, :, None] + link
    through[:, np.arange(k), np.arange(k)] = np.inf
    arrival = through.min(axis=1)  # [producer, device]: through a link, from the producer's best other device
    local_start = head[list(producers)]
    local_compute = np.where(problem.fits[list(producers)], problem.compute_s[list(producers)], np.inf)
    return earliest_start_s(arrival, local_start, local_compute)


def earliest_start_s(arrival_s: np.ndarray, local_start_s: np.ndarray, local_compute_s: np.ndarray) -> np.ndarray:
    """The earliest a task can start on each device, from its producers (rows) on each device (columns): a producer
    sent from elsewhere arrives at ``arrival_s`` at the earliest; one on the same device starts there at
    ``local_start_s`` at the earliest and takes ``local_compute_s``, and those run one at a time (the one-machine
    bound: the latest start among any of them plus all their compute from it on). Each split is tried that sends
    the producers arriving earliest (the best split is one of them); with many producers, each alone."""
    m, k = arrival_s.shape
    if m == 0:
        return np.zeros(k)
    if m > _EXACT_SPLIT_MAX_PRODUCERS:
        return np.minimum(arrival_s, local_start_s + local_compute_s).max(axis=0)
    # Per device, producers by latest start first (the one-machine bound's order), each with its arrival's rank;
    # split ``j`` sends the ``j`` earliest-arriving producers and runs the others locally.
    by_start = np.argsort(-local_start_s, axis=0)
    start_s = np.take_along_axis(local_start_s, by_start, axis=0)
    compute_s = np.take_along_axis(local_compute_s, by_start, axis=0)
    rank = np.take_along_axis(np.argsort(np.argsort(arrival_s, axis=0), axis=0), by_start, axis=0)
    local = rank[None] >= np.arange(m + 1)[:, None, None]  # [split, producer, device]
    busy = np.cumsum(np.where(local, compute_s[None], 0.0), axis=1)
    local_done = np.where(local, start_s[None] + busy, -np.inf).max(axis=1)
    sent = np.vstack([np.zeros(k), np.sort(arrival_s, axis=0)])  # [split, device]: the last sent tensor's arrival
    return np.maximum(sent, local_done).min(axis=0)


def _load_bound(problem: Problem) -> float:
    if problem.num_tasks == 0:
        return 0.0
    # A memory-infeasible LP means no plan fits; the memory-free bound is then the useful one. Should the
    # solver fail, equal device weights still give a valid (weaker) bound.
    device_weight, memory_price = (
        _solve_load_lp(problem, respect_memory=True)
        or _solve_load_lp(problem, respect_memory=False)
        or (np.full(problem.num_devices, 1.0 / problem.num_devices), np.zeros(problem.num_devices))
    )
    finite = problem.runs_on
    price = device_weight[None, :] * np.where(finite, problem.compute_s, 0.0)
    per_task = np.where(finite, price + memory_price[None, :] * problem.memory_bytes[:, None], np.inf)
    finite_capacity = np.where(np.isfinite(problem.memory_capacity_bytes), problem.memory_capacity_bytes, 0.0)
    return max(0.0, float(per_task.min(axis=1).sum() - memory_price @ finite_capacity))


def _solve_load_lp(problem: Problem, respect_memory: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """Duals (device weights on the simplex, memory prices >= 0) of the load LP, or None if it is infeasible.

    Rows: one "assigned once" row per task, one load row per device (``sum_i p_ik x_ik - T <= 0``),
    one memory row per device with finite capacity. Compute is scaled to its largest finite value
    and memory to the capacity so the solver sees numbers near 1.
    """
    n, k = problem.num_tasks, problem.num_devices
    finite = problem.runs_on
    time_scale = float(problem.compute_s[finite].max()) if finite.any() else 1.0
    time_scale = time_scale if time_scale > 0 else 1.0
    capacity = problem.memory_capacity_bytes
    # Leaving out a memory row only weakens the bound; a zero capacity would divide by zero.
    memory_rows = np.flatnonzero(np.isfinite(capacity) & (capacity > 0)) if respect_memory else np.array([], int)

    tasks, devices = np.nonzero(finite)
    num_x = tasks.size
    memory_row = np.full(k, -1)
    memory_row[memory_rows] = n + k + np.arange(memory_rows.size)
    has_memory_row = memory_row[devices] >= 0
    entries = 2 + has_memory_row
    first = np.cumsum(entries) - entries
    rows = np.empty(int(entries.sum()) + k, np.int32)
    values = np.empty(rows.size)
    rows[first], values[first] = tasks, 1.0
    rows[first + 1], values[first + 1] = n + devices, problem.compute_s[tasks, devices] / time_scale
    with_memory = first[has_memory_row] + 2
    rows[with_memory] = memory_row[devices[has_memory_row]]
    capacity_of_x = problem.memory_capacity_bytes[devices[has_memory_row]]
    values[with_memory] = problem.memory_bytes[tasks[has_memory_row]] / capacity_of_x
    rows[-k:], values[-k:] = n + np.arange(k), -1.0  # the makespan column T
    starts = np.r_[first, rows.size - k, rows.size].astype(np.int32)

    lp = highspy.HighsLp()
    lp.num_col_ = num_x + 1
    lp.num_row_ = n + k + memory_rows.size
    lp.col_cost_ = np.r_[np.zeros(num_x), 1.0]
    lp.col_lower_ = np.zeros(num_x + 1)
    lp.col_upper_ = np.full(num_x + 1, highspy.kHighsInf)
    lp.row_lower_ = np.r_[np.ones(n), np.full(k + memory_rows.size, -highspy.kHighsInf)]
    lp.row_upper_ = np.r_[np.ones(n), np.zeros(k), np.ones(memory_rows.size)]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = starts
    lp.a_matrix_.index_ = rows
    lp.a_matrix_.value_ = values
    solver = new_highs()
    solver.setOptionValue("output_flag", False)
    # Interior point without crossover: several times faster than simplex on 10^5 columns, and the
    # duals need not be exact (see the module docstring).
    solver.setOptionValue("solver", "ipm")
    solver.setOptionValue("run_crossover", "off")
    solver.passModel(lp)
    solver.run()
    if solver.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    row_dual = np.asarray(solver.getSolution().row_dual)
    # For "<=" rows of a minimisation HiGHS reports non-positive duals; their magnitudes are y and z.
    device_weight = np.clip(-row_dual[n : n + k], 0.0, None)
    if device_weight.sum() <= 0:
        device_weight = np.full(k, 1.0 / k)
    device_weight = device_weight / device_weight.sum()
    memory_price = np.zeros(k)
    for r, d in enumerate(memory_rows):
        # Undo the row scaling: a price per scaled row is a price per capacity-fraction.
        memory_price[d] = max(0.0, -row_dual[n + k + r]) * time_scale / problem.memory_capacity_bytes[d]
    return device_weight, memory_price


def memory_error(problem: Problem, placer: str, task: int, used_bytes: np.ndarray) -> InfeasibleError:
    """The error a greedy placer raises when ``task`` fits on no device any more, though the model fits the cluster.

    Models that cannot fit at all are refused before placing, by :func:`check_memory_feasible`.
    """
    runs_on = problem.runs_on[task]
    free = ", ".join(
        f"{problem.device_names[d]}: {format_bytes(max(problem.memory_capacity_bytes[d] - used_bytes[d], 0.0))} free"
        for d in np.flatnonzero(runs_on)
    )
    pinned = "" if runs_on.all() else ", the only devices it can run on"
    return InfeasibleError(
        f"{placer} cannot fit the model: it needs {format_bytes(float(problem.memory_bytes.sum()))} and the cluster "
        f"has {_total_memory(problem)}, but {placer}'s greedy placement "
        f"left no device with room for task {problem.task_names[task]!r} "
        f"({format_bytes(float(problem.memory_bytes[task]))}; {free}{pinned}); try the 'milp' placer or another "
        "baseline, or add memory"
    )


def _total_memory(problem: Problem) -> str:
    """``31.2 GB in total``, or ``unlimited memory`` (a device without a limit), for messages."""
    total = float(problem.memory_capacity_bytes.sum())
    return "unlimited memory" if math.isinf(total) else f"{format_bytes(total)} in total"
