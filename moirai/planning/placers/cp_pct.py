"""``cp_pct``: Mayer et al.'s Critical Path partitioning with PCT scheduling (DIDL'17 §3.2.2, §4.1).

Partitioning: the critical path is the longest path by compute time (each task timed on the
fastest device, where the path is meant to run). It is found from downward ranks: start at the
sink with the largest downward rank and follow, at every task, the predecessor with the largest
downward rank back to a source. The whole path goes to the fastest device that can hold it; if
none can, it is divided among the fastest devices in path order. Every other task, in
topological order, goes to the device with the least sum of compute time already assigned
plus its own (eq. 7) among those with room for it. A task only goes where its tensors can
cross from and to the neighbours placed before it (no infinite ``transfer_s``): the registry's
pruning (:func:`moirai.planning.bounds.without_unlinked_devices`) keeps every device some
plan may use, not one that a choice made already rules out.

Scheduling: PCT, the simulator's list schedule (longest remaining path first, eq. 12).
Option ``contention`` (default True) is the link model that list schedule assumes.
"""

from __future__ import annotations

import numpy as np

from moirai.errors import InfeasibleError
from moirai.planning.bounds import memory_error
from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import PlacerReport
from moirai.planning.simulate import simulate


def critical_path(problem: Problem, weight: np.ndarray) -> list[int]:
    """The longest path by ``weight`` (task times), from a source to a sink, via downward ranks."""
    down_rank = [0.0] * problem.num_tasks
    seconds = weight.tolist()
    for v in problem.topological_order:
        down_rank[v] = seconds[v] + max((down_rank[u] for u in problem.predecessors[v]), default=0.0)
    sinks = [v for v in range(problem.num_tasks) if not problem.successors[v]]
    path = [max(sinks, key=lambda v: (down_rank[v], -v))]
    while problem.predecessors[path[-1]]:
        path.append(max(problem.predecessors[path[-1]], key=lambda u: (down_rank[u], -u)))
    return path[::-1]


def linked_devices(problem: Problem, placement: np.ndarray, v: int) -> np.ndarray:
    """Per device, whether task ``v`` there could get every input from its placed producers and send every output
    to its placed consumers (``placement`` -1 where not placed): no tensor over a missing link."""
    linked = np.ones(problem.num_devices, bool)
    for t in problem.input_tensors[v]:
        source = placement[problem.tensor_producer[t]]
        if source >= 0:
            linked &= np.isfinite(problem.transfer_s[t, source])
    for t in problem.output_tensors[v]:
        for c in problem.tensor_consumers[t]:
            if placement[c] >= 0:
                linked &= np.isfinite(problem.transfer_s[t, :, placement[c]])
    return linked


def _no_device(problem: Problem, v: int, placement: np.ndarray, used_bytes: np.ndarray) -> InfeasibleError:
    """Why task ``v`` has no device: memory (:func:`memory_error`) where a device it can run on and reach its placed
    neighbours from is left, else the links."""
    reachable = problem.runs_on[v] & linked_devices(problem, placement, v)
    if reachable.any():
        return memory_error(problem, "cp_pct", v, used_bytes)
    return InfeasibleError(
        f"cp_pct cannot place task {problem.task_names[v]!r}: no device it can run on has links (finite transfer_s) "
        "from its producers and to its consumers where cp_pct's greedy placement put them; try the 'milp' or "
        "'heft' placer, or give the problem the missing links"
    )


@register("cp_pct", minimises=True, respects_memory=True, start_plan=5)
def place_cp_pct(problem: Problem, contention: bool = True) -> Plan:
    placement = np.full(problem.num_tasks, -1)
    if problem.num_tasks == 0:
        return Plan(placement, problem.device_names, order=tuple(() for _ in problem.device_names), placer="cp_pct")
    fastest_first = np.argsort(-problem.device_speed, kind="stable")
    reference = np.where(
        problem.runs_on[:, fastest_first[0]],
        problem.compute_s[:, fastest_first[0]],
        problem.compute_s.min(axis=1),
    )
    path = critical_path(problem, reference)
    used = np.zeros(problem.num_devices)
    capacity = problem.memory_capacity_bytes

    def can_take(device: int, tasks: list[int]) -> bool:
        fits = used[device] + problem.memory_bytes[tasks].sum() <= capacity[device]
        return bool(fits and problem.runs_on[tasks, device].all())

    whole = next((int(d) for d in fastest_first if can_take(int(d), path)), None)
    for v in path:
        linked = linked_devices(problem, placement, v)
        device = (
            whole
            if whole is not None
            else next((int(d) for d in fastest_first if can_take(int(d), [v]) and linked[d]), None)
        )
        if device is None:
            raise _no_device(problem, v, placement, used)
        placement[v] = device
        used[device] += problem.memory_bytes[v]

    load_s = np.bincount(
        placement[path], weights=problem.compute_s[path, placement[path]], minlength=len(used)
    ).tolist()
    compute = problem.compute_s.tolist()
    memory = problem.memory_bytes.tolist()
    free = (capacity - used).tolist()
    for v in problem.topological_order:
        if placement[v] >= 0:
            continue
        # Eq. 7: the device whose assigned compute plus this task's is least, among those with room and links to
        # the neighbours placed so far.
        linked = linked_devices(problem, placement, v).tolist()
        finish_load = [
            load + seconds if room >= memory[v] and link else np.inf
            for load, seconds, room, link in zip(load_s, compute[v], free, linked, strict=True)
        ]
        device = min(range(len(finish_load)), key=finish_load.__getitem__)
        if not np.isfinite(finish_load[device]):
            raise _no_device(problem, v, placement, capacity - np.array(free))
        placement[v] = device
        free[device] -= memory[v]
        load_s[device] = finish_load[device]

    partition = Plan(placement, problem.device_names)
    order = simulate(problem, partition, contention=contention).device_order()
    return Plan(
        placement,
        problem.device_names,
        order=order,
        placer="cp_pct",
        report=PlacerReport(notes={"critical_path": path}),
    )
