"""A schedule grown one task at a time: book a task on a device with the transfers its inputs need.

The list schedulers (m-ETF, m-SCT, GETF) append a task after the last one on its device and a
transfer after the last one on its link; HEFT (``insertion=True``) puts each in the earliest idle
slot long enough for it. Either way the transfers follow :mod:`moirai.planning.schedule.transfers`: a tensor
crosses to a device once, and with ``contention`` a directed link sends one tensor at a time, the
inputs of one task in :func:`send_priority` order. The per-device and per-link orders a builder
produces are the plan's, and its times are the simulator's for those orders, so the simulator replays
exactly the schedule the placer built.

The devices' own time for messages is the simulator's too (:func:`task_duration_s`): a task's busy time is its
compute, the sends of every transfer of its outputs (:func:`send_cpu_s`) and the receives of every transfer it
receives (:func:`recv_cpu_s`; of a tensor's consumers on a device, :func:`receiving_task`'s). A producer is booked
before anyone knows which devices its outputs go to, so when a consumer on another device asks for its tensor,
the producer's busy time grows by the send and the transfers of its tensors leave after it; and a consumer
booked later that comes first in topological order takes over the receive. Both change tasks already booked, so
booking re-times the schedule (:meth:`ScheduleBuilder.book`): every task and transfer starts as early as the
orders booked so far allow, as the simulator starts them. What a task would cost on a device before it is booked
(:meth:`ScheduleBuilder.ready_and_busy_s`) counts the sends it adds to its producers and the receives it takes,
not how far re-timing other tasks moves them: an estimate, for choosing a device; the booked times are exact
([Note: a send lengthens its producer] in docs/design.md).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from moirai.planning.problem import Problem
from moirai.planning.schedule.transfers import (
    output_arrival_s,
    receiving_task,
    recv_cpu_s,
    send_cpu_s,
    send_priority,
    transfer_duration_s,
)


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

    def retime(self, since_s: float, start_s: list[float], finish_s: list[float]) -> None:
        """Take the times of the items that started at ``since_s`` or later from ``start_s`` and ``finish_s`` (their
        order stays)."""
        index = bisect_left(self.starts, since_s)
        items = self.items[index:]
        self.starts[index:] = [start_s[x] for x in items]
        self.finishes[index:] = [finish_s[x] for x in items]


_PRICES = (transfer_duration_s, send_cpu_s, recv_cpu_s)


class NewTransfer(NamedTuple):
    """A transfer a booking adds: ``tensor`` from device ``source``, starting at ``start_s`` (estimated), at ``index``
    on its link (-1 without contention)."""

    tensor: int
    source: int
    start_s: float
    index: int


class Estimate(NamedTuple):
    """What booking a task on a device would take, before re-timing: when its inputs are there, how long it keeps
    the device busy (compute and receives) and the transfers it adds."""

    ready_s: float
    busy_s: float
    transfers: list[NewTransfer]


class ScheduleBuilder:
    """A partial schedule of ``problem``: devices, links and memory of the tasks booked so far.

    ``insertion``: a task or transfer takes the earliest idle slot long enough for it (HEFT);
    otherwise it goes after the last one on its device or link (ETF-style list scheduling).
    ``contention=False`` lets every transfer start as soon as its producer finishes.

    The times are those the simulator gives the orders booked so far (a task booked with ``not_before_s`` waits
    that long too, until :meth:`drop_waits`). ``changed_tasks`` and ``changed_devices``: the tasks the last
    booking's re-timing moved (the booked one where it moved from its estimate), and the devices whose tasks or
    incoming transfers it moved.
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
        self.links: dict[tuple[int, int], BusyIntervals] = {}  # items: transfer ids
        self.arrival_s: dict[tuple[int, int], float] = {}  # (tensor, device) -> when it is there
        self.memory_used_bytes = [0.0] * k
        self.changed_tasks: set[int] = set()
        self.changed_devices: set[int] = set()
        self._sent: dict[tuple[int, int], list[int]] = {}  # tensors per link in booking order
        self._producer = problem.tensor_producer.tolist()
        self._compute = problem.compute_s.tolist()
        self._memory = problem.memory_bytes.tolist()
        self._capacity = problem.memory_capacity_bytes.tolist()
        self._release_s = problem.costs.release_s.tolist()
        self._prices: dict[int, tuple[list[float], list[float], list[float]]] = {}  # tensor -> _price(tensor, source)
        # Per booked task: the sends its outputs' transfers take from its device, its busy time (compute, sends and
        # receives; set when re-timed), the transfers it receives, its neighbours on its device (-1: none), what it
        # waits for (producers on its device; n + transfer id), a start it may not precede, and what waits for it
        # (consumers on its device; n + id of a transfer of its tensors).
        self._sends_s = [0.0] * n
        self._duration_s = [0.0] * n
        self._received: list[list[int]] = [[] for _ in range(n)]
        self._before = [-1] * n
        self._after = [-1] * n
        self._inputs: list[list[int]] = [[] for _ in range(n)]
        self._not_before_s = [0.0] * n
        self._local_consumers: list[list[int]] = [[] for _ in range(n)]
        self._outgoing: list[list[int]] = [[] for _ in range(n)]  # n + transfer id
        # Per booked transfer (its id: the order booked): tensor, devices, link time, start, arrival, neighbours on
        # its link, consumers on its destination and the one that receives it.
        self._transfer_id: dict[tuple[int, int], int] = {}
        self._tensor: list[int] = []
        self._source: list[int] = []
        self._destination: list[int] = []
        self._seconds: list[float] = []
        self._transfer_start_s: list[float] = []
        self._transfer_finish_s: list[float] = []
        self._link_before: list[int] = []
        self._link_after: list[int] = []
        self._recv_s: list[float] = []  # what receiving it takes from its receiver (recv_cpu_s)
        self._consumers: list[list[int]] = []
        self._receiver: list[int] = []

    def fits(self, task: int, device: int) -> bool:
        """Whether ``task`` can run on ``device`` and its memory still fits next to the tasks booked there."""
        return (
            self._compute[task][device] != np.inf
            and self.memory_used_bytes[device] + self._memory[task] <= self._capacity[device]
        )

    def estimate(self, task: int, device: int) -> Estimate:
        """What booking ``task`` (all of whose producers are booked) on ``device`` takes before re-timing: its inputs
        arrive once their producers, lengthened by the sends this adds, have finished and their links are free."""
        ready_s, busy_s = self._release_s[task][device], self._compute[task][device]
        placement, finish, producer, transfer_id = self.placement, self.finish_s, self._producer, self._transfer_id
        posted: dict[int, float] = {}  # producer -> its finish with the sends this booking adds
        remote: list[tuple[int, int, list[float]]] = []  # (tensor, its producer's device, the link's prices)
        for t in self.problem.input_tensors[task]:
            u = producer[t]
            source = placement[u]
            if source == device:
                if finish[u] > ready_s:
                    ready_s = finish[u]
                continue
            q = transfer_id.get((t, device))
            if q is not None:
                if self._transfer_finish_s[q] > ready_s:
                    ready_s = self._transfer_finish_s[q]
                if self._recv_s[q] and receiving_task(self.problem, (self._receiver[q], task)) == task:
                    busy_s += self._recv_s[q]
            elif not remote or all(t != other for other, _, _ in remote):  # a tensor read twice crosses once
                link_s, sender_s, receiver_s = self._prices.get(t) or self._price(t, source)
                remote.append((t, source, link_s))
                posted[u] = posted.get(u, finish[u]) + sender_s[device]
                busy_s += receiver_s[device]
        if len(remote) > 1:
            remote.sort(key=lambda new: send_priority(posted[producer[new[0]]], new[0]))
        transfers: list[NewTransfer] = []
        tried: list[tuple[BusyIntervals, int]] = []  # slots taken on the links while booking the next, given back
        for t, source, link_s in remote:
            ready, seconds = posted[producer[t]], link_s[device]
            if not self.contention:
                transfers.append(NewTransfer(t, source, ready, -1))
                ready_s = max(ready_s, ready + seconds)
                continue
            link = self.links.get((source, device))
            if link is None:
                link = self.links[source, device] = BusyIntervals()  # empty until a transfer is booked on it
            start, index = link.earliest_slot(ready, seconds) if self.insertion else link.append_slot(ready)
            link.insert(index, start, seconds, -1)
            tried.append((link, index))
            transfers.append(NewTransfer(t, source, start, index))
            ready_s = max(ready_s, start + seconds)
        for link, index in reversed(tried):
            link.remove(index)
        return Estimate(ready_s, busy_s, transfers)

    def _price(self, tensor: int, source: int) -> tuple[list[float], list[float], list[float]]:
        """What sending ``tensor`` from ``source``, its producer's device, to each device takes: the link
        (:func:`transfer_duration_s`), the sender (:func:`send_cpu_s`) and the receiver (:func:`recv_cpu_s`); kept in
        ``_prices``, as a booked producer stays on its device."""
        devices = np.arange(self.problem.num_devices)
        prices = tuple(price(self.problem, tensor, source, devices).tolist() for price in _PRICES)
        self._prices[tensor] = prices
        return prices

    def device_slot(self, device: int, ready_s: float, duration_s: float) -> tuple[float, int]:
        """Start of a task of ``duration_s`` on ``device`` whose inputs are there at ``ready_s``, and its index."""
        intervals = self.devices[device]
        return intervals.earliest_slot(ready_s, duration_s) if self.insertion else intervals.append_slot(ready_s)

    def ready_and_busy_s(self, task: int, device: int) -> tuple[float, float]:
        """When every input of ``task`` would be on ``device``, and how long it would keep the device busy: its
        compute and the receives it would take (:meth:`estimate`; nothing is booked)."""
        estimate = self.estimate(task, device)
        return estimate.ready_s, estimate.busy_s

    def earliest_start_s(self, task: int, device: int) -> float:
        """Earliest start of ``task`` on ``device`` before re-timing; ``inf`` when it cannot run or fit there."""
        if not self.fits(task, device):
            return np.inf
        return self.device_slot(device, *self.ready_and_busy_s(task, device))[0]

    def book(self, task: int, device: int, not_before_s: float = 0.0) -> float:
        """Book ``task`` on ``device`` with the transfers of its inputs, starting no earlier than ``not_before_s``,
        and re-time the schedule; returns its start."""
        problem, n = self.problem, self.problem.num_tasks
        estimate = self.estimate(task, device)
        seeds = {task}
        lengthened = False  # whether a task booked before takes a send or gives up a receive
        for t in problem.input_tensors[task]:
            u = self._producer[t]
            if self.placement[u] == device:
                if task not in self._local_consumers[u]:
                    self._local_consumers[u].append(task)
                    self._inputs[task].append(u)
                continue
            q = self._transfer_id.get((t, device))
            if q is None or task in self._consumers[q]:
                continue
            self._consumers[q].append(task)
            self._inputs[task].append(n + q)
            receiver = self._receiver[q]
            if receiving_task(problem, (receiver, task)) == task:
                self._received[receiver].remove(q)
                self._received[task].append(q)
                self._receiver[q] = task
                if self._recv_s[q]:
                    seeds.add(receiver)
                    lengthened = True
        for new in estimate.transfers:
            q = len(self._tensor)
            u = self._producer[new.tensor]
            self._transfer_id[new.tensor, device] = q
            self._tensor.append(new.tensor)
            self._source.append(new.source)
            self._destination.append(device)
            link_s, sender_s, receiver_s = self._prices[new.tensor]
            seconds = link_s[device]
            self._seconds.append(seconds)
            self._recv_s.append(receiver_s[device])
            self._transfer_start_s.append(new.start_s)
            self._transfer_finish_s.append(new.start_s + seconds)
            self._consumers.append([task])
            self._receiver.append(task)
            self._received[task].append(q)
            self._inputs[task].append(n + q)
            self._outgoing[u].append(n + q)
            if sender_s[device]:
                self._sends_s[u] += sender_s[device]
                seeds.add(u)
                lengthened = True
            self.arrival_s[new.tensor, device] = new.start_s + seconds
            self._sent.setdefault((new.source, device), []).append(new.tensor)
            self._link_before.append(-1)
            self._link_after.append(-1)
            if new.index >= 0:
                link = self.links.setdefault((new.source, device), BusyIntervals())
                self._link_neighbours(link.items, new.index, q, self._link_before, self._link_after)
                link.insert(new.index, new.start_s, seconds, q)
            seeds.add(n + q)
        self._not_before_s[task] = not_before_s
        seconds = self._busy_s(task, device)
        start, index = self.device_slot(device, max(estimate.ready_s, not_before_s), seconds)
        self._link_neighbours(self.devices[device].items, index, task, self._before, self._after)
        self.devices[device].insert(index, start, seconds, task)
        self.placement[task] = device
        self.start_s[task] = start
        self.finish_s[task] = start + seconds
        self.memory_used_bytes[device] += self._memory[task]
        if lengthened:
            self._retime(seeds)
        else:  # the new task and transfers took the times the estimate found, which moves nothing
            self._duration_s[task] = seconds
            self.changed_tasks, self.changed_devices = set(), set()
        return self.start_s[task]

    def drop_waits(self) -> None:
        """Forget every ``not_before_s`` given to :meth:`book` and re-time: the simulator's times for the orders."""
        waiting = {task for task, wait in enumerate(self._not_before_s) if wait > 0}
        self._not_before_s = [0.0] * self.problem.num_tasks
        if waiting:
            self._retime(waiting)

    @staticmethod
    def _link_neighbours(items: list[int], index: int, item: int, before: list[int], after: list[int]) -> None:
        """Chain ``item``, about to be inserted at ``index`` of ``items``, between its neighbours there."""
        previous = items[index - 1] if index else -1
        following = items[index] if index < len(items) else -1
        before[item], after[item] = previous, following
        if previous >= 0:
            after[previous] = item
        if following >= 0:
            before[following] = item

    def _busy_s(self, task: int, device: int) -> float:
        """How long a booked task keeps its device busy: compute, sends of its outputs, receives it takes (the
        simulator's :func:`task_duration_s`)."""
        return self._compute[task][device] + self._sends_s[task] + sum(self._recv_s[q] for q in self._received[task])

    def _retime(self, seeds: set[int]) -> None:
        """Start every task and transfer reached from ``seeds`` (tasks whose busy time or wait changed, new tasks
        and transfers, n + a transfer's id) as early as its device or link order, its inputs, its release and its
        wait allow, as the simulator does. What waits for one is visited when its finish moves (a new one's slot
        fits before the next in its order). They are taken in the order of their start before the change, which
        the orders and inputs respect, so each is mostly visited once; one whose predecessor moves after its visit
        is visited again."""
        n = self.problem.num_tasks
        placement, release, not_before = self.placement, self._release_s, self._not_before_s
        before, after, inputs, duration = self._before, self._after, self._inputs, self._duration_s
        local_consumers, outgoing = self._local_consumers, self._outgoing
        start, finish = self.start_s, self.finish_s
        transfer_start, transfer_finish = self._transfer_start_s, self._transfer_finish_s
        producer, tensor, seconds = self._producer, self._tensor, self._seconds
        link_before, link_after, consumers = self._link_before, self._link_after, self._consumers
        contention = self.contention
        for x in seeds:
            if x < n:
                duration[x] = self._busy_s(x, placement[x])
        heap = [(start[x] if x < n else transfer_start[x - n], x) for x in seeds]
        heapq.heapify(heap)
        queued = bytearray(n + len(tensor))
        for x in seeds:
            queued[x] = 1
        moved_tasks: set[int] = set()
        moved_transfers: set[int] = set()
        since: dict[int, float] = {}  # a device or link (-1 - a * k - b) -> the earliest start it moves from
        k = self.problem.num_devices
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            x = pop(heap)[1]
            queued[x] = 0
            if x < n:
                begin = max(release[x][placement[x]], not_before[x])
                if before[x] >= 0 and finish[before[x]] > begin:
                    begin = finish[before[x]]
                for y in inputs[x]:
                    ready = finish[y] if y < n else transfer_finish[y - n]
                    if ready > begin:
                        begin = ready
                end = begin + duration[x]
                ended = finish[x]
                if end != ended or begin != start[x]:
                    device = placement[x]
                    since[device] = min(since.get(device, start[x]), start[x])
                    start[x], finish[x] = begin, end
                    moved_tasks.add(x)
                if end == ended:
                    continue
                waiting = local_consumers[x] + outgoing[x]
                if after[x] >= 0:
                    waiting.append(after[x])
            else:
                q = x - n
                begin = finish[producer[tensor[q]]]
                if contention and link_before[q] >= 0 and transfer_finish[link_before[q]] > begin:
                    begin = transfer_finish[link_before[q]]
                end = begin + seconds[q]
                ended = transfer_finish[q]
                if end != ended or begin != transfer_start[q]:
                    link = -1 - self._source[q] * k - self._destination[q]
                    since[link] = min(since.get(link, transfer_start[q]), transfer_start[q])
                    transfer_start[q], transfer_finish[q] = begin, end
                    moved_transfers.add(q)
                if end == ended:
                    continue
                waiting = consumers[q]
                if contention and link_after[q] >= 0:
                    waiting = [*waiting, n + link_after[q]]
            for y in waiting:
                if not queued[y]:
                    queued[y] = 1
                    push(heap, (start[y] if y < n else transfer_start[y - n], y))
        self.changed_tasks = moved_tasks
        self.changed_devices = {placement[x] for x in moved_tasks} | {self._destination[q] for q in moved_transfers}
        for q in moved_transfers:
            self.arrival_s[tensor[q], self._destination[q]] = transfer_finish[q]
        for resource, since_s in since.items():
            if resource >= 0:
                self.devices[resource].retime(since_s, start, finish)
            elif contention:
                link = -1 - resource
                self.links[link // k, link % k].retime(since_s, transfer_start, transfer_finish)

    @property
    def order(self) -> list[list[int]]:
        """Tasks of every device in execution order."""
        return [list(intervals.items) for intervals in self.devices]

    def transfer_order(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Tensors of every used link in the order they are sent (booking order without contention)."""
        if self.contention:
            return {link: tuple(self._tensor[q] for q in busy.items) for link, busy in self.links.items() if busy.items}
        return {link: tuple(tensors) for link, tensors in self._sent.items()}

    @property
    def makespan_s(self) -> float:
        """When the tasks booked so far are done, model outputs with the driver included (:func:`output_arrival_s`),
        as the simulator measures a request."""
        booked = np.array(self.placement) >= 0
        if not booked.any():
            return 0.0
        placement = np.where(booked, self.placement, 0)
        return float(output_arrival_s(self.problem, placement, np.array(self.finish_s))[booked].max())
