"""Large-neighbourhood search for the throughput objective: moves of tasks between devices, priced by the period and
judged by the objective's value.

A plan's period (:attr:`moirai.planning.simulate.Timeline.period_s`) depends on its placement alone: every device's
tasks with their sends and receives (:mod:`moirai.planning.schedule.transfers`), the runtime's charges
(:attr:`moirai.planning.costs.RequestCosts.charges`), and every directed link's transfers, a tensor crossing once to
each device that reads it. :class:`Loads` keeps those per device and link for one placement and prices a move from
the tensors its tasks touch, so a move costs time in the tasks' degree, not a simulation; the search's result is
simulated, and so is every move the loads would keep where they do not price what the objective judges (a latency
limit, or a value past the period: :func:`judges_by_simulation`).

The neighbourhoods, tried in turn, a pass each:

- **boundary**: one task to a device that makes one of its inputs or reads one of its outputs (a stage boundary
  moved by one task, or a task joining its neighbours);
- **chunks**: the first or last 1, 2, 4, ... tasks, in topological order, of the busiest device (or of both ends of
  the busiest link) to another device, all of them included (a boundary moved by many tasks, a stage split onto an
  idle device, two stages merged);
- **swap**: the tasks of two devices exchanged (a stage on a faster or better-linked device).

A move is kept when it shortens the period, or keeps it and lowers the sum of squared loads (so load leaves the
busiest device even where another is as busy), and, where the move is simulated, when :func:`judged_no_worse` keeps
it ([Note: moves judged by the value]). Where a full pass keeps nothing and the value is above the period, an escape
pass (with ``escapes``) tries the moves to a period below the value that the loads would not keep, and keeps the
first that lowers the value. The search stops when the value reaches the bound (within the relative gap), when a
full pass over every neighbourhood (and the escape pass after it) keeps nothing
(:attr:`StopReason.NO_IMPROVING_MOVE`), or at the deadline.

From such a local optimum :func:`kicked_search` goes on (iterated local search): a kick moves a random run of a
device's tasks (the busiest's, most often), in topological order, to another device, the search descends from
there, and the result is kept when its value is better. It stops at the deadline, the bound, or once as many kicks
as it took to find its last improvement (and at least :data:`KICKS_BEFORE_STALL`) have found nothing
([Note: kicks]). The milp placer alternates kicks with windows (:mod:`moirai.planning.solve.period_windows`: many
tasks' devices chosen at once by a small integer program of these same loads) while either gains.

[Note: moves judged by the value]
The throughput objective values a plan by the period it is served at (a round trip a part holds its device for may
be longer than the period, :attr:`moirai.planning.simulate.Timeline.served_period_s`), which the loads do not price.
Priced by the period alone, a descent kept moves that sent work to another device and back, and its result was
thrown away at the end when it served slower than its start, so kick after kick came to nothing. Each move the loads
would keep is now simulated and kept only if the value is no worse, and, where it is the same, only if the move does
not make the value exceed the period (a round trip is timed only on a device some path leaves and re-enters,
:func:`moirai.planning.simulate.devices_with_round_trips`). A kick's descent takes 2-3 times as long, and the search
uses its budget where it used to stall: on six random layered graphs of 120-200 tasks (4 devices, kicked searches of
10 s from one descent) its served periods were 0.05% longer to 0.5% shorter, and milp's throughput plans (10 s) on
the bench's zoo rows 0-3.2% shorter (bench/RESULTS.md, section 3).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from moirai.planning.objective import Objective
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import StopReason
from moirai.planning.schedule import recv_cpu_s, send_cpu_s, transfer_duration_s
from moirai.planning.simulate import Timeline, simulate
from moirai.planning.solve.search import gap_closed

_IMPROVEMENT = 1e-12  # relative: a period this much shorter counts as progress
# Relative: an escape pass's move lowers the value by more than this (a normal move raises it by 1e-9 at most).
_ESCAPE_GAIN = 1e-6
KICKS_BEFORE_STALL = 200  # kicks without a shorter period, at least, before the kicked search gives up
KICK_BUSIEST = 0.7  # how often a kick takes its tasks from the busiest device (else from a random one)
KICK_SHARE = 0.5  # a kick moves at most this share of its device's tasks


class Loads:
    """Every device's and link's time per request under one placement, as the simulator's period counts them."""

    def __init__(self, problem: Problem, placement: np.ndarray) -> None:
        self.problem = problem
        k = problem.num_devices
        charges = problem.costs.charges
        self.compute_s = np.where(np.isfinite(problem.compute_s), problem.compute_s, np.inf) + charges.own_s
        self.driver_s = charges.driver_s
        self.always_s, self.taking_part_s = charges.always_s, charges.taking_part_s
        self.driver_taking_part_s = charges.driver_taking_part_s
        costs = problem.costs
        self.input_own_s, self.input_driver_s, self.input_link_s = (
            charges.input_own_s,
            charges.input_driver_s,
            costs.input_link_s,
        )
        self.input_readers, self.inputs_of_task = costs.input_readers, costs.inputs_of_task
        self.output_link_s = costs.output_link_s
        tensors, devices = np.arange(problem.num_tensors)[:, None, None], np.arange(k)
        src, dst = devices[None, :, None], devices[None, None, :]
        self.transfer_s = transfer_duration_s(problem, tensors, src, dst)
        self.send_s = send_cpu_s(problem, tensors, src, dst)
        self.recv_s = recv_cpu_s(problem, tensors, src, dst)
        self.producer = problem.tensor_producer.tolist()
        self.consumers = [list(cs) for cs in problem.tensor_consumers]
        self._touching = [
            sorted({*problem.input_tensors[i], *problem.output_tensors[i]}) for i in range(problem.num_tasks)
        ]
        self.placement = np.asarray(placement, int).copy()
        self._placement_list = self.placement.tolist()
        self._k, self._memory_list = k, problem.memory_bytes.tolist()
        self.device_s, self.link_s, self.count, self.memory_bytes = self._totals(self.placement)

    def _totals(self, placement: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        problem, k = self.problem, self.problem.num_devices
        tasks = np.arange(problem.num_tasks)
        device = np.bincount(placement, weights=self.compute_s[tasks, placement], minlength=k)
        device[0] += self.driver_s[tasks, placement].sum()
        count = np.bincount(placement, minlength=k)
        device += self.always_s + np.where(count > 0, self.taking_part_s, 0.0)
        device[0] += self.driver_taking_part_s[count > 0].sum()
        link = np.zeros((k, k))
        np.add.at(link, (placement, 0), self.output_link_s[tasks, placement])
        on, device_list, link_list = placement.tolist(), device.tolist(), link.ravel().tolist()
        for t, (producer, consumers) in enumerate(zip(self.producer, self.consumers, strict=True)):
            a = on[producer]
            self._add_tensor(t, a, {on[c] for c in consumers} - {a}, device_list, link_list, 1.0)
        for j in range(len(self.input_readers)):
            self._model_input(j, on, None, device_list, link_list, 1.0)
        memory = np.bincount(placement, weights=problem.memory_bytes, minlength=k)
        return np.array(device_list), np.array(link_list).reshape(k, k), count, memory

    @property
    def period_s(self) -> float:
        return float(max(self.device_s.max(initial=0.0), self.link_s.max(initial=0.0)))

    @staticmethod
    def key(device_s: list[float], link_s: list[float]) -> tuple[float, float]:
        """What a move lowers: the period, then the sum of squared loads (the lists :meth:`priced` gives)."""
        return max(max(device_s, default=0.0), max(link_s, default=0.0)), sum(x * x for x in device_s + link_s)

    @property
    def current_key(self) -> tuple[float, float]:
        """:meth:`key` of these loads."""
        return Loads.key(self.device_s.tolist(), self.link_s.ravel().tolist())

    @staticmethod
    def improves(key: tuple[float, float], best_key: tuple[float, float]) -> bool:
        """Whether loads of ``key`` are kept over ``best_key``'s: a shorter period, or the same period and a lower
        sum of squared loads (load leaves the busiest device even where another is as busy)."""
        shorter = key[0] < best_key[0] * (1 - _IMPROVEMENT)
        return shorter or (key[0] <= best_key[0] and key[1] < best_key[1] * (1 - _IMPROVEMENT))

    def priced(self, tasks: list[int], target: int) -> tuple[list[float], list[float]] | None:
        """Device and link loads (the links flat, ``a * k + b``) with ``tasks`` moved to device ``target`` (None: it
        cannot run one or hold them)."""
        placement, compute = self._placement_list, self.compute_s
        moving = [i for i in tasks if placement[i] != target]
        if not moving or any(math.isinf(compute.item(i, target)) for i in moving):
            return None
        memory = sum(self._memory_list[i] for i in moving)
        if self.memory_bytes.item(target) + memory > self.problem.memory_capacity_bytes.item(target):
            return None
        k = self._k
        device, link = self.device_s.tolist(), self.link_s.ravel().tolist()
        touched = sorted({t for i in moving for t in self._touching[i]})
        inputs = sorted({j for i in moving for j in self.inputs_of_task[i]})
        # Each touched tensor's sender and readers' devices before and after; one whose ends stay is left alone.
        moved = dict.fromkeys(moving, target)
        producers, consumers, changed = self.producer, self.consumers, []
        for t in touched:
            a, readers = placement[producers[t]], {placement[c] for c in consumers[t]}
            new_a, new_readers = moved.get(producers[t], a), {moved.get(c, placement[c]) for c in consumers[t]}
            if new_a != a or new_readers != readers:
                self._add_tensor(t, a, readers - {a}, device, link, -1.0)
                changed.append((t, new_a, new_readers - {new_a}))
        for j in inputs:
            self._model_input(j, placement, None, device, link, -1.0)
        before = self.count.tolist()
        count = before.copy()
        driver, output_link = self.driver_s, self.output_link_s
        for i in moving:
            a = placement[i]
            device[a] -= compute.item(i, a)
            device[target] += compute.item(i, target)
            device[0] += driver.item(i, target) - driver.item(i, a)
            link[a * k] -= output_link.item(i, a)
            link[target * k] += output_link.item(i, target)
            count[a] -= 1
            count[target] += 1
        for d in {placement[i] for i in moving} | {target}:
            was, now = before[d] > 0, count[d] > 0
            device[d] += self.taking_part_s.item(d) * (float(now) - float(was))
            device[0] += self.driver_taking_part_s.item(d) * (float(now) - float(was))
        for t, a, readers in changed:
            self._add_tensor(t, a, readers, device, link, 1.0)
        for j in inputs:
            self._model_input(j, placement, moved, device, link, 1.0)
        return device, link

    def _add_tensor(self, t: int, a: int, readers: set[int], device: list, link: list, sign: float) -> None:
        """Add (``sign`` 1) or remove (-1) tensor ``t``'s transfers from device ``a`` to each of ``readers`` (the
        other devices that read it); ``device`` and ``link`` (flat, ``a * k + b``) are Python lists: a move touches
        a few tensors, and numpy's per-element cost would be most of its price."""
        k = self._k
        for b in readers:
            link[a * k + b] += sign * self.transfer_s.item(t, a, b)
            device[a] += sign * self.send_s.item(t, a, b)
            device[b] += sign * self.recv_s.item(t, a, b)

    def _model_input(
        self, j: int, placement: list[int], moved: dict[int, int] | None, device: list, link: list, sign: float
    ) -> None:
        """Add (``sign`` 1) or remove (-1) model input ``j``'s messages from the driver, once to each device with a
        reader (:meth:`moirai.planning.costs.RequestCosts.link_s`), as :meth:`_add_tensor` does a tensor's."""
        readers = self.input_readers[j]
        devices = {moved.get(i, placement[i]) for i in readers} if moved else {placement[i] for i in readers}
        for b in sorted(devices):
            link[b] += sign * self.input_link_s.item(j, b)
            device[0] += sign * self.input_driver_s.item(j, b)
            device[b] += sign * self.input_own_s.item(j, b)

    def apply(self, placement: np.ndarray, device_s: Sequence[float], link_s: Sequence[float]) -> None:
        """Take ``placement``, whose loads :meth:`priced` or :meth:`relabelled` gave (in place: moves read it)."""
        k = self.problem.num_devices
        self.placement[:] = placement
        self._placement_list = self.placement.tolist()
        self.count[:] = np.bincount(placement, minlength=k)
        self.memory_bytes[:] = np.bincount(placement, weights=self.problem.memory_bytes, minlength=k)
        self.device_s, self.link_s = np.array(device_s, float), np.array(link_s, float).reshape(k, k)

    def without(self, tasks: Sequence[int]) -> tuple[list[float], list[float], list[int], list[int]]:
        """Device and link loads (the links flat) with ``tasks`` taken out: their compute and the driver's work for
        them, their model outputs, every tensor they make or read and every model input they read (each tensor's and
        input's every crossing), and the charge for taking part of each device they leave empty; and the tensors and
        inputs taken out (what a window's program prices again, :mod:`moirai.planning.solve.period_windows`)."""
        placement, k = self._placement_list, self._k
        device, link = self.device_s.tolist(), self.link_s.ravel().tolist()
        tensors = sorted({t for i in tasks for t in self._touching[i]})
        inputs = sorted({j for i in tasks for j in self.inputs_of_task[i]})
        for t in tensors:
            a = placement[self.producer[t]]
            self._add_tensor(t, a, {placement[c] for c in self.consumers[t]} - {a}, device, link, -1.0)
        for j in inputs:
            self._model_input(j, placement, None, device, link, -1.0)
        left = self.count.tolist()
        for i in tasks:
            a = placement[i]
            device[a] -= self.compute_s.item(i, a)
            device[0] -= self.driver_s.item(i, a)
            link[a * k] -= self.output_link_s.item(i, a)
            left[a] -= 1
        for d in {placement[i] for i in tasks}:
            if left[d] == 0:
                device[d] -= self.taking_part_s.item(d)
                device[0] -= self.driver_taking_part_s.item(d)
        return device, link, tensors, inputs

    def relabelled(self, a: int, b: int) -> tuple[list[float], list[float]] | None:
        """Device and link loads (as :meth:`priced` gives them) with the tasks of devices ``a`` and ``b`` exchanged
        (None: they do not fit or run)."""
        swapped = self.placement.copy()
        swapped[self.placement == a], swapped[self.placement == b] = b, a
        tasks = np.arange(self.problem.num_tasks)
        if not np.all(np.isfinite(self.compute_s[tasks, swapped])):
            return None
        device, link, _, memory = self._totals(swapped)
        if np.any(memory > self.problem.memory_capacity_bytes):
            return None
        return device.tolist(), link.ravel().tolist()


@dataclass
class PeriodSearchResult:
    plan: Plan
    timeline: Timeline
    stop_reason: StopReason
    passes: int = 0
    moves_tried: int = 0
    moves_kept: int = 0
    history: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, value)
    kicks: int = 0  # kicked_search's kicks, and those whose descent gave a better value
    kicks_kept: int = 0
    windows: int = 0  # period_windows.window_search's programs, and those whose placement was kept
    windows_kept: int = 0


