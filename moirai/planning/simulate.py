"""Discrete-event simulator: the one judge of every plan's makespan.

Semantics (the contract between the simulator, the MILP and the runtime):

* Task ``i`` on device ``p(i)`` runs for :func:`moirai.planning.schedule.task_duration_s`: ``compute_s[i, p(i)]`` plus
  the sender's time (:func:`moirai.planning.schedule.send_cpu_s`) of every transfer of its outputs and the receiver's
  time (:func:`moirai.planning.schedule.recv_cpu_s`) of every transfer it receives (the first of a tensor's consumers
  on a device in topological order receives it), non-preemptively, one task at a time per device.
* Tensor ``t`` made by a task on device ``a`` is sent once to every other device ``b`` hosting
  at least one of its consumers and takes :func:`moirai.planning.schedule.transfer_duration_s`, starting no earlier
  than its producer's finish (sends included); consumers on ``a`` use it as soon as its producer finishes.
  A multi-hop route is one directed pair with its effective time.
* With ``contention=True`` transfers on one directed link ``(a, b)`` never overlap; transfers on
  different links overlap each other, and compute overlaps communication (separate streams, as
  on GPUs). A transfer starts when its producer has finished and its link is free. With
  ``contention=False`` a transfer starts as soon as its producer finishes.
* A task starts when its device has finished the task before it in the device's order and every
  input tensor is on its device. ``plan.order`` is followed exactly when given;
  ``plan.transfer_order[(a, b)]`` is followed on that link when given (with contention; without
  it links do not queue), else the link sends the tensor that became ready first (ties: lower
  tensor index).
* When ``plan.order`` is None the devices are list-scheduled: whenever a device is idle it starts,
  among its tasks whose inputs have all arrived, the one with the longest remaining path
  (:func:`upward_rank`: compute on the assigned devices plus the transfers the placement
  implies, Mayer et al.'s PCT); ties go to the earlier task in topological order.
* Every set of :attr:`Problem.colocated` runs on one device: a plan that separates one is a :class:`PlanError`.
* Memory is static: a device holds the sum of ``memory_bytes`` of its tasks. A plan that
  exceeds a device's capacity is still simulated; :attr:`Timeline.fits_memory` says so.
* Graph inputs are on every device for free; graph outputs are not sent anywhere.

Every start happens at the earliest moment the rules allow, so the simulated times of a plan
whose orders come from a feasible schedule are never later than that schedule's.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from moirai.errors import PlanError
from moirai.planning.colocation import check_colocated
from moirai.planning.plan import Plan, check_plan
from moirai.planning.problem import Problem, check_problem
from moirai.planning.schedule import (
    ImpliedTransfers,
    implied_transfers,
    output_arrival_s,
    runtime_cpu_s,
    send_priority,
    task_duration_s,
    transfer_duration_s,
)


class Transfer(NamedTuple):
    """One tensor sent over one directed link."""

    tensor: int
    src: int
    dst: int
    start: float
    finish: float


@dataclass(frozen=True, eq=False)
class Timeline:
    """Start and finish of every task and transfer of one simulated plan."""

    makespan_s: float
    task_start: np.ndarray
    task_finish: np.ndarray
    placement: np.ndarray
    transfers: list[Transfer]
    busy_s: np.ndarray
    memory_bytes: np.ndarray
    memory_capacity_bytes: np.ndarray
    contention: bool
    execution_sequences: tuple[tuple[int, ...], ...]
    runtime_cpu_s: np.ndarray  # each device's CPU time per request outside tasks and transfers (runtime_cpu_s)
    problem: Problem | None = field(default=None, repr=False)  # what was simulated: round trips read its graph

    @property
    def fits_memory(self) -> bool:
        """Whether every device holds no more than its capacity."""
        return bool(np.all(self.memory_bytes <= self.memory_capacity_bytes))

    @property
    def link_busy_s(self) -> dict[tuple[int, int], float]:
        """Seconds every used directed link spends sending, per request: tensors between tasks and the driver's
        messages, the model inputs from device 0 and the outputs back to it (:meth:`RequestCosts.link_s`)."""
        busy: dict[tuple[int, int], float] = {}
        for transfer in self.transfers:
            busy[transfer.src, transfer.dst] = (
                busy.get((transfer.src, transfer.dst), 0.0) + transfer.finish - transfer.start
            )
        if self.problem is not None:
            messages_s = self.problem.costs.link_s(self.placement)
            for a, b in zip(*np.nonzero(messages_s), strict=True):
                busy[int(a), int(b)] = busy.get((int(a), int(b)), 0.0) + float(messages_s[a, b])
        return busy

    @property
    def period_s(self) -> float:
        """The steady-state period of a stream of requests pipelined through this plan: the busiest device or
        link's time per request (each device and link serves one request at a time, requests in order); a
        device's time is its tasks' (``busy_s``) and the runtime's own work and output messages (``runtime_cpu_s``)."""
        device_s = self.busy_s + self.runtime_cpu_s
        return max(float(device_s.max(initial=0.0)), max(self.link_busy_s.values(), default=0.0))

    @property
    def served_period_s(self) -> float:
        """The period the runtime serves a stream of queued requests at, at best: :attr:`period_s`, or the longest
        round trip a part holds its device for (:attr:`round_trip_s`: the next request's part waits for it),
        whichever is longer."""
        return max(self.period_s, float(self.round_trip_s.max(initial=0.0)))

    @functools.cached_property
    def round_trip_s(self) -> np.ndarray:
        """Per device, the longest its part holds it for one request waiting for work sent elsewhere to come back
        (:func:`round_trip_s`; zeros for a timeline made without its problem)."""
        if self.problem is None:
            return np.zeros(len(self.busy_s))
        return round_trip_s(self.problem, self)

    @property
    def driver_hold_s(self) -> float:
        """How long part 0 holds the driver for one request where it waits for another device at all
        (:func:`driver_hold_s`; 0 for a timeline made without its problem)."""
        return 0.0 if self.problem is None else driver_hold_s(self.problem, self)

    @property
    def utilisation(self) -> np.ndarray:
        """Fraction of the makespan each device spends computing."""
        return self.busy_s / self.makespan_s if self.makespan_s > 0 else np.zeros_like(self.busy_s)

    def device_order(self) -> tuple[tuple[int, ...], ...]:
        """Tasks of every device in the order they ran (sorted by start time)."""
        return self.execution_sequences

    def transfer_order(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Tensors sent over every used link, in the order they were sent."""
        order: dict[tuple[int, int], list[int]] = {}
        for transfer in sorted(self.transfers, key=lambda x: (x.start, x.finish)):
            order.setdefault((transfer.src, transfer.dst), []).append(transfer.tensor)
        return {link: tuple(tensors) for link, tensors in order.items()}


def upward_rank(problem: Problem, placement: np.ndarray) -> np.ndarray:
    """Longest path from each task to a sink under ``placement``: compute plus cross-device transfers.

    Mayer et al.'s PCT (eq. 12): a task's own time on its device plus the largest, over its
    consumers, of the transfer (0 on the same device) and the consumer's rank.
    """
    placement = np.asarray(placement, int)
    tensor, consumer = problem.consumer_pairs
    src, dst = placement[problem.tensor_producer[tensor]], placement[consumer]
    with np.errstate(invalid="ignore"):  # an unlinked pair on one device costs nothing
        pair_s = np.where(src == dst, 0.0, transfer_duration_s(problem, tensor, src, dst))
    return problem.longest_path_to_sink_s(problem.compute_s[np.arange(problem.num_tasks), placement], pair_s)


def _check_runnable(problem: Problem, placement: np.ndarray, duration: np.ndarray, transfers: ImpliedTransfers) -> None:
    impossible = np.flatnonzero(~np.isfinite(duration))
    if impossible.size:
        i = int(impossible[0])
        raise PlanError(
            f"task {problem.task_names[i]!r} is placed on {problem.device_names[placement[i]]!r}, "
            "where it cannot run (infinite compute time); place it on another device"
        )
    for q, seconds in enumerate(transfers.duration):
        if not np.isfinite(seconds):
            raise PlanError(
                f"tensor {problem.tensor_names[transfers.tensor[q]]!r} must go from "
                f"{problem.device_names[transfers.src[q]]!r} to {problem.device_names[transfers.dst[q]]!r}, "
                "which have no link (infinite transfer time); co-locate its producer and consumers"
            )


def _link_sequences(problem: Problem, plan: Plan, transfers: ImpliedTransfers) -> dict[int, list[int]]:
    """The transfer order the plan prescribes on each link, as transfer indices (link = a * K + b)."""
    k = problem.num_devices
    on_link: dict[tuple[int, int], dict[int, int]] = {}
    for q, (t, a, b) in enumerate(zip(transfers.tensor, transfers.src, transfers.dst, strict=True)):
        on_link.setdefault((a, b), {})[t] = q
    sequences: dict[int, list[int]] = {}
    for (a, b), tensors in (plan.transfer_order or {}).items():
        expected = on_link.get((a, b), {})
        if sorted(tensors) != sorted(expected):
            missing = sorted(set(expected) - set(tensors))
            extra = sorted(set(tensors) - set(expected))
            twice = sorted({t for t in tensors if list(tensors).count(t) > 1})
            raise PlanError(
                f"transfer_order for link {problem.device_names[a]!r} -> {problem.device_names[b]!r} must list "
                f"exactly the tensors the placement sends over it once each (missing {missing}, not sent {extra}"
                + (f", listed twice {twice})" if twice else ")")
            )
        sequences[a * k + b] = [expected[t] for t in tensors]
    return sequences


def simulate(problem: Problem, plan: Plan, contention: bool = True) -> Timeline:
    """Simulate ``plan`` on ``problem``; raise :class:`PlanError` if its orders deadlock or it separates a colocated
    set of tasks."""
    check_problem(problem, "moirai.simulate's problem")
    check_plan(plan, "moirai.simulate's plan")
    plan.check(problem)
    check_colocated(problem, plan.placement)
    n, k = problem.num_tasks, problem.num_devices
    placement = plan.placement
    transfers = implied_transfers(problem, placement)
    duration_array = task_duration_s(problem, placement, transfers)
    _check_runnable(problem, placement, duration_array, transfers)
    duration = duration_array.tolist()
    device_of = placement.tolist()
    release = problem.costs.release_s[np.arange(n), placement].tolist()
    inputs_needed = transfers.inputs_needed
    local_consumers, by_producer = transfers.local_consumers, transfers.by_producer
    transfer_duration, transfer_consumers = transfers.duration, transfers.consumers
    link_of = [a * k + b for a, b in zip(transfers.src, transfers.dst, strict=True)]
    num_transfers = len(link_of)

    ordered = plan.order is not None
    if ordered:
        device_queue = [list(tasks) for tasks in plan.order]
        head = [0] * k
    else:
        rank = upward_rank(problem, placement).tolist()
        task_at = problem.topological_order
        priority = [(0.0, 0)] * n  # (-rank, topological position): the heap pops the longest path first
        for p, u in enumerate(task_at):
            priority[u] = (-rank[u], p)
        ready_heap: list[list[tuple[float, int]]] = [[] for _ in range(k)]
        for u in range(n):
            if inputs_needed[u] == 0:
                ready_heap[device_of[u]].append(priority[u])
        for waiting in ready_heap:
            heapq.heapify(waiting)
    link_sequences = _link_sequences(problem, plan, transfers) if contention else {}
    link_head = dict.fromkeys(link_sequences, 0)
    link_fifo: dict[int, list[tuple[float, int, int]]] = {}
    producer_done = [False] * num_transfers
    link_busy: set[int] = set()
    device_busy = [False] * k

    task_start = [0.0] * n
    task_finish = [0.0] * n
    transfer_start = [0.0] * num_transfers
    transfer_finish = [0.0] * num_transfers
    sequences: list[list[int]] = [[] for _ in range(k)]
    events: list[tuple[float, int]] = []  # (time, code): code < n is a task, else n + transfer
    dirty_devices: set[int] = set(range(k))
    dirty_links: set[int] = set()
    now = 0.0

    def input_arrived(c: int) -> None:
        inputs_needed[c] -= 1
        if inputs_needed[c] == 0:
            d = device_of[c]
            if not ordered:
                heapq.heappush(ready_heap[d], priority[c])
            dirty_devices.add(d)

    while True:
        for d in dirty_devices:
            if device_busy[d]:
                continue
            if ordered:
                if head[d] == len(device_queue[d]) or inputs_needed[device_queue[d][head[d]]]:
                    continue
                u = device_queue[d][head[d]]
                head[d] += 1
            else:
                if not ready_heap[d]:
                    continue
                u = task_at[heapq.heappop(ready_heap[d])[1]]
            device_busy[d] = True
            task_start[u] = max(now, release[u])
            sequences[d].append(u)
            heapq.heappush(events, (task_start[u] + duration[u], u))
        dirty_devices.clear()
        for link in dirty_links:
            if link in link_busy:
                continue
            if link in link_sequences:
                sequence = link_sequences[link]
                if link_head[link] == len(sequence) or not producer_done[sequence[link_head[link]]]:
                    continue
                q = sequence[link_head[link]]
                link_head[link] += 1
            else:
                fifo = link_fifo.get(link)
                if not fifo:
                    continue
                q = heapq.heappop(fifo)[2]
            link_busy.add(link)
            transfer_start[q] = now
            heapq.heappush(events, (now + transfer_duration[q], n + q))
        dirty_links.clear()
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] == now:
            code = heapq.heappop(events)[1]
            if code < n:
                task_finish[code] = now
                d = device_of[code]
                device_busy[d] = False
                dirty_devices.add(d)
                for c in local_consumers[code]:
                    input_arrived(c)
                for q in by_producer[code]:
                    producer_done[q] = True
                    if contention:
                        link = link_of[q]
                        if link not in link_sequences:
                            waiting = (*send_priority(now, transfers.tensor[q]), q)
                            heapq.heappush(link_fifo.setdefault(link, []), waiting)
                        dirty_links.add(link)
                    else:
                        transfer_start[q] = now
                        heapq.heappush(events, (now + transfer_duration[q], n + q))
            else:
                q = code - n
                transfer_finish[q] = now
                if contention:
                    link_busy.discard(link_of[q])
                    dirty_links.add(link_of[q])
                for c in transfer_consumers[q]:
                    input_arrived(c)

    if sum(len(s) for s in sequences) < n:
        raise PlanError(_deadlock_message(problem, plan, sequences, inputs_needed))
    busy = np.bincount(placement, weights=duration_array, minlength=k) if n else np.zeros(k)
    memory = np.bincount(placement, weights=problem.memory_bytes, minlength=k) if n else np.zeros(k)
    transfer_list = [
        Transfer(t, a, b, s, f)
        for t, a, b, s, f in zip(
            transfers.tensor, transfers.src, transfers.dst, transfer_start, transfer_finish, strict=True
        )
    ]
    finish = np.array(task_finish)
    return Timeline(
        makespan_s=float(output_arrival_s(problem, placement, finish).max()) if n else 0.0,
        task_start=np.array(task_start),
        task_finish=finish,
        placement=placement.copy(),
        transfers=transfer_list,
        busy_s=busy,
        memory_bytes=memory,
        memory_capacity_bytes=problem.memory_capacity_bytes.copy(),
        contention=contention,
        execution_sequences=tuple(tuple(s) for s in sequences),
        runtime_cpu_s=runtime_cpu_s(problem, placement),
        problem=problem,
    )


def _deadlock_message(problem: Problem, plan: Plan, sequences: list[list[int]], inputs_needed: list[int]) -> str:
    stuck = []
    for d, tasks in enumerate(plan.order or ()):
        if len(sequences[d]) < len(tasks):
            waiting = tasks[len(sequences[d])]
            stuck.append(
                f"{problem.device_names[d]!r} waits to run {problem.task_names[waiting]!r} "
                f"({inputs_needed[waiting]} input(s) never arrive)"
            )
    detail = "; ".join(stuck) or "a link's transfer_order waits for a tensor whose producer never runs"
    return (
        f"the plan's per-device orders (and transfer orders) are jointly inconsistent and deadlock: {detail}. "
        "Give orders that follow one topological order of the graph."
    )


def round_trip_s(problem: Problem, timeline: Timeline) -> np.ndarray:
    """Per device, the longest time its part holds the device for one request while waiting for work it sent to
    another device to come back: from the start of a task whose output returns to this device through another's
    tasks to the finish of the task it returns to (0 for a device no path leaves and re-enters).

    The runtime runs a part whole, request after request, so such a part holds its device for that long whatever
    its busy time: a pipeline's period is at least the longest round trip. A part that only waits for its inputs
    (a pipeline stage) has none: the wait is the pipeline filling. On device 0 too, where requests are queued: the
    driver sends every queued request's inputs before it runs part 0 of the oldest, so a later stage on device 0
    finds the earlier stages busy with the next requests ([Note: end on rank 0]; :func:`driver_hold_s` is the
    exception, a driver that has no next request to send).
    """
    placement = timeline.placement
    order = problem.topological_order
    held = np.zeros(problem.num_devices)
    for device in devices_with_round_trips(problem, placement):
        # earliest[i]: the earliest start of a task on ``device`` from which task i is reached (itself included);
        # returning[i]: the same over paths that pass through another device's tasks on the way to task i.
        earliest = np.full(problem.num_tasks, np.inf)
        returning = np.full(problem.num_tasks, np.inf)
        for task in order:
            here = placement[task] == device
            for predecessor in problem.predecessors[task]:
                earliest[task] = min(earliest[task], earliest[predecessor])
                away = placement[predecessor] != device
                returning[task] = min(returning[task], earliest[predecessor] if away else returning[predecessor])
            if here:
                earliest[task] = min(earliest[task], timeline.task_start[task])
                if np.isfinite(returning[task]):
                    held[device] = max(held[device], timeline.task_finish[task] - returning[task])
    return held


def devices_with_round_trips(problem: Problem, placement: np.ndarray) -> list[int]:
    """The devices some path of tasks leaves and re-enters under ``placement``, in order: those
    :func:`round_trip_s` may hold (one pass over the edges, where timing each device's round trips takes one per
    device; a search asks it of every placement it judges)."""
    on = np.asarray(placement, int).tolist()
    # reached[i]: devices with a task from which a path reaches task i (its own included); left[i]: devices such a
    # path has left (passed through another device's task) on its way to task i, bit d for device d.
    reached, left = [0] * problem.num_tasks, [0] * problem.num_tasks
    returned = 0
    for task in problem.topological_order:
        own, came, came_left = 1 << on[task], 0, 0
        for predecessor in problem.predecessors[task]:
            came |= reached[predecessor]
            came_left |= left[predecessor]
        returned |= came_left & own
        reached[task] = came | own
        left[task] = came_left | (came & ~own)
    return [device for device in range(problem.num_devices) if returned >> device & 1]


def driver_hold_s(problem: Problem, timeline: Timeline) -> float:
    """How long part 0 holds device 0 for one request where some task of it waits for another device: from the
    request's start to part 0's last finish (0 where part 0 waits for nothing but the request's inputs).

    The driver sends a request's inputs and then runs part 0 in the same thread; a request that arrives meanwhile
    waits for part 0 to finish before its inputs go out. Where each request is made only after an earlier one's
    result came back (a sequence's next decode step), the earlier stages therefore wait for device 0's later stage:
    a plan whose later stage was device 0's ran two decode steps in flight no faster than one.
    """
    on_driver = np.flatnonzero(timeline.placement == 0)
    if any(timeline.placement[p] != 0 for task in on_driver for p in problem.predecessors[task]):
        return float(timeline.task_finish[on_driver].max())
    return 0.0
