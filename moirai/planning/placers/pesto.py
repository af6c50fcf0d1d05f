"""``pesto``: the Pesto ILP (Hafeez et al., Middleware 2021, §3.2) on a graph coarsened as in §3.3.

**Coarsening (§3.3).** Rounds of batch merging: in every round, edges are taken heaviest
communication first and merged as a matching when Theorem 3.5's condition (ii) says the
pair is joined by no other path (the child has one parent, the parent one child, the child
sits one level below the parent, or every other child of the parent sits below the child,
by height = longest path from a root). The printed condition (iii), meant to make the batch
safe, is vacuous as typeset (an edge ``u_i -> v_j`` already forces ``H(v_j) > H(u_i)``), so
the batch is checked instead: a merge that closes a cycle in the quotient graph is undone.
Rounds stop at ``target_tasks`` (Pesto uses ~200) or when nothing can merge. A merge must
leave the group a device with room for it.

**ILP (§3.2), generalised to K devices** the way its authors sketch (one more placement
indicator per device: ``x[i, k]``, one-hot; for K = 2 it is Pesto's ``x_i``). Every edge
``(u, v)`` of the coarse graph becomes a communication vertex ``q`` (Pesto's augmentation);
``z[q, a, b]`` marks that it crosses link ``a -> b`` and its duration is that link's time::

    minimise C_max
    C_u <= S_q,  S_q + sum_ab c[q, a, b] z[q, a, b] <= S_v        precedence, eqs. (1), (6)
    C_i = S_i + sum_k p[i, k] x[i, k] <= C_max                   eqs. (2), (3)
    z[q, a, b] >= x[u, a] + x[v, b] - 1                          eq. (5), per link
    sum_i m_i x[i, k] <= capacity_k                              memory, eq. (8)

(``z`` may be continuous: it only lengthens transfers and adds conflicts, so the optimum
keeps it at its lower bound. Pesto's memory constraint balances footprints; here it is the
device capacity, the static memory model of :mod:`moirai.planning.simulate`.)

Tasks on one device and transfers on one link do not overlap (eqs. (4), (7), (10)): for
every pair not already ordered by a path, a binary ``delta`` orders them, active when both
share the device (or link): ``S_i >= C_j - M delta - M (1 - same)`` and
``S_j >= C_i - M (1 - delta) - M (1 - same)``; the sign of ``M delta`` is the erratum in
docs/design.md (eq. (10) prints ``+M_s delta``).

HiGHS (through Pyomo) starts from the m-ETF schedule of the coarse graph, which is feasible
for the ILP (the coarse graph has one tensor per edge, like the augmented graph), or from HEFT's where that is
shorter (simulated: the simulator prices more than the ILP, so its times meet the ILP's rows); its
makespan is the horizon and so the big-M. A task or an edge that alone takes longer than the horizon is
forbidden where it would run, not priced (its scaled time can be more than HiGHS reads), and a start that takes
no time is the plan. The solver stops at the placer's wall-clock
budget ``time_limit_s`` (building the model counts) and its best incumbent is used; if it
returns none, the warm start stands in; where m-ETF's greedy placement finds no room for a task, HEFT's
plan of the whole graph stands in for pesto's (the report says so). Members of a group run on its device, groups in
the order of their start times.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import networkx as nx
import numpy as np
import pyomo.environ as pyo
from pyomo.common.collections import ComponentMap

from moirai.errors import InfeasibleError
from moirai.planning.highs import run_highs
from moirai.planning.placers import register
from moirai.planning.placers.m_etf import m_etf_schedule
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import SolverReport
from moirai.planning.schedule import ScheduleBuilder, transfer_duration_s
from moirai.planning.schedule.heft import heft_schedule, upward_rank_mean_costs
from moirai.planning.simulate import simulate


@register("pesto", minimises=True, respects_memory=True)
def place_pesto(problem: Problem, target_tasks: int = 200, time_limit_s: float = 30.0) -> Plan:
    """Pesto's plan; ``time_limit_s`` is the wall-clock budget of the whole placer (the solver gets what is left)."""
    deadline = time.perf_counter() + time_limit_s
    groups = coarsen(problem, target_tasks)
    coarse = merge_tasks(problem, groups)
    # m-ETF's schedule of the coarse graph is feasible for the ILP: its makespan bounds the optimum (big-M).
    try:
        heuristic = m_etf_schedule(coarse)
    except InfeasibleError as error:  # its greedy choices left a task no room, where another placer may find one
        return _heft_fallback(problem, f"m_etf found no warm start: {error}")
    # The ILP starts from the shorter of m-ETF's and HEFT's schedules, whose makespan is its horizon (big-M and time
    # unit): m-ETF starts each task where it can start soonest, and on a chain whose fast devices alternate took
    # 1e9 s where 0.6 s would do; scaled by that, better plans differed by less than the solver's tolerances and one
    # of 1.6 s came back as optimal.
    start, name = heuristic, "m_etf"
    heft = _heft_of(coarse)
    if heft is not None and heft.makespan_s < heuristic.makespan_s:
        start, name = heft, "HEFT"
    # A start that takes no time is optimal, and a horizon of zero would scale every time to infinity.
    solution = solve_pesto_ilp(coarse, start, deadline) if start.makespan_s > 0 else None
    report = SolverReport(solver="highs", notes={"coarse_tasks": coarse.num_tasks, "time_limit_s": time_limit_s})
    if solution is None:
        group_device, group_start = start.placement, start.start_s
        report.solver_status = f"{name} warm start (" + (
            "it takes no time: optimal)" if start.makespan_s <= 0 else "the solver returned no incumbent)"
        )
    else:
        group_device, group_start, report.solver_status = solution
    placement = np.empty(problem.num_tasks, int)
    group_of = np.empty(problem.num_tasks, int)
    for g, members in enumerate(groups):
        placement[members] = group_device[g]
        group_of[members] = g
    rank = problem.topological_position
    order = nx.lexicographical_topological_sort(
        problem.graph, key=lambda task: (group_start[group_of[task]], group_of[task], rank[task])
    )
    per_device: list[list[int]] = [[] for _ in range(problem.num_devices)]
    for task in order:
        per_device[placement[task]].append(task)
    return Plan(placement, problem.device_names, order=tuple(map(tuple, per_device)), placer="pesto", report=report)


