"""The Moirai MILP (paper §III-D, eqs. 4-8) in Pyomo: joint placement and scheduling, docs/design.md's errata fixed.

The model states what :mod:`moirai.planning.simulate` does. ``x[i,k]`` puts task ``i`` on device ``k``;
``S_i`` is its start. A tensor ``t`` is sent *once* to every device ``b`` that hosts one of its consumers
and not its producer (``y[t,b]``); ``w[t,a,b] = x[u,a] y[t,b]`` picks the link and so the duration (7).
The finish ``C_i = S_i + sum_k p_ik x_ik + sum_(t,a,b) send_cpu_s[t,a,b] w[t,a,b] + sum r[t,i,b]`` (4b, 4c)
counts the sender's time of every transfer of ``i``'s outputs and the receiver's time of every transfer ``i``
receives, as :func:`moirai.planning.schedule.task_duration_s` does. Transfers
start after their producer's finish (4a) and consumers on ``b`` start after the transfer arrives. Two tasks
that share a device never overlap (6, one ``delta`` per incomparable pair), nor do two transfers
on one directed link (8). Memory is the static sum the simulator uses (5). The objective is
the makespan ``T >= C_i`` (4).

Two formulations (``formulation=``):

* ``"paper"``: the constraints as the paper prints them (errata fixed: ``-M delta``, one
  transfer per tensor and destination, per-link contention): one constant big-M (100 horizons),
  a ``delta`` for every incomparable pair of tasks and of transfers, no time windows.
* ``"strong"``: per task and device a head (earliest start there) and a tail (least time the
  plan runs on after it), both counting the transfers a device change costs; with a horizon (the
  best known plan's makespan, so ``T <= horizon`` is valid) they drop the devices a task cannot
  use, give time windows ``[earliest start, latest finish]``, pair-specific big-Ms, and drop or
  fix the order of pairs whose windows cannot overlap; transfer pairs ordered by a path need no
  binary; one aggregated "same device"/"same link" variable per pair; cuts on ``T`` (every
  device's work after each head threshold, every task's ancestors before it and descendants
  after it on each device, head and tail of the device used); symmetry breaking between
  identical devices. Measured against ``"paper"`` in ``bench/milp_ablation.py``: the cuts raise
  the LP bound by 4-12% and, mostly, let the search prune once placements are fixed.

A model covers either the whole problem or a :class:`Window` of it: a set of free tasks, with
everything scheduled before them fixed as constants and everything after them summarised by
tails (how long the plan runs on after each free task finishes, per device). The large-
neighbourhood search in :mod:`moirai.planning.solve.search` solves windows.

Times inside the model are in units of ``horizon / 1000`` so the solver sees numbers near 1.

The model is built by equation group (assignment and memory, precedence, objective rows, transfers,
device order, link order, cuts); :mod:`moirai.planning.solve.window` supplies the bounds that tighten it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyomo.environ as pyo

from moirai.errors import InfeasibleError, MoiraiError
from moirai.planning.problem import Problem
from moirai.planning.schedule.transfers import recv_cpu_s, send_cpu_s, transfer_duration_s
from moirai.planning.solve.window import (
    Window,
    allowed_devices,
    descendant_sets,
    device_heads_and_tails,
    device_pair_kinds,
    devices_in_time,
    identical_device_groups,
    time_windows,
    transfer_pair_kinds,
)

if TYPE_CHECKING:  # the objective asks this module for its rows: annotations only here
    from pyomo.common.collections import ComponentMap

    from moirai.planning.objective import Objective
    from moirai.planning.simulate import Timeline

FORMULATIONS = ("strong", "paper")
MODEL_TIME_SCALE = 1000.0  # the horizon, in model time units
_PAPER_BIG_M = 100.0 * MODEL_TIME_SCALE
_NARROWING_ROUNDS = 4


@dataclass(frozen=True)
class ModelSize:
    binaries: int
    continuous: int
    constraints: int
    build_s: float


@dataclass
class MilpModel:
    """A built Pyomo model and what is needed to warm-start it and read its solution."""

    problem: Problem
    window: Window
    formulation: str
    model: pyo.ConcreteModel
    unit_s: float
    transfer_sources: dict[tuple[int, int], tuple[int, ...]]
    device_pairs: dict[tuple[int, int], str]  # (i, j) -> "delta" | "i_first" | "j_first" | "apart"
    transfer_pairs: dict[tuple[tuple[int, int], tuple[int, int]], str]
    symmetric_groups: tuple[tuple[int, ...], ...]
    objective_var: Any = None  # the variable minimised: T (latency) or P (period), in model units
    rows: MilpRows | None = None  # the objective's rows, which also warm-start its own variables
    size: ModelSize | None = None


@dataclass
class _Model:
    """What the row groups of one model share: the window, its bounds (seconds) and the Pyomo model."""

    problem: Problem
    window: Window
    strong: bool
    unit_s: float
    allowed: dict[int, tuple[int, ...]]
    earliest_s: dict[int, float]
    latest_finish_s: dict[int, float]
    fastest_s: dict[int, float]
    head_s: dict[tuple[int, int], float]
    tail_s: dict[tuple[int, int], float]
    descendants: dict[int, set[int]]
    m: pyo.ConcreteModel
    finish: dict[int, Any]  # finish time of every free task (model units), an expression
    transfer_sources: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    receive_terms: list[tuple[int, int, int]] = field(default_factory=list)  # (tensor, receiver, device) of m.r

    @property
    def free(self) -> tuple[int, ...]:
        return self.window.free_tasks

    def scaled(self, seconds: float) -> float:
        return seconds / self.unit_s

    def add(self, row: Any) -> None:
        self.m.constraints.add(row)


def build_model(
    problem: Problem, window: Window, formulation: str = "strong", objective: Objective | None = None
) -> MilpModel:
    """The Pyomo model of ``window`` (use :func:`whole_problem` for the full MILP) minimising ``objective``
    (None: latency).

    Rows by equation group, in this order: assignment and memory (4c, 5), precedence (4a), the objective's
    rows, transfers (7), device order (6), link order (8), then (strong) the objective's cuts and symmetry.
    """
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    rows = LATENCY_ROWS if objective is None else objective.milp_rows()
    started = time.perf_counter()
    c = _bounded_model(problem, window, formulation)
    _transfer_variables(c)
    _assignment_and_memory_rows(c)
    _precedence_rows(c)
    rows.before_transfers(c, objective)
    transfers = _transfer_rows(c)
    rows.after_transfers(c, objective, transfers)
    device_pairs = _device_order_rows(c)
    transfer_pairs = _link_order_rows(c, transfers)
    symmetric_groups: tuple[tuple[int, ...], ...] = ()
    if c.strong:
        rows.cuts(c)
        if len(c.free) == problem.num_tasks:
            symmetric_groups = identical_device_groups(problem)
            _symmetry_rows(c, symmetric_groups)
    m = c.m
    objective_var = rows.variable(m)
    m.objective = pyo.Objective(expr=objective_var, sense=pyo.minimize)
    built = MilpModel(
        problem=problem,
        window=window,
        formulation=formulation,
        model=m,
        unit_s=c.unit_s,
        transfer_sources=transfers.sources,
        device_pairs=device_pairs,
        transfer_pairs=transfer_pairs,
        symmetric_groups=symmetric_groups,
        objective_var=objective_var,
        rows=rows,
    )
    delta_pairs = sum(kind == "delta" for kind in device_pairs.values())
    link_delta_pairs = sum(kind == "delta" for kind in transfer_pairs.values())
    built.size = ModelSize(
        binaries=len(m.x) + len(transfers.sources) + delta_pairs + link_delta_pairs,
        continuous=len(c.free)
        + 1
        + len(transfers.sources)
        + len(m.w)
        + len(m.r)
        + (len(device_pairs) + len(transfer_pairs)) * c.strong,
        constraints=len(m.constraints),
        build_s=time.perf_counter() - started,
    )
    return built


def _bounded_model(problem: Problem, window: Window, formulation: str) -> _Model:
    """Allowed devices and time windows of the free tasks (narrowed by heads and tails when strong), and the
    model's assignment, start and objective variables bounded by them."""
    strong = formulation == "strong"
    unit = window.horizon_s / MODEL_TIME_SCALE if window.horizon_s > 0 else 1.0
    free = window.free_tasks
    allowed = allowed_devices(problem, free)
    free_graph = problem.graph.subgraph(free)
    earliest_s, latest_finish_s, fastest_s = time_windows(problem, window, allowed, free_graph)
    head_s: dict[tuple[int, int], float] = {}
    tail_s: dict[tuple[int, int], float] = {}
    if strong:
        for _ in range(_NARROWING_ROUNDS):  # fewer devices give later heads and longer tails, which drop more
            head_s, tail_s = device_heads_and_tails(problem, window, allowed, free_graph)
            narrowed = devices_in_time(problem, allowed, head_s, tail_s, window.horizon_s)
            if narrowed == allowed:
                break
            allowed = narrowed
        stuck = [i for i in free if not allowed[i]]
        if stuck:
            raise InfeasibleError(
                f"task {problem.task_names[stuck[0]]!r} cannot finish on any device within the horizon "
                f"({window.horizon_s:g} s): no plan meets it"
            )
        # The windows narrowed by the devices left: heads and tails count transfers.
        for i in free:
            earliest_s[i] = max(earliest_s[i], min(head_s[i, k] for k in allowed[i]))
            latest_finish_s[i] = min(latest_finish_s[i], window.horizon_s - min(tail_s[i, k] for k in allowed[i]))
            fastest_s[i] = float(min(problem.compute_s[i, k] for k in allowed[i]))

    m = pyo.ConcreteModel(name=f"moirai_{formulation}")
    m.x = pyo.Var([(i, k) for i in free for k in allowed[i]], domain=pyo.Binary)
    if strong:
        bounds = {i: (earliest_s[i] / unit, (latest_finish_s[i] - fastest_s[i]) / unit) for i in free}
        m.S = pyo.Var(free, domain=pyo.NonNegativeReals, bounds=lambda _, i: bounds[i])
        m.T = pyo.Var(bounds=(0.0, MODEL_TIME_SCALE))
    else:
        m.S = pyo.Var(free, domain=pyo.NonNegativeReals)
        m.T = pyo.Var(domain=pyo.NonNegativeReals)
    m.constraints = pyo.ConstraintList()
    duration = {i: sum(problem.compute_s[i, k] / unit * m.x[i, k] for k in allowed[i]) for i in free}
    finish = {i: m.S[i] + duration[i] for i in free}
    return _Model(
        problem,
        window,
        strong,
        unit,
        allowed,
        earliest_s,
        latest_finish_s,
        fastest_s,
        head_s,
        tail_s,
        descendant_sets(free_graph),
        m,
        finish,
    )


