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

Two formulations (``formulation=``, :mod:`moirai.planning.solve.formulation`): ``"paper"``, the constraints as the
paper prints them with one constant big-M, and ``"strong"``, which narrows devices and time windows by heads, tails
and a horizon, orders pairs with window-specific big-Ms, and adds cuts (:mod:`moirai.planning.solve.cuts`) and
symmetry breaking. Measured against ``"paper"`` in ``bench/milp_ablation.py``: the cuts raise the LP bound by 4-12%
and, mostly, let the search prune once placements are fixed.

A model covers either the whole problem or a :class:`Window` of it: a set of free tasks, with
everything scheduled before them fixed as constants and everything after them summarised by
tails (how long the plan runs on after each free task finishes, per device). The large-
neighbourhood search in :mod:`moirai.planning.solve.search` solves windows.

Times inside the model are in units of ``horizon / 1000`` so the solver sees numbers near 1.

The model is built by equation group (assignment and memory, precedence, objective rows, transfers,
device order, link order, cuts); this module holds the groups every formulation shares, the formulation its order
rows and cuts, :mod:`moirai.planning.solve.rows` the objective's rows, and :mod:`moirai.planning.solve.window` the
bounds that tighten it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyomo.environ as pyo

from moirai.planning.colocation import colocated_sets
from moirai.planning.problem import Problem
from moirai.planning.schedule.transfers import recv_cpu_s, send_cpu_s, transfer_duration_s
from moirai.planning.solve.formulation import FORMULATIONS, Formulation, formulation_named
from moirai.planning.solve.parts import MODEL_TIME_SCALE, ModelParts, Transfers
from moirai.planning.solve.rows import LATENCY_ROWS, MilpRows
from moirai.planning.solve.window import Window, allowed_devices, descendant_sets, time_windows

if TYPE_CHECKING:
    from moirai.planning.objective import Objective

__all__ = ["FORMULATIONS", "MODEL_TIME_SCALE", "MilpModel", "ModelSize", "build_model"]


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
    formulation: Formulation
    model: pyo.ConcreteModel
    unit_s: float
    transfer_sources: dict[tuple[int, int], tuple[int, ...]]
    device_pairs: dict[tuple[int, int], str]  # (i, j) -> "delta" | "i_first" | "j_first" | "apart"
    transfer_pairs: dict[tuple[tuple[int, int], tuple[int, int]], str]
    symmetric_groups: tuple[tuple[int, ...], ...]
    objective_var: Any = None  # the variable minimised: T (latency) or P (period), in model units
    rows: MilpRows | None = None  # the objective's rows, which also warm-start its own variables
    size: ModelSize | None = None


def build_model(
    problem: Problem, window: Window, formulation: str = "strong", objective: Objective | None = None
) -> MilpModel:
    """The Pyomo model of ``window`` (use :func:`whole_problem` for the full MILP) minimising ``objective``
    (None: latency).

    Rows by equation group, in this order: assignment and memory (4c, 5), precedence (4a), the objective's
    rows, transfers (7), device order (6), link order (8), then the formulation's cuts.
    """
    form = formulation_named(formulation)
    rows = LATENCY_ROWS if objective is None else objective.milp_rows()
    started = time.perf_counter()
    c = _bounded_model(problem, window, form)
    _transfer_variables(c)
    _assignment_and_memory_rows(c)
    _no_link_rows(c)
    _colocation_rows(c)
    _precedence_rows(c)
    rows.before_transfers(c, objective)
    transfers = _transfer_rows(c, form)
    rows.after_transfers(c, objective, transfers)
    device_pairs = form.device_order_rows(c)
    transfer_pairs = form.link_order_rows(c, transfers)
    symmetric_groups = form.cuts(c, rows)
    m = c.m
    objective_var = rows.variable(m)
    m.objective = pyo.Objective(expr=objective_var, sense=pyo.minimize)
    return MilpModel(
        problem=problem,
        window=window,
        formulation=form,
        model=m,
        unit_s=c.unit_s,
        transfer_sources=transfers.sources,
        device_pairs=device_pairs,
        transfer_pairs=transfer_pairs,
        symmetric_groups=symmetric_groups,
        objective_var=objective_var,
        rows=rows,
        size=_model_size(m, time.perf_counter() - started),
    )


def _model_size(m: pyo.ConcreteModel, build_s: float) -> ModelSize:
    variables = list(m.component_data_objects(pyo.Var))
    binaries = sum(v.is_binary() for v in variables)
    return ModelSize(binaries, len(variables) - binaries, len(m.constraints), build_s)