def improve_period(
    problem: Problem,
    plan: Plan,
    timeline: Timeline,
    deadline: float,
    bound_s: float,
    mip_gap: float,
    objective: Objective,
    escapes: bool = False,
) -> PeriodSearchResult:
    """The neighbourhood search from ``plan`` (simulated as ``timeline``) until ``deadline`` (a
    ``time.perf_counter`` value), the bound, or a pass that keeps nothing; never worse than its start. ``escapes``:
    whether it runs escape passes from a round trip, which simulate every move they try (the milp placer's best
    start does; a kick's descent does not: most kicks make a round trip, and the kicks are many)."""
    started = time.perf_counter()
    loads = Loads(problem, timeline.placement)
    best_key = loads.current_key
    result = PeriodSearchResult(plan, timeline, StopReason.TIME_LIMIT, history=[(0.0, objective.value_s(timeline))])
    judged = judges_by_simulation(objective)
    current, current_value_s = timeline, objective.value_s(timeline)

    def value_s() -> float:  # what the gap is closed on: the period the loads price, or the judged value
        return current_value_s if judged else best_key[0]

    # A pass keeps moves that lighten the loads; where none does and the value is above the period (a round trip
    # holds it, or for generation a step's latency shared by the steps in flight), an escape pass tries the moves to
    # a period below the value that the loads would not keep, each simulated, and keeps the first that lowers the
    # value by more than a normal move may raise it (so no two moves undo each other; [Note: moves judged by the
    # value]).
    escaping = False
    while result.stop_reason is StopReason.TIME_LIMIT and time.perf_counter() < deadline:
        if gap_closed(value_s(), bound_s, mip_gap):
            result.stop_reason = StopReason.GAP_CLOSED
            break
        result.passes += 1
        kept = 0
        for tasks, target, swap in _moves(problem, loads):
            if time.perf_counter() >= deadline or gap_closed(value_s(), bound_s, mip_gap):
                break
            result.moves_tried += 1
            priced = loads.relabelled(*swap) if swap else loads.priced(tasks, target)
            if priced is None:
                continue
            key = Loads.key(*priced)
            if escaping:
                if Loads.improves(key, best_key) or key[0] >= value_s() * (1 - _IMPROVEMENT):
                    continue
            elif not Loads.improves(key, best_key):
                continue
            placement = loads.placement.copy()
            if swap:
                a, b = swap
                placement[loads.placement == a], placement[loads.placement == b] = b, a
            else:
                placement[tasks] = target
            if judged:
                candidate = simulate(problem, Plan(placement, problem.device_names, placer=plan.placer))
                if escaping:
                    if not objective.improves(candidate, current, relative=_ESCAPE_GAIN):
                        continue
                elif not judged_no_worse(objective, candidate, current):
                    continue
                current, current_value_s = candidate, objective.value_s(candidate)
            loads.apply(placement, *priced)
            best_key = key
            kept += 1
            result.moves_kept += 1
            result.history.append((time.perf_counter() - started, value_s()))
            if escaping:
                break  # back to the passes that price their moves
        else:
            if kept == 0:
                above_period = escapes and judged and _value_above_period(objective, current)
                if escaping or not above_period:
                    result.stop_reason = StopReason.NO_IMPROVING_MOVE
                escaping = not escaping and above_period
                continue
        escaping = False
    if result.moves_kept:
        adopt_final(result, problem, plan, timeline, loads.placement, current if judged else None, objective)
    return result