def _transfer_variables(c: _Model) -> None:
    """The transfer variables ``y``, ``R``, ``w`` of every candidate transfer, and each free producer's finish
    extended by the sender's time of the transfers it makes.

    A producer fixed before a window keeps its finish: a window that sends its tensor to a new device
    underestimates that device's time by the send; the search judges every window by simulating it.
    """
    problem, m = c.problem, c.m
    free_set = set(c.free)
    c.transfer_sources = _transfer_candidates(problem, c.window, c.allowed, free_set)
    m.y = pyo.Var(list(c.transfer_sources), domain=pyo.Binary)
    m.R = pyo.Var(list(c.transfer_sources), domain=pyo.NonNegativeReals)
    m.w = pyo.Var([(t, a, b) for (t, b), sources in c.transfer_sources.items() for a in sources], bounds=(0.0, 1.0))
    for (t, b), sources in c.transfer_sources.items():
        u = int(problem.tensor_producer[t])
        if u not in free_set:
            continue
        for a in sources:
            seconds = float(send_cpu_s(problem, t, a, b))
            if seconds > 0:
                c.finish[u] = c.finish[u] + c.scaled(seconds) * m.w[t, a, b]
    _receiver_time_variables(c)


def _receiver_time_variables(c: _Model) -> None:
    """The receiver's time of every transfer, added to the finish of the tensor's receiver: of its consumers on
    the destination, the first in topological order (:func:`moirai.planning.schedule.task_duration_s`).

    ``r[t,i,b] >= sum_a recv_cpu_s[t,a,b] w[t,a,b] - M (1 - x[i,b] + sum_(j before i) x[j,b])``: consumer ``i``
    pays when the tensor comes to ``b``, ``i`` is on ``b`` and no consumer before it is.
    """
    problem, m, free_set = c.problem, c.m, set(c.free)
    position = problem.topological_position
    terms: list[tuple[int, int, int]] = []
    rows: list[tuple[tuple[int, int, int], Any, float, list[int]]] = []
    for (t, b), sources in c.transfer_sources.items():
        paid = {a: c.scaled(float(recv_cpu_s(problem, t, a, b))) for a in sources}
        big_m = max(paid.values(), default=0.0)
        if big_m <= 0:
            continue
        earlier: list[int] = []
        for i in sorted(problem.tensor_consumers[t], key=lambda j: position[j]):
            if i not in free_set:
                if c.window.placement[i] == b:
                    break  # a fixed consumer on b receives it; no later one pays
                continue
            if b in c.allowed[i]:
                received = sum(seconds * m.w[t, a, b] for a, seconds in paid.items())
                rows.append(((t, i, b), received, big_m, list(earlier)))
                terms.append((t, i, b))
                earlier.append(i)
    m.r = pyo.Var(terms, domain=pyo.NonNegativeReals)
    for key, received, big_m, before in rows:
        _, i, b = key
        c.add(m.r[key] >= received - big_m * (1 - m.x[i, b] + sum(m.x[j, b] for j in before)))
        c.finish[i] = c.finish[i] + m.r[key]
    c.receive_terms = terms


