"""Windows for the throughput objective: the devices of many tasks chosen together by a small integer program.

The period search's moves (:mod:`moirai.planning.solve.period_search`) change one device per move and keep only
moves that shorten the period. Where the busiest devices are as busy as each other, or a better plan needs many
tasks to change device at once (an exchange between two stages), no single move helps. A window frees the tasks of
two devices and lets a mixed-integer program place them, with the loads :class:`Loads` counts made linear:

- ``x[i, d]``: free task ``i`` on device ``d``;
- ``y[t, a, b] >= x[producer, a] + x[reader, b] - 1``: tensor ``t`` sent over ``a -> b``, once whatever its
  readers there (its link time on ``a -> b``, sender's time on ``a``, receiver's on ``b``);
- ``z[j, b] >= x[reader, b]``: model input ``j`` sent to ``b``; ``u[d] >= x[i, d]``: device ``d`` taking part;
- every device's and link's load is a constant (what the fixed tasks cost) plus those columns, and the program
  minimises their maximum, plus a small weight on the devices' summed load (of two equal periods, less work).

Two kinds of window, each round of :func:`window_search` taking every pair as the first kind, then as the second:
**between the two** devices only, minimising the busier of the two (and their links) with every other load held at
most the period (two devices evened out where a third holds the period, which a period-only program could not see
as progress), and to **any** device, minimising the period. Links loaded below :data:`WATCHED_LINK_SHARE` of the
period are left out (the crossings are most of a program's columns). The program starts from the current placement;
each result is priced again by :class:`Loads`, links included, and kept when it lowers the period or, at the same
period, the sum of squared loads, and where the value is not the period alone, when the simulator keeps it (the
descent's rules, [Note: moves judged by the value]).

A window of more tasks than :data:`MAX_WINDOW_TASKS` (adjusted as programs finish in time or not) takes the pair's
tasks in a run of the topological order. The search stops at the deadline, the bound, or when a round over every
pair of devices, both kinds, keeps nothing (:attr:`StopReason.NO_IMPROVING_MOVE`: a stall, as the kicks', not a
proof where a program ran out of time or a window held only a run of a pair's tasks; the milp placer then goes on
with kicks).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import networkx as nx
import numpy as np

from moirai.errors import MoiraiError
from moirai.planning.highs import SparseLinearProgram
from moirai.planning.objective import Objective, Throughput
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import StopReason
from moirai.planning.simulate import Timeline, simulate
from moirai.planning.solve.period_search import (
    Loads,
    PeriodSearchResult,
    adopt_final,
    judged_no_worse,
    judges_by_simulation,
)
from moirai.planning.solve.search import gap_closed

MAX_WINDOW_TASKS = 120  # free tasks in a window at first; shrinks when a program runs out of time, grows when not
MIN_WINDOW_TASKS = 16
WATCHED_LINK_SHARE = 0.5  # links loaded below this share of the period are left out of the program
WINDOW_TIME_S = 0.5  # the most one window's program may take
WINDOW_GAP = 1e-5  # a program stops within this share of its bound: the search keeps gains of a few 1e-4
_TIE = 1e-4  # weight of the devices' summed load beside the busiest one


@dataclass(frozen=True)
class Window:
    """Tasks freed together, and the devices they may go to (None: any)."""

    tasks: tuple[int, ...]
    devices: tuple[int, ...] | None


@dataclass
class _Program:
    """A window's program as it is built: columns by key, rows, and every load's linear expression."""

    num_devices: int
    watched: np.ndarray  # [k, k]: the links whose loads the program counts
    unit_s: float  # the program's unit of time: the current period, so that its loads are near 1
    columns: dict[tuple, int] = field(default_factory=dict)
    rows: list[tuple[list[int], list[float], float, float]] = field(default_factory=list)
    constant: np.ndarray = field(init=False)
    terms: list[list[tuple[int, float]]] = field(init=False)

    def __post_init__(self) -> None:
        k = self.num_devices
        self.constant = np.zeros(k + k * k)  # devices, then links a * k + b
        self.terms = [[] for _ in range(k + k * k)]

    def column(self, key: tuple) -> int:
        return self.columns.setdefault(key, len(self.columns))

    def charge(self, device: int | None, link: tuple[int, int] | None, column: int | None, seconds: float) -> None:
        """Add ``seconds`` (times ``column``, or as a constant when it is None) to a device's or a link's load."""
        if seconds == 0.0:
            return
        if link is not None and not self.watched[link]:
            return
        row = device if link is None else self.num_devices * (1 + link[0]) + link[1]
        if column is None:
            self.constant[row] += seconds / self.unit_s
        else:
            self.terms[row].append((column, seconds / self.unit_s))

    def at_least_sum(self, column: int, ones: list[int | None]) -> None:
        """``column >= sum(ones) - (len(ones) - 1)``, a None among ``ones`` being a constant 1 (a fixed task)."""
        cols, vals, lower = [column], [1.0], 1.0 - len(ones)
        for other in ones:
            if other is None:
                lower += 1.0
            else:
                cols.append(other)
                vals.append(-1.0)
        self.rows.append((cols, vals, lower, math.inf))


class WindowResult(NamedTuple):
    """A window program's answer: the placement, whether the program proved it optimal, and its proven lower bound
    on the program's cost (in units of the period it started from; ``-inf`` where it proved none)."""

    placement: np.ndarray
    optimal: bool
    cost_bound: float


