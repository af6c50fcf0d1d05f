"""``getf``: Generalized Earliest Time First (Su, Ren, Vardi and Wierman, 2020).

GETF schedules precedence-constrained tasks on *related* machines (one speed per machine)
with machine-dependent communication delays, in two steps:

1. **Group assignment.** Machines are grouped by speed (within a group speeds differ by less
   than ``speed_ratio``, 2 in the paper's power-of-two grouping) and a linear program, the
   relaxation of the assignment of tasks to groups (Chudak and Shmoys' LP), is solved::

       minimise  D
       sum_g x[j, g] = 1                                   every task j
       C_j >= sum_g p[j, g] x[j, g]                        its own processing
       C_j >= C_i + sum_g p[j, g] x[j, g]                  every edge (i, j)
       sum_j p[j, g] x[j, g] <= |g| D                      load of every group
       C_j <= D,  x >= 0

   ``p[j, g]`` is the task's time on the slowest device of the group (the paper rounds speeds
   down). Like the paper's, this LP leaves communication out. Each task goes to the group that
   carries the largest share of it (``integral=True`` instead solves the assignment as a MILP,
   as the Moirai paper's evaluation did with Gurobi).
2. **ETF within groups.** Earliest Time First (Hwang et al.) with communication: repeatedly
   start the ready task that can start earliest on a device of its group, ties to the larger
   static level (longest compute path to a sink).

Memory (not in the paper, needed here): the LP keeps each group's load within the group's
memory, and the ETF step only uses devices with room; a task whose group is full may use a
device of another group.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from moirai.planning.highs import SparseLinearProgram
from moirai.planning.placers import register
from moirai.planning.placers._list_scheduling import earliest_time_first, list_schedule, to_plan
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem


@register("getf", minimises=True, respects_memory=True, start_plan=7)
def place_getf(
    problem: Problem,
    speed_ratio: float = 2.0,
    integral: bool = False,
    time_limit_s: float = 30.0,
    contention: bool = True,
) -> Plan:
    groups = speed_groups(problem, speed_ratio)
    task_group = group_assignment(problem, groups, integral, time_limit_s)
    allowed = np.zeros((problem.num_tasks, problem.num_devices), bool)
    for task, group in enumerate(task_group):
        allowed[task, groups[group]] = True
    choose = partial(earliest_time_first, priority=-static_level(problem), allowed=allowed)
    schedule = list_schedule(problem, choose, "getf", contention)
    return to_plan(
        schedule,
        "getf",
        groups=[[problem.device_names[d] for d in group] for group in groups],
        tasks_per_group=np.bincount(task_group, minlength=len(groups)).tolist(),
    )


def speed_groups(problem: Problem, speed_ratio: float = 2.0) -> list[np.ndarray]:
    """Devices grouped fastest first; in a group every speed is above the group's fastest / ``speed_ratio``."""
    speed = problem.device_speed / problem.device_speed.max()  # fastest 1
    groups = []
    remaining = list(np.argsort(-speed, kind="stable"))
    while remaining:
        fastest = speed[remaining[0]]
        members = [d for d in remaining if speed[d] > fastest / speed_ratio]
        groups.append(np.array(members, int))
        remaining = [d for d in remaining if d not in members]
    return groups


def group_assignment(
    problem: Problem, groups: list[np.ndarray], integral: bool = False, time_limit_s: float | None = None
) -> np.ndarray:
    """Group of every task: the largest share in GETF's relaxed assignment LP (or the MILP's choice)."""
    n, num_groups = problem.num_tasks, len(groups)
    group_s = np.full((n, num_groups), np.inf)
    capacity = np.array([problem.memory_capacity_bytes[g].sum() for g in groups])
    for index, group in enumerate(groups):
        compute = problem.compute_s[:, group]
        runs = np.isfinite(compute).any(axis=1) & (problem.memory_bytes <= problem.memory_capacity_bytes[group].max())
        slowest = np.where(np.isfinite(compute), compute, -np.inf).max(axis=1)
        group_s[runs, index] = slowest[runs]
    # Columns: x[j, g] at j * num_groups + g, then C_j, then D.
    completion, makespan = n * num_groups, n * num_groups + n
    share = np.arange(n * num_groups).reshape(n, num_groups)
    lp = SparseLinearProgram(
        makespan + 1,
        lower=np.zeros(makespan + 1),
        upper=np.concatenate([np.isfinite(group_s).ravel().astype(float), np.full(n + 1, np.inf)]),
        cost=np.eye(1, makespan + 1, makespan).ravel(),
    )
    finite_s = np.where(np.isfinite(group_s), group_s, 0.0)
    for task in range(n):
        lp.add_row(share[task], np.ones(num_groups), 1.0, 1.0)
        own = [completion + task, *share[task]]
        lp.add_row(own, [1.0, *(-finite_s[task])], 0.0, np.inf)
        for parent in problem.predecessors[task]:
            lp.add_row([*own, completion + parent], [1.0, *(-finite_s[task]), -1.0], 0.0, np.inf)
        lp.add_row([completion + task, makespan], [1.0, -1.0], -np.inf, 0.0)
    for index, group in enumerate(groups):
        lp.add_row([*share[:, index], makespan], [*finite_s[:, index], -float(len(group))], -np.inf, 0.0)
        if np.isfinite(capacity[index]):
            lp.add_row(share[:, index], problem.memory_bytes, -np.inf, capacity[index])
    if integral:
        solution = lp.solve(integer_vars=share.ravel(), time_limit_s=time_limit_s)
    else:
        # Interior point: several times faster than simplex on this LP for thousands of tasks.
        solution = lp.solve(time_limit_s=time_limit_s, method="ipm")
    return np.argmax(solution[: n * num_groups].reshape(n, num_groups), axis=1)


def static_level(problem: Problem) -> np.ndarray:
    """Longest path of mean compute times from every task to a sink (ETF's tie-break)."""
    return problem.longest_path_to_sink_s(problem.mean_compute_s)