def _receiver_time(c: _Model, device: int) -> Any:
    """The receiver's time device ``device`` spends on the transfers its free tasks receive (model units)."""
    return sum(c.m.r[t, i, b] for t, i, b in c.receive_terms if b == device)


def _sender_time(c: _Model, device: int) -> Any:
    """The sender's time device ``device`` spends on the transfers of free producers (model units)."""
    free_set = set(c.free)
    return sum(
        c.scaled(float(send_cpu_s(c.problem, t, device, b))) * c.m.w[t, device, b]
        for (t, b), sources in c.transfer_sources.items()
        if device in sources and int(c.problem.tensor_producer[t]) in free_set
    )


def _assignment_and_memory_rows(c: _Model) -> None:
    """(4c) one device each; (5) memory, net of what fixed tasks already hold."""
    problem, window, m, allowed = c.problem, c.window, c.m, c.allowed
    for i in c.free:
        c.add(sum(m.x[i, k] for k in allowed[i]) == 1)
    fixed_mask = np.ones(problem.num_tasks, bool)
    fixed_mask[list(c.free)] = False
    for k in range(problem.num_devices):
        capacity = problem.memory_capacity_bytes[k]
        if not np.isfinite(capacity):
            continue
        held = float(problem.memory_bytes[fixed_mask & (window.placement == k)].sum())
        users = [i for i in c.free if k in allowed[i] and problem.memory_bytes[i] > 0]
        if users and sum(problem.memory_bytes[i] for i in users) > capacity - held:
            share = {i: float(problem.memory_bytes[i] / capacity) for i in users}
            c.add(sum(share[i] * m.x[i, k] for i in users) <= (capacity - held) / capacity)


