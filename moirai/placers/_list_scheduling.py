"""What the list-scheduling baselines (m-ETF, m-SCT, GETF) share: a schedule grown one task at a time.

The schedule is a :class:`moirai.schedule.ScheduleBuilder` without insertion: a task never goes
before one already on its device (Baechi's and Hwang et al.'s ETF are non-insertion), with the
project's communication rule (a tensor crosses to a device once, one transfer at a time per
directed link with ``contention=True``) and static memory. Its transfer order per link is handed to
the plan, so the simulator replays exactly the schedule the placer built.

:class:`ReadyTasks` keeps the earliest start time of every ready task on every device.
Committing a task to device ``d`` changes only ``d``'s free time, memory and incoming
links, so only column ``d`` is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moirai.bounds import format_bytes
from moirai.errors import InfeasibleError
from moirai.problem import Plan, Problem
from moirai.schedule import ScheduleBuilder


def to_plan(schedule: ScheduleBuilder, placer: str, **info: object) -> Plan:
    """The plan of a finished list schedule: its device orders and its link orders, which the simulator replays."""
    return Plan(
        np.array(schedule.placement, int),
        schedule.problem.device_names,
        order=tuple(tuple(tasks) for tasks in schedule.order),
        transfer_order=schedule.transfer_order(),
        placer=placer,
        info={"scheduled_makespan_s": schedule.makespan_s, **info},
    )


class ReadyTasks:
    """Tasks whose predecessors are all placed, with their earliest start on every device (inf: cannot run or fit)."""

    def __init__(self, schedule: ScheduleBuilder) -> None:
        problem = schedule.problem
        self.schedule = schedule
        self._missing_inputs = np.array([len(p) for p in problem.predecessors], int)
        self.start_s: dict[int, np.ndarray] = {}
        for task in np.flatnonzero(self._missing_inputs == 0):
            self._add(int(task))

    def _add(self, task: int) -> None:
        self.start_s[task] = np.array(
            [self.schedule.earliest_start_s(task, d) for d in range(self.schedule.problem.num_devices)]
        )

    def __bool__(self) -> bool:
        return bool(self.start_s)

    def commit(self, task: int, device: int, not_before_s: float = 0.0) -> None:
        """Place ``task`` on ``device`` and bring the start times of the remaining ready tasks up to date."""
        self.schedule.book(task, device, not_before_s)
        del self.start_s[task]
        for other, starts in self.start_s.items():
            starts[device] = self.schedule.earliest_start_s(other, device)
        for successor in self.schedule.problem.successors[task]:
            self._missing_inputs[successor] -= 1
            if self._missing_inputs[successor] == 0:
                self._add(successor)


Choice = tuple[float, int, int]  # (start time, task, device)


def list_schedule(
    problem: Problem,
    choose: Callable[[ReadyTasks], Choice],
    placer: str,
    contention: bool = True,
) -> ScheduleBuilder:
    """Schedule every task, asking ``choose`` for the next (start, task, device) among the ready tasks.

    ``choose`` sees only tasks that still fit somewhere; a ready task that fits on no device
    raises :class:`InfeasibleError` (memory only grows, so it never will).
    """
    ready = ReadyTasks(ScheduleBuilder(problem, insertion=False, contention=contention))
    while ready:
        stuck = [task for task, starts in ready.start_s.items() if not np.isfinite(starts).any()]
        if stuck:
            raise memory_error(problem, placer, stuck[0], np.array(ready.schedule.memory_used_bytes))
        start, task, device = choose(ready)
        ready.commit(task, device, not_before_s=start)
    return ready.schedule


def earliest_time_first(ready: ReadyTasks, priority: np.ndarray, allowed: np.ndarray | None = None) -> Choice:
    """The ready (task, device) pair that can start first; ties go to the smaller ``priority[task]``.

    ``allowed[task]`` (a device mask) restricts a task to some devices while any of them can take it.
    """
    candidates = []
    for task, starts in ready.start_s.items():
        if allowed is not None and np.isfinite(starts[allowed[task]]).any():
            starts = np.where(allowed[task], starts, np.inf)
        device = int(np.argmin(starts))
        candidates.append((float(starts[device]), float(priority[task]), task, device))
    start, _, task, device = min(candidates)
    return start, task, device


def topological_rank(problem: Problem) -> np.ndarray:
    """Position of every task in the problem's topological order (Baechi's tie-break)."""
    rank = np.empty(problem.num_tasks, int)
    rank[list(problem.topological_order)] = np.arange(problem.num_tasks)
    return rank


def memory_error(problem: Problem, placer: str, task: int, used_bytes: np.ndarray) -> InfeasibleError:
    """The error a greedy placer raises when ``task`` fits on no device any more, though the model fits the cluster.

    Models that cannot fit at all are refused before placing, by :func:`moirai.bounds.check_memory_feasible`.
    """
    free = ", ".join(
        f"{name}: {format_bytes(max(cap - used, 0.0))} free"
        for name, cap, used in zip(problem.device_names, problem.memory_capacity_bytes, used_bytes, strict=True)
    )
    return InfeasibleError(
        f"{placer} cannot fit the model: it needs {format_bytes(float(problem.memory_bytes.sum()))} and the cluster "
        f"has {format_bytes(float(problem.memory_capacity_bytes.sum()))} in total, but {placer}'s greedy placement "
        f"left no device with room for task {problem.task_names[task]!r} "
        f"({format_bytes(float(problem.memory_bytes[task]))}; {free}); try the 'milp' placer or another baseline, "
        "or add memory"
    )
