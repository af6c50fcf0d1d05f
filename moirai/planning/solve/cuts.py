"""The strong formulation's cuts (:class:`moirai.planning.solve.formulation.StrongFormulation`): the latency
objective's valid inequalities on ``T`` and the starts from heads, tails and the work queued on each device, and the
rows that break the symmetry between identical devices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyomo.environ as pyo

from moirai.planning.problem import Problem

if TYPE_CHECKING:
    from moirai.planning.solve.parts import ModelParts


def latency_cuts(c: ModelParts) -> None:
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
    add_device_load_cuts(m, c.problem, allowed, head, tail, c.unit_s)
    shortest_tail = {i: min(tail[i, k] for k in allowed[i]) for i in c.free}
    earliest = {i: c.scaled(c.earliest_s[i]) for i in c.free}
    add_chain_load_cuts(m, c.problem, allowed, c.descendants, earliest, shortest_tail, c.unit_s)


def symmetry_rows(c: ModelParts, groups: tuple[tuple[int, ...], ...]) -> None:
    """Identical devices: the k-th of a group is used only after the (k-1)-th (by first task)."""
    m, allowed = c.m, c.allowed
    order = sorted(c.free, key=c.problem.topological_position.__getitem__)
    for group in groups:
        for previous, device in zip(group, group[1:], strict=False):
            for p, i in enumerate(order):
                if device in allowed[i]:
                    earlier = [m.x[h, previous] for h in order[:p] if previous in allowed[h]]
                    c.add(m.x[i, device] <= sum(earlier))


def add_device_load_cuts(
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


def add_chain_load_cuts(
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