class _SimulatedStart(NamedTuple):
    """A simulated schedule as the ILP's warm start reads one (a :class:`ScheduleBuilder`'s fields): the simulator
    prices more than the ILP (the runtime's sends and receives), so its times meet every row of the ILP's."""

    placement: np.ndarray
    start_s: np.ndarray
    finish_s: np.ndarray
    arrival_s: np.ndarray  # [tensor, device]: when the tensor is there (NaN where it never goes)
    makespan_s: float


def _heft_of(coarse: Problem) -> _SimulatedStart | None:
    """HEFT's schedule of the coarse graph, simulated (None where it finds no room)."""
    try:
        timeline = simulate(coarse, heft_schedule(coarse, upward_rank_mean_costs(coarse)))
    except InfeasibleError:
        return None
    arrival = np.full((coarse.num_tensors, coarse.num_devices), np.nan)
    for transfer in timeline.transfers:
        arrival[transfer.tensor, transfer.dst] = transfer.finish
    return _SimulatedStart(timeline.placement, timeline.task_start, timeline.task_finish, arrival, timeline.makespan_s)


def _heft_fallback(problem: Problem, reason: str) -> Plan:
    """HEFT's plan of ``problem``, as pesto's, the report saying why."""
    plan = heft_schedule(problem, upward_rank_mean_costs(problem))
    plan.placer = "pesto"
    plan.report.notes["fallback"] = f"heft: {reason}"
    return plan


# --- coarsening (§3.3) -------------------------------------------------------------


