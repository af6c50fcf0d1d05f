"""The Moirai MILP (paper §III-D, eqs. 4-8) in Pyomo: joint placement and scheduling, DESIGN.md's errata fixed.

The model states what :mod:`moirai.simulate` does. ``x[i,k]`` puts task ``i`` on device ``k``;
``S_i`` is its start and ``C_i = S_i + sum_k p_ik x_ik`` its finish (4b, 4c). A tensor ``t`` is
sent *once* to every device ``b`` that hosts one of its consumers and not its producer
(``y[t,b]``); ``w[t,a,b] = x[u,a] y[t,b]`` picks the link and so the duration (7). Transfers start
after their producer (4a) and consumers on ``b`` start after the transfer arrives. Two tasks
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
neighbourhood search in :mod:`moirai.solve.search` solves windows.

Times inside the model are in units of ``horizon / 1000`` so the solver sees numbers near 1.
"""

from __future__ import annotations

import io
import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np
import pyomo.environ as pyo
from pyomo.common.collections import ComponentMap
from pyomo.contrib.solver.common.results import SolutionStatus, TerminationCondition

from moirai.highs import SolverOutcome, run_highs
from moirai.problem import Plan, Problem
from moirai.simulate import Timeline

FORMULATIONS = ("strong", "paper")
SOLVERS = ("highs", "gurobi")
_MODEL_TIME_SCALE = 1000.0  # the horizon, in model time units
_PAPER_BIG_M = 100.0 * _MODEL_TIME_SCALE
_ORDER_TOLERANCE = 1e-5  # model time units; below solver noise times are "equal" when ordering
_LOG_LINES_KEPT = 40
_NARROWING_ROUNDS = 4


@dataclass(frozen=True)
class Window:
    """What a model decides (``free_tasks``) and what it takes as given; see :func:`whole_problem`.

    ``placement``: device of every task (for free tasks, their current device, used as a start).
    ``fixed_finish_s``: finish of each task scheduled before the window, ``nan`` for the others.
    ``arrived_s``: ``(tensor, device) -> time`` for transfers already made before the window.
    ``device_ready_s`` / ``link_ready_s[a, b]``: when each device / directed link is free of them.
    ``tail_s[f, k]``: time the plan runs on after free task ``free_tasks[f]`` finishes on ``k``.
    ``horizon_s``: an upper bound on the best objective (the current solution's).
    ``deadline_s``: a time by which every transfer of the current solution has finished.
    """

    free_tasks: tuple[int, ...]
    placement: np.ndarray
    fixed_finish_s: np.ndarray
    arrived_s: dict[tuple[int, int], float]
    device_ready_s: np.ndarray
    link_ready_s: np.ndarray
    tail_s: np.ndarray
    horizon_s: float
    deadline_s: float


def whole_problem(problem: Problem, horizon_s: float) -> Window:
    """The window that frees every task: the full MILP."""
    n, k = problem.num_tasks, problem.num_devices
    return Window(
        free_tasks=tuple(range(n)),
        placement=np.zeros(n, int),
        fixed_finish_s=np.full(n, np.nan),
        arrived_s={},
        device_ready_s=np.zeros(k),
        link_ready_s=np.zeros((k, k)),
        tail_s=np.zeros((n, k)),
        horizon_s=horizon_s,
        deadline_s=horizon_s,
    )


@dataclass(frozen=True)
class SolverSettings:
    solver: str = "highs"
    time_limit_s: float = 60.0
    mip_gap: float = 1e-4
    threads: int | None = None
    report: Callable[[str], None] | None = None  # receives status lines: incumbent, bound and gap in ms


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
    size: ModelSize | None = None


@dataclass
class MilpSolution:
    """What a solve returned, in seconds; ``placement``/``start_s`` cover the window's free tasks."""

    status: str
    solver: str
    objective_s: float | None
    bound_s: float | None
    optimal: bool = False
    placement: dict[int, int] = field(default_factory=dict)
    start_s: dict[int, float] = field(default_factory=dict)
    transfer_start_s: dict[tuple[int, int], float] = field(default_factory=dict)
    solve_s: float = 0.0
    log_tail: list[str] = field(default_factory=list)

    @property
    def has_solution(self) -> bool:
        return self.objective_s is not None


# --- windows, bounds, pairs -----------------------------------------------------------


