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

The model is built by equation group (assignment and memory, precedence, objective rows, transfers,
device order, link order, cuts); :mod:`moirai.solve.window` supplies the bounds that tighten it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pyomo.environ as pyo

from moirai.errors import MoiraiError
from moirai.objective import LATENCY, Objective
from moirai.problem import Problem
from moirai.solve.window import (
    Window,
    allowed_devices,
    descendant_sets,
    device_heads_and_tails,
    devices_in_time,
    identical_device_groups,
    time_windows,
)

FORMULATIONS = ("strong", "paper")
# Objectives the model has rows for (moirai.objective): "latency" is the makespan T >= every finish plus tail.
# Another objective adds its variable and rows where build_model writes "objective rows", and its cuts.
MILP_OBJECTIVES = ("latency",)
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
    size: ModelSize | None = None


def build_model(
    problem: Problem, window: Window, formulation: str = "strong", objective: Objective = LATENCY
) -> MilpModel:
    """The Pyomo model of ``window`` (use :func:`whole_problem` for the full MILP) minimising ``objective``."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    if objective.name not in MILP_OBJECTIVES:
        raise MoiraiError(f"the MILP has no rows for objective {objective.name!r}; it models {MILP_OBJECTIVES}")
    started = time.perf_counter()
    strong = formulation == "strong"
    unit = window.horizon_s / MODEL_TIME_SCALE if window.horizon_s > 0 else 1.0
    free = window.free_tasks
    free_set = set(free)
    allowed = allowed_devices(problem, free)
    free_graph = problem.graph.subgraph(free)
    earliest_s, latest_finish_s, fastest_s = time_windows(problem, window, allowed, free_graph)
    if strong:
        for _ in range(_NARROWING_ROUNDS):  # fewer devices give later heads and longer tails, which drop more
            head_s, tail_s = device_heads_and_tails(problem, window, allowed, free_graph)
            narrowed = devices_in_time(problem, allowed, head_s, tail_s, window.horizon_s)
            if narrowed == allowed:
                break
            allowed = narrowed
        # The windows narrowed by the devices left: heads and tails count transfers.
        for i in free:
            earliest_s[i] = max(earliest_s[i], min(head_s[i, k] for k in allowed[i]))
            latest_finish_s[i] = min(latest_finish_s[i], window.horizon_s - min(tail_s[i, k] for k in allowed[i]))
            fastest_s[i] = float(min(problem.compute_s[i, k] for k in allowed[i]))
    descendants = descendant_sets(free_graph)
    whole = len(free) == problem.num_tasks

    def scaled(seconds: float) -> float:
        return seconds / unit

    m = pyo.ConcreteModel(name=f"moirai_{formulation}")
    x_index = [(i, k) for i in free for k in allowed[i]]
    m.x = pyo.Var(x_index, domain=pyo.Binary)
    if strong:
        bounds = {i: (scaled(earliest_s[i]), scaled(latest_finish_s[i] - fastest_s[i])) for i in free}
        m.S = pyo.Var(free, domain=pyo.NonNegativeReals, bounds=lambda _, i: bounds[i])
        m.T = pyo.Var(bounds=(0.0, MODEL_TIME_SCALE))
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
        order = sorted(free, key=problem.topological_position.__getitem__)
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