def _precedence_rows(c: _Model) -> None:
    """(4a) precedence of tasks, and device readiness after fixed tasks."""
    problem, window, m, free_set = c.problem, c.window, c.m, set(c.free)
    for i in c.free:
        for u in problem.predecessors[i]:
            if u in free_set:
                c.add(m.S[i] >= c.finish[u])
            elif not math.isnan(window.fixed_finish_s[u]):
                c.add(m.S[i] >= c.scaled(window.fixed_finish_s[u]))
        ready = {k: c.scaled(window.device_ready_s[k]) for k in c.allowed[i] if window.device_ready_s[k] > 0}
        if ready:
            c.add(m.S[i] >= sum(r * m.x[i, k] for k, r in ready.items()))


def _latency_rows(c: _Model, objective: Objective | None = None) -> None:
    """The latency objective: T covers every free task plus what runs after it on its device, and the transfer of
    the model outputs it makes to device 0 (:func:`moirai.planning.schedule.output_arrival_s`)."""
    for f, i in enumerate(c.free):
        c.add(c.m.T >= c.finish[i] + sum(c.scaled(c.window.tail_s[f, k]) * c.m.x[i, k] for k in c.allowed[i]))
        output_s = c.problem.costs.output_s
        output = {k: c.scaled(output_s[i, k]) for k in c.allowed[i] if output_s[i, k] > 0}
        if output:
            c.add(c.m.T >= c.finish[i] + sum(seconds * c.m.x[i, k] for k, seconds in output.items()))


