"""What a message costs on the cluster's links, per request: a tensor from device ``a`` to ``b`` takes
``latency[a, b] + bytes / bandwidth[a, b]`` on the cluster's (routed) link matrices, 0 on one device, and keeps
device ``a`` busy for ``send_cpu_s[a, b] + bytes * send_cpu_s_per_byte[a, b]`` (:func:`send_cpu_s`), and device
``b`` busy for the receiver's time (:func:`recv_cpu_s`); both 0 unless calibrated. The runtime's header
(:func:`header_s`), the model inputs it sends (:func:`input_messages`) and the model outputs sent to it
(:func:`output_messages`) are priced the same way.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moirai.cluster.devices import Cluster
from moirai.frontend.graph import OpGraph, model_input_readers, model_output_bytes
from moirai.frontend.trace import TracedModel
from moirai.runtime.header import HEADER_BYTES  # the runtime's header layout prices it


def transfer_s(tensor_bytes: np.ndarray, cluster: Cluster) -> np.ndarray:
    """``[t, a, b]``: time to send tensor ``t`` from device ``a`` to ``b`` (0 on the diagonal)."""
    off_diagonal = ~np.eye(len(cluster), dtype=bool)
    with np.errstate(divide="ignore"):
        per_byte = np.where(off_diagonal, 1.0 / cluster.bandwidth_bytes_per_s, 0.0)
    latency = cluster.latency_s * off_diagonal
    return latency[None, :, :] + np.asarray(tensor_bytes, float)[:, None, None] * per_byte[None, :, :]


def header_s(cluster: Cluster) -> np.ndarray:
    """``[k]``: when device ``k`` can start a request: the runtime's header, a message of :data:`HEADER_BYTES` from
    device 0 (the driver), has come and been taken in (its delay and its receiver's CPU time; 0 where no finite
    link leads: such a device cannot take part anyway)."""
    header = np.array([HEADER_BYTES])
    delay = transfer_s(header, cluster)[0, 0] + recv_cpu_s(header, cluster)[0, 0]
    return np.where(np.isfinite(delay), delay, 0.0)


class OutputMessages(NamedTuple):
    """``[node, k]``, for the one message that carries the model outputs ``node`` makes on device ``k`` to the
    driver on device 0 (zero on device 0, and without ``traced``, which knows the outputs)."""

    delay_s: np.ndarray  # from the node's finish until device 0 holds them: send, transfer and receive
    send_cpu_s: np.ndarray  # CPU time the send takes from device k
    recv_cpu_s: np.ndarray  # CPU time the receive takes from device 0
    link_s: np.ndarray  # time the message holds the link from device k to device 0


def output_messages(graph: OpGraph, traced: TracedModel | None, cluster: Cluster) -> OutputMessages:
    """What sending each node's model outputs to device 0 costs (:class:`OutputMessages`)."""
    costs = [np.zeros((len(graph.nodes), len(cluster))) for _ in OutputMessages._fields]
    if traced is not None:
        for node, made_bytes in model_output_bytes(graph, traced).items():
            message = np.array([made_bytes])
            sender, receiver = send_cpu_s(message, cluster)[0, :, 0], recv_cpu_s(message, cluster)[0, :, 0]
            link = transfer_s(message, cluster)[0, :, 0]
            for cost, value in zip(costs, (sender + link + receiver, sender, receiver, link), strict=True):
                cost[node] = value
    return OutputMessages(*(np.where(np.isfinite(cost), cost, 0.0) for cost in costs))


class InputMessages(NamedTuple):
    """``[j, k]``, for the message that carries model input ``j`` from the driver on device 0 to device ``k``
    (zero on device 0), and the nodes that read each input (empty without ``traced``, which knows the inputs)."""

    readers: tuple[tuple[int, ...], ...]
    delay_s: np.ndarray  # from the request's start until device k holds it: send, transfer and receive
    send_cpu_s: np.ndarray  # CPU time the send takes from device 0
    recv_cpu_s: np.ndarray  # CPU time the receive takes from device k
    link_s: np.ndarray  # time the message holds the link from device 0 to device k


def input_messages(graph: OpGraph, traced: TracedModel | None, cluster: Cluster) -> InputMessages:
    """What sending each model input from device 0 to the devices that read it costs (:class:`InputMessages`)."""
    inputs = model_input_readers(graph, traced) if traced is not None else []
    message = np.array([input_bytes for input_bytes, _ in inputs])
    sender, receiver = send_cpu_s(message, cluster)[:, 0, :], recv_cpu_s(message, cluster)[:, 0, :]
    link = transfer_s(message, cluster)[:, 0, :]
    costs = (sender + link + receiver, sender, receiver, link)
    return InputMessages(
        tuple(readers for _, readers in inputs), *(np.where(np.isfinite(cost), cost, 0.0) for cost in costs)
    )


def send_cpu_s(tensor_bytes: np.ndarray, cluster: Cluster) -> np.ndarray:
    """``[t, a, b]``: time sending tensor ``t`` from device ``a`` to ``b`` keeps ``a`` busy (0 on the diagonal)."""
    return _cpu_time_s(tensor_bytes, cluster.send_cpu_s, cluster.send_cpu_s_per_byte)


def recv_cpu_s(tensor_bytes: np.ndarray, cluster: Cluster) -> np.ndarray:
    """``[t, a, b]``: time receiving tensor ``t`` from device ``a`` keeps ``b`` busy (0 on the diagonal)."""
    return _cpu_time_s(tensor_bytes, cluster.recv_cpu_s, cluster.recv_cpu_s_per_byte)


def _cpu_time_s(tensor_bytes: np.ndarray, fixed_s: np.ndarray, s_per_byte: np.ndarray) -> np.ndarray:
    off_diagonal = ~np.eye(len(fixed_s), dtype=bool)
    fixed, per_byte = fixed_s * off_diagonal, s_per_byte * off_diagonal
    return fixed[None, :, :] + np.asarray(tensor_bytes, float)[:, None, None] * per_byte[None, :, :]
