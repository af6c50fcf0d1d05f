"""Clusters from calibration: one whose links were measured between local ranks (:func:`calibrate`), a
cluster with the calibrated costs of its link kinds (:func:`calibrated_cluster`), and the one way every entry
point (``moirai.compile``, ``moirai.load``, ``moirai compile --devices``, torchrun ranks) turns a list of local
devices into a cluster (:func:`local_cluster`)."""

from __future__ import annotations

import dataclasses
import socket
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from moirai.cluster.calibration.cache import (
    MEASURED_CALIBRATIONS,
    check_calibration,
    local_calibration,
    local_host_links,
    local_request_cost,
)
from moirai.cluster.calibration.fit import HostLink, TransferCost, link_kind
from moirai.cluster.calibration.measure import DEFAULT_REPEATS, DEFAULT_SIZES_BYTES, measure_transfer_costs
from moirai.cluster.calibration.request_cost import RequestCost
from moirai.cluster.devices import Cluster, Device, Link, warn_if_oversubscribed_here
from moirai.cluster.host import available_cores
from moirai.cluster.kinds import CPU, kind_for_backend
from moirai.errors import ClusterError, MoiraiWarning, user_stacklevel


def local_cluster(
    devices: Cluster | Sequence[str], calibration: str | Path = "auto", hosts: Sequence[str] | None = None
) -> Cluster:
    """``devices`` as a cluster: local devices (a list of torch device strings) are detected, and their links get
    this machine's calibration (:func:`moirai.cluster.calibration.local_calibration`: ``"auto"`` cached or measured
    once, ``"remeasure"``, a calibration file's path) unless ``calibration`` is ``"none"`` (the detected defaults).
    A :class:`Cluster` keeps the links it describes; one on this host alone is checked for more CPU devices than
    cores (:func:`moirai.cluster.devices.warn_if_oversubscribed_here`).

    ``hosts`` (one per device: torchrun's ranks on several hosts) puts the devices on their hosts; a link between
    two hosts gets the cost ``moirai calibrate`` measured under torchrun (:func:`~.cache.local_host_links`), and one
    never measured keeps the default with a warning (an error where ``calibration`` names a file)."""
    check_calibration(calibration)
    if isinstance(devices, Cluster):
        warn_if_oversubscribed_here(devices)
        return devices
    cluster = Cluster.from_devices(devices, hosts)
    if calibration == "none" or len(cluster) < 2:
        return cluster
    links = local_calibration([d.torch_device for d in cluster.devices], calibration)
    host_links = local_host_links(calibration) if hosts is not None else {}
    unmeasured = sorted({str(link) for link in _host_links_of(cluster) if link not in host_links})
    if unmeasured:
        what = (
            f"the links {', '.join(unmeasured)} between hosts were never measured, so the plan assumes the default "
            "link between local devices for them"
        )
        measure = "torchrun (on every host) ... -m moirai calibrate --update-cache, or --save FILE and calibration=FILE"
        if calibration not in MEASURED_CALIBRATIONS:
            raise ClusterError(f"calibration file {str(calibration)!r}: {what}; measure them with {measure}")
        warnings.warn(f"{what}; measure them with {measure}", MoiraiWarning, stacklevel=user_stacklevel())
    return calibrated_cluster(cluster, links, local_request_cost(calibration), host_links)


def _host_links_of(cluster: Cluster) -> set[HostLink]:
    """The links between two hosts that the cluster's devices use."""
    devices = cluster.devices
    return {
        HostLink(a.host, b.host, link_kind(a.torch_device, b.torch_device))
        for a in devices
        for b in devices
        if a.host != b.host
    }