def _latency_cuts(c: _Model) -> None:
    """Strong cuts: every task starts after its head and T covers its tail, both for the device it is on; the
    work each device must still do after each head; chains of descendants."""
    m, allowed = c.m, c.allowed
    head = {ik: c.scaled(seconds) for ik, seconds in c.head_s.items()}
    tail = {ik: c.scaled(seconds) for ik, seconds in c.tail_s.items()}
    for f, i in enumerate(c.free):
        if any(head[i, k] > m.S[i].lb for k in allowed[i]):
            c.add(m.S[i] >= sum(head[i, k] * m.x[i, k] for k in allowed[i]))
        if any(tail[i, k] > c.scaled(c.window.tail_s[f, k]) for k in allowed[i]):  # else the objective row says it
            c.add(m.T >= c.finish[i] + sum(tail[i, k] * m.x[i, k] for k in allowed[i]))
    _add_device_load_cuts(m, c.problem, allowed, head, tail, c.unit_s)
    shortest_tail = {i: min(tail[i, k] for k in allowed[i]) for i in c.free}
    earliest = {i: c.scaled(c.earliest_s[i]) for i in c.free}
    _add_chain_load_cuts(m, c.problem, allowed, c.descendants, earliest, shortest_tail, c.unit_s)


def _period_rows(c: _Model, objective: Objective) -> None:
    """Throughput: the period P covers every device's compute per request; with a latency limit (then the
    window's horizon), T covers every finish and stays within it."""
    if len(c.free) != c.problem.num_tasks:
        raise MoiraiError("the throughput objective is modelled for the whole problem only, not windows")
    m = c.m
    m.P = pyo.Var(bounds=(0.0, MODEL_TIME_SCALE))  # a period never exceeds the latency, nor that the horizon
    problem = c.problem
    # The simulator's charges (RequestCosts.charges, the sum of every term of PERIOD_TERMS), linear in x and in
    # u[k] = 1 when device k has a task.
    charges = problem.costs.charges
    charged = [k for k in range(problem.num_devices) if charges.taking_part_s[k] > 0]
    m.u = pyo.Var(charged, domain=pyo.Binary)
    for k in charged:
        for i in c.free:
            if k in c.allowed[i]:
                c.add(m.u[k] >= m.x[i, k])
    for k in range(problem.num_devices):
        users = [i for i in c.free if k in c.allowed[i]]
        runtime = c.scaled(charges.always_s[k]) + (c.scaled(charges.taking_part_s[k]) * m.u[k] if k in charged else 0)
        outputs = sum(c.scaled(charges.own_s[i, k]) * m.x[i, k] for i in users if charges.own_s[i, k] > 0)
        if k == 0:
            outputs += sum(
                c.scaled(charges.driver_s[i, d]) * m.x[i, d]
                for i in c.free
                for d in c.allowed[i]
                if charges.driver_s[i, d] > 0
            )
        if users:
            c.add(
                m.P
                >= sum(c.scaled(problem.compute_s[i, k]) * m.x[i, k] for i in users)
                + _sender_time(c, k)
                + _receiver_time(c, k)
                + runtime
                + outputs
            )
        elif k == 0:
            c.add(m.P >= runtime + outputs)
    if objective.latency_limit_s is not None:
        _latency_rows(c)
        c.add(m.T <= MODEL_TIME_SCALE)


def _link_period_rows(c: _Model, objective: Objective, transfers: _Transfers) -> None:
    """Throughput: the period covers every directed link's transfers per request (a tensor sent once per device)."""
    on_link: dict[tuple[int, int], list[Any]] = {}
    for (t, b), sources in transfers.sources.items():
        for a in sources:
            on_link.setdefault((a, b), []).append(c.scaled(transfer_duration_s(c.problem, t, a, b)) * c.m.w[t, a, b])
    for terms in on_link.values():
        c.add(c.m.P >= sum(terms))


def _no_rows(*args: Any) -> None:
    return None


def _period_warm_start(values: ComponentMap, built: MilpModel, timeline: Timeline) -> None:
    """The period P of the start plan (the busiest device or link) and which devices its free tasks use (u)."""
    m = built.model
    values[m.P] = timeline.period_s / built.unit_s
    used = {int(timeline.placement[i]) for i in built.window.free_tasks}
    for k in m.u:
        values[m.u[k]] = float(k in used)