def coarsen(problem: Problem, target_tasks: int) -> list[list[int]]:
    """Groups of tasks (each a list in topological order) whose quotient graph is a DAG of about ``target_tasks``."""
    group_of = np.arange(problem.num_tasks)
    edge_s = problem.mean_transfer_s
    while len(np.unique(group_of)) > target_tasks:
        quotient, weight = _quotient(problem, group_of, edge_s)
        pairs = _mergeable_matching(problem, quotient, weight, group_of, quotient.number_of_nodes() - target_tasks)
        merged = _merge_acyclic(quotient, pairs)
        if not merged:
            break
        relabel = np.arange(problem.num_tasks)
        for u, v in merged:
            relabel[v] = u
        group_of = relabel[group_of]
    rank = problem.topological_position
    members: dict[int, list[int]] = {}
    for task in sorted(range(problem.num_tasks), key=rank.__getitem__):
        members.setdefault(int(group_of[task]), []).append(task)
    return sorted(members.values(), key=lambda tasks: rank[tasks[0]])


def _quotient(problem: Problem, group_of: np.ndarray, edge_s: np.ndarray) -> tuple[nx.DiGraph, dict]:
    """Graph of the groups (named by a member) and the communication time on each of its edges."""
    quotient = nx.DiGraph()
    quotient.add_nodes_from(np.unique(group_of).tolist())
    weight: dict[tuple[int, int], float] = {}
    for t, consumers in enumerate(problem.tensor_consumers):
        source = int(group_of[problem.tensor_producer[t]])
        for target in {int(group_of[c]) for c in consumers} - {source}:
            quotient.add_edge(source, target)
            weight[source, target] = weight.get((source, target), 0.0) + float(edge_s[t])
    return quotient, weight


def _mergeable_matching(
    problem: Problem, quotient: nx.DiGraph, weight: dict, group_of: np.ndarray, wanted: int
) -> list[tuple[int, int]]:
    """Up to ``wanted`` disjoint edges, heaviest communication first, each safe on its own (Theorem 3.5 (ii))."""
    height: dict[int, int] = {}
    for node in nx.topological_sort(quotient):
        height[node] = 1 + max((height[p] for p in quotient.predecessors(node)), default=0)
    # Sums per group, indexed by the group's label (a member's task index).
    compute = np.zeros_like(problem.compute_s)
    np.add.at(compute, group_of, problem.compute_s)
    memory = np.bincount(group_of, weights=problem.memory_bytes, minlength=problem.num_tasks)
    capacity = problem.memory_capacity_bytes
    matched: set[int] = set()
    pairs = []
    for u, v in sorted(quotient.edges, key=lambda e: (-weight[e], height[e[0]], e)):
        if len(pairs) == wanted:
            break
        if u in matched or v in matched:
            continue
        unique_path = (
            quotient.out_degree(u) == 1
            or quotient.in_degree(v) == 1
            or height[v] == height[u] + 1
            or all(height[w] > height[v] for w in quotient.successors(u) if w != v)
        )
        room = np.isfinite(compute[u] + compute[v]) & (memory[u] + memory[v] <= capacity)
        if unique_path and room.any():
            pairs.append((u, v))
            matched.update((u, v))
    return pairs


