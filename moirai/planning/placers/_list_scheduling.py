"""What the list-scheduling baselines (m-ETF, m-SCT, GETF) share: a schedule grown one task at a time.

The schedule is a :class:`moirai.planning.schedule.ScheduleBuilder` without insertion: a task never goes
before one already on its device (Baechi's and Hwang et al.'s ETF are non-insertion), with the
project's communication rule (a tensor crosses to a device once, one transfer at a time per
directed link with ``contention=True``), the devices' time for messages, and static memory. Its transfer order per
link is handed to the plan, so the simulator replays exactly the schedule the placer built, and the plan's
``report.predicted_makespan_s`` is the simulated makespan (m-SCT's waits for a favourite child left out: the
simulator starts every task as soon as its device order and inputs allow).

:class:`ReadyTasks` keeps the earliest start time of every ready task on every device.
Committing a task to device ``d`` changes ``d``'s free time, memory and incoming links, and the re-timing its
sends and receives cause moves some tasks and transfers: only column ``d``, the columns of the devices where
something moved, and the rows of the tasks one of whose producers moved are recomputed.
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
    """The plan of a finished list schedule: its device orders and its link orders, which the simulator replays,
    and its makespan once every task starts as early as those orders allow, as the simulator starts them."""
    schedule.drop_waits()
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
        """Place ``task`` on ``device`` and bring the start times of the remaining ready tasks up to date: on
        the devices whose tasks or incoming transfers the booking moved (``device`` among them), and on every device
        for a task whose producer it moved (a send added to it, a receive taken from it, or a wait behind them)."""
        schedule = self.schedule
        schedule.book(task, device, not_before_s)
        del self.start_s[task]
        successors = schedule.problem.successors
        moved = {s for x in schedule.changed_tasks for s in successors[x] if s in self.start_s}
        columns = sorted(schedule.changed_devices | {device})
        for other, starts in self.start_s.items():
            for d in range(len(starts)) if other in moved else columns:
                starts[d] = schedule.earliest_start_s(other, d)
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
    waits: bool = False,
) -> ScheduleBuilder:
    """Schedule every task, asking ``choose`` for the next (start, task, device) among the ready tasks.

    ``choose`` sees only tasks that still fit somewhere; a ready task that fits on no device
    raises :class:`InfeasibleError` (memory only grows, so it never will). ``waits``: the start ``choose`` gives
    may be later than the task's earliest (m-SCT's device waiting for a favourite child), and the task waits for
    it; otherwise the task starts as early as the schedule allows once booked.
    """
    ready = ReadyTasks(ScheduleBuilder(problem, insertion=False, contention=contention))
    while ready:
        stuck = [task for task, starts in ready.start_s.items() if not np.isfinite(starts).any()]
        if stuck:
            raise memory_error(problem, placer, stuck[0], np.array(ready.schedule.memory_used_bytes))
        start, task, device = choose(ready)
        ready.commit(task, device, not_before_s=start if waits else 0.0)
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
