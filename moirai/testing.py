"""Problem builders that tests and benches share: the one random-problem generator, random layered DAGs, and the
one true brute-force optimum. Torch-free, like the planning core it feeds."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import networkx as nx
import numpy as np

from moirai.errors import PlanError
from moirai.planning.bounds import placement_bound_s
from moirai.planning.costs import RequestCosts
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate

# Every cost random_problem can draw beyond compute and transfers, at a scale that matters next to them.
EVERY_COST = {
    "send_cpu_s": 0.5,
    "recv_cpu_s": 0.5,
    "request_cpu_s": 0.3,
    "output_cpu_s": 0.3,
    "input_s": 0.3,
    "driver_part_cpu_s": 0.3,
}


def random_problem(
    seed: int | np.random.Generator,
    num_tasks: int | None = None,
    num_devices: int | None = None,
    *,
    slowdown: float = 1.0,
    task_memory_bytes: float = 0.0,
    capacity_bytes: float | Sequence[float] = math.inf,
    forbid_fraction: float = 0.0,
    send_cpu_s: float = 0.0,
    recv_cpu_s: float = 0.0,
    header_s: float = 0.0,
    output_s: float = 0.0,
    request_cpu_s: float = 0.0,
    output_cpu_s: float = 0.0,
    input_s: float = 0.0,
    driver_part_cpu_s: float = 0.0,
) -> Problem:
    """A random DAG: every task reads up to two earlier tasks, a producer's tensor is shared by two consumers
    half the time (it crosses to a device once), compute and per-link transfer times are random.

    ``num_tasks``/``num_devices`` default to 4-7 tasks and 2-3 devices drawn from the seed (small enough for
    :func:`brute_force_optimum`). ``slowdown``: device ``d`` is ``1 + (slowdown - 1) d / (K - 1)`` times
    slower than device 0. Every task holds ``task_memory_bytes``; devices hold ``capacity_bytes`` (one number
    or one per device). ``forbid_fraction`` of the tasks cannot run on one random device (infinite time).
    ``send_cpu_s``: every transfer keeps its sending device busy for a random time up to this, ``recv_cpu_s`` its
    receiving device (drawn last, so the rest of the problem is that of the same seed without them).
    ``header_s``: every device but the first waits a random time up to this for its header (drawn after them).
    ``output_s``: the last two tasks make model outputs that take a random time up to this to reach the first
    device from the others (drawn last).
    ``input_s``: two model inputs, each read by two or three random tasks, whose messages from the first device take
    a random time up to this to arrive, cost both ends CPU time up to half of it and hold the link up to half of it;
    their outputs' messages hold the link too (drawn after everything else).
    ``driver_part_cpu_s``: the first device is charged a random time up to this for every other device taking part
    (drawn last).
    """
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    n = int(rng.integers(4, 8)) if num_tasks is None else num_tasks
    k = int(rng.integers(2, 4)) if num_devices is None else num_devices
    producers: list[int] = []
    consumers: list[tuple[int, ...]] = []
    for v in range(1, n):
        parents = rng.choice(v, size=int(rng.integers(0, min(v, 2) + 1)), replace=False)
        for u in parents.tolist():
            shared = [t for t, p in enumerate(producers) if p == u]
            if shared and rng.random() < 0.5:
                consumers[shared[0]] = consumers[shared[0]] + (v,)
            else:
                producers.append(u)
                consumers.append((v,))
    transfer = rng.uniform(0.1, 2.0, (len(producers), k, k)).round(2)
    transfer[:, np.arange(k), np.arange(k)] = 0.0
    compute = rng.uniform(0.5, 3.0, (n, k)).round(2) * np.linspace(1.0, slowdown, k)
    if forbid_fraction > 0 and k > 1:
        forbidden = np.flatnonzero(rng.random(n) < forbid_fraction)
        compute[forbidden, rng.integers(0, k, forbidden.size)] = np.inf
    sender = np.zeros_like(transfer)
    if send_cpu_s > 0:
        sender = rng.uniform(0.0, send_cpu_s, transfer.shape).round(2)
        sender[:, np.arange(k), np.arange(k)] = 0.0
    receiver = np.zeros_like(transfer)
    if recv_cpu_s > 0:
        receiver = rng.uniform(0.0, recv_cpu_s, transfer.shape).round(2)
        receiver[:, np.arange(k), np.arange(k)] = 0.0
    header = np.zeros(k)
    if header_s > 0:
        header[1:] = rng.uniform(0.0, header_s, k - 1).round(2)
    output = np.zeros((n, k))
    if output_s > 0:
        output[-2:, 1:] = rng.uniform(0.0, output_s, (2, k - 1)).round(2)
    request_cpu = rng.uniform(0.0, request_cpu_s, k).round(2) if request_cpu_s > 0 else np.zeros(k)
    output_send, output_recv = np.zeros((n, k)), np.zeros((n, k))
    if output_cpu_s > 0:  # the last two tasks make model outputs; sending them to device 0 costs both ends
        output_send[-2:, 1:] = rng.uniform(0.0, output_cpu_s, (2, k - 1)).round(2)
        output_recv[-2:, 1:] = rng.uniform(0.0, output_cpu_s, (2, k - 1)).round(2)
    readers: list[list[int]] = []
    inputs = {name: np.zeros((0, k)) for name in ("input_s", "input_send_cpu_s", "input_recv_cpu_s", "input_link_s")}
    output_link = np.zeros((n, k))
    if input_s > 0:
        readers = [rng.choice(n, size=int(rng.integers(2, 4)), replace=False).tolist() for _ in range(2)]
        for name, most_s in zip(inputs, (input_s, input_s / 2, input_s / 2, input_s / 2), strict=True):
            inputs[name] = rng.uniform(0.0, most_s, (2, k)).round(2)
            inputs[name][:, 0] = 0.0
        output_link[-2:, 1:] = rng.uniform(0.0, input_s / 2, (2, k - 1)).round(2)
    driver_part = np.zeros(k)
    if driver_part_cpu_s > 0:
        driver_part[1:] = rng.uniform(0.0, driver_part_cpu_s, k - 1).round(2)
    return Problem(
        device_names=tuple(f"dev{d}" for d in range(k)),
        memory_capacity_bytes=np.broadcast_to(np.asarray(capacity_bytes, float), (k,)).copy(),
        task_names=tuple(f"task{i}" for i in range(n)),
        compute_s=compute,
        memory_bytes=np.full(n, float(task_memory_bytes)),
        tensor_names=tuple(f"tensor{t}" for t in range(len(producers))),
        tensor_producer=np.array(producers, int),
        tensor_consumers=tuple(consumers),
        transfer_s=transfer,
        send_cpu_s=sender,
        recv_cpu_s=receiver,
        costs=RequestCosts.build(
            n,
            k,
            readers,
            **inputs,
            output_link_s=output_link,
            header_s=header,
            output_s=output,
            request_cpu_s=request_cpu,
            driver_part_cpu_s=driver_part,
            output_send_cpu_s=output_send,
            output_recv_cpu_s=output_recv,
        ),
    )


def random_layered_problem(
    num_tasks: int,
    num_devices: int,
    seed: int = 0,
    width: int = 3,
    communication_ratio: float = 1.0,
    cpu_ratio: float = 0.0,
) -> Problem:
    """A random layered DAG on heterogeneous devices: layers of 1 to ``2 width`` tasks, each reading the output of
    1-3 tasks of the layer before (one tensor per task, sent once to each device that reads it); devices differ
    in speed and per-task affinity; transfer times are ``communication_ratio`` times the mean compute on average.
    ``cpu_ratio``: a transfer keeps its sender and its receiver busy for a random fraction, up to this, of its
    transfer time each (drawn last, so the rest is the problem of the same seed without them)."""
    rng = np.random.default_rng(seed)
    layers: list[list[int]] = []
    placed = 0
    while placed < num_tasks:
        size = int(min(rng.integers(1, 2 * width), num_tasks - placed))
        layers.append(list(range(placed, placed + size)))
        placed += size
    consumers: list[list[int]] = [[] for _ in range(num_tasks)]
    for previous, layer in zip(layers, layers[1:], strict=False):
        for v in layer:
            for u in rng.choice(previous, size=min(len(previous), int(rng.integers(1, 4))), replace=False):
                consumers[int(u)].append(v)
    producers = [u for u in range(num_tasks) if consumers[u]]
    speed = rng.uniform(1.0, 3.0, num_devices)
    base = rng.uniform(1e-4, 1e-3, num_tasks)
    compute = base[:, None] / speed[None, :] * rng.uniform(0.7, 1.3, (num_tasks, num_devices))
    bandwidth = rng.uniform(0.5, 2.0, (num_devices, num_devices))
    size = rng.uniform(0.2, 1.8, len(producers)) * compute.mean() * communication_ratio
    transfer = size[:, None, None] / bandwidth[None]
    transfer[:, np.arange(num_devices), np.arange(num_devices)] = 0.0
    send, recv = (transfer * rng.uniform(0.0, cpu_ratio, transfer.shape) for _ in range(2))
    return Problem(
        device_names=tuple(f"dev{d}" for d in range(num_devices)),
        memory_capacity_bytes=np.full(num_devices, np.inf),
        task_names=tuple(f"task{i}" for i in range(num_tasks)),
        compute_s=compute,
        memory_bytes=np.zeros(num_tasks),
        tensor_names=tuple(f"out{u}" for u in producers),
        tensor_producer=np.array(producers, int),
        tensor_consumers=tuple(tuple(consumers[u]) for u in producers),
        transfer_s=transfer,
        send_cpu_s=send,
        recv_cpu_s=recv,
    )


def brute_force_optimum(problem: Problem, contention: bool = True) -> float:
    """The true optimum: the best simulated makespan over every placement that fits memory and keeps every colocated
    set on one device, every device order and (with contention) every order on every link; ``inf`` when no placement
    fits. Placements are visited by
    a lower bound (:func:`moirai.planning.bounds.placement_bound_s`) and the search stops when that bound
    reaches the best found."""
    k = problem.num_devices
    topological_orders = list(nx.all_topological_sorts(problem.graph))
    placements = [np.array(p, int) for p in itertools.product(range(k), repeat=problem.num_tasks)]  # () too
    placements = [
        p
        for p in placements
        if np.all(np.bincount(p, weights=problem.memory_bytes, minlength=k) <= problem.memory_capacity_bytes)
        and np.all(problem.runs_on[np.arange(problem.num_tasks), p])
        and all(len(set(p[list(members)].tolist())) == 1 for members in problem.colocated)
    ]
    best = math.inf
    for bound, placement in sorted(((placement_bound_s(problem, p), p) for p in placements), key=lambda bp: bp[0]):
        if bound >= best * (1 - 1e-12):  # relative: problems in nanoseconds are below any absolute tolerance
            break
        orders = {tuple(tuple(i for i in order if placement[i] == d) for d in range(k)) for order in topological_orders}
        links = link_tensors(problem, placement) if contention else {}
        for order in orders:
            for link_orders in itertools.product(*(itertools.permutations(ts) for ts in links.values())):
                plan = Plan(placement, problem.device_names, order, dict(zip(links, link_orders, strict=True)))
                try:
                    best = min(best, simulate(problem, plan, contention).makespan_s)
                except PlanError:
                    continue  # link orders that contradict the device orders deadlock
    return best


def link_tensors(problem: Problem, placement: np.ndarray) -> dict[tuple[int, int], tuple[int, ...]]:
    links: dict[tuple[int, int], set[int]] = {}
    for t, consumers in enumerate(problem.tensor_consumers):
        a = int(placement[problem.tensor_producer[t]])
        for c in consumers:
            if placement[c] != a:
                links.setdefault((a, int(placement[c])), set()).add(t)
    return {link: tuple(sorted(ts)) for link, ts in links.items()}