def _allowed_devices(problem: Problem, tasks: Iterable[int]) -> dict[int, tuple[int, ...]]:
    fits = problem.memory_bytes[:, None] <= problem.memory_capacity_bytes[None, :]
    ok = np.isfinite(problem.compute_s) & fits
    return {i: tuple(int(k) for k in np.flatnonzero(ok[i])) for i in tasks}


def _time_windows(
    problem: Problem, window: Window, allowed: dict[int, tuple[int, ...]], free_graph: nx.DiGraph
) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Earliest start, latest finish and the shortest possible duration of every free task (seconds)."""
    fastest = {i: float(min(problem.compute_s[i, k] for k in allowed[i])) for i in window.free_tasks}
    position = {i: f for f, i in enumerate(window.free_tasks)}
    earliest: dict[int, float] = {}
    for i in nx.topological_sort(free_graph):
        ready = min(float(window.device_ready_s[k]) for k in allowed[i])
        for u in problem.predecessors[i]:
            if u in position:
                ready = max(ready, earliest[u] + fastest[u])
            elif not math.isnan(window.fixed_finish_s[u]):
                ready = max(ready, float(window.fixed_finish_s[u]))
        earliest[i] = ready
    tail: dict[int, float] = {}
    for i in reversed(list(nx.topological_sort(free_graph))):
        after = min(float(window.tail_s[position[i], k]) for k in allowed[i])
        for j in free_graph.successors(i):
            after = max(after, fastest[j] + tail[j])
        tail[i] = after
    latest_finish = {i: window.horizon_s - tail[i] for i in window.free_tasks}
    return earliest, latest_finish, fastest


def _device_heads_and_tails(
    problem: Problem, window: Window, allowed: dict[int, tuple[int, ...]], free_graph: nx.DiGraph
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """For every free task ``i`` and device ``k`` it may run on (seconds, keyed ``(i, k)``):

    ``head``: the earliest ``i`` can start on ``k``: each input comes from its producer's best device,
    plus the transfer when that is not ``k`` (links never wait: a lower bound).
    ``tail``: the least time the plan runs on after ``i`` finishes on ``k``, the same way forwards.
    """
    position = {i: f for f, i in enumerate(window.free_tasks)}
    order = list(nx.topological_sort(free_graph))
    head: dict[tuple[int, int], float] = {}
    for i in order:
        for k in allowed[i]:
            ready = float(window.device_ready_s[k])
            for t in problem.input_tensors[i]:
                u = int(problem.tensor_producer[t])
                if u in position:
                    arrival = min(
                        head[u, a] + problem.compute_s[u, a] + (0.0 if a == k else problem.transfer_s[t, a, k])
                        for a in allowed[u]
                    )
                elif (t, k) in window.arrived_s:
                    arrival = window.arrived_s[t, k]
                elif math.isnan(window.fixed_finish_s[u]):
                    continue
                else:
                    a = int(window.placement[u])
                    arrival = window.fixed_finish_s[u] + (0.0 if a == k else problem.transfer_s[t, a, k])
                ready = max(ready, float(arrival))
            head[i, k] = ready
    tail: dict[tuple[int, int], float] = {}
    for i in reversed(order):
        for k in allowed[i]:
            after = float(window.tail_s[position[i], k])
            for t in problem.output_tensors[i]:
                for j in problem.tensor_consumers[t]:
                    if j in position:
                        after = max(
                            after,
                            min(
                                (0.0 if b == k else problem.transfer_s[t, k, b]) + problem.compute_s[j, b] + tail[j, b]
                                for b in allowed[j]
                            ),
                        )
            tail[i, k] = after
    return head, tail


def _devices_in_time(
    problem: Problem,
    allowed: dict[int, tuple[int, ...]],
    head_s: dict[tuple[int, int], float],
    tail_s: dict[tuple[int, int], float],
    horizon_s: float,
) -> dict[int, tuple[int, ...]]:
    """``allowed`` without the devices on which a task cannot run between its head and tail inside the horizon."""
    return {
        i: tuple(k for k in devices if head_s[i, k] + problem.compute_s[i, k] + tail_s[i, k] <= horizon_s * (1 + 1e-9))
        for i, devices in allowed.items()
    }


def _descendant_sets(graph: nx.DiGraph) -> dict[int, set[int]]:
    return {i: nx.descendants(graph, i) for i in graph.nodes}


def identical_device_groups(problem: Problem) -> tuple[tuple[int, ...], ...]:
    """Groups (of two or more) of devices no plan can tell apart: same times, memory and links."""
    k = problem.num_devices
    groups: list[list[int]] = []
    for d in range(k):
        for group in groups:
            if _devices_identical(problem, group[0], d):
                group.append(d)
                break
        else:
            groups.append([d])
    return tuple(tuple(g) for g in groups if len(g) > 1)


def _devices_identical(problem: Problem, a: int, b: int) -> bool:
    if not np.array_equal(problem.compute_s[:, a], problem.compute_s[:, b]):
        return False
    if problem.memory_capacity_bytes[a] != problem.memory_capacity_bytes[b]:
        return False
    swap = np.arange(problem.num_devices)
    swap[a], swap[b] = b, a
    return np.array_equal(problem.transfer_s, problem.transfer_s[:, swap][:, :, swap])


# --- the model -----------------------------------------------------------------------


def build_model(problem: Problem, window: Window, formulation: str = "strong") -> MilpModel:
    """The Pyomo model of ``window`` (use :func:`whole_problem` for the full MILP)."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    started = time.perf_counter()
    strong = formulation == "strong"
    unit = window.horizon_s / _MODEL_TIME_SCALE if window.horizon_s > 0 else 1.0
    free = window.free_tasks
    free_set = set(free)
    allowed = _allowed_devices(problem, free)
    free_graph = problem.graph.subgraph(free)
    earliest_s, latest_finish_s, fastest_s = _time_windows(problem, window, allowed, free_graph)
    if strong:
        for _ in range(_NARROWING_ROUNDS):  # fewer devices give later heads and longer tails, which drop more
            head_s, tail_s = _device_heads_and_tails(problem, window, allowed, free_graph)
            narrowed = _devices_in_time(problem, allowed, head_s, tail_s, window.horizon_s)
            if narrowed == allowed:
                break
            allowed = narrowed
        # The windows narrowed by the devices left: heads and tails count transfers.
        for i in free:
            earliest_s[i] = max(earliest_s[i], min(head_s[i, k] for k in allowed[i]))
            latest_finish_s[i] = min(latest_finish_s[i], window.horizon_s - min(tail_s[i, k] for k in allowed[i]))
            fastest_s[i] = float(min(problem.compute_s[i, k] for k in allowed[i]))
    descendants = _descendant_sets(free_graph)
    whole = len(free) == problem.num_tasks

    def scaled(seconds: float) -> float:
        return seconds / unit

    m = pyo.ConcreteModel(name=f"moirai_{formulation}")
    x_index = [(i, k) for i in free for k in allowed[i]]
    m.x = pyo.Var(x_index, domain=pyo.Binary)
    if strong:
        bounds = {i: (scaled(earliest_s[i]), scaled(latest_finish_s[i] - fastest_s[i])) for i in free}
        m.S = pyo.Var(free, domain=pyo.NonNegativeReals, bounds=lambda _, i: bounds[i])
        m.T = pyo.Var(bounds=(0.0, _MODEL_TIME_SCALE))
    else:
        m.S = pyo.Var(free, domain=pyo.NonNegativeReals)
        m.T = pyo.Var(domain=pyo.NonNegativeReals)
    m.constraints = pyo.ConstraintList()
    add = m.constraints.add

    duration = {i: sum(scaled(problem.compute_s[i, k]) * m.x[i, k] for k in allowed[i]) for i in free}
    finish = {i: m.S[i] + duration[i] for i in free}

    # (4c) one device each; (5) memory, net of what fixed tasks already hold.
    for i in free:
        add(sum(m.x[i, k] for k in allowed[i]) == 1)
    fixed_mask = np.ones(problem.num_tasks, bool)
    fixed_mask[list(free)] = False
    for k in range(problem.num_devices):
        capacity = problem.memory_capacity_bytes[k]
        if not np.isfinite(capacity):
            continue
        held = float(problem.memory_bytes[fixed_mask & (window.placement == k)].sum())
        users = [i for i in free if k in allowed[i] and problem.memory_bytes[i] > 0]
        if users and sum(problem.memory_bytes[i] for i in users) > capacity - held:
            share = {i: float(problem.memory_bytes[i] / capacity) for i in users}
            add(sum(share[i] * m.x[i, k] for i in users) <= (capacity - held) / capacity)

    # (4a) precedence of tasks, and device readiness after fixed tasks.
    for i in free:
        for u in problem.predecessors[i]:
            if u in free_set:
                add(m.S[i] >= finish[u])
            elif not math.isnan(window.fixed_finish_s[u]):
                add(m.S[i] >= scaled(window.fixed_finish_s[u]))
        ready = {k: scaled(window.device_ready_s[k]) for k in allowed[i] if window.device_ready_s[k] > 0}
        if ready:
            add(m.S[i] >= sum(r * m.x[i, k] for k, r in ready.items()))

    # Objective rows: T covers every free task plus what runs after it on its device.
    for f, i in enumerate(free):
        add(m.T >= finish[i] + sum(scaled(window.tail_s[f, k]) * m.x[i, k] for k in allowed[i]))

    # (7) transfers: one per tensor and destination device, duration from the link chosen.
    transfers = _transfer_candidates(problem, window, allowed, free_set)
    m.y = pyo.Var(list(transfers), domain=pyo.Binary)
    m.R = pyo.Var(list(transfers), domain=pyo.NonNegativeReals)
    w_index = [(t, a, b) for (t, b), sources in transfers.items() for a in sources]
    m.w = pyo.Var(w_index, bounds=(0.0, 1.0))
    transfer_duration = {}
    transfer_earliest_s: dict[tuple[int, int], float] = {}
    transfer_latest_s: dict[tuple[int, int], float] = {}
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
            earliest = earliest_s[u] + fastest_s[u]
        else:
            for j in free_consumers:
                add(y >= m.x[j, b])
            (a,) = sources
            add(m.w[t, a, b] == y)
            produced = scaled(window.fixed_finish_s[u])
            earliest = float(window.fixed_finish_s[u])
        if not fixed_here:
            add(y <= sum(m.x[j, b] for j in free_consumers))
        transfer_duration[t, b] = sum(scaled(problem.transfer_s[t, a, b]) * m.w[t, a, b] for a in sources)
        add(m.R[t, b] >= produced)
        link_ready = {a: scaled(window.link_ready_s[a, b]) for a in sources if window.link_ready_s[a, b] > 0}
        if link_ready:
            add(m.R[t, b] >= sum(r * m.w[t, a, b] for a, r in link_ready.items()))
        transfer_earliest_s[t, b] = earliest
        latest = window.deadline_s if fixed_here else max(latest_finish_s[j] - fastest_s[j] for j in free_consumers)
        transfer_latest_s[t, b] = latest
        if strong:
            m.R[t, b].setlb(scaled(earliest))
            add(m.R[t, b] + transfer_duration[t, b] <= scaled(latest))
        for j in free_consumers:
            big_m = scaled(latest - earliest_s[j]) if strong else _PAPER_BIG_M
            add(m.S[j] >= m.R[t, b] + transfer_duration[t, b] - big_m * (1 - m.x[j, b]))
    for (t, b), arrival in window.arrived_s.items():
        for j in problem.tensor_consumers[t]:
            if j in free_set and b in allowed[j]:
                add(m.S[j] >= scaled(arrival) * m.x[j, b])

    # (6) no two tasks overlap on one device.
    device_pairs = _device_pair_kinds(free, allowed, descendants, earliest_s, latest_finish_s, fastest_s, strong)
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
            i_first_m = scaled(latest_finish_s[i] - earliest_s[j])
            j_first_m = scaled(latest_finish_s[j] - earliest_s[i])
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

    # (8) no two transfers overlap on one directed link.
    transfer_pairs = _transfer_pair_kinds(
        problem, transfers, descendants, free_set, transfer_earliest_s, transfer_latest_s, strong
    )
    link_delta_pairs = [pair for pair, kind in transfer_pairs.items() if kind == "delta"]
    m.link_delta = pyo.Var(link_delta_pairs, domain=pyo.Binary)
    if strong:
        m.same_link = pyo.Var(list(transfer_pairs), bounds=(0.0, 1.0))
    for (q, r), kind in transfer_pairs.items():
        shared = [a for a in transfers[q] if a in transfers[r]]
        q_end = m.R[q] + transfer_duration[q]
        r_end = m.R[r] + transfer_duration[r]
        if strong:
            same = m.same_link[q, r]
            for a in shared:
                add(same >= m.w[q[0], a, q[1]] + m.w[r[0], a, r[1]] - 1)
            q_first_m = scaled(transfer_latest_s[q] - transfer_earliest_s[r])
            r_first_m = scaled(transfer_latest_s[r] - transfer_earliest_s[q])
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

    symmetric_groups = identical_device_groups(problem) if strong and whole else ()
    if strong:
        head = {ik: scaled(seconds) for ik, seconds in head_s.items()}
        tail = {ik: scaled(seconds) for ik, seconds in tail_s.items()}
        # Every task starts after its head and runs on for its tail, both for the device it is on.
        for f, i in enumerate(free):
            if any(head[i, k] > m.S[i].lb for k in allowed[i]):
                add(m.S[i] >= sum(head[i, k] * m.x[i, k] for k in allowed[i]))
            if any(tail[i, k] > scaled(window.tail_s[f, k]) for k in allowed[i]):  # else the objective row says it
                add(m.T >= finish[i] + sum(tail[i, k] * m.x[i, k] for k in allowed[i]))
        _add_device_load_cuts(m, problem, allowed, head, tail, unit)
        shortest_tail = {i: min(tail[i, k] for k in allowed[i]) for i in free}
        earliest = {i: scaled(earliest_s[i]) for i in free}
        _add_chain_load_cuts(m, problem, allowed, descendants, earliest, shortest_tail, unit)
        # Identical devices: the k-th of a group is used only after the (k-1)-th (by first task).
        topo_position = {i: p for p, i in enumerate(problem.topological_order)}
        order = sorted(free, key=topo_position.__getitem__)
        for group in symmetric_groups:
            for previous, device in zip(group, group[1:], strict=False):
                for p, i in enumerate(order):
                    if device in allowed[i]:
                        earlier = [m.x[h, previous] for h in order[:p] if previous in allowed[h]]
                        add(m.x[i, device] <= sum(earlier))

    m.objective = pyo.Objective(expr=m.T, sense=pyo.minimize)
    built = MilpModel(
        problem=problem,
        window=window,
        formulation=formulation,
        model=m,
        unit_s=unit,
        transfer_sources=transfers,
        device_pairs=device_pairs,
        transfer_pairs=transfer_pairs,
        symmetric_groups=symmetric_groups,
    )
    built.size = ModelSize(
        binaries=len(x_index) + len(transfers) + len(delta_pairs) + len(link_delta_pairs),
        continuous=len(free) + 1 + len(transfers) + len(w_index) + (len(device_pairs) + len(transfer_pairs)) * strong,
        constraints=len(m.constraints),
        build_s=time.perf_counter() - started,
    )
    return built


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
                sources = tuple(a for a in allowed[u] if a != b and np.isfinite(problem.transfer_s[t, a, b]))
            else:
                a = int(window.placement[u])
                sources = (a,) if a != b else ()
            if wanted and sources:
                candidates[t, b] = sources
    return candidates