def _bounded_model(problem: Problem, window: Window, formulation: Formulation) -> ModelParts:
    """Allowed devices and time windows of the free tasks (narrowed as the formulation does), and the model's
    assignment, start and objective variables bounded by them."""
    unit = window.horizon_s / MODEL_TIME_SCALE if window.horizon_s > 0 else 1.0
    free = window.free_tasks
    allowed = allowed_devices(problem, free)
    free_graph = problem.graph.subgraph(free)
    earliest_s, latest_finish_s, fastest_s = time_windows(problem, window, allowed, free_graph)
    m = pyo.ConcreteModel(name=f"moirai_{formulation.name}")
    c = ModelParts(
        problem, window, unit, allowed, earliest_s, latest_finish_s, fastest_s, {}, {}, descendant_sets(free_graph), m
    )
    formulation.narrow(c)
    m.x = pyo.Var([(i, k) for i in free for k in c.allowed[i]], domain=pyo.Binary)
    formulation.time_variables(c)
    m.constraints = pyo.ConstraintList()
    duration = {i: sum(problem.compute_s[i, k] / unit * m.x[i, k] for k in c.allowed[i]) for i in free}
    c.finish = {i: m.S[i] + duration[i] for i in free}
    return c


def _transfer_variables(c: ModelParts) -> None:
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


def _receiver_time_variables(c: ModelParts) -> None:
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


def _assignment_and_memory_rows(c: ModelParts) -> None:
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


def _no_link_rows(c: ModelParts) -> None:
    """A tensor's producer and consumer never on two devices with no link between them (infinite transfer time):
    :func:`_transfer_candidates` leaves such links out, so without these rows the split would cost nothing."""
    problem, m, free_set = c.problem, c.m, set(c.free)

    def devices(i: int) -> tuple[int, ...]:
        return c.allowed[i] if i in free_set else (int(c.window.placement[i]),)

    def on(i: int, k: int) -> Any:
        return m.x[i, k] if i in free_set else 1

    touching = {t for i in free_set for t in problem.output_tensors[i] + problem.input_tensors[i]}
    for t in sorted(touching):
        u = int(problem.tensor_producer[t])
        for j in problem.tensor_consumers[t]:
            if u not in free_set and j not in free_set:
                continue
            for a in devices(u):
                for b in devices(j):
                    if a != b and not np.isfinite(transfer_duration_s(problem, t, a, b)):
                        c.add(on(u, a) + on(j, b) <= 1)


def _colocation_rows(c: ModelParts) -> None:
    """Every colocated set on one device, on a device every member may use: the problem as it is, with tasks between
    members free (the registry's contraction, which groups them, is for the placers that cannot keep sets)."""
    m, free_set = c.m, set(c.free)
    for members in colocated_sets(c.problem):
        free = [i for i in members if i in free_set]
        if not free:
            continue
        common = set.intersection(*(set(c.allowed[i]) for i in free))
        fixed = {int(c.window.placement[i]) for i in members if i not in free_set}
        if fixed:
            common &= fixed
        for i in free:
            for k in c.allowed[i]:
                c.add(m.x[i, k] == 0 if k not in common else m.x[i, k] == m.x[free[0], k])


def _precedence_rows(c: ModelParts) -> None:
    """(4a) precedence of tasks, device readiness after fixed tasks, and each task's release (its header and the
    model inputs it reads, :attr:`moirai.planning.costs.RequestCosts.release_s`)."""
    problem, window, m, free_set = c.problem, c.window, c.m, set(c.free)
    for i in c.free:
        for u in problem.predecessors[i]:
            if u in free_set:
                c.add(m.S[i] >= c.finish[u])
            elif not math.isnan(window.fixed_finish_s[u]):
                c.add(m.S[i] >= c.scaled(window.fixed_finish_s[u]))
        release = problem.costs.release_s[i]  # its device's header and the model inputs it reads
        ready_s = {k: max(float(window.device_ready_s[k]), float(release[k])) for k in c.allowed[i]}
        ready = {k: c.scaled(seconds) for k, seconds in ready_s.items() if seconds > 0}
        if ready:
            c.add(m.S[i] >= sum(r * m.x[i, k] for k, r in ready.items()))


def _transfer_rows(c: ModelParts, formulation: Formulation) -> Transfers:
    """(7) transfers: one per tensor and destination device, duration from the link chosen."""
    problem, window, m, allowed = c.problem, c.window, c.m, c.allowed
    free_set = set(c.free)
    add, scaled, finish = c.add, c.scaled, c.finish
    transfers = c.transfer_sources
    result = Transfers(transfers, {}, {}, {})
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
        formulation.transfer_window(c, (t, b), result.duration[t, b], earliest, latest)
        for j in free_consumers:
            big_m = formulation.arrival_big_m(c, latest, j)
            add(m.S[j] >= m.R[t, b] + result.duration[t, b] - big_m * (1 - m.x[j, b]))
    for (t, b), arrival in window.arrived_s.items():
        for j in problem.tensor_consumers[t]:
            if j in free_set and b in allowed[j]:
                add(m.S[j] >= scaled(arrival) * m.x[j, b])
    return result


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
