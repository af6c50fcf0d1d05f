"""``m_topo``: Baechi's memory-constrained topological placement (Jeon et al., SoCC 2020, §4.1).

Walk the tasks in topological order and fill the devices one after the other: a device
takes tasks until the next one would exceed its limit, then the next device starts. With
``uniform=True`` (Baechi's default) the limit of every device is the model's memory split
evenly plus the largest task (never more than the device holds), which spreads the model
over all devices; ``uniform=False`` fills each device to its capacity. If the even split
leaves tasks over (devices smaller than the even share), the placement falls back to
filling to capacity. Each device runs its tasks in topological order.
"""

from __future__ import annotations

import numpy as np

from moirai.planning.bounds import memory_error
from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import PlacerReport


@register("m_topo", minimises=False, respects_memory=True, start_plan=4)
def place_m_topo(problem: Problem, uniform: bool = True) -> Plan:
    capacity = problem.memory_capacity_bytes
    if uniform:
        even_share = problem.memory_bytes.sum() / problem.num_devices + problem.memory_bytes.max(initial=0.0)
        placement, _, left_over = _fill_in_topological_order(problem, np.minimum(capacity, even_share))
        if left_over is None:
            return _plan(problem, placement, limit="even share")
    placement, used, left_over = _fill_in_topological_order(problem, capacity)
    if left_over is not None:
        raise memory_error(problem, "m_topo", left_over, used)
    return _plan(problem, placement, limit="capacity")


def _fill_in_topological_order(problem: Problem, limit_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray, int | None]:
    """Devices filled in turn up to ``limit_bytes``: placement, bytes used, first task left over (None: all placed)."""
    placement = np.full(problem.num_tasks, -1, int)
    used = np.zeros(problem.num_devices)
    device = 0
    for task in problem.topological_order:
        while device < problem.num_devices and not _fits(problem, task, device, used, limit_bytes):
            device += 1
        if device == problem.num_devices:
            return placement, used, task
        placement[task] = device
        used[device] += problem.memory_bytes[task]
    return placement, used, None


def _fits(problem: Problem, task: int, device: int, used: np.ndarray, limit_bytes: np.ndarray) -> bool:
    return bool(problem.runs_on[task, device] and used[device] + problem.memory_bytes[task] <= limit_bytes[device])


def _plan(problem: Problem, placement: np.ndarray, limit: str) -> Plan:
    order = tuple(tuple(t for t in problem.topological_order if placement[t] == d) for d in range(problem.num_devices))
    return Plan(
        placement,
        problem.device_names,
        order=order,
        placer="m_topo",
        report=PlacerReport(notes={"memory_limit": limit}),
    )