def _device_pair_kinds(
    free: tuple[int, ...],
    allowed: dict[int, tuple[int, ...]],
    descendants: dict[int, set[int]],
    earliest_s: dict[int, float],
    latest_finish_s: dict[int, float],
    fastest_s: dict[int, float],
    strong: bool,
) -> dict[tuple[int, int], str]:
    """Which incomparable pairs need a non-overlap constraint, and which kind."""
    kinds: dict[tuple[int, int], str] = {}
    for a, i in enumerate(free):
        for j in free[a + 1 :]:
            if j in descendants[i] or i in descendants[j] or not set(allowed[i]) & set(allowed[j]):
                continue
            if not strong:
                kinds[i, j] = "delta"
                continue
            if latest_finish_s[i] <= earliest_s[j] or latest_finish_s[j] <= earliest_s[i]:
                continue  # the windows alone keep them apart
            i_first = earliest_s[i] + fastest_s[i] <= latest_finish_s[j] - fastest_s[j] + 1e-12
            j_first = earliest_s[j] + fastest_s[j] <= latest_finish_s[i] - fastest_s[i] + 1e-12
            kinds[i, j] = {(True, True): "delta", (True, False): "i_first", (False, True): "j_first"}.get(
                (i_first, j_first), "apart"
            )
    return kinds


