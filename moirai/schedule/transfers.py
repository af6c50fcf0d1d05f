"""What a transfer costs, in which order a link sends, and which transfers a placement implies."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moirai.problem import Problem


def transfer_duration_s(problem: Problem, tensor: int | np.ndarray, src: int | np.ndarray, dst: int | np.ndarray):
    """Seconds the directed link ``src -> dst`` is busy sending ``tensor``: the one place that says what a
    transfer costs. Every schedule (simulator, list schedulers, HEFT, start plans) asks this function; the
    MILP's transfer rows (:mod:`moirai.solve.model`) mirror it.

    Takes scalars or equally shaped index arrays (the simulator prices a whole placement at once).
    A fixed per-transfer cost is a term added here; CPU time a transfer takes from the sending and
    receiving devices belongs next to it, booked by :meth:`ScheduleBuilder._book_transfer` and the
    simulator's transfer events.
    """
    return problem.transfer_s[tensor, src, dst]


def send_priority(ready_s: float, tensor: int) -> tuple[float, int]:
    """The order a link sends waiting tensors in: first ready, first sent; ties go to the lower tensor index."""
    return ready_s, tensor


class ImpliedTransfers(NamedTuple):
    """The transfers a placement implies (one per tensor and destination device), and who waits for what."""

    tensor: list[int]
    src: list[int]
    dst: list[int]
    duration: list[float]
    consumers: list[list[int]]  # tasks that wait for each transfer
    by_producer: list[list[int]]  # transfers each task triggers when it finishes
    local_consumers: list[list[int]]  # tasks on the producer's device that wait for each task
    inputs_needed: list[int]  # distinct input tensors of every task


def implied_transfers(problem: Problem, placement: np.ndarray) -> ImpliedTransfers:
    """Every transfer ``placement`` needs: a tensor crosses to a device once, whatever its consumers there."""
    n = problem.num_tasks
    pair_tensor = np.fromiter((t for t, cs in enumerate(problem.tensor_consumers) for _ in cs), int, count=-1)
    pair_consumer = np.fromiter((c for cs in problem.tensor_consumers for c in cs), int, count=-1)
    if pair_tensor.size:
        unique_pairs = np.unique(np.stack([pair_tensor, pair_consumer], axis=1), axis=0)
        pair_tensor, pair_consumer = unique_pairs[:, 0], unique_pairs[:, 1]
    producer = problem.tensor_producer[pair_tensor]
    src = placement[producer]
    dst = placement[pair_consumer]
    inputs_needed = np.bincount(pair_consumer, minlength=n).tolist()

    local_consumers: list[list[int]] = [[] for _ in range(n)]
    local = src == dst
    for u, c in zip(producer[local].tolist(), pair_consumer[local].tolist(), strict=True):
        local_consumers[u].append(c)

    remote = ~local
    # One transfer per (tensor, destination device); consumers on that device share it.
    keys = pair_tensor[remote] * problem.num_devices + dst[remote]
    unique_keys, transfer_of_pair = np.unique(keys, return_inverse=True)
    tensor = (unique_keys // problem.num_devices).astype(int)
    transfer_dst = (unique_keys % problem.num_devices).astype(int)
    transfer_src = placement[problem.tensor_producer[tensor]]
    duration = transfer_duration_s(problem, tensor, transfer_src, transfer_dst)
    waiting: list[list[int]] = [[] for _ in range(unique_keys.size)]
    for q, c in zip(transfer_of_pair.tolist(), pair_consumer[remote].tolist(), strict=True):
        waiting[q].append(c)
    by_producer: list[list[int]] = [[] for _ in range(n)]
    for q, u in enumerate(problem.tensor_producer[tensor].tolist()):
        by_producer[u].append(q)
    return ImpliedTransfers(
        tensor.tolist(),
        transfer_src.tolist(),
        transfer_dst.tolist(),
        duration.tolist(),
        waiting,
        by_producer,
        local_consumers,
        inputs_needed,
    )