def window_placement(
    loads: Loads,
    window: Window,
    time_limit_s: float,
    mip_gap: float = 1e-6,
    watched_link_share: float | None = None,
    acyclic: bool = False,
) -> WindowResult | None:
    """The placement the window's program finds within ``time_limit_s`` (the other tasks where ``loads`` has them);
    None when the solver found no point (never the case from its start). ``watched_link_share``: links loaded below
    this share of the period are left out of the program (:data:`WATCHED_LINK_SHARE` when None; 0 counts them all).
    ``acyclic`` (a window of every task only): the devices also take an order, and a tensor goes only from a device
    to a later one, so no path leaves a device and comes back (:func:`_device_order_rows`).

    The program is built from what the window's tasks touch (:meth:`Loads.without` gives the rest as constants),
    so its cost is in the window's size and degree, not the graph's."""
    k = loads.problem.num_devices
    if acyclic and len(window.tasks) != loads.problem.num_tasks:
        raise ValueError("an acyclic window frees every task: a tensor between fixed tasks would have no order")
    placement = loads.placement.tolist()
    among = range(k) if window.devices is None else sorted({*window.devices, *(placement[i] for i in window.tasks)})
    allowed = {i: [d for d in among if math.isfinite(loads.compute_s.item(i, d))] for i in window.tasks}
    share = WATCHED_LINK_SHARE if watched_link_share is None else watched_link_share
    program = _Program(k, loads.link_s >= share * loads.period_s, loads.period_s or 1.0)
    device, link, tensors, inputs = loads.without(window.tasks)
    program.constant[:k] = np.array(device) / program.unit_s
    program.constant[k:] = np.where(program.watched.ravel(), np.array(link) / program.unit_s, 0.0)
    for i in window.tasks:
        for d in allowed[i]:
            program.column(("x", i, d))

    def options(v: int) -> list[tuple[int, int | None]]:  # (device, its column; None where v is fixed there)
        return [(d, program.columns["x", v, d]) for d in allowed[v]] if v in allowed else [(placement[v], None)]

    _task_terms(loads, program, allowed)
    _taking_part_terms(loads, program, allowed)
    _tensor_terms(loads, program, options, tensors)
    _input_terms(loads, program, options, inputs)
    _memory_rows(loads, program, allowed)
    if acyclic:
        _device_order_rows(program)
    cost = _load_rows(program, set(among))
    upper = np.array([math.inf if key[0] == "period" else 1.0 for key in program.columns])
    lp = SparseLinearProgram(len(program.columns), 0.0, upper, cost)
    for row in program.rows:
        lp.add_row(*row)
    binaries = [c for key, c in program.columns.items() if key[0] in ("x", "o")]
    start = {program.columns["x", i, d]: float(d == placement[i]) for i in window.tasks for d in allowed[i]}
    solution = lp.solve_mip(binaries, time_limit_s, start, mip_gap)
    if solution is None:
        return None
    chosen = loads.placement.copy()
    for i in window.tasks:
        chosen[i] = max(allowed[i], key=lambda d: solution.values[program.columns["x", i, d]])
    return WindowResult(chosen, solution.optimal, solution.bound)


class PeriodBound(NamedTuple):
    """What :func:`period_lower_bound` proved and found."""

    bound_s: float  # no placement that fits memory has a shorter period (never below the objective's load bound)
    period_s: float  # the shortest period of a placement the program found: ``placement``'s
    optimal: bool  # whether the program proved ``period_s`` the shortest (within its gap)
    placement: np.ndarray  # the program's placement, or the start where that is no shorter