def _transfer_pair_kinds(
    problem: Problem,
    transfers: dict[tuple[int, int], tuple[int, ...]],
    descendants: dict[int, set[int]],
    free_set: set[int],
    earliest_s: dict[tuple[int, int], float],
    latest_s: dict[tuple[int, int], float],
    strong: bool,
) -> dict[tuple[tuple[int, int], tuple[int, int]], str]:
    """Pairs of transfers that may share a directed link: "delta", or "q_first" when a path orders them."""
    by_destination: dict[int, list[tuple[int, int]]] = {}
    for q in transfers:
        by_destination.setdefault(q[1], []).append(q)
    kinds: dict[tuple[tuple[int, int], tuple[int, int]], str] = {}
    for queue in by_destination.values():
        for a, q in enumerate(queue):
            for r in queue[a + 1 :]:
                if not set(transfers[q]) & set(transfers[r]):
                    continue
                if not strong:
                    kinds[q, r] = "delta"
                    continue
                if latest_s[q] <= earliest_s[r] or latest_s[r] <= earliest_s[q]:
                    continue
                if _transfer_precedes(problem, q, r, descendants, free_set):
                    kinds[q, r] = "q_first"
                elif _transfer_precedes(problem, r, q, descendants, free_set):
                    kinds[r, q] = "q_first"
                else:
                    kinds[q, r] = "delta"
    return kinds


