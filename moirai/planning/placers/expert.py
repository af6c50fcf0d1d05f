"""``expert``: the hand split people write: contiguous chunks of the topological order, one per device.

Devices take the chunks in the order the cluster lists them (stage 0 on the first device, as
in a pipeline). The cut points minimise the slowest stage's compute time subject to every
stage fitting its device's memory: for a time budget ``T`` a greedy pass that makes every
stage as long as ``T`` and memory allow decides feasibility (optimal for contiguous splits),
and bisection on ``T`` finds the smallest feasible budget. Communication is ignored, as a
hand split does.
"""

from __future__ import annotations

import numpy as np

from moirai.errors import InfeasibleError
from moirai.planning.bounds import format_bytes
from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import PlacerReport

_BISECTION_STEPS = 100


@register("expert", minimises=False, respects_memory=True, start_plan=2)
def place_expert(problem: Problem) -> Plan:
    order = np.array(problem.topological_order, int)
    compute = problem.compute_s[order]
    # A task a device cannot run costs more than any budget the bisection tries, so no stage takes it.
    finite_total = float(np.where(np.isfinite(compute), compute, 0.0).sum())
    unaffordable = 2.0 * (finite_total + 1.0) * max(problem.num_tasks, 1)
    time_prefix = np.vstack([np.zeros(problem.num_devices), np.cumsum(np.minimum(compute, unaffordable), axis=0)]).T
    memory_prefix = np.r_[0.0, np.cumsum(problem.memory_bytes[order])]

    def stage_ends(budget_s: float) -> list[int] | None:
        """Where every stage ends when each takes as much as ``budget_s`` and its memory allow, or None."""
        ends, start = [], 0
        for d in range(problem.num_devices):
            by_time = np.searchsorted(time_prefix[d], time_prefix[d][start] + budget_s, side="right") - 1
            by_memory = np.searchsorted(memory_prefix, memory_prefix[start] + problem.memory_capacity_bytes[d], "right")
            start = int(max(start, min(by_time, by_memory - 1)))
            ends.append(start)
        return ends if start == problem.num_tasks else None

    high = float(time_prefix[:, -1].max())
    ends = stage_ends(high)
    if ends is None:
        raise InfeasibleError(
            f"no split into contiguous chunks (one per device, in cluster order) fits memory: the model needs "
            f"{format_bytes(float(problem.memory_bytes.sum()))} and the devices have "
            f"{', '.join(format_bytes(c) for c in problem.memory_capacity_bytes)}; try 'heft' or 'milp'"
        )
    low = 0.0
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        candidate = stage_ends(middle)
        if candidate is None:
            low = middle
        else:
            high, ends = middle, candidate
    starts = [0, *ends[:-1]]
    slowest_stage_s = max(
        time_prefix[d][b] - time_prefix[d][a] for d, (a, b) in enumerate(zip(starts, ends, strict=True))
    )
    if slowest_stage_s >= unaffordable:
        raise InfeasibleError("no contiguous split runs every task on a device that can run it; try 'heft'")
    chunks = tuple(tuple(order[a:b].tolist()) for a, b in zip(starts, ends, strict=True))
    placement = np.zeros(problem.num_tasks, int)
    for device, chunk in enumerate(chunks):
        placement[list(chunk)] = device
    info = {"slowest_stage_s": float(slowest_stage_s)}
    return Plan(placement, problem.device_names, order=chunks, placer="expert", report=PlacerReport(notes=info))
