"""What the list-scheduling baselines (m-ETF, m-SCT, GETF) share: a schedule grown one task at a time.

The schedule is a :class:`moirai.planning.schedule.ScheduleBuilder` without insertion: a task never goes
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

from moirai.planning.bounds import memory_error
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import PlacerReport
from moirai.planning.schedule import ScheduleBuilder


def to_plan(schedule: ScheduleBuilder, placer: str, **notes: object) -> Plan:
    """The plan of a finished list schedule: its device orders and its link orders, which the simulator replays."""
    return Plan(
        np.array(schedule.placement, int),
        schedule.problem.device_names,
        order=tuple(tuple(tasks) for tasks in schedule.order),
        transfer_order=schedule.transfer_order(),
        placer=placer,
        report=PlacerReport(predicted_makespan_s=schedule.makespan_s, contention=schedule.contention, notes=notes),
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