def _transfer_precedes(
    problem: Problem, q: tuple[int, int], r: tuple[int, int], descendants: dict[int, set[int]], free_set: set[int]
) -> bool:
    """Transfer q must end before r starts: every consumer of q's tensor leads to (or is) r's producer."""
    producer = int(problem.tensor_producer[r[0]])
    consumers = problem.tensor_consumers[q[0]]
    return producer in free_set and all(
        c in free_set and (c == producer or producer in descendants[c]) for c in consumers
    )


# --- warm start and solution ----------------------------------------------------------


def relabel_identical_devices(problem: Problem, placement: np.ndarray) -> np.ndarray:
    """A device permutation (old -> new) that makes ``placement`` obey the symmetry-breaking rows."""
    mapping = np.arange(problem.num_devices)
    first_use = {}
    for i in problem.topological_order:
        first_use.setdefault(int(placement[i]), len(first_use))
    for group in identical_device_groups(problem):
        by_first_use = sorted(group, key=lambda d: first_use.get(d, math.inf))
        for new, old in zip(group, by_first_use, strict=True):
            mapping[old] = new
    return mapping


def warm_start_values(built: MilpModel, timeline: Timeline) -> ComponentMap:
    """Values of every model variable for the schedule in ``timeline`` (restricted to the window)."""
    problem, window, m = built.problem, built.window, built.model
    unit = built.unit_s
    placement = timeline.placement
    start = timeline.task_start / unit
    finish = timeline.task_finish / unit
    sent = {(tr.tensor, tr.dst): tr for tr in timeline.transfers}
    values = ComponentMap()
    free = window.free_tasks
    for i, k in m.x:
        values[m.x[i, k]] = float(placement[i] == k)
    for i in free:
        values[m.S[i]] = float(start[i])
    for (t, b), sources in built.transfer_sources.items():
        u = int(problem.tensor_producer[t])
        transfer = sent.get((t, b))
        values[m.y[t, b]] = float(transfer is not None)
        values[m.R[t, b]] = transfer.start / unit if transfer is not None else float(timeline.task_finish[u] / unit)
        for a in sources:
            values[m.w[t, a, b]] = float(transfer is not None and transfer.src == a)

    def precedes(i: int, j: int) -> bool:
        return (start[i], finish[i], i) < (start[j], finish[j], j)

    for i, j in built.device_pairs:
        if built.formulation == "strong":
            values[m.same[i, j]] = float(placement[i] == placement[j])
        if (i, j) in m.delta:
            values[m.delta[i, j]] = float(precedes(i, j))
    for q, r in built.transfer_pairs:
        tq, tr_ = sent.get(q), sent.get(r)
        both = tq is not None and tr_ is not None and tq.src == tr_.src
        if built.formulation == "strong":
            values[m.same_link[q, r]] = float(both)
        if (*q, *r) in m.link_delta:  # Pyomo flattens the index on lookup, not on membership tests
            q_start = values[m.R[q]]
            r_start = values[m.R[r]]
            values[m.link_delta[q, r]] = float((q_start, q[0]) < (r_start, r[0]))
    tails = [finish[i] + window.tail_s[f, placement[i]] / unit for f, i in enumerate(free)]
    values[m.T] = float(max(tails, default=0.0))
    return values


