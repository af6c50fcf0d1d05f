"""What a transfer costs, in which order a link sends, and which transfers a placement implies.

The cost rule, one place for it. A tensor ``t`` sent from device ``a`` to device ``b``:

* occupies the directed link ``a -> b`` for :func:`transfer_duration_s` (the runtime's delay from the send call
  to a blocked receiver holding the tensor: latency plus bytes over bandwidth, the receiver's CPU time included,
  since a woken receiver is on the transfer's path);
* occupies the *sending device* ``a`` for :func:`send_cpu_s` (the CPU time the send takes from it: staging and
  copying on the core its compute uses). This time extends the producer's busy time on ``a``: a task's duration
  is its compute time plus the send time of every transfer its outputs need (one per tensor and remote
  device), :func:`task_duration_s`. Its transfers start when that extended task finishes.
* occupies the *receiving device* ``b`` for :func:`recv_cpu_s` (posting the receive, waking up, taking the
  message in: time a receiver busy with other work loses). This time extends the task that receives the
  tensor on ``b``: of the tensor's consumers on ``b``, the first in topological order (:func:`receiving_task`, its
  :attr:`ImpliedTransfers.receiver`), where the runtime waits for it before the first use.

The runtime's driver on device 0 adds two: a device other than 0 starts a request's first task only once the
driver's header has come (:attr:`RequestCosts.header_s`, a release time of the device), and a task off device 0 that
makes a model output is done once that output is with the driver (:func:`output_arrival_s`). And the runtime
itself works on each request on every device taking part, and both ends of an output's message spend CPU
time (:func:`runtime_cpu_s`): before a device's first task and after its last, so it lengthens the period of
pipelined requests; of one request's latency only the driver's own work, a release time of every task
(:attr:`RequestCosts.release_s`; the headers' and outputs' delays are their messages').

Why at the extended finish: the runtime posts a producer's sends right after it, one after another, before the
device's next op (:mod:`moirai.runtime.split`), so the device is busy with them before it computes again, and a
tensor for the second destination leaves only after the first send has been posted. Starting every transfer
after all of its producer's sends keeps one finish time per task in the simulator, the schedule builder and
the MILP. It overstates a transfer's delay by the sends posted before it plus its own (whose CPU time the
measured delay already holds): tens of microseconds per transfer, erring towards fewer transfers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from moirai.planning.problem import Problem


def transfer_duration_s(problem: Problem, tensor: int | np.ndarray, src: int | np.ndarray, dst: int | np.ndarray):
    """Seconds the directed link ``src -> dst`` is busy sending ``tensor``: the one place that says what a
    transfer costs. Every schedule (simulator, list schedulers, HEFT, start plans) asks this function; the
    MILP's transfer rows (:mod:`moirai.planning.solve.model`) mirror it.

    Takes scalars or equally shaped index arrays (the simulator prices a whole placement at once).
    A fixed per-transfer cost is a term added here; the sender's CPU time is :func:`send_cpu_s`.
    """
    return problem.transfer_s[tensor, src, dst]


def send_cpu_s(problem: Problem, tensor: int | np.ndarray, src: int | np.ndarray, dst: int | np.ndarray):
    """Seconds sending ``tensor`` over ``src -> dst`` keeps device ``src`` busy (booked after its producer, see
    the module's rule); the MILP's finish times (:mod:`moirai.planning.solve.model`) mirror it."""
    return problem.send_cpu_s[tensor, src, dst]


def recv_cpu_s(problem: Problem, tensor: int | np.ndarray, src: int | np.ndarray, dst: int | np.ndarray):
    """Seconds receiving ``tensor`` over ``src -> dst`` keeps device ``dst`` busy (booked on the tensor's receiver,
    see the module's rule); the MILP's finish times (:mod:`moirai.planning.solve.model`) mirror it."""
    return problem.recv_cpu_s[tensor, src, dst]


def receiving_task(problem: Problem, consumers: Iterable[int]) -> int:
    """Of a transfer's consumers on its destination device, the one whose busy time holds the receive
    (:func:`recv_cpu_s`): the first in topological order. The simulator (:func:`implied_transfers`) and the schedule
    builder (as consumers are booked) both ask this function."""
    position = problem.topological_position
    return min(consumers, key=lambda c: position[c])


def task_duration_s(problem: Problem, placement: np.ndarray, transfers: ImpliedTransfers) -> np.ndarray:
    """Every task's busy time on its device under ``placement``: its compute time plus the send time of every
    transfer of its outputs and the receive time of every transfer it receives (``transfers``:
    :func:`implied_transfers` of the same placement)."""
    n = problem.num_tasks
    compute = problem.compute_s[np.arange(n), placement]
    if not transfers.tensor:
        return compute
    producer = problem.tensor_producer[transfers.tensor]
    sends = np.bincount(producer, weights=transfers.send_cpu, minlength=n)
    return compute + sends + np.bincount(transfers.receiver, weights=transfers.recv_cpu, minlength=n)


def output_arrival_s(problem: Problem, placement: np.ndarray, task_finish_s: np.ndarray) -> np.ndarray:
    """When each task's work for the request is done: its finish plus, off device 0, the transfer of the model's
    outputs it makes to the driver there (:attr:`RequestCosts.output_s`); a request is done when every task's is."""
    return np.asarray(task_finish_s, float) + problem.costs.output_s[np.arange(problem.num_tasks), placement]


def runtime_cpu_s(problem: Problem, placement: np.ndarray) -> np.ndarray:
    """``[k]``: the CPU time per request each device spends under ``placement`` outside its tasks and their
    transfers: the runtime's own work on every device with a task and on device 0, whose driver takes every
    request, and both ends of the model outputs' messages to device 0, as the terms of
    :data:`moirai.planning.costs.PERIOD_TERMS` charge them (:attr:`moirai.planning.costs.RequestCosts.charges`)."""
    return problem.costs.charges.device_s(placement)


def send_priority(ready_s: float, tensor: int) -> tuple[float, int]:
    """The order a link sends waiting tensors in: first ready, first sent; ties go to the lower tensor index."""
    return ready_s, tensor


class ImpliedTransfers(NamedTuple):
    """The transfers a placement implies (one per tensor and destination device), and who waits for what."""

    tensor: list[int]
    src: list[int]
    dst: list[int]
    duration: list[float]
    send_cpu: list[float]  # the sender's busy time, added to its producer's (task_duration_s)
    recv_cpu: list[float]  # the receiver's busy time, added to its receiver's
    receiver: list[int]  # of the transfer's consumers, the first in topological order
    consumers: list[list[int]]  # tasks that wait for each transfer
    by_producer: list[list[int]]  # transfers each task triggers when it finishes
    local_consumers: list[list[int]]  # tasks on the producer's device that wait for each task
    inputs_needed: list[int]  # distinct input tensors of every task


def implied_transfers(problem: Problem, placement: np.ndarray) -> ImpliedTransfers:
    """Every transfer ``placement`` needs: a tensor crosses to a device once, whatever its consumers there."""
    n = problem.num_tasks
    pair_tensor, pair_consumer = problem.reading_pairs
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
    sender_s = send_cpu_s(problem, tensor, transfer_src, transfer_dst)
    receiver_s = recv_cpu_s(problem, tensor, transfer_src, transfer_dst)
    waiting: list[list[int]] = [[] for _ in range(unique_keys.size)]
    for q, c in zip(transfer_of_pair.tolist(), pair_consumer[remote].tolist(), strict=True):
        waiting[q].append(c)
    receiver = [receiving_task(problem, consumers) for consumers in waiting]
    by_producer: list[list[int]] = [[] for _ in range(n)]
    for q, u in enumerate(problem.tensor_producer[tensor].tolist()):
        by_producer[u].append(q)
    return ImpliedTransfers(
        tensor.tolist(),
        transfer_src.tolist(),
        transfer_dst.tolist(),
        duration.tolist(),
        sender_s.tolist(),
        receiver_s.tolist(),
        receiver,
        waiting,
        by_producer,
        local_consumers,
        inputs_needed,
    )