def period_lower_bound(
    problem: Problem, start: np.ndarray, time_limit_s: float = 60.0, acyclic: bool = False
) -> PeriodBound:
    """A lower bound on the period of every placement of ``problem`` that fits memory: the window program over every
    task and every link, from ``start``, solved for up to ``time_limit_s``. A bench's bound, like the cut-task bound
    of latency: the milp placer does not compute it. ``acyclic``: of every such placement whose devices' graph of
    tensors has no cycle (none leaves a device and comes back, so the runtime serves it at its period), and the
    placement returned is one.

    [Note: the period bound]
    The program minimises the period plus ``_TIE`` times the devices' loads that depend on the tasks (each at most
    the period), in units of ``start``'s period ``u``: a placement of period ``P`` costs at most ``P / u * (1 + _TIE
    * k)`` on ``k`` devices, so the solver's proven bound ``c`` on the cost gives ``P >= c * u / (1 + _TIE * k)``
    for every placement. Colocation is not in the program: leaving a constraint out only lowers the bound. The
    served period (:attr:`moirai.planning.simulate.Timeline.served_period_s`) is never below the period, so the
    bound is one on the throughput objective too; the placement the program finds may hold a round trip and serve
    slower than its period."""
    loads = Loads(problem, np.asarray(start, int))
    if problem.num_devices < 2:
        return PeriodBound(loads.period_s, loads.period_s, True, loads.placement)
    floor_s = Throughput().lower_bound_s(problem)
    everything = Window(tuple(range(problem.num_tasks)), None)
    found = window_placement(loads, everything, time_limit_s, WINDOW_GAP, watched_link_share=0.0, acyclic=acyclic)
    start_counts = not acyclic or devices_acyclic(problem, loads.placement)
    if found is None:
        if not start_counts:
            raise MoiraiError("the acyclic period program found no placement: give it a start without a cycle")
        return PeriodBound(floor_s, loads.period_s, False, loads.placement)
    proven_s = found.cost_bound * loads.period_s / (1 + _TIE * problem.num_devices)
    program_s = Loads(problem, found.placement).period_s
    period_s, placement = (
        (loads.period_s, loads.placement)
        if start_counts and loads.period_s <= program_s
        else (program_s, found.placement)
    )
    return PeriodBound(min(max(floor_s, proven_s), period_s), period_s, found.optimal, placement)


def devices_acyclic(problem: Problem, placement: np.ndarray) -> bool:
    """Whether ``placement``'s devices' graph of tensors (a -> b where a tensor made on a is read on b) has no
    cycle."""
    tensor, consumer = problem.consumer_pairs
    src, dst = placement[problem.tensor_producer[tensor]], placement[consumer]
    crossing = src != dst
    graph = nx.DiGraph(zip(src[crossing].tolist(), dst[crossing].tolist(), strict=True))
    return nx.is_directed_acyclic_graph(graph)


def _task_terms(loads: Loads, program: _Program, allowed: dict[int, list[int]]) -> None:
    """Each free task on one device: its compute (its charges included), the driver's work for it, its model
    outputs' link."""
    for i, devices in allowed.items():
        program.rows.append(([program.columns["x", i, d] for d in devices], [1.0] * len(devices), 1.0, 1.0))
        for d in devices:
            x = program.columns["x", i, d]
            program.charge(d, None, x, loads.compute_s.item(i, d))
            program.charge(0, None, x, loads.driver_s.item(i, d))
            program.charge(None, (d, 0), x, loads.output_link_s.item(i, d))


def _taking_part_terms(loads: Loads, program: _Program, allowed: dict[int, list[int]]) -> None:
    """The charge for taking part of each device the window could leave empty or fill (a device that keeps a fixed
    task keeps its charge among the constants)."""
    leaving = np.bincount([loads.placement[i] for i in allowed], minlength=program.num_devices)
    for d in range(program.num_devices):
        members = [program.columns["x", i, d] for i in allowed if ("x", i, d) in program.columns]
        if loads.count[d] > leaving[d] or not members:
            continue
        taking = program.column(("u", d))
        program.charge(d, None, taking, loads.taking_part_s.item(d))
        program.charge(0, None, taking, loads.driver_taking_part_s.item(d))
        program.rows.extend(([taking, x], [1.0, -1.0], 0.0, math.inf) for x in members)


def _tensor_terms(loads: Loads, program: _Program, options, tensors: list[int]) -> None:  # noqa: ANN001
    """Each tensor the window touches, once over every link from its producer's device to a device with a reader
    (a constant where both ends are fixed)."""
    for t in tensors:
        reader_options = [options(c) for c in loads.consumers[t]]
        for a, x_a in options(loads.producer[t]):
            for b in range(program.num_devices):
                at_b = [x for choices in reader_options for d, x in choices if d == b]
                if b == a or not at_b or not (program.watched[a, b] or _costs_devices(loads, t, a, b)):
                    continue
                if x_a is None and any(x is None for x in at_b):
                    y = None  # a fixed producer and a fixed reader: sent whatever the window does
                else:
                    y = program.column(("y", t, a, b))
                    for x_b in at_b:
                        program.at_least_sum(y, [x_a, x_b])
                program.charge(None, (a, b), y, loads.transfer_s.item(t, a, b))
                program.charge(a, None, y, loads.send_s.item(t, a, b))
                program.charge(b, None, y, loads.recv_s.item(t, a, b))