def progress_text(stage: str, incumbent_s: float | None, bound_s: float | None) -> str:
    """``stage: incumbent 1.2345 ms, bound 1.1000 ms, gap 10.9%``: a status line in the problem's own time."""
    has_incumbent = incumbent_s is not None and math.isfinite(incumbent_s)
    has_bound = bound_s is not None and math.isfinite(bound_s)
    incumbent = f"{incumbent_s * 1e3:.4f} ms" if has_incumbent else "none yet"
    bound = f"{bound_s * 1e3:.4f} ms" if has_bound else "none yet"
    gap = "?"
    if has_incumbent and has_bound and incumbent_s > 0:
        gap = f"{max(0.0, incumbent_s - bound_s) / incumbent_s:.2%}"
    return f"{stage}: incumbent {incumbent}, bound {bound}, gap {gap}"


class _LogStream(io.TextIOBase):
    """Keeps the last lines of the solver's log; passes Gurobi's progress lines on to ``progress``.

    A Gurobi progress line ends its columns with ``... Incumbent BestBd Gap% ...``.
    """

    def __init__(self, progress: Callable[[float, float], None] | None) -> None:
        self.lines: list[str] = []
        self._partial = ""
        self._progress = progress

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._partial += text
        *complete, self._partial = self._partial.split("\n")
        for line in complete:
            if line.strip():
                self.lines.append(line.rstrip())
                del self.lines[:-_LOG_LINES_KEPT]
                if self._progress is not None:
                    self._pass_on_progress(line.split())
        return len(text)

    def _pass_on_progress(self, words: list[str]) -> None:
        gap_at = next((n for n, word in enumerate(words) if word.endswith("%")), None)
        if gap_at is None or gap_at < 2:
            return
        try:
            incumbent, bound = float(words[gap_at - 2]), float(words[gap_at - 1])
        except ValueError:
            return  # a "-" where no incumbent exists yet, or a line that is not a progress line
        self._progress(incumbent, bound)


