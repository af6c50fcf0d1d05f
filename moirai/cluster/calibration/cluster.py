"""Clusters from calibration: one whose links were measured between local ranks (:func:`calibrate`), a
cluster with the calibrated costs of its link kinds (:func:`calibrated_cluster`), and the one way every entry
point (``moirai.compile``, ``moirai.load``, ``moirai compile --devices``, torchrun ranks) turns a list of local
devices into a cluster (:func:`local_cluster`)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from moirai.cluster.calibration.fit import TransferCost, link_kind
from moirai.cluster.calibration.measure import DEFAULT_SIZES_BYTES, measure_transfer_costs
from moirai.cluster.calibration.request_cost import RequestCost
from moirai.cluster.devices import Cluster, Device, Link, warn_if_oversubscribed_here
from moirai.cluster.kinds import kind_for_backend
from moirai.errors import ClusterError


def local_cluster(devices: Cluster | Sequence[str], calibration: str | Path = "auto") -> Cluster:
    """``devices`` as a cluster: local devices (a list of torch device strings) are detected, and their links get
    this machine's calibration (:func:`moirai.cluster.calibration.local_calibration`: ``"auto"`` cached or measured
    once, ``"remeasure"``, a calibration file's path) unless ``calibration`` is ``"none"`` (the detected defaults).
    A :class:`Cluster` keeps the links it describes; one on this host alone is checked for more CPU devices than
    cores (:func:`moirai.cluster.devices.warn_if_oversubscribed_here`)."""
    if isinstance(devices, Cluster):
        warn_if_oversubscribed_here(devices)
        return devices
    cluster = Cluster.from_devices(devices)
    if calibration == "none" or len(cluster) < 2:
        return cluster
    from moirai.cluster.calibration.cache import local_calibration, local_request_cost

    links = local_calibration([d.torch_device for d in cluster.devices], calibration)
    return calibrated_cluster(cluster, links, local_request_cost(calibration))


def calibrate(
    world_size: int = 2,
    backend: str = "gloo",
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = 15,
    base: Cluster | None = None,
    output: str | Path | None = None,
) -> Cluster:
    """A cluster whose links are measured between ``world_size`` local ranks (rank r = device r).

    ``base`` supplies the devices (one per rank, in rank order); by default they are detected
    (``cpu`` for gloo, ``cuda:r`` for nccl). ``output`` writes the result as a cluster file.
    """
    devices = rank_devices(world_size, backend, None if base is None else base.devices)
    costs = measure_transfer_costs([d.torch_device for d in devices], sizes_bytes, repeats)
    return measured_cluster(devices, costs, base.name if base is not None else f"calibrated-{backend}", output)


def rank_devices(world_size: int, backend: str, base: Sequence[Device] | None) -> tuple[Device, ...]:
    """The device of each rank: ``base``'s (a cluster file's devices, in rank order), else detected ones."""
    if world_size < 2:
        raise ClusterError("calibration needs at least two ranks (world_size >= 2)")
    if base is not None:
        if len(base) != world_size:
            raise ClusterError(
                f"the base cluster has {len(base)} devices, calibration runs {world_size} ranks; give --world-size "
                f"{len(base)} (or leave it out)"
            )
        return tuple(base)
    kind = kind_for_backend(backend)
    local = [f"{kind.name}:{r}" if kind.accelerator else kind.name for r in range(world_size)]
    host = socket.gethostname()
    return tuple(
        dataclasses.replace(d, name=f"rank{r}", host=host, rank=r)
        for r, d in enumerate(Cluster.from_devices(local).devices)
    )


def measured_cluster(
    devices: Sequence[Device], costs: Mapping[tuple[int, int], TransferCost], name: str, output: str | Path | None
) -> Cluster:
    links = [
        Link(devices[src].name, devices[dst].name, cost.bandwidth_bytes_per_s, cost.latency_s)
        for (src, dst), cost in costs.items()
    ]
    cluster = Cluster.from_links(devices, links, name=name)
    if output is not None:
        cluster.to_file(output)
    return cluster


def calibrated_cluster(
    cluster: Cluster, costs: Mapping[str, TransferCost], requests: RequestCost | None = None
) -> Cluster:
    """``cluster`` with every link's latency, bandwidth and its ends' CPU times those of its kind in ``costs``,
    and, with ``requests``, the runtime's work per request on each device (the driver's on device 0).

    The measured delay already holds the receiver's CPU time of a receiver blocked in its wait; a schedule
    also books that time on the receiving device, where a receiver busy with other work loses it.
    """
    k = len(cluster)
    bandwidth, latency = cluster.bandwidth_bytes_per_s.copy(), cluster.latency_s.copy()
    cpu = {label: getattr(cluster, label).copy() for label in _CPU_FIELDS}
    for a in range(k):
        for b in range(k):
            kind = link_kind(cluster.devices[a].torch_device, cluster.devices[b].torch_device)
            if a != b and kind in costs:
                cost = costs[kind]
                bandwidth[a, b], latency[a, b] = cost.bandwidth_bytes_per_s, cost.latency_s
                for label, field_name in _CPU_FIELDS.items():
                    cpu[label][a, b] = getattr(cost, field_name)
    request_cpu = cluster.request_cpu_s
    if requests is not None:
        request_cpu = np.r_[requests.driver_cpu_s, np.full(k - 1, requests.worker_cpu_s)]
    return Cluster(cluster.devices, bandwidth, latency, name=cluster.name, **cpu, request_cpu_s=request_cpu)


# Cluster matrix -> TransferCost field.
_CPU_FIELDS = {
    "send_cpu_s": "sender_cpu_s",
    "send_cpu_s_per_byte": "sender_cpu_s_per_byte",
    "recv_cpu_s": "receiver_cpu_s",
    "recv_cpu_s_per_byte": "receiver_cpu_s_per_byte",
}