class MilpRows(NamedTuple):
    """An objective's part of the MILP (:meth:`moirai.planning.objective.Objective.milp_rows`)."""

    before_transfers: Callable[..., None]
    after_transfers: Callable[..., None]
    cuts: Callable[[_Model], None]  # strong formulation only
    variable: Callable[[pyo.ConcreteModel], Any]  # the variable it minimises
    warm_start: Callable[[ComponentMap, MilpModel, Timeline], None]  # its own variables' start values


LATENCY_ROWS = MilpRows(_latency_rows, _no_rows, _latency_cuts, lambda m: m.T, _no_rows)
THROUGHPUT_ROWS = MilpRows(_period_rows, _link_period_rows, _no_rows, lambda m: m.P, _period_warm_start)


@dataclass
class _Transfers:
    sources: dict[tuple[int, int], tuple[int, ...]]  # (tensor, destination) -> possible source devices
    duration: dict[tuple[int, int], Any]  # model units, an expression of the link chosen
    earliest_s: dict[tuple[int, int], float]
    latest_s: dict[tuple[int, int], float]


def _transfer_rows(c: _Model) -> _Transfers:
    """(7) transfers: one per tensor and destination device, duration from the link chosen."""
    problem, window, m, allowed, strong = c.problem, c.window, c.m, c.allowed, c.strong
    free_set = set(c.free)
    add, scaled, finish = c.add, c.scaled, c.finish
    transfers = c.transfer_sources
    result = _Transfers(transfers, {}, {}, {})
    for (t, b), sources in transfers.items():
        u = int(problem.tensor_producer[t])
        consumers = problem.tensor_consumers[t]
        free_consumers = [j for j in consumers if j in free_set and b in allowed[j]]
        fixed_here = any(j not in free_set and window.placement[j] == b for j in consumers)
        y = m.y[t, b]
        if u in free_set:
            if b in allowed[u]:
                add(y <= 1 - m.x[u, b])
            x_ub = m.x[u, b] if b in allowed[u] else 0
            for j in free_consumers:
                add(y >= m.x[j, b] - x_ub)
            if fixed_here:
                add(y >= 1 - x_ub)
            for a in sources:
                add(m.w[t, a, b] <= m.x[u, a])
                add(m.w[t, a, b] <= y)
                add(m.w[t, a, b] >= m.x[u, a] + y - 1)
            produced = finish[u]
            earliest = c.earliest_s[u] + c.fastest_s[u]
        else:
            for j in free_consumers:
                add(y >= m.x[j, b])
            (a,) = sources
            add(m.w[t, a, b] == y)
            produced = scaled(window.fixed_finish_s[u])
            earliest = float(window.fixed_finish_s[u])
        if not fixed_here:
            add(y <= sum(m.x[j, b] for j in free_consumers))
        result.duration[t, b] = sum(scaled(transfer_duration_s(problem, t, a, b)) * m.w[t, a, b] for a in sources)
        add(m.R[t, b] >= produced)
        link_ready = {a: scaled(window.link_ready_s[a, b]) for a in sources if window.link_ready_s[a, b] > 0}
        if link_ready:
            add(m.R[t, b] >= sum(r * m.w[t, a, b] for a, r in link_ready.items()))
        result.earliest_s[t, b] = earliest
        latest = window.deadline_s if fixed_here else max(c.latest_finish_s[j] - c.fastest_s[j] for j in free_consumers)
        result.latest_s[t, b] = latest
        if strong:
            m.R[t, b].setlb(scaled(earliest))
            add(m.R[t, b] + result.duration[t, b] <= scaled(latest))
        for j in free_consumers:
            big_m = scaled(latest - c.earliest_s[j]) if strong else _PAPER_BIG_M
            add(m.S[j] >= m.R[t, b] + result.duration[t, b] - big_m * (1 - m.x[j, b]))
    for (t, b), arrival in window.arrived_s.items():
        for j in problem.tensor_consumers[t]:
            if j in free_set and b in allowed[j]:
                add(m.S[j] >= scaled(arrival) * m.x[j, b])
    return result