def judges_by_simulation(objective: Objective) -> bool:
    """Whether a search simulates each move its loads would keep, as they do not price what ``objective`` judges: a
    latency limit, or a value past the period (a round trip, [Note: moves judged by the value])."""
    return objective.latency_limit_s is not None or not objective.milp_models_value


def judged_no_worse(objective: Objective, candidate: Timeline, current: Timeline) -> bool:
    """Whether a move the loads would keep is kept by the simulator ([Note: moves judged by the value]): acceptable,
    and a better value, or the same value without one above the period where ``current``'s was not (a move that
    sends work there and back for a shorter period, its round trip as long as the old period, is a dead end)."""
    if not objective.acceptable(candidate) or objective.worsens(candidate, current):
        return False
    if objective.worsens(current, candidate):
        return True
    return _value_above_period(objective, current) or not _value_above_period(objective, candidate)


def _value_above_period(objective: Objective, timeline: Timeline) -> bool:
    """Whether ``objective`` values ``timeline`` above its period (by more than a part in 10^9): a round trip holds
    it, or for generation a step's latency shared by the steps in flight."""
    return objective.value_s(timeline) > timeline.period_s * (1 + 1e-9)


def adopt_final(
    result: PeriodSearchResult,
    problem: Problem,
    plan: Plan,
    timeline: Timeline,
    placement: np.ndarray,
    simulated: Timeline | None,
    objective: Objective,
) -> None:
    """Give ``result`` the plan of ``placement`` where ``objective`` prefers it to the start (``plan``, simulated as
    ``timeline``); ``simulated``: that placement's timeline where the search already has it (with a latency limit)."""
    final = Plan(placement.copy(), problem.device_names, placer=plan.placer)
    final_timeline = simulated if simulated is not None else simulate(problem, final)
    if objective.improves(final_timeline, timeline):
        result.plan, result.timeline = final, final_timeline