def _device_order_rows(program: _Program) -> None:
    """``o[a, b]``: device ``a`` comes before ``b``; a tensor's crossing ``y[t, a, b] <= o[a, b]``, at most one of
    ``o[a, b]`` and ``o[b, a]``, and the order transitive, so the devices' graph of crossings has no cycle."""
    k = program.num_devices
    order = {(a, b): program.column(("o", a, b)) for a, b in itertools.permutations(range(k), 2)}
    for key, y in list(program.columns.items()):
        if key[0] == "y":
            program.rows.append(([y, order[key[2], key[3]]], [1.0, -1.0], -math.inf, 0.0))
    for a, b in itertools.combinations(range(k), 2):
        program.rows.append(([order[a, b], order[b, a]], [1.0, 1.0], -math.inf, 1.0))
    for a, b, c in itertools.permutations(range(k), 3):
        program.rows.append(([order[a, b], order[b, c], order[a, c]], [1.0, 1.0, -1.0], -math.inf, 1.0))


def _costs_devices(loads: Loads, t: int, a: int, b: int) -> bool:
    """Whether sending tensor ``t`` over ``a -> b`` takes its sender's or receiver's time."""
    return bool(loads.send_s.item(t, a, b) or loads.recv_s.item(t, a, b))


def _input_terms(loads: Loads, program: _Program, options, inputs: list[int]) -> None:  # noqa: ANN001
    """Each model input the window touches, once from the driver to every device with a reader."""
    for j in inputs:
        reader_options = [options(i) for i in loads.input_readers[j]]
        for b in range(program.num_devices):
            at_b = [x for choices in reader_options for d, x in choices if d == b]
            own_s, driver_s = loads.input_own_s.item(j, b), loads.input_driver_s.item(j, b)
            if not at_b or not (program.watched[0, b] or own_s or driver_s):
                continue
            z = None if any(x is None for x in at_b) else program.column(("z", j, b))
            if z is not None:
                program.rows.extend(([z, x], [1.0, -1.0], 0.0, math.inf) for x in at_b)
            program.charge(None, (0, b), z, loads.input_link_s.item(j, b))
            program.charge(0, None, z, driver_s)
            program.charge(b, None, z, own_s)


def _memory_rows(loads: Loads, program: _Program, allowed: dict[int, list[int]]) -> None:
    """What each device holds within its capacity, in shares of it (near 1, as the loads)."""
    memory = loads.problem.memory_bytes
    for d in range(program.num_devices):
        capacity = float(loads.problem.memory_capacity_bytes[d])
        members = [i for i in allowed if ("x", i, d) in program.columns]
        if not math.isfinite(capacity) or not members:
            continue
        held = loads.memory_bytes.item(d) - sum(memory.item(i) for i in allowed if loads.placement[i] == d)
        columns = [program.columns["x", i, d] for i in members]
        program.rows.append((columns, [memory.item(i) / capacity for i in members], -math.inf, 1.0 - held / capacity))


def _load_rows(program: _Program, minimised: set[int]) -> np.ndarray:
    """Rows ``period >= load`` for the loads of the ``minimised`` devices and the links between them, ``load <= 1``
    (the current period, the program's unit) for the others; the cost vector (the period, plus the tie weight on
    every device's load)."""
    k = program.num_devices
    period = program.column(("period",))
    cost = np.zeros(len(program.columns))
    cost[period] = 1.0
    for row, entries in enumerate(program.terms):
        if not entries and program.constant[row] == 0.0:
            continue
        cols, vals = [c for c, _ in entries], [v for _, v in entries]
        ends = {row} if row < k else set(divmod(row - k, k))
        if ends <= minimised:
            program.rows.append(([*cols, period], [*vals, -1.0], -math.inf, -program.constant[row]))
        elif cols:
            program.rows.append((cols, vals, -math.inf, 1.0 - program.constant[row]))
        if row < k:
            for c, v in entries:
                cost[c] += _TIE * v
    return cost