def _merge_acyclic(quotient: nx.DiGraph, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pairs whose joint contraction keeps ``quotient`` acyclic (drops the lightest pair of every cycle)."""
    kept = list(pairs)
    while kept:
        label = {v: u for u, v in kept}
        contracted = nx.DiGraph()
        contracted.add_edges_from(
            (label.get(a, a), label.get(b, b)) for a, b in quotient.edges if label.get(a, a) != label.get(b, b)
        )
        # A cycle lies inside one strongly connected component; each such component holds a merged pair.
        tangled = [c for c in nx.strongly_connected_components(contracted) if len(c) > 1]
        if not tangled:
            return kept
        drop = {max(i for i, (u, _) in enumerate(kept) if u in component) for component in tangled}
        kept = [pair for i, pair in enumerate(kept) if i not in drop]
    return kept


def merge_tasks(problem: Problem, groups: Sequence[Sequence[int]]) -> Problem:
    """Pesto's coarse graph: one task per group (compute and memory add up), one tensor per edge between groups.

    An edge's tensor stands for every tensor crossing it (transfer times add up), as Pesto's
    augmented graph has one communication vertex per edge; tensors inside a group vanish. A colocated set becomes
    the set of its members' groups.
    """
    group_of = np.empty(problem.num_tasks, int)
    for g, members in enumerate(groups):
        group_of[list(members)] = g
    crossing: dict[tuple[int, int], list[int]] = {}
    for t, tensor_consumers in enumerate(problem.tensor_consumers):
        source = int(group_of[problem.tensor_producer[t]])
        for target in sorted({int(group_of[c]) for c in tensor_consumers} - {source}):
            crossing.setdefault((source, target), []).append(t)
    k = problem.num_devices
    return Problem(
        device_names=problem.device_names,
        memory_capacity_bytes=problem.memory_capacity_bytes,
        memory_reserve_bytes=problem.memory_reserve_bytes,
        task_names=tuple(problem.task_names[m[0]] + (f"+{len(m) - 1}" if len(m) > 1 else "") for m in groups),
        compute_s=np.array([problem.compute_s[list(m)].sum(axis=0) for m in groups]),
        memory_bytes=np.array([problem.memory_bytes[list(m)].sum() for m in groups]),
        tensor_names=tuple(f"{u}->{v}" for u, v in crossing),
        tensor_producer=np.array([u for u, _ in crossing], int),
        tensor_consumers=tuple((v,) for _, v in crossing),
        transfer_s=np.array([problem.transfer_s[ts].sum(axis=0) for ts in crossing.values()]).reshape(-1, k, k),
        tensor_bytes=np.array([problem.tensor_bytes[ts].sum() for ts in crossing.values()]),
        send_cpu_s=np.array([problem.send_cpu_s[ts].sum(axis=0) for ts in crossing.values()]).reshape(-1, k, k),
        recv_cpu_s=np.array([problem.recv_cpu_s[ts].sum(axis=0) for ts in crossing.values()]).reshape(-1, k, k),
        costs=problem.costs.merge(groups),
        colocated=tuple(tuple({int(group_of[i]) for i in members}) for members in problem.colocated),
    )


# --- the ILP (§3.2) ----------------------------------------------------------------


@dataclass
class PestoIlp:
    """The Pyomo model and the index lists needed to warm-start it and read it back."""

    model: pyo.ConcreteModel
    horizon_s: float
    edges: list[tuple[int, int]]
    links: list[tuple[int, int]]
    task_pairs: list[tuple[int, int]]
    transfer_pairs: list[tuple[int, int]]


def solve_pesto_ilp(
    problem: Problem, warm_start: ScheduleBuilder | _SimulatedStart, deadline: float
) -> tuple[np.ndarray, np.ndarray, str] | None:
    """Device and start time of every task from the Pesto ILP's best incumbent, or None if there is none.

    The solver stops at ``deadline`` (a :func:`time.perf_counter` value); building the model counts.
    ``warm_start`` (a schedule of ``problem`` whose tensors each have one consumer, as
    :func:`merge_tasks` makes them) is a feasible solution: the solver starts from it and
    its makespan is the big-M.
    """
    ilp = build_pesto_ilp(problem, warm_start.makespan_s)
    outcome = run_highs(
        ilp.model,
        _warm_start_values(problem, ilp, warm_start),
        time_limit_s=max(deadline - time.perf_counter(), 0.0),
        threads=1,
    )
    if outcome.value is None:
        return None
    value = outcome.value
    m = ilp.model
    placement = np.array([max(m.devices, key=lambda k, i=i: value(m.x[i, k])) for i in m.tasks], int)
    start = np.array([value(m.start[i]) for i in m.tasks]) * ilp.horizon_s
    return placement, start, f"ILP {'optimal' if outcome.optimal else 'feasible'} ({outcome.status})"


_PAST_HORIZON = 1 + 1e-9  # a scaled time above this is longer than the horizon (rounding aside)


def build_pesto_ilp(problem: Problem, horizon_s: float) -> PestoIlp:
    """The Pesto ILP for ``problem``, times scaled so that ``horizon_s`` (a bound on the optimum; the big-M) is 1."""
    n, k = problem.num_tasks, problem.num_devices
    links = [(a, b) for a in range(k) for b in range(k) if a != b]
    edges = list(problem.graph.edges)
    horizon = max(horizon_s, 1e-12)
    edge_s = {
        (e, a, b): float(problem.transfer_s[problem.graph.edges[u, v]["tensors"], a, b].sum()) / horizon
        for e, (u, v) in enumerate(edges)
        for a, b in links
    }
    # An edge over a pair of devices with no link (infinite transfer time) is forbidden by a row, not priced; so is
    # one, and a task on a device, that alone takes longer than the horizon: no plan within it has them, and their
    # scaled times (1e15 where a fast device made the horizon tiny) are more than HiGHS reads.
    unlinked = [key for key, scaled in edge_s.items() if not scaled <= _PAST_HORIZON]
    edge_s.update(dict.fromkeys(unlinked, 0.0))
    runnable = problem.fits & (problem.compute_s / horizon <= _PAST_HORIZON)
    compute = np.where(runnable, problem.compute_s, 0.0) / horizon
    reach = problem.reachable()
    task_pairs = [(i, j) for i, j in itertools.combinations(range(n), 2) if not (reach[i, j] or reach[j, i])]
    transfer_pairs = [
        (q, r)
        for q, r in itertools.combinations(range(len(edges)), 2)
        if not _ordered_by_a_path(edges[q], edges[r], reach) and not _ordered_by_a_path(edges[r], edges[q], reach)
    ]

    m = pyo.ConcreteModel()
    m.tasks, m.devices, m.edges = pyo.RangeSet(0, n - 1), pyo.RangeSet(0, k - 1), pyo.RangeSet(0, len(edges) - 1)
    m.links = pyo.Set(initialize=links, dimen=2)
    m.task_pairs = pyo.Set(initialize=task_pairs, dimen=2)
    m.transfer_pairs = pyo.Set(initialize=transfer_pairs, dimen=2)
    m.x = pyo.Var(m.tasks, m.devices, domain=pyo.Binary)
    for i, d in zip(*np.nonzero(~runnable), strict=True):
        m.x[int(i), int(d)].fix(0)
    m.start = pyo.Var(m.tasks, bounds=(0, 1))
    m.send = pyo.Var(m.edges, bounds=(0, 1))
    m.crosses = pyo.Var(m.edges, m.links, bounds=(0, 1))
    m.makespan = pyo.Var(bounds=(0, 1))
    m.same_device = pyo.Var(m.task_pairs, bounds=(0, 1))
    m.task_first = pyo.Var(m.task_pairs, domain=pyo.Binary)
    m.same_link = pyo.Var(m.transfer_pairs, bounds=(0, 1))
    m.transfer_first = pyo.Var(m.transfer_pairs, domain=pyo.Binary)
    m.objective = pyo.Objective(expr=m.makespan)

    def finish(i: int) -> pyo.Expression:
        return m.start[i] + sum(compute[i, d] * m.x[i, d] for d in range(k))

    def arrival(e: int) -> pyo.Expression:
        return m.send[e] + sum(edge_s[e, a, b] * m.crosses[e, a, b] for a, b in links)

    m.one_device = pyo.Constraint(m.tasks, rule=lambda m, i: sum(m.x[i, d] for d in range(k)) == 1)
    m.ends_by_makespan = pyo.Constraint(m.tasks, rule=lambda m, i: finish(i) <= m.makespan)
    m.send_after_producer = pyo.Constraint(m.edges, rule=lambda m, e: finish(edges[e][0]) <= m.send[e])
    m.consume_after_arrival = pyo.Constraint(m.edges, rule=lambda m, e: arrival(e) <= m.start[edges[e][1]])
    m.crossing = pyo.Constraint(
        m.edges, m.links, rule=lambda m, e, a, b: m.crosses[e, a, b] >= m.x[edges[e][0], a] + m.x[edges[e][1], b] - 1
    )
    m.no_link = pyo.ConstraintList()
    for e, a, b in unlinked:
        m.no_link.add(m.x[edges[e][0], a] + m.x[edges[e][1], b] <= 1)
    m.memory = pyo.ConstraintList()
    for d in range(k):
        if np.isfinite(problem.memory_capacity_bytes[d]):
            m.memory.add(sum(problem.memory_bytes[i] * m.x[i, d] for i in range(n)) <= problem.memory_capacity_bytes[d])
    # No overlap on a device (eqs. (4), (10)) and on a link (eq. (7)) for pairs no path orders; big-M is 1.
    m.no_overlap = pyo.ConstraintList()
    for i, j in task_pairs:
        together, i_first = m.same_device[i, j], m.task_first[i, j]
        for d in range(k):
            m.no_overlap.add(together >= m.x[i, d] + m.x[j, d] - 1)
        m.no_overlap.add(m.start[i] >= finish(j) - i_first - (1 - together))
        m.no_overlap.add(m.start[j] >= finish(i) - (1 - i_first) - (1 - together))
    for q, r in transfer_pairs:
        together, q_first = m.same_link[q, r], m.transfer_first[q, r]
        for a, b in links:
            m.no_overlap.add(together >= m.crosses[q, a, b] + m.crosses[r, a, b] - 1)
        m.no_overlap.add(m.send[q] >= arrival(r) - q_first - (1 - together))
        m.no_overlap.add(m.send[r] >= arrival(q) - (1 - q_first) - (1 - together))
    return PestoIlp(m, horizon, edges, links, task_pairs, transfer_pairs)


def _ordered_by_a_path(before: tuple[int, int], after: tuple[int, int], reach: np.ndarray) -> bool:
    """Whether transfer ``before`` (an edge) must finish before transfer ``after`` starts."""
    return before[1] == after[0] or bool(reach[before[1], after[0]])


def _warm_start_values(problem: Problem, ilp: PestoIlp, schedule: ScheduleBuilder | _SimulatedStart) -> ComponentMap:
    """Values of every variable of ``ilp`` for the list schedule ``schedule``."""
    m, unit = ilp.model, ilp.horizon_s
    placement = schedule.placement
    values = ComponentMap()
    for i in range(problem.num_tasks):
        values[m.start[i]] = schedule.start_s[i] / unit
        for d in range(problem.num_devices):
            values[m.x[i, d]] = float(placement[i] == d)
    send = np.empty(len(ilp.edges))
    link = []
    for e, (u, v) in enumerate(ilp.edges):
        a, b = int(placement[u]), int(placement[v])
        send[e] = schedule.finish_s[u] / unit
        if a != b:
            (t,) = problem.graph.edges[u, v]["tensors"]
            send[e] = (schedule.arrival_s[t, b] - transfer_duration_s(problem, t, a, b)) / unit
        values[m.send[e]] = send[e]
        link.append((a, b) if a != b else None)
        for a_b in ilp.links:
            values[m.crosses[(e, *a_b)]] = float(a_b == link[e])
    values[m.makespan] = schedule.makespan_s / unit
    for i, j in ilp.task_pairs:
        values[m.same_device[i, j]] = float(placement[i] == placement[j])
        values[m.task_first[i, j]] = float(schedule.start_s[i] <= schedule.start_s[j])
    for q, r in ilp.transfer_pairs:
        values[m.same_link[q, r]] = float(link[q] is not None and link[q] == link[r])
        values[m.transfer_first[q, r]] = float(send[q] <= send[r])
    return values
