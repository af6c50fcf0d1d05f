"""``single``: the whole model on the fastest device that can hold it (the no-parallelism reference)."""

from __future__ import annotations

import numpy as np

from moirai.errors import InfeasibleError
from moirai.planning.bounds import format_bytes
from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem


@register("single", minimises=False, respects_memory=True, start_plan=1)
def place_single(problem: Problem) -> Plan:
    """Every task on the device with the least total compute time among those that hold the whole model."""
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
    return one_device_plan(problem, int(candidates[np.argmin(total_s[candidates])]))


def one_device_plan(problem: Problem, device: int) -> Plan:
    """Every task on ``device``, in the graph's own (topological) order."""
    order = tuple(problem.topological_order if d == device else () for d in range(problem.num_devices))
    return Plan(np.full(problem.num_tasks, device), problem.device_names, order=order, placer="single")
