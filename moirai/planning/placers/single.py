"""``single``: the whole model on the one device that runs it fastest, as the simulator judges it, the driver's
messages included (the no-parallelism reference)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moirai.errors import InfeasibleError
from moirai.planning.bounds import format_bytes
from moirai.planning.objective import LATENCY, Objective
from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem

if TYPE_CHECKING:
    from moirai.planning.simulate import Timeline


@register("single", minimises=False, respects_memory=True, start_plan=1)
def place_single(problem: Problem) -> Plan:
    """Every task on the device, among those that hold the whole model, with the least simulated latency."""
    return best_single_device(problem, LATENCY)[0]


def best_single_device(problem: Problem, objective: Objective) -> tuple[Plan, Timeline]:
    """The single-device plan best by ``objective`` as simulated (the output's way back to device 0 and the
    runtime's work per request included) and its timeline; ties go to the least compute, then the lower index."""
    from moirai.planning.simulate import simulate

    needed = float(problem.memory_bytes.sum())
    total_s = problem.compute_s.sum(axis=0)
    candidates = np.flatnonzero((problem.memory_capacity_bytes >= needed) & np.isfinite(total_s))
    if candidates.size == 0:
        largest = float(problem.memory_capacity_bytes.max())
        if largest < needed:
            reason = f"it needs {format_bytes(needed)}, the largest device has {format_bytes(largest)}"
        else:
            reason = "every device with enough memory has a task it cannot run (infinite compute time)"
        raise InfeasibleError(
            f"no single device can run the whole model: {reason}; use a placer that splits the model, e.g. 'heft'"
        )
    judged = []
    for d in candidates.tolist():
        plan = one_device_plan(problem, d)
        judged.append((plan, simulate(problem, plan), float(total_s[d])))
    best = min(judged, key=lambda j: (objective.rank(j[1]), j[2]))
    return best[0], best[1]


def one_device_plan(problem: Problem, device: int) -> Plan:
    """Every task on ``device``, in the graph's own (topological) order."""
    order = tuple(problem.topological_order if d == device else () for d in range(problem.num_devices))
    return Plan(np.full(problem.num_tasks, device), problem.device_names, order=order, placer="single")