def _moves(problem: Problem, loads: Loads) -> Iterator[tuple[list[int], int, tuple[int, int] | None]]:
    """Every move of the three neighbourhoods under the current placement: (tasks, target device, swapped pair)."""
    placement, k = loads.placement, problem.num_devices
    position = problem.topological_position
    for i in problem.topological_order:
        neighbours = {int(problem.tensor_producer[t]) for t in problem.input_tensors[i]}
        neighbours |= {c for t in problem.output_tensors[i] for c in problem.tensor_consumers[t]}
        for d in sorted({int(placement[j]) for j in neighbours} - {int(placement[i])}):
            yield [i], d, None
    busy = [int(np.argmax(loads.device_s))]
    if loads.link_s.max(initial=0.0) > loads.device_s.max(initial=0.0):
        busy = [int(x) for x in np.unravel_index(np.argmax(loads.link_s), loads.link_s.shape)]
    for a in busy:
        stage = sorted(np.flatnonzero(placement == a).tolist(), key=lambda i: position[i])
        sizes, size = [], 1
        while size < len(stage):
            sizes.append(size)
            size *= 2
        sizes.append(len(stage))
        for size in sizes:
            for chunk in (stage[:size], stage[-size:]):
                for d in range(k):
                    if d != a:
                        yield chunk, d, None
    for a in range(k):
        for b in range(a + 1, k):
            yield [], -1, (a, b)


