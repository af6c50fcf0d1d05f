"""``m_sct``: Baechi's memory-constrained Small Communication Times placer (Jeon et al., SoCC 2020, §4.3).

SCT (Hanen and Munier) first solves a linear program that picks for every task at most one
*favourite child*: relaxed variable ``x[u, v]`` is 0 when the edge's communication is saved
(the child is the favourite), 1 when it is paid::

    minimise  w
    s_u + p_u + c_uv x_uv <= s_v            every edge (u, v)
    sum_v x_uv >= out_degree(u) - 1         at most one favourite child per task
    sum_u x_uv >= in_degree(v) - 1          at most one favourite parent per task
    s_u + p_u <= w,  0 <= x <= 1,  s >= 0

An edge whose ``x`` is at most the threshold (0.5, Baechi's rounding) becomes a favourite
edge; conflicts are resolved most-confident-first so every task keeps at most one favourite
child and one favourite parent.

The schedule is then m-ETF's, except that a device that just ran a task whose favourite
child is ready and starts earliest on this device waits for that child, unless another task
becomes *urgent* first (it could start on every device by then): Baechi's "awake" state.
That is how favourite children end up on their parent's device. The plan keeps the device orders; the
simulator (and the reported makespan) starts each task as soon as they allow, without the waits.

Interpretation for heterogeneous clusters (the LP has one time per task and per edge):
``p_u`` is the task's mean compute time over the devices that can run it and ``c_uv`` the
mean, over ordered device pairs, of the time to send the edge's tensors.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from moirai.planning.highs import SparseLinearProgram
from moirai.planning.placers import register
from moirai.planning.placers._list_scheduling import Choice, ReadyTasks, list_schedule, to_plan
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem


@register("m_sct", minimises=True, respects_memory=True, start_plan=8)
def place_m_sct(problem: Problem, threshold: float = 0.5, contention: bool = True) -> Plan:
    favourite = favourite_children(problem, threshold)
    priority = problem.topological_position
    choose = partial(_sct_choice, favourite=favourite, priority=priority)
    schedule = list_schedule(problem, choose, "m_sct", contention, waits=True)
    return to_plan(schedule, "m_sct", favourite_children=int((favourite >= 0).sum()))


def favourite_children(problem: Problem, threshold: float = 0.5) -> np.ndarray:
    """``favourite[u]``: the favourite child of task ``u`` from the relaxed SCT LP, or -1."""
    edges = list(problem.graph.edges)
    n, e = problem.num_tasks, len(edges)
    favourite = np.full(n, -1, int)
    if e == 0:
        return favourite
    task_s, tensor_s = problem.mean_compute_s, problem.mean_transfer_s
    # Columns: x per edge, then s per task, then the makespan w.
    start, makespan = e, e + n
    lp = SparseLinearProgram(
        e + n + 1,
        lower=np.zeros(e + n + 1),
        upper=np.concatenate([np.ones(e), np.full(n + 1, np.inf)]),
        cost=np.eye(1, e + n + 1, makespan).ravel(),
    )
    out_edges: list[list[int]] = [[] for _ in range(n)]
    in_edges: list[list[int]] = [[] for _ in range(n)]
    for index, (u, v) in enumerate(edges):
        edge_s = float(tensor_s[problem.graph.edges[u, v]["tensors"]].sum())
        lp.add_row([start + u, start + v, index], [1.0, -1.0, edge_s], -np.inf, -task_s[u])
        out_edges[u].append(index)
        in_edges[v].append(index)
    for task in range(n):
        for incident in (out_edges[task], in_edges[task]):
            if incident:
                lp.add_row(incident, np.ones(len(incident)), len(incident) - 1, np.inf)
        lp.add_row([start + task, makespan], [1.0, -1.0], -np.inf, -task_s[task])
    paid = lp.solve()[:e]
    has_parent = np.zeros(n, bool)
    for index in np.argsort(paid, kind="stable"):
        u, v = edges[index]
        if paid[index] <= threshold and favourite[u] < 0 and not has_parent[v]:
            favourite[u] = v
            has_parent[v] = True
    return favourite


def _sct_choice(ready: ReadyTasks, favourite: np.ndarray, priority: np.ndarray) -> Choice:
    """The next (start, task, device): ETF, but a device waits for its last task's favourite child."""
    urgent_s = {task: float(starts[np.isfinite(starts)].max()) for task, starts in ready.start_s.items()}
    candidates = []
    for device, tasks in enumerate(ready.schedule.order):
        child = favourite[tasks[-1]] if tasks else -1
        child_starts = ready.start_s.get(child)
        child_ready_here = child_starts is not None and np.isfinite(child_starts[device])
        if child_ready_here and child_starts[device] <= child_starts.min():
            # Awake: run the favourite child, unless another task turns urgent first (urgent wins ties).
            options = [(float(child_starts[device]), 1, priority[child], child)] + [
                (urgent_s[task], 0, priority[task], task)
                for task, starts in ready.start_s.items()
                if task != child and np.isfinite(starts[device])
            ]
            start, _, _, task = min(options)
            candidates.append((start, priority[task], 0, device, task))
        else:
            options = [(float(starts[device]), priority[task], task) for task, starts in ready.start_s.items()]
            start, _, task = min(options)
            if np.isfinite(start):
                candidates.append((start, priority[task], 1, device, task))
    start, _, _, device, task = min(candidates)
    return start, task, device