def _device_order_rows(c: _Model) -> dict[tuple[int, int], str]:
    """(6) no two tasks overlap on one device; returns the kind of every pair of free tasks."""
    m, allowed, strong, add, scaled, finish = c.m, c.allowed, c.strong, c.add, c.scaled, c.finish
    device_pairs = device_pair_kinds(
        c.free, allowed, c.descendants, c.earliest_s, c.latest_finish_s, c.fastest_s, strong
    )
    delta_pairs = [pair for pair, kind in device_pairs.items() if kind == "delta"]
    m.delta = pyo.Var(delta_pairs, domain=pyo.Binary)
    if strong:
        m.same = pyo.Var(list(device_pairs), bounds=(0.0, 1.0))
    for (i, j), kind in device_pairs.items():
        shared = [k for k in allowed[i] if k in allowed[j]]
        if kind == "apart":
            for k in shared:
                add(m.x[i, k] + m.x[j, k] <= 1)
            continue
        if strong:
            same = m.same[i, j]
            for k in shared:
                add(same >= m.x[i, k] + m.x[j, k] - 1)
            i_first_m = scaled(c.latest_finish_s[i] - c.earliest_s[j])
            j_first_m = scaled(c.latest_finish_s[j] - c.earliest_s[i])
            if kind == "i_first":
                add(m.S[j] >= finish[i] - i_first_m * (1 - same))
            elif kind == "j_first":
                add(m.S[i] >= finish[j] - j_first_m * (1 - same))
            else:
                add(m.S[j] >= finish[i] - i_first_m * (2 - m.delta[i, j] - same))
                add(m.S[i] >= finish[j] - j_first_m * (1 + m.delta[i, j] - same))
        else:
            for k in shared:
                off = _PAPER_BIG_M * (2 - m.x[i, k] - m.x[j, k])
                add(m.S[j] >= finish[i] - _PAPER_BIG_M * (1 - m.delta[i, j]) - off)
                add(m.S[i] >= finish[j] - _PAPER_BIG_M * m.delta[i, j] - off)
    return device_pairs


def _link_order_rows(c: _Model, transfers: _Transfers) -> dict[tuple[tuple[int, int], tuple[int, int]], str]:
    """(8) no two transfers overlap on one directed link; returns the kind of every pair of transfers."""
    m, strong, add, scaled = c.m, c.strong, c.add, c.scaled
    transfer_pairs = transfer_pair_kinds(
        c.problem, transfers.sources, c.descendants, set(c.free), transfers.earliest_s, transfers.latest_s, strong
    )
    link_delta_pairs = [pair for pair, kind in transfer_pairs.items() if kind == "delta"]
    m.link_delta = pyo.Var(link_delta_pairs, domain=pyo.Binary)
    if strong:
        m.same_link = pyo.Var(list(transfer_pairs), bounds=(0.0, 1.0))
    for (q, r), kind in transfer_pairs.items():
        shared = [a for a in transfers.sources[q] if a in transfers.sources[r]]
        q_end = m.R[q] + transfers.duration[q]
        r_end = m.R[r] + transfers.duration[r]
        if strong:
            same = m.same_link[q, r]
            for a in shared:
                add(same >= m.w[q[0], a, q[1]] + m.w[r[0], a, r[1]] - 1)
            q_first_m = scaled(transfers.latest_s[q] - transfers.earliest_s[r])
            r_first_m = scaled(transfers.latest_s[r] - transfers.earliest_s[q])
            if kind == "q_first":
                add(m.R[r] >= q_end - q_first_m * (1 - same))
            else:
                add(m.R[r] >= q_end - q_first_m * (2 - m.link_delta[q, r] - same))
                add(m.R[q] >= r_end - r_first_m * (1 + m.link_delta[q, r] - same))
        else:
            for a in shared:
                off = _PAPER_BIG_M * (2 - m.w[q[0], a, q[1]] - m.w[r[0], a, r[1]])
                add(m.R[r] >= q_end - _PAPER_BIG_M * (1 - m.link_delta[q, r]) - off)
                add(m.R[q] >= r_end - _PAPER_BIG_M * m.link_delta[q, r] - off)
    return transfer_pairs


def _symmetry_rows(c: _Model, groups: tuple[tuple[int, ...], ...]) -> None:
    """Identical devices: the k-th of a group is used only after the (k-1)-th (by first task)."""
    m, allowed = c.m, c.allowed
    order = sorted(c.free, key=c.problem.topological_position.__getitem__)
    for group in groups:
        for previous, device in zip(group, group[1:], strict=False):
            for p, i in enumerate(order):
                if device in allowed[i]:
                    earlier = [m.x[h, previous] for h in order[:p] if previous in allowed[h]]
                    c.add(m.x[i, device] <= sum(earlier))


