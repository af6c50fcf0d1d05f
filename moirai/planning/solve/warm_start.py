"""From schedules to model values and back: the warm start of a MILP and the plan its solution gives."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
from pyomo.common.collections import ComponentMap

from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.schedule.transfers import implied_transfers, recv_cpu_s, transfer_duration_s
from moirai.planning.simulate import Timeline
from moirai.planning.solve.model import MODEL_TIME_SCALE, MilpModel
from moirai.planning.solve.window import identical_device_groups

_ORDER_TOLERANCE = 1e-5  # model time units; below solver noise times are "equal" when ordering


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
    receivers = implied_transfers(problem, placement)
    received_by = {
        (t, b): (i, float(recv_cpu_s(problem, t, a, b)))
        for t, a, b, i in zip(receivers.tensor, receivers.src, receivers.dst, receivers.receiver, strict=True)
    }
    for t, i, b in m.r:
        receiver, seconds = received_by.get((t, b), (None, 0.0))
        values[m.r[t, i, b]] = seconds / unit if receiver == i else 0.0

    def precedes(i: int, j: int) -> bool:
        return (start[i], finish[i], i) < (start[j], finish[j], j)

    same, same_link = m.component("same"), m.component("same_link")  # the formulation's aggregated pair variables
    for i, j in built.device_pairs:
        if same is not None:
            values[same[i, j]] = float(placement[i] == placement[j])
        if (i, j) in m.delta:
            values[m.delta[i, j]] = float(precedes(i, j))
    for q, r in built.transfer_pairs:
        tq, tr_ = sent.get(q), sent.get(r)
        both = tq is not None and tr_ is not None and tq.src == tr_.src
        if same_link is not None:
            values[same_link[q, r]] = float(both)
        if (*q, *r) in m.link_delta:  # Pyomo flattens the index on lookup, not on membership tests
            q_start = values[m.R[q]]
            r_start = values[m.R[r]]
            values[m.link_delta[q, r]] = float((q_start, q[0]) < (r_start, r[0]))
    tails = [finish[i] + window.tail_s[f, placement[i]] / unit for f, i in enumerate(free)]
    values[m.T] = float(max(tails, default=0.0))
    if built.rows is not None:
        built.rows.warm_start(values, built, timeline)
    return values


def transfer_starts(
    problem: Problem, placement: np.ndarray, start_s: np.ndarray, known_s: dict[tuple[int, int], float]
) -> dict[tuple[int, int], float]:
    """Every ``(tensor, destination device)`` transfer ``placement`` needs, with its start time: ``known_s``'s where
    it has one, else its producer's start (a transfer the placement newly needs)."""
    needed: dict[tuple[int, int], float] = {}
    for t, consumers in enumerate(problem.tensor_consumers):
        u = int(problem.tensor_producer[t])
        for c in consumers:
            b = int(placement[c])
            if b != placement[u] and (t, b) not in needed:
                needed[t, b] = known_s.get((t, b), float(start_s[u]))
    return needed


def plan_from_times(
    problem: Problem,
    placement: np.ndarray,
    start_s: np.ndarray,
    transfer_start_s: dict[tuple[int, int], float] | None,
    placer: str,
) -> Plan:
    """A plan whose orders follow the given times, repaired to one topological order (solver noise)."""
    unit = _ORDER_TOLERANCE * max(float(np.max(start_s, initial=0.0)), 1e-30) / MODEL_TIME_SCALE
    key = np.round(start_s / unit) if unit > 0 else start_s
    duration = problem.compute_s[np.arange(problem.num_tasks), placement]
    # Zero-length tasks go before longer ones starting at the same moment.
    sorted_tasks = nx.lexicographical_topological_sort(
        problem.graph, key=lambda i: (key[i], duration[i] > 0, problem.topological_position[i])
    )
    order: list[list[int]] = [[] for _ in range(problem.num_devices)]
    for i in sorted_tasks:
        order[int(placement[i])].append(int(i))
    transfer_order = None
    if transfer_start_s is not None:
        links: dict[tuple[int, int], list[tuple[float, float, int]]] = {}
        for (t, b), begin in transfer_start_s.items():
            a = int(placement[problem.tensor_producer[t]])
            length = transfer_duration_s(problem, t, a, b)
            links.setdefault((a, b), []).append((round(begin / unit), length > 0, t))
        transfer_order = {link: tuple(t for *_, t in sorted(entries)) for link, entries in links.items()}
    return Plan(
        placement=placement,
        device_names=problem.device_names,
        order=tuple(tuple(o) for o in order),
        transfer_order=transfer_order,
        placer=placer,
    )
