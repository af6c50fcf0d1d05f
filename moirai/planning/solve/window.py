"""Windows of the MILP and the bounds that tighten a model: what is free, what is fixed, what cannot happen.

A :class:`Window` frees some tasks of a schedule and summarises the rest (finish times before it,
tails after it); :func:`whole_problem` frees every task. From a window and a horizon (an upper bound
on the objective) the functions here derive each free task's allowed devices, its time window, its
head and tail on every device, and the groups of identical devices, which :mod:`moirai.planning.solve.model`
turns into variable bounds, big-Ms and fixed orders.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx
import numpy as np

from moirai.planning.bounds import earliest_start_s
from moirai.planning.problem import Problem
from moirai.planning.schedule.transfers import transfer_duration_s


@dataclass(frozen=True)
class Window:
    """What a model decides (``free_tasks``) and what it takes as given; see :func:`whole_problem`.

    ``placement``: device of every task (for free tasks, their current device, used as a start).
    ``fixed_finish_s``: finish of each task scheduled before the window, ``nan`` for the others.
    ``arrived_s``: ``(tensor, device) -> time`` for transfers already made before the window.
    ``device_ready_s`` / ``link_ready_s[a, b]``: when each device / directed link is free of them (a device
    is not ready before its header, :attr:`moirai.planning.costs.RequestCosts.header_s`).
    ``tail_s[f, k]``: time the plan runs on after free task ``free_tasks[f]`` finishes on ``k``.
    ``horizon_s``: an upper bound on the best objective (the current solution's).
    ``deadline_s``: a time by which every transfer of the current solution has finished.
    """

    free_tasks: tuple[int, ...]
    placement: np.ndarray
    fixed_finish_s: np.ndarray
    arrived_s: dict[tuple[int, int], float]
    device_ready_s: np.ndarray
    link_ready_s: np.ndarray
    tail_s: np.ndarray
    horizon_s: float
    deadline_s: float


def whole_problem(problem: Problem, horizon_s: float) -> Window:
    """The window that frees every task: the full MILP."""
    n, k = problem.num_tasks, problem.num_devices
    return Window(
        free_tasks=tuple(range(n)),
        placement=np.zeros(n, int),
        fixed_finish_s=np.full(n, np.nan),
        arrived_s={},
        device_ready_s=problem.costs.header_s.copy(),
        link_ready_s=np.zeros((k, k)),
        tail_s=np.zeros((n, k)),
        horizon_s=horizon_s,
        deadline_s=horizon_s,
    )


def allowed_devices(problem: Problem, tasks: Iterable[int]) -> dict[int, tuple[int, ...]]:
    return {i: tuple(int(k) for k in np.flatnonzero(problem.fits[i])) for i in tasks}


def time_windows(
    problem: Problem, window: Window, allowed: dict[int, tuple[int, ...]], free_graph: nx.DiGraph
) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Earliest start, latest finish and the shortest possible duration of every free task (seconds)."""
    fastest = {i: float(min(problem.compute_s[i, k] for k in allowed[i])) for i in window.free_tasks}
    position = {i: f for f, i in enumerate(window.free_tasks)}
    earliest: dict[int, float] = {}
    for i in nx.topological_sort(free_graph):
        ready = min(float(window.device_ready_s[k]) for k in allowed[i])
        for u in problem.predecessors[i]:
            if u in position:
                ready = max(ready, earliest[u] + fastest[u])
            elif not math.isnan(window.fixed_finish_s[u]):
                ready = max(ready, float(window.fixed_finish_s[u]))
        earliest[i] = ready
    tail: dict[int, float] = {}
    for i in reversed(list(nx.topological_sort(free_graph))):
        after = min(float(window.tail_s[position[i], k]) for k in allowed[i])
        for j in free_graph.successors(i):
            after = max(after, fastest[j] + tail[j])
        tail[i] = after
    latest_finish = {i: window.horizon_s - tail[i] for i in window.free_tasks}
    return earliest, latest_finish, fastest


def device_heads_and_tails(
    problem: Problem, window: Window, allowed: dict[int, tuple[int, ...]], free_graph: nx.DiGraph
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """For every free task ``i`` and device ``k`` it may run on (seconds, keyed ``(i, k)``):

    ``head``: the earliest ``i`` can start on ``k``: each input comes from its producer's best device,
    plus the transfer when that is not ``k`` (links never wait: a lower bound).
    ``tail``: the least time the plan runs on after ``i`` finishes on ``k``, the same way forwards.
    """
    position = {i: f for f, i in enumerate(window.free_tasks)}
    order = list(nx.topological_sort(free_graph))
    head: dict[tuple[int, int], float] = {}
    for i in order:
        free_producers = [u for u in problem.predecessors[i] if u in position]
        # Free producers on the same device run one at a time; the others send (moirai.planning.bounds).
        from_free = earliest_start_s(*_producer_times(problem, i, free_producers, allowed, head))
        for k in allowed[i]:
            ready = max(float(window.device_ready_s[k]), float(from_free[k]))
            for t in problem.input_tensors[i]:
                u = int(problem.tensor_producer[t])
                if u in position:
                    continue
                elif (t, k) in window.arrived_s:
                    arrival = window.arrived_s[t, k]
                elif math.isnan(window.fixed_finish_s[u]):
                    continue
                else:
                    a = int(window.placement[u])
                    arrival = window.fixed_finish_s[u] + (0.0 if a == k else transfer_duration_s(problem, t, a, k))
                ready = max(ready, float(arrival))
            head[i, k] = ready
    tail: dict[tuple[int, int], float] = {}
    for i in reversed(order):
        for k in allowed[i]:
            after = float(window.tail_s[position[i], k])
            for t in problem.output_tensors[i]:
                for j in problem.tensor_consumers[t]:
                    if j in position:
                        after = max(
                            after,
                            min(
                                (0.0 if b == k else transfer_duration_s(problem, t, k, b))
                                + problem.compute_s[j, b]
                                + tail[j, b]
                                for b in allowed[j]
                            ),
                        )
            tail[i, k] = after
    return head, tail


def _producer_times(
    problem: Problem,
    i: int,
    producers: list[int],
    allowed: dict[int, tuple[int, ...]],
    head: dict[tuple[int, int], float],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For :func:`moirai.planning.bounds.earliest_start_s`: per producer of ``i`` (rows) and device (columns), the
    earliest its tensors for ``i`` arrive from its best other device, and its earliest start and compute there."""
    k = problem.num_devices
    arrival = np.full((len(producers), k), np.inf)
    start = np.full((len(producers), k), np.inf)
    compute = np.full((len(producers), k), np.inf)
    for row, u in enumerate(producers):
        tensors = [t for t in problem.output_tensors[u] if i in problem.tensor_consumers[t]]
        for a in allowed[u]:
            start[row, a], compute[row, a] = head[u, a], problem.compute_s[u, a]
            link = np.max([transfer_duration_s(problem, t, a, np.arange(k)) for t in tensors], axis=0)
            through = head[u, a] + problem.compute_s[u, a] + link
            through[a] = np.inf
            np.minimum(arrival[row], through, out=arrival[row])
    return arrival, start, compute


def devices_in_time(
    problem: Problem,
    allowed: dict[int, tuple[int, ...]],
    head_s: dict[tuple[int, int], float],
    tail_s: dict[tuple[int, int], float],
    horizon_s: float,
) -> dict[int, tuple[int, ...]]:
    """``allowed`` without the devices on which a task cannot run between its head and tail inside the horizon."""
    return {
        i: tuple(k for k in devices if head_s[i, k] + problem.compute_s[i, k] + tail_s[i, k] <= horizon_s * (1 + 1e-9))
        for i, devices in allowed.items()
    }


def descendant_sets(graph: nx.DiGraph) -> dict[int, set[int]]:
    return {i: nx.descendants(graph, i) for i in graph.nodes}


def identical_device_groups(problem: Problem, ignoring_driver: bool = False) -> tuple[tuple[int, ...], ...]:
    """Groups (of two or more) of devices no plan can tell apart: same times, memory, links, header delay and
    runtime work per request (every per-request cost), device 0 only where nothing charges it alone
    (``ignoring_driver``: whatever their per-request costs, :attr:`Problem.costs`)."""
    k = problem.num_devices
    groups: list[list[int]] = []
    for d in range(k):
        for group in groups:
            if _devices_identical(problem, group[0], d, ignoring_driver):
                group.append(d)
                break
        else:
            groups.append([d])
    return tuple(tuple(g) for g in groups if len(g) > 1)


def _devices_identical(problem: Problem, a: int, b: int, ignoring_driver: bool) -> bool:
    if not np.array_equal(problem.compute_s[:, a], problem.compute_s[:, b]):
        return False
    if not ignoring_driver:
        if not problem.costs.same_for(a, b):
            return False
        if 0 in (a, b) and problem.costs.charges.singles_out_driver():
            return False
    if problem.memory_capacity_bytes[a] != problem.memory_capacity_bytes[b]:
        return False
    swap = np.arange(problem.num_devices)
    swap[a], swap[b] = b, a
    return all(
        np.array_equal(matrix, matrix[:, swap][:, :, swap])
        for matrix in (problem.transfer_s, problem.send_cpu_s, problem.recv_cpu_s)
    )


def device_pair_kinds(
    free: tuple[int, ...],
    allowed: dict[int, tuple[int, ...]],
    descendants: dict[int, set[int]],
    earliest_s: dict[int, float],
    latest_finish_s: dict[int, float],
    fastest_s: dict[int, float],
    strong: bool,
) -> dict[tuple[int, int], str]:
    """Which incomparable pairs need a non-overlap constraint, and which kind."""
    kinds: dict[tuple[int, int], str] = {}
    for a, i in enumerate(free):
        for j in free[a + 1 :]:
            if j in descendants[i] or i in descendants[j] or not set(allowed[i]) & set(allowed[j]):
                continue
            if not strong:
                kinds[i, j] = "delta"
                continue
            if latest_finish_s[i] <= earliest_s[j] or latest_finish_s[j] <= earliest_s[i]:
                continue  # the windows alone keep them apart
            i_first = earliest_s[i] + fastest_s[i] <= latest_finish_s[j] - fastest_s[j] + 1e-12
            j_first = earliest_s[j] + fastest_s[j] <= latest_finish_s[i] - fastest_s[i] + 1e-12
            kinds[i, j] = {(True, True): "delta", (True, False): "i_first", (False, True): "j_first"}.get(
                (i_first, j_first), "apart"
            )
    return kinds


def transfer_pair_kinds(
    problem: Problem,
    transfers: dict[tuple[int, int], tuple[int, ...]],
    descendants: dict[int, set[int]],
    free_set: set[int],
    earliest_s: dict[tuple[int, int], float],
    latest_s: dict[tuple[int, int], float],
    strong: bool,
) -> dict[tuple[tuple[int, int], tuple[int, int]], str]:
    """Pairs of transfers that may share a directed link: "delta", or "q_first" when a path orders them."""
    by_destination: dict[int, list[tuple[int, int]]] = {}
    for q in transfers:
        by_destination.setdefault(q[1], []).append(q)
    kinds: dict[tuple[tuple[int, int], tuple[int, int]], str] = {}
    for queue in by_destination.values():
        for a, q in enumerate(queue):
            for r in queue[a + 1 :]:
                if not set(transfers[q]) & set(transfers[r]):
                    continue
                if not strong:
                    kinds[q, r] = "delta"
                    continue
                if latest_s[q] <= earliest_s[r] or latest_s[r] <= earliest_s[q]:
                    continue
                if transfer_precedes(problem, q, r, descendants, free_set):
                    kinds[q, r] = "q_first"
                elif transfer_precedes(problem, r, q, descendants, free_set):
                    kinds[r, q] = "q_first"
                else:
                    kinds[q, r] = "delta"
    return kinds


def transfer_precedes(
    problem: Problem, q: tuple[int, int], r: tuple[int, int], descendants: dict[int, set[int]], free_set: set[int]
) -> bool:
    """Transfer q must end before r starts: every consumer of q's tensor leads to (or is) r's producer."""
    producer = int(problem.tensor_producer[r[0]])
    consumers = problem.tensor_consumers[q[0]]
    return producer in free_set and all(
        c in free_set and (c == producer or producer in descendants[c]) for c in consumers
    )
