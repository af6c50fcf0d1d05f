"""What the list-scheduling baselines (m-ETF, m-SCT, GETF) share: a schedule grown one task at a time.

:class:`PartialSchedule` places tasks one after the other, never inserting a task before
one already on its device (Baechi's and Hwang et al.'s ETF are non-insertion), with the
simulator's communication model: a tensor crosses to a device once, transfers on one
directed link run one after the other (``contention=True``), and a device holds the sum
of the memory of its tasks. Its transfer order per link is handed to the plan, so the
simulator replays exactly the schedule the placer built.

:class:`ReadyTasks` keeps the earliest start time of every ready task on every device.
Committing a task to device ``d`` changes only ``d``'s free time, memory and incoming
links, so only column ``d`` is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moirai.bounds import format_bytes
from moirai.errors import InfeasibleError
from moirai.problem import Plan, Problem


@dataclass
class PartialSchedule:
    problem: Problem
    contention: bool = True
    placement: np.ndarray = field(init=False)
    start_s: np.ndarray = field(init=False)
    finish_s: np.ndarray = field(init=False)
    device_free_s: np.ndarray = field(init=False)
    link_free_s: np.ndarray = field(init=False)
    memory_used_bytes: np.ndarray = field(init=False)
    arrival_s: dict[tuple[int, int], float] = field(init=False, default_factory=dict)
    order: list[list[int]] = field(init=False)
    transfer_order: dict[tuple[int, int], list[int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        n, k = self.problem.num_tasks, self.problem.num_devices
        self.placement = np.full(n, -1, int)
        self.start_s = np.full(n, np.nan)
        self.finish_s = np.full(n, np.nan)
        self.device_free_s = np.zeros(k)
        self.link_free_s = np.zeros((k, k))
        self.memory_used_bytes = np.zeros(k)
        self.order = [[] for _ in range(k)]

    def fits(self, task: int, device: int) -> bool:
        """Whether ``task`` can run on ``device`` and its memory still fits there."""
        return bool(
            np.isfinite(self.problem.compute_s[task, device])
            and self.memory_used_bytes[device] + self.problem.memory_bytes[task]
            <= self.problem.memory_capacity_bytes[device]
        )

    def _transfers_needed(self, task: int, device: int) -> tuple[float, list[tuple[int, int]]]:
        """Time the inputs already on ``device`` are there, and the (tensor, source) pairs still to send."""
        ready = 0.0
        to_send = []
        for t in self.problem.input_tensors[task]:
            producer = int(self.problem.tensor_producer[t])
            source = int(self.placement[producer])
            if source == device:
                ready = max(ready, self.finish_s[producer])
            elif (t, device) in self.arrival_s:
                ready = max(ready, self.arrival_s[t, device])
            else:
                to_send.append((t, source))
        # First ready, first sent (ties by tensor index), as the simulator sends.
        to_send.sort(key=lambda ts: (self.finish_s[self.problem.tensor_producer[ts[0]]], ts[0]))
        return ready, to_send

    def _send(self, tensors: list[tuple[int, int]], device: int, commit: bool) -> float:
        ready = 0.0
        link_free = {}
        for t, source in tensors:
            produced = self.finish_s[self.problem.tensor_producer[t]]
            start = produced
            if self.contention:
                start = max(link_free.get(source, self.link_free_s[source, device]), produced)
            arrival = start + self.problem.transfer_s[t, source, device]
            link_free[source] = arrival
            ready = max(ready, arrival)
            if commit:
                self.arrival_s[t, device] = arrival
                self.transfer_order.setdefault((source, device), []).append(t)
        if commit and self.contention:
            for source, free in link_free.items():
                self.link_free_s[source, device] = free
        return ready

    def data_ready_s(self, task: int, device: int) -> float:
        """When every input of ``task`` (all of whose producers are placed) would be on ``device``."""
        ready, to_send = self._transfers_needed(task, device)
        return max(ready, self._send(to_send, device, commit=False))

    def earliest_start_s(self, task: int, device: int) -> float:
        """Earliest start of ``task`` appended to ``device``; ``inf`` when it cannot run or fit there."""
        if not self.fits(task, device):
            return np.inf
        return max(self.device_free_s[device], self.data_ready_s(task, device))

    def commit(self, task: int, device: int, not_before_s: float = 0.0) -> None:
        """Append ``task`` to ``device``, sending its missing inputs; it starts no earlier than ``not_before_s``."""
        ready, to_send = self._transfers_needed(task, device)
        ready = max(ready, self._send(to_send, device, commit=True))
        start = max(self.device_free_s[device], ready, not_before_s)
        self.placement[task] = device
        self.start_s[task] = start
        self.finish_s[task] = start + self.problem.compute_s[task, device]
        self.device_free_s[device] = self.finish_s[task]
        self.memory_used_bytes[device] += self.problem.memory_bytes[task]
        self.order[device].append(task)

    @property
    def makespan_s(self) -> float:
        return float(np.nanmax(self.finish_s)) if self.problem.num_tasks else 0.0

    def to_plan(self, placer: str, **info: object) -> Plan:
        return Plan(
            self.placement.copy(),
            self.problem.device_names,
            order=tuple(tuple(tasks) for tasks in self.order),
            transfer_order={link: tuple(tensors) for link, tensors in self.transfer_order.items()},
            placer=placer,
            info={"scheduled_makespan_s": self.makespan_s, **info},
        )


class ReadyTasks:
    """Tasks whose predecessors are all placed, with their earliest start on every device (inf: cannot run or fit)."""

    def __init__(self, schedule: PartialSchedule) -> None:
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
        self.schedule.commit(task, device, not_before_s)
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
) -> PartialSchedule:
    """Schedule every task, asking ``choose`` for the next (start, task, device) among the ready tasks.

    ``choose`` sees only tasks that still fit somewhere; a ready task that fits on no device
    raises :class:`InfeasibleError` (memory only grows, so it never will).
    """
    ready = ReadyTasks(PartialSchedule(problem, contention))
    while ready:
        stuck = [task for task, starts in ready.start_s.items() if not np.isfinite(starts).any()]
        if stuck:
            raise memory_error(problem, placer, stuck[0], ready.schedule.memory_used_bytes)
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