def kicked_search(
    problem: Problem,
    plan: Plan,
    timeline: Timeline,
    deadline: float,
    bound_s: float,
    mip_gap: float,
    objective: Objective,
    seed: int = 0,
) -> PeriodSearchResult:
    """Iterated local search from ``plan`` (a local optimum of :func:`improve_period`): kick, descend, keep the
    better, until ``deadline``, the bound, or a stall; never worse than its start."""
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    result = PeriodSearchResult(plan, timeline, StopReason.TIME_LIMIT, history=[(0.0, objective.value_s(timeline))])
    since_kept, kicks_to_last = 0, 0
    while time.perf_counter() < deadline:
        if gap_closed(objective.value_s(result.timeline), bound_s, mip_gap):
            result.stop_reason = StopReason.GAP_CLOSED
            break
        if since_kept >= max(KICKS_BEFORE_STALL, kicks_to_last):
            result.stop_reason = StopReason.NO_IMPROVING_MOVE
            break
        kicked = _kicked(problem, result.timeline.placement, rng)
        if kicked is None:
            since_kept += 1
            continue
        start = Plan(kicked, problem.device_names, placer=plan.placer)
        start_timeline = simulate(problem, start)
        since_kept += 1
        result.kicks += 1
        if not objective.acceptable(start_timeline):
            continue
        search = improve_period(problem, start, start_timeline, deadline, bound_s, mip_gap, objective)
        result.moves_tried += search.moves_tried
        result.moves_kept += search.moves_kept
        if objective.improves(search.timeline, result.timeline):
            result.plan, result.timeline = search.plan, search.timeline
            result.kicks_kept += 1
            kicks_to_last, since_kept = result.kicks, 0
            result.history.append((time.perf_counter() - started, objective.value_s(search.timeline)))
    return result


def _kicked(problem: Problem, placement: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    """``placement`` with a random run of one device's tasks, in topological order, moved to another device (None:
    that device has no tasks, or the other cannot run or hold them, or a tensor would cross devices with no link)."""
    k = problem.num_devices
    if k < 2:
        return None
    loads = Loads(problem, placement)
    source = int(np.argmax(loads.device_s)) if rng.random() < KICK_BUSIEST else int(rng.integers(k))
    position = problem.topological_position
    stage = sorted(np.flatnonzero(placement == source).tolist(), key=lambda i: position[i])
    if not stage:
        return None
    length = int(rng.integers(1, max(1, int(len(stage) * KICK_SHARE)) + 1))
    first = int(rng.integers(0, len(stage) - length + 1))
    target = int(rng.integers(k - 1))
    target += target >= source
    run = stage[first : first + length]
    priced = loads.priced(run, target)
    if priced is None or math.isinf(Loads.key(*priced)[0]):  # it cannot hold them, or a tensor would cross no link
        return None
    kicked = placement.copy()
    kicked[run] = target
    return kicked
