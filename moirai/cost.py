"""Cost model: Cluster x OpGraph -> Problem (plain numbers).

``analytic``: roofline per node and device, ``max(flops / peak, bytes / memory bandwidth)``
divided by an efficiency, plus one launch overhead per op. Transfers cost
``latency + bytes / bandwidth`` on the directed link. Memory per node: its parameters and
buffers plus the activations it produces (a static upper bound: every activation is held).
"""

from __future__ import annotations

import numpy as np

from moirai.devices import Cluster
from moirai.graph import OpGraph
from moirai.problem import Problem

ANALYTIC_EFFICIENCY = 0.5


def build_problem(graph: OpGraph, cluster: Cluster) -> Problem:
    """The placement problem of ``graph`` on ``cluster`` with analytic costs."""
    flops = np.array([n.flops for n in graph.nodes])
    moved = np.array([n.bytes_moved for n in graph.nodes])
    op_count = np.array([len(n.targets) for n in graph.nodes])
    peak = np.array([d.peak_flops for d in cluster.devices])
    memory_bandwidth = np.array([d.memory_bandwidth_bytes_per_s for d in cluster.devices])
    launch = np.array([d.launch_overhead_s for d in cluster.devices])
    compute = np.maximum(flops[:, None] / peak, moved[:, None] / memory_bandwidth) / ANALYTIC_EFFICIENCY
    compute += op_count[:, None] * launch

    tensor_index: dict[tuple[int, str], int] = {}
    names, producers, consumers, sizes = [], [], [], []
    for e in graph.edges:
        key = (e.src, e.tensor)
        if key not in tensor_index:
            tensor_index[key] = len(names)
            names.append(e.tensor)
            producers.append(e.src)
            consumers.append([])
            sizes.append(e.bytes)
        consumers[tensor_index[key]].append(e.dst)
    sizes_array = np.array(sizes, float)
    with np.errstate(divide="ignore"):
        per_byte = np.where(np.eye(len(cluster), dtype=bool), 0.0, 1.0 / cluster.bandwidth_bytes_per_s)
    latency = cluster.latency_s * ~np.eye(len(cluster), dtype=bool)
    transfer = latency[None, :, :] + sizes_array[:, None, None] * per_byte[None, :, :]
    return Problem(
        device_names=cluster.names,
        memory_capacity_bytes=np.array([d.memory_bytes for d in cluster.devices]),
        task_names=tuple(n.name for n in graph.nodes),
        compute_s=compute,
        memory_bytes=np.array([n.param_bytes + n.output_bytes for n in graph.nodes]),
        tensor_names=tuple(names),
        tensor_producer=np.array(producers, int),
        tensor_consumers=tuple(tuple(c) for c in consumers),
        transfer_s=transfer.reshape(len(names), len(cluster), len(cluster)),
        tensor_bytes=sizes_array,
    )
