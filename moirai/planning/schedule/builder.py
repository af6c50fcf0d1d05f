"""A schedule grown one task at a time: book a task on a device, book the transfers its inputs need, undo.

The list schedulers (m-ETF, m-SCT, GETF) append a task after the last one on its device and a
transfer after the last one on its link; HEFT (``insertion=True``) puts each in the earliest idle
slot long enough for it. Either way the transfers follow :mod:`moirai.planning.schedule.transfers`: a tensor
crosses to a device once, and with ``contention`` a directed link sends one tensor at a time, the
inputs of one task in :func:`send_priority` order. The per-device and per-link orders a builder
produces are the plan's, so the simulator replays exactly the schedule the placer built.

A producer is booked before the builder knows which devices its outputs go to, so the sender's time of
a transfer (:func:`send_cpu_s`) is booked when a consumer on another device asks for it: an interval on the
sending device after the producer (appended, or the earliest idle slot), the transfer starting after it.
The simulator adds the same time to the producer itself (:func:`task_duration_s`); where a task was
booked between the two, the simulated plan runs later than the builder's estimate, and the simulator is
the judge of every plan. The receiver's time of a transfer (:func:`recv_cpu_s`) extends the task that books
it (the first consumer booked on the device; the simulator charges the first in topological order).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from moirai.planning.problem import Problem
from moirai.planning.schedule.transfers import recv_cpu_s, send_cpu_s, send_priority, transfer_duration_s

_SEND = -1  # a device interval that posts a transfer, not a task


@dataclass
class BusyIntervals:
    """Busy intervals of one device or link, sorted and disjoint, with what occupies each."""

    starts: list[float] = field(default_factory=list)
    finishes: list[float] = field(default_factory=list)
    items: list[int] = field(default_factory=list)

    def earliest_slot(self, ready_s: float, duration_s: float) -> tuple[float, int]:
        """Earliest start at or after ``ready_s`` of an idle gap of ``duration_s``, and the index to insert at."""
        index = bisect_right(self.finishes, ready_s)
        start = max(ready_s, self.finishes[index - 1]) if index else ready_s
        while index < len(self.starts) and start + duration_s > self.starts[index]:
            start = max(ready_s, self.finishes[index])
            index += 1
        return start, index

    def append_slot(self, ready_s: float) -> tuple[float, int]:
        """Start at or after ``ready_s`` and after everything booked, and the index to insert at (the end)."""
        return (max(ready_s, self.finishes[-1]) if self.finishes else ready_s), len(self.items)

    def insert(self, index: int, start_s: float, duration_s: float, item: int) -> None:
        self.starts.insert(index, start_s)
        self.finishes.insert(index, start_s + duration_s)
        self.items.insert(index, item)

    def remove(self, index: int) -> None:
        del self.starts[index], self.finishes[index], self.items[index]


@dataclass
class Booking:
    """The input transfers booked for ``task`` on ``device``: (source, index on its link or -1, tensor, arrival),
    and the sender's intervals booked for them: (source device, index on it)."""

    task: int
    device: int
    ready_s: float  # when every input of the task is on the device
    transfers: list[tuple[int, int, int, float]]
    sends: list[tuple[int, int]] = field(default_factory=list)