def _progress_in_seconds(report: Callable[[str], None] | None, unit_s: float) -> Callable[[float, float], None] | None:
    """Turns the solver's (incumbent, bound) in model units into a status line for ``report``."""
    if report is None:
        return None
    return lambda incumbent, bound: report(progress_text("MILP", incumbent * unit_s, bound * unit_s))


def solve_model(built: MilpModel, settings: SolverSettings, warm_start: Timeline | None = None) -> MilpSolution:
    """Solve a built model within ``settings.time_limit_s``; never raises for solver trouble."""
    if settings.solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {settings.solver!r}")
    values = warm_start_values(built, warm_start) if warm_start is not None else None
    if settings.solver == "gurobi":
        solution = _solve_with(built, settings, values, "gurobi")
        if solution.status.startswith("unavailable"):
            warnings.warn(f"Gurobi cannot solve this model ({solution.status}); using HiGHS", stacklevel=2)
        else:
            return solution
    return _solve_with(built, settings, values, "highs")


def _solve_with(
    built: MilpModel, settings: SolverSettings, values: ComponentMap | None, solver_name: str
) -> MilpSolution:
    progress = _progress_in_seconds(settings.report, built.unit_s)
    # HiGHS reports its bounds through a callback; Gurobi's only come in its log.
    log = _LogStream(progress if solver_name == "gurobi" else None)
    started = time.perf_counter()
    run = _run_highs if solver_name == "highs" else _run_gurobi
    try:
        outcome = run(built, settings, values, log, progress)
    except Exception as error:  # noqa: BLE001 - a failing solver must fall back, never crash the placer
        kind = "unavailable" if _is_licence_or_missing(error) else "error"
        message = f"{kind}: {type(error).__name__}: {error}".splitlines()[0]
        return MilpSolution(message, solver_name, None, None, log_tail=log.lines)
    unit = built.unit_s
    bound_s = outcome.bound * unit if outcome.bound is not None and math.isfinite(outcome.bound) else None
    solution = MilpSolution(
        outcome.status,
        solver_name,
        None,
        bound_s,
        optimal=outcome.optimal,
        solve_s=time.perf_counter() - started,
        log_tail=log.lines,
    )
    if outcome.value is None:
        return solution
    value = outcome.value
    m = built.model
    solution.objective_s = value(m.T) * unit
    for i in built.window.free_tasks:
        solution.placement[i] = max((k for (j, k) in m.x if j == i), key=lambda k: value(m.x[i, k]))
        solution.start_s[i] = value(m.S[i]) * unit
    for q in built.transfer_sources:
        if value(m.y[q]) > 0.5:
            solution.transfer_start_s[q] = value(m.R[q]) * unit
    return solution