def calibrate(
    world_size: int = 2,
    backend: str = "gloo",
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = DEFAULT_REPEATS,
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


def rank_devices(
    world_size: int, backend: str, base: Sequence[Device] | None, *, local: bool = True
) -> tuple[Device, ...]:
    """The device of each rank: ``base``'s (a cluster file's devices, in rank order), else detected ones.

    ``local``: the ranks are this machine's processes (not torchrun's across hosts), so at most as many as it hosts:
    one an accelerator of ``backend``'s kind, else one a core (:func:`moirai.cluster.host.available_cores`), and
    two at least (a world of 100000 ranks hung)."""
    if world_size < 2:
        raise ClusterError("calibration needs at least two ranks (world_size >= 2)")
    if base is not None and len(base) != world_size:
        raise ClusterError(
            f"the base cluster has {len(base)} devices, calibration runs {world_size} ranks; give --world-size "
            f"{len(base)} (or leave it out)"
        )
    kind = kind_for_backend(backend)
    most = kind.count() if kind.accelerator else max(2, len(available_cores()))
    if local and world_size > most:
        unit = f"{kind.name} device" if kind.accelerator else "core"
        if most < 2:  # no world size fits: say what the machine lacks, not a size below the least
            raise ClusterError(
                f"calibration runs at least 2 local {backend} ranks, one a {unit}, but this machine has {most}; "
                f"run it where two {unit}s are, or with --backend {CPU.backend} for the host's links"
            )
        raise ClusterError(
            f"calibration runs {world_size} local {backend} ranks, one a {unit}, but this machine hosts at most "
            f"{most}; give a world size (--world-size, or the base cluster's devices) of {most} or fewer"
        )
    if base is not None:
        return tuple(base)
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
    cluster: Cluster,
    costs: Mapping[str, TransferCost],
    requests: RequestCost | None = None,
    host_links: Mapping[HostLink, TransferCost] | None = None,
) -> Cluster:
    """``cluster`` with every link's latency, bandwidth and its ends' CPU times those of its kind in ``costs``,
    and, with ``requests``, the runtime's work per request on each device (the driver's alone on device 0) and the
    driver's for each other device that takes part.

    ``host_links`` (measured under torchrun) price a link by its two devices' hosts and kind: a link between
    hosts only from them, a link within a host from them where that host's links were measured, else by its kind.

    The measured delay already holds the receiver's CPU time of a receiver blocked in its wait; a schedule
    also books that time on the receiving device, where a receiver busy with other work loses it.
    """
    k = len(cluster)
    bandwidth, latency = cluster.bandwidth_bytes_per_s.copy(), cluster.latency_s.copy()
    cpu = {label: getattr(cluster, label).copy() for label in _CPU_FIELDS}
    host_links = host_links or {}
    for a in range(k):
        for b in range(k):
            src, dst = cluster.devices[a], cluster.devices[b]
            kind = link_kind(src.torch_device, dst.torch_device)
            measured = host_links.get(HostLink(src.host, dst.host, kind))
            cost = measured if measured is not None else costs.get(kind) if src.host == dst.host else None
            if a != b and cost is not None:
                bandwidth[a, b], latency[a, b] = cost.bandwidth_bytes_per_s, cost.latency_s
                for label, field_name in _CPU_FIELDS.items():
                    cpu[label][a, b] = getattr(cost, field_name)
    request_cpu, driver_part = cluster.request_cpu_s, cluster.driver_part_cpu_s
    if requests is not None:
        request_cpu = np.r_[requests.driver_alone_cpu_s, np.full(k - 1, requests.worker_cpu_s)]
        driver_part = np.r_[0.0, np.full(k - 1, requests.driver_part_cpu_s)]
    return Cluster(
        cluster.devices,
        bandwidth,
        latency,
        name=cluster.name,
        **cpu,
        request_cpu_s=request_cpu,
        driver_part_cpu_s=driver_part,
    )


# Cluster matrix -> TransferCost field.
_CPU_FIELDS = {
    "send_cpu_s": "sender_cpu_s",
    "send_cpu_s_per_byte": "sender_cpu_s_per_byte",
    "recv_cpu_s": "receiver_cpu_s",
    "recv_cpu_s_per_byte": "receiver_cpu_s_per_byte",
}