def _add_device_load_cuts(
    m: pyo.ConcreteModel,
    problem: Problem,
    allowed: dict[int, tuple[int, ...]],
    head: dict[tuple[int, int], float],
    tail: dict[tuple[int, int], float],
    unit_s: float,
) -> None:
    """Per device ``k`` and threshold ``h``: the tasks on ``k`` whose head there is at least ``h`` run one
    after another after ``h`` and before ``T`` less their shortest tail; the same with tails.

    With ``h`` the smallest head this is the plain load cut; larger ones count the time a device
    must idle before its inputs can arrive. The constant ``h + tail`` holds only when one of those
    tasks is on ``k``: the part of it above ``floor`` (a bound on ``T`` every plan meets) is counted
    when the task that sets the threshold is there.
    """
    duration = {(i, k): problem.compute_s[i, k] / unit_s for i in allowed for k in allowed[i]}
    floor = max((min(head[i, k] + duration[i, k] + tail[i, k] for k in allowed[i]) for i in allowed), default=0.0)
    for k in range(problem.num_devices):
        users = [i for i in allowed if k in allowed[i]]
        for bound, other in ((head, tail), (tail, head)):
            for threshold in sorted({bound[i, k] for i in users}):
                late = [i for i in users if bound[i, k] >= threshold]
                setter = next(i for i in late if bound[i, k] == threshold)
                constant = threshold + min(other[i, k] for i in late)
                base = min(constant, floor)
                work = sum(duration[i, k] * m.x[i, k] for i in late)
                m.constraints.add(m.T >= base + (constant - base) * m.x[setter, k] + work)


def _add_chain_load_cuts(
    m: pyo.ConcreteModel,
    problem: Problem,
    allowed: dict[int, tuple[int, ...]],
    descendants: dict[int, set[int]],
    earliest: dict[int, float],
    tail: dict[int, float],
    unit_s: float,
) -> None:
    """Per device ``k`` and task ``i``: ``i``'s ancestors on ``k`` run one after another before ``S_i``, and
    ``i`` with its descendants on ``k`` one after another between ``S_i`` and ``T`` (less their shortest tail).

    The LP relaxation gains little from them; the search does: once placements are fixed they bound
    starts and ``T`` by the work queued on each device, before any order binary is decided.
    """
    ancestors: dict[int, set[int]] = {i: set() for i in descendants}
    for i, below in descendants.items():
        for j in below:
            ancestors[j].add(i)
    for i in descendants:
        chain_after = descendants[i] | {i}
        for k in range(problem.num_devices):
            before = [j for j in ancestors[i] if k in allowed[j]]
            if len(before) > 1:
                work = sum(problem.compute_s[j, k] / unit_s * m.x[j, k] for j in before)
                m.constraints.add(m.S[i] >= min(earliest[j] for j in before) + work)
            after = [j for j in chain_after if k in allowed[j]]
            if len(after) > 1:
                work = sum(problem.compute_s[j, k] / unit_s * m.x[j, k] for j in after)
                m.constraints.add(m.T >= m.S[i] + work + min(tail[j] for j in chain_after))


def _transfer_candidates(
    problem: Problem, window: Window, allowed: dict[int, tuple[int, ...]], free_set: set[int]
) -> dict[tuple[int, int], tuple[int, ...]]:
    """Every (tensor, destination) transfer the window may need, with its possible source devices."""
    candidates: dict[tuple[int, int], tuple[int, ...]] = {}
    touching = {t for i in free_set for t in problem.output_tensors[i] + problem.input_tensors[i]}
    for t in sorted(touching):
        u = int(problem.tensor_producer[t])
        consumers = problem.tensor_consumers[t]
        free_consumers = [j for j in consumers if j in free_set]
        if u not in free_set and (not free_consumers or math.isnan(window.fixed_finish_s[u])):
            continue
        for b in range(problem.num_devices):
            if (t, b) in window.arrived_s:
                continue
            wanted = any(b in allowed[j] for j in free_consumers)
            if u in free_set:
                wanted = wanted or any(j not in free_set and window.placement[j] == b for j in consumers)
                sources = tuple(a for a in allowed[u] if a != b and np.isfinite(transfer_duration_s(problem, t, a, b)))
            else:
                a = int(window.placement[u])
                sources = (a,) if a != b else ()
            if wanted and sources:
                candidates[t, b] = sources
    return candidates