def _run_highs(
    built: MilpModel,
    settings: SolverSettings,
    values: ComponentMap | None,
    log: _LogStream,
    progress: Callable[[float, float], None] | None,
) -> SolverOutcome:
    return run_highs(built.model, values, settings.time_limit_s, settings.mip_gap, settings.threads, log, progress)


def _run_gurobi(
    built: MilpModel,
    settings: SolverSettings,
    values: ComponentMap | None,
    log: _LogStream,
    progress: Callable[[float, float], None] | None,  # fed from the log instead
) -> SolverOutcome:
    from pyomo.contrib.solver.solvers.gurobi.gurobi_direct import GurobiDirect

    solver = GurobiDirect()
    if not solver.available():
        raise RuntimeError(f"gurobipy is not usable here ({solver.available()})")
    options: dict[str, Any] = {
        "tee": [log],
        "time_limit": max(settings.time_limit_s, 0.01),
        "rel_gap": settings.mip_gap,
        "load_solutions": False,
        "raise_exception_on_nonoptimal_result": False,
    }
    if settings.threads is not None:
        options["threads"] = settings.threads
    if values is not None:
        for var, value in values.items():
            var.set_value(value, skip_validation=True)
        options["warmstart_discrete_vars"] = True
    results = solver.solve(built.model, **options)
    status = results.termination_condition.name
    optimal = results.termination_condition == TerminationCondition.convergenceCriteriaSatisfied
    bound = results.objective_bound
    if results.solution_status not in (SolutionStatus.feasible, SolutionStatus.optimal):
        return SolverOutcome(status, optimal, bound, None)
    results.solution_loader.load_vars()
    return SolverOutcome(status, optimal, bound, lambda var: float(var.value))


def _is_licence_or_missing(error: Exception) -> bool:
    text = str(error).lower()
    return any(word in text for word in ("licen", "size-limited", "too large", "not usable", "no module"))


def plan_from_times(
    problem: Problem,
    placement: np.ndarray,
    start_s: np.ndarray,
    transfer_start_s: dict[tuple[int, int], float] | None,
    placer: str,
) -> Plan:
    """A plan whose orders follow the given times, repaired to one topological order (solver noise)."""
    unit = _ORDER_TOLERANCE * max(float(np.max(start_s, initial=0.0)), 1e-30) / _MODEL_TIME_SCALE
    key = np.round(start_s / unit) if unit > 0 else start_s
    duration = problem.compute_s[np.arange(problem.num_tasks), placement]
    topo_position = np.empty(problem.num_tasks, int)
    topo_position[list(problem.topological_order)] = np.arange(problem.num_tasks)
    # Zero-length tasks go before longer ones starting at the same moment.
    sorted_tasks = nx.lexicographical_topological_sort(
        problem.graph, key=lambda i: (key[i], duration[i] > 0, topo_position[i])
    )
    order: list[list[int]] = [[] for _ in range(problem.num_devices)]
    for i in sorted_tasks:
        order[int(placement[i])].append(int(i))
    transfer_order = None
    if transfer_start_s is not None:
        links: dict[tuple[int, int], list[tuple[float, float, int]]] = {}
        for (t, b), begin in transfer_start_s.items():
            a = int(placement[problem.tensor_producer[t]])
            length = problem.transfer_s[t, a, b]
            links.setdefault((a, b), []).append((round(begin / unit), length > 0, t))
        transfer_order = {link: tuple(t for *_, t in sorted(entries)) for link, entries in links.items()}
    return Plan(
        placement=placement,
        device_names=problem.device_names,
        order=tuple(tuple(o) for o in order),
        transfer_order=transfer_order,
        placer=placer,
    )