class ScheduleBuilder:
    """A partial schedule of ``problem``: devices, links and memory of the tasks booked so far.

    ``insertion``: a task or transfer takes the earliest idle slot long enough for it (HEFT);
    otherwise it goes after the last one on its device or link (ETF-style list scheduling).
    ``contention=False`` lets every transfer start as soon as its producer finishes.
    """

    def __init__(self, problem: Problem, insertion: bool = False, contention: bool = True) -> None:
        n, k = problem.num_tasks, problem.num_devices
        self.problem = problem
        self.insertion = insertion
        self.contention = contention
        self.placement = [-1] * n
        self.start_s = [float("nan")] * n
        self.finish_s = [float("nan")] * n
        self.devices = [BusyIntervals() for _ in range(k)]
        self.links: dict[tuple[int, int], BusyIntervals] = {}
        self.arrival_s: dict[tuple[int, int], float] = {}  # (tensor, device) -> when it is there
        self.memory_used_bytes = [0.0] * k
        self._sent: dict[tuple[int, int], list[int]] = {}  # tensors per link in booking order
        self._producer = problem.tensor_producer.tolist()
        self._compute = problem.compute_s.tolist()
        self._memory = problem.memory_bytes.tolist()
        self._capacity = problem.memory_capacity_bytes.tolist()
        self._release_s = problem.costs.release_s.tolist()

    def fits(self, task: int, device: int) -> bool:
        """Whether ``task`` can run on ``device`` and its memory still fits next to the tasks booked there."""
        return (
            self._compute[task][device] != np.inf
            and self.memory_used_bytes[device] + self._memory[task] <= self._capacity[device]
        )

    def book_inputs(self, task: int, device: int) -> Booking:
        """Book the transfers that bring the inputs of ``task`` (all of whose producers are booked) to ``device``."""
        ready_s, booked, remote, sends = self._release_s[task][device], [], [], []
        placement, finish, producer = self.placement, self.finish_s, self._producer
        for t in self.problem.input_tensors[task]:
            source = placement[producer[t]]
            if source == device:
                ready_s = max(ready_s, finish[producer[t]])
            elif (t, device) in self.arrival_s:
                ready_s = max(ready_s, self.arrival_s[t, device])
            else:
                remote.append(t)
        for t in sorted(remote, key=lambda t: send_priority(finish[producer[t]], t)):
            arrival = self._book_transfer(t, placement[producer[t]], device, booked, sends)
            ready_s = max(ready_s, arrival)
        return Booking(task, device, ready_s, booked, sends)

    def _book_transfer(
        self,
        tensor: int,
        source: int,
        device: int,
        booked: list[tuple[int, int, int, float]],
        sends: list[tuple[int, int]],
    ) -> float:
        """Book ``tensor`` on the link ``source -> device`` once its producer is done and the source device has
        posted it; returns its arrival."""
        produced_s = self.finish_s[self._producer[tensor]]
        sender_s = float(send_cpu_s(self.problem, tensor, source, device))
        if sender_s > 0:
            slot = self.device_slot(source, produced_s, sender_s)
            self.devices[source].insert(slot[1], slot[0], sender_s, _SEND)
            sends.append((source, slot[1]))
            produced_s = slot[0] + sender_s
        seconds = float(transfer_duration_s(self.problem, tensor, source, device))
        if not self.contention:
            booked.append((source, -1, tensor, produced_s + seconds))
            return produced_s + seconds
        link = self.links.setdefault((source, device), BusyIntervals())
        start, index = link.earliest_slot(produced_s, seconds) if self.insertion else link.append_slot(produced_s)
        link.insert(index, start, seconds, tensor)
        booked.append((source, index, tensor, start + seconds))
        return start + seconds

    def unbook(self, booking: Booking) -> None:
        """Take back the transfers of ``booking`` (the last booking made)."""
        for source, index, _, _ in reversed(booking.transfers):  # the last booked is still at its index
            if index >= 0:
                self.links[source, booking.device].remove(index)
        for source, index in reversed(booking.sends):
            self.devices[source].remove(index)

    def device_slot(self, device: int, ready_s: float, duration_s: float) -> tuple[float, int]:
        """Start of a task of ``duration_s`` on ``device`` whose inputs are there at ``ready_s``, and its index."""
        intervals = self.devices[device]
        return intervals.earliest_slot(ready_s, duration_s) if self.insertion else intervals.append_slot(ready_s)

    def ready_and_busy_s(self, task: int, device: int) -> tuple[float, float]:
        """When every input of ``task`` would be on ``device``, and how long it would keep the device busy: its
        compute and the receives of the transfers it would book (nothing stays booked)."""
        booking = self.book_inputs(task, device)
        self.unbook(booking)
        return booking.ready_s, self._busy_s(booking)

    def _busy_s(self, booking: Booking) -> float:
        """How long the booked task keeps its device busy: its compute and the receives of the transfers it books."""
        device = booking.device
        received = sum(float(recv_cpu_s(self.problem, t, source, device)) for source, _, t, _ in booking.transfers)
        return self._compute[booking.task][device] + received

    def earliest_start_s(self, task: int, device: int) -> float:
        """Earliest start of ``task`` on ``device``; ``inf`` when it cannot run or fit there."""
        if not self.fits(task, device):
            return np.inf
        return self.device_slot(device, *self.ready_and_busy_s(task, device))[0]

    def book(self, task: int, device: int, not_before_s: float = 0.0) -> float:
        """Book ``task`` on ``device`` with the transfers of its inputs, starting no earlier than ``not_before_s``;
        returns its start."""
        booking = self.book_inputs(task, device)
        seconds = self._busy_s(booking)
        for source, _, t, arrival in booking.transfers:
            self.arrival_s[t, device] = arrival
            self._sent.setdefault((source, device), []).append(t)
        start, index = self.device_slot(device, max(booking.ready_s, not_before_s), seconds)
        self.devices[device].insert(index, start, seconds, task)
        self.placement[task] = device
        self.start_s[task] = start
        self.finish_s[task] = start + seconds
        self.memory_used_bytes[device] += self._memory[task]
        return start

    @property
    def order(self) -> list[list[int]]:
        """Tasks of every device in execution order."""
        return [[item for item in intervals.items if item != _SEND] for intervals in self.devices]

    def transfer_order(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Tensors of every used link in the order they are sent (booking order without contention)."""
        if self.contention:
            return {link: tuple(busy.items) for link, busy in self.links.items()}
        return {link: tuple(tensors) for link, tensors in self._sent.items()}

    @property
    def makespan_s(self) -> float:
        return max((f for f in self.finish_s if f == f), default=0.0)