def window_search(
    problem: Problem,
    plan: Plan,
    timeline: Timeline,
    deadline: float,
    bound_s: float,
    mip_gap: float,
    objective: Objective,
) -> PeriodSearchResult:
    """Windows over every pair of devices, the busiest first, both kinds, until ``deadline``, the bound, or a round
    that keeps nothing; never worse than its start."""
    started = time.perf_counter()
    state = _State(Loads(problem, timeline.placement), timeline)
    result = PeriodSearchResult(plan, timeline, StopReason.TIME_LIMIT, history=[(0.0, objective.value_s(timeline))])
    size = {True: MAX_WINDOW_TASKS, False: MAX_WINDOW_TASKS}  # by kind: between the pair only, or anywhere
    rng = np.random.default_rng(0)
    kept = problem.num_devices > 1
    while kept:
        kept = False
        for pair, between in _round(state.loads):
            left = deadline - time.perf_counter()
            if left <= 0 or gap_closed(state.value_s(objective), bound_s, mip_gap):
                result.stop_reason = StopReason.TIME_LIMIT if left <= 0 else StopReason.GAP_CLOSED
                return _finished(result, problem, plan, timeline, state, objective)
            window = _window(state.loads, pair, between, size[between], rng)
            if window is None:
                continue
            found = window_placement(state.loads, window, min(WINDOW_TIME_S, left), WINDOW_GAP)
            result.windows += 1
            if found is None:
                continue
            size[between] = _resized(size[between], found.optimal, len(window.tasks))
            if state.take(problem, found.placement, objective, plan.placer):
                kept = True
                result.windows_kept += 1
                result.history.append((time.perf_counter() - started, state.value_s(objective)))
    result.stop_reason = StopReason.NO_IMPROVING_MOVE
    return _finished(result, problem, plan, timeline, state, objective)


@dataclass
class _State:
    """The search's placement: its loads, their key, and (where the search judges by simulation) its timeline."""

    loads: Loads
    timeline: Timeline
    key: tuple[float, float] = field(init=False)

    def __post_init__(self) -> None:
        self.key = self.loads.current_key

    def value_s(self, objective: Objective) -> float:
        """What the gap is closed on: the period the loads price, or the value where the search judges by simulation."""
        return objective.value_s(self.timeline) if judges_by_simulation(objective) else self.key[0]

    def take(self, problem: Problem, placement: np.ndarray, objective: Objective, placer: str) -> bool:
        """Move to ``placement`` when its loads improve on the current ones and the simulator keeps it where the
        search judges by simulation (the descent's rules, :func:`judged_no_worse`)."""
        fresh = Loads(problem, placement)
        key = fresh.current_key
        if not Loads.improves(key, self.key):
            return False
        if judges_by_simulation(objective):
            candidate = simulate(problem, Plan(placement, problem.device_names, placer=placer))
            if not judged_no_worse(objective, candidate, self.timeline):
                return False
            self.timeline = candidate
        self.loads, self.key = fresh, key
        return True


def _round(loads: Loads) -> list[tuple[tuple[int, int], bool]]:
    """A round's windows: every pair of devices, the busiest device's pairs first, between the pair, then the same
    pairs to any device (none where there are only two)."""
    k = loads.problem.num_devices
    order = np.argsort(-loads.device_s, kind="stable").tolist()
    pairs = list(itertools.combinations(order, 2))
    return [(pair, between) for between in ((True, False) if k > 2 else (True,)) for pair in pairs]


def _window(loads: Loads, pair: tuple[int, int], between: bool, size: int, rng: np.random.Generator) -> Window | None:
    """The pair's tasks under the current placement (None: it has none), or a random run of ``size`` of them in
    topological order where it has more."""
    a, b = pair
    tasks = np.flatnonzero((loads.placement == a) | (loads.placement == b)).tolist()
    if not tasks:
        return None
    if len(tasks) > size:
        position = loads.problem.topological_position
        tasks.sort(key=lambda i: position[i])
        first = int(rng.integers(0, len(tasks) - size + 1))
        tasks = tasks[first : first + size]
    return Window(tuple(tasks), pair if between else None)


def _resized(size: int, optimal: bool, tasks: int) -> int:
    """The next window's task limit: smaller after a program that ran out of time, larger after one that did not
    (when it was at the limit)."""
    if not optimal:
        return max(MIN_WINDOW_TASKS, int(min(size, tasks) * 0.75))
    return size + size // 4 if tasks >= size else size


def _finished(
    result: PeriodSearchResult, problem: Problem, plan: Plan, timeline: Timeline, state: _State, objective: Objective
) -> PeriodSearchResult:
    if result.windows_kept:
        simulated = state.timeline if judges_by_simulation(objective) else None
        adopt_final(result, problem, plan, timeline, state.loads.placement, simulated, objective)
    return result
