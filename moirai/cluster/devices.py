"""Cluster description: devices of different speed and memory, and the directed links between them.

A cluster comes from a file, a preset, the local machine, or a list of torch device strings::

    cluster = Cluster.from_file("cluster.toml")
    cluster = Cluster.preset("moirai-inter-server")     # names: Cluster.presets()
    cluster = Cluster.detect()                           # local CPU and every visible CUDA device
    cluster = Cluster.from_devices(["cpu", "cpu"])       # two logical CPU devices
    cluster.transfer_time_s(1e6, 0, 1)                   # latency + bytes / bandwidth

Cluster file (TOML; GB = 1e9 bytes, Gbps = 1e9 bits/s)::

    name = "two-gpus"

    [[devices]]
    name = "A"
    torch_device = "cuda:0"
    host = "server-a"             # optional, default "localhost"
    rank = 0                      # optional: the torch.distributed rank serving this device (one per device)
    cores = [0, 1]                # optional: the host's CPU cores its rank runs on (default: an even split)
    threads = 2                   # optional: its rank's torch threads (default: its cores; 2 for a GPU)
    type = "t4"                   # a row of moirai/data/device_types.toml ...
    memory_gb = 16                # ... whose numbers the fields below override

    [[devices]]
    name = "B"
    torch_device = "cpu"
    kind = "cpu"
    memory_gb = 64
    peak_tflops = { fp32 = 1.0, bf16 = 1.0 }   # explicit numbers instead of a type
    memory_bandwidth_gb_per_s = 80
    launch_overhead_us = 5        # optional
    efficiency = 0.3              # optional

    [[links]]                     # directed; both_directions = true adds the reverse link
    src = "A"
    dst = "B"
    bandwidth_gbps = 96
    latency_us = 10
    both_directions = true

Instead of ``[[links]]`` a file may give full matrices (row = sender, column = receiver,
diagonal ignored), as the paper's Table III does::

    [matrix]
    bandwidth_gbps = [[0, 44.26], [42.39, 0]]
    latency_us = 10               # a number for every link, or a matrix

Routes (paper §III-C, Fig. 3): a pair of devices without a direct link communicates over the
path with the widest bottleneck; its bandwidth is the smallest on the path and its latency the
sum along it (among equally wide paths, the one with the lowest latency). Links stay directed,
so an asymmetric cluster keeps different numbers per direction.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moirai.cluster.files import (
    check_device,
    check_device_names,
    check_device_ranks,
    cluster_description,
    device_to_dict,
    preset_description,
    preset_names,
    read_cluster_file,
    to_toml,
    torch_device_name,
)
from moirai.cluster.hardware import GBPS_IN_BYTES_PER_S, LOCAL_HOST, MICROSECOND, Device, Link, host_key, in_unit
from moirai.cluster.host import available_cores, core_shares, device_index
from moirai.cluster.kinds import CPU, accelerator_kinds, detect_device, kind_of, local_link
from moirai.errors import ClusterError, OversubscriptionWarning, user_stacklevel
from moirai.user_files import write_output

if TYPE_CHECKING:  # imported where links are routed: ranks import this module ([Note: what a rank imports])
    import networkx as nx

# The CPU time a transfer takes from its two ends: fixed seconds and seconds per byte.
_CPU_TIME_MATRICES = ("send_cpu_s", "send_cpu_s_per_byte", "recv_cpu_s", "recv_cpu_s_per_byte")
# The runtime's own CPU time per request, one number per device: name -> what it is.
_PER_DEVICE_CPU_TIMES = {
    "request_cpu_s": "the runtime's own time per request on each device",
    "driver_part_cpu_s": "the driver's time per request for each other device taking part",
}


@dataclass(frozen=True, eq=False)
class Cluster:
    """Devices and the effective directed link matrices (``bandwidth[a, b]`` is a -> b).

    The matrices are full-mesh: pairs without a direct link hold the numbers of their route.
    ``links`` are the direct links the cluster was described with (empty when it was given as
    matrices). ``send_cpu_s[a, b] + bytes * send_cpu_s_per_byte[a, b]``: the time a send over ``a -> b``
    keeps device ``a`` busy, and ``recv_cpu_s`` / ``recv_cpu_s_per_byte`` the time receiving it keeps ``b`` busy
    (default 0; a calibration measures them, :func:`moirai.cluster.calibration.calibrated_cluster`).
    ``request_cpu_s[k]``: the runtime's own CPU time per request on device ``k``'s rank beyond its ops and
    messages (device 0's rank is the driver, this its work when it computes alone; default 0, measured by the
    calibration too); ``driver_part_cpu_s[k]``: the driver's more per request when device ``k`` takes part too (its
    header and status; 0 for device 0).
    """

    devices: tuple[Device, ...]
    bandwidth_bytes_per_s: np.ndarray
    latency_s: np.ndarray
    links: tuple[Link, ...] = ()
    name: str = ""
    send_cpu_s: np.ndarray = None  # type: ignore[assignment]
    send_cpu_s_per_byte: np.ndarray = None  # type: ignore[assignment]
    recv_cpu_s: np.ndarray = None  # type: ignore[assignment]
    recv_cpu_s_per_byte: np.ndarray = None  # type: ignore[assignment]
    request_cpu_s: np.ndarray = None  # type: ignore[assignment]
    driver_part_cpu_s: np.ndarray = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        k = len(self.devices)
        if k == 0:
            raise ClusterError("a cluster needs at least one device")
        check_device_names([d.name for d in self.devices])
        check_device_ranks(self.devices)
        object.__setattr__(self, "bandwidth_bytes_per_s", np.asarray(self.bandwidth_bytes_per_s, float))
        object.__setattr__(self, "latency_s", np.asarray(self.latency_s, float))
        for label in _CPU_TIME_MATRICES:
            value = getattr(self, label)
            object.__setattr__(self, label, np.zeros((k, k)) if value is None else np.asarray(value, float))
        matrices = {
            "bandwidth": self.bandwidth_bytes_per_s,
            "latency": self.latency_s,
            **{label: getattr(self, label) for label in _CPU_TIME_MATRICES},
        }
        for label, matrix in matrices.items():
            if matrix.shape != (k, k):
                raise ClusterError(f"{label} matrix is {matrix.shape}, must be {k}x{k} (one row per device)")
        for label in _CPU_TIME_MATRICES:
            if not np.all(np.isfinite(matrices[label])) or np.any(matrices[label] < 0):
                raise ClusterError(
                    f"{label} (a sender's or receiver's time per transfer) must be non-negative finite numbers"
                )
        for label, meaning in _PER_DEVICE_CPU_TIMES.items():
            value = getattr(self, label)
            seconds = np.zeros(k) if value is None else np.asarray(value, float)
            if seconds.shape != (k,) or not np.all(np.isfinite(seconds)) or np.any(seconds < 0):
                raise ClusterError(
                    f"{label} ({meaning}) must be {k} non-negative finite numbers, got {seconds.tolist()}"
                )
            object.__setattr__(self, label, seconds)
        off_diagonal = ~np.eye(k, dtype=bool)
        if np.any(~(self.bandwidth_bytes_per_s[off_diagonal] > 0)):
            raise ClusterError("every link between two distinct devices needs a positive bandwidth")
        if np.any(~(self.latency_s >= 0)):
            raise ClusterError("link latencies must be non-negative")
        for d in self.devices:
            check_device(d)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __str__(self) -> str:
        """One line per device (kind, speed, memory) and the fastest and slowest link: what ``print`` shows."""
        from moirai.planning.bounds import format_bytes

        lines = [f"Cluster {self.name or '(unnamed)'}: {len(self)} device(s)"]
        for d in self.devices:
            where = "" if d.host == LOCAL_HOST else f" on {d.host}"
            lines.append(
                f"  {d.name}: {d.torch_device}{where}, {d.peak_flops / 1e9:.1f} GFLOP/s, {format_bytes(d.memory_bytes)}"
            )
        if len(self) > 1:
            off = ~np.eye(len(self), dtype=bool)
            lines.append(
                f"  links: {self.latency_s[off].min() * 1e6:.0f}-{self.latency_s[off].max() * 1e6:.0f} us, "
                f"{format_bytes(self.bandwidth_bytes_per_s[off].min())}/s-{format_bytes(self.bandwidth_bytes_per_s[off].max())}/s"
            )
        return "\n".join(lines)

    def index(self, name: str) -> int:
        """Position of the device called ``name``."""
        try:
            return self.names.index(name)
        except ValueError:
            raise ClusterError(f"no device named {name!r}; devices are {list(self.names)}") from None

    def renamed(self, names: Sequence[str]) -> Cluster:
        """This cluster with its devices called ``names``, in order (the links follow them); nothing else changes."""
        if len(names) != len(self):
            raise ClusterError(f"{len(names)} names given for {len(self)} devices; give one name per device")
        new_name = dict(zip(self.names, names, strict=True))
        devices = tuple(dataclasses.replace(d, name=n) for d, n in zip(self.devices, names, strict=True))
        links = tuple(dataclasses.replace(link, src=new_name[link.src], dst=new_name[link.dst]) for link in self.links)
        return dataclasses.replace(self, devices=devices, links=links)

    def transfer_time_s(self, num_bytes: float, src: int, dst: int) -> float:
        """Time to move ``num_bytes`` from device ``src`` to ``dst`` (0 on one device)."""
        if src == dst:
            return 0.0
        return float(self.latency_s[src, dst] + num_bytes / self.bandwidth_bytes_per_s[src, dst])

    def route(self, src: str, dst: str) -> tuple[str, ...]:
        """Device names along the path ``src -> dst`` takes (two names for a direct link)."""
        for name in (src, dst):
            self.index(name)  # raises for an unknown name
        if src == dst:
            return (src,)
        links = self.links or _links_of_matrices(self.names, self.bandwidth_bytes_per_s, self.latency_s)
        graph = _link_graph(self.names, links)
        if graph.has_edge(src, dst):
            return (src, dst)
        return tuple(_widest_path(graph, src, dst))

    # --- constructors -----------------------------------------------------------------

    @classmethod
    def from_links(cls, devices: Sequence[Device], links: Iterable[Link], name: str = "") -> Cluster:
        """A cluster from direct links; pairs without one are routed (widest bottleneck)."""
        devices, links = tuple(devices), tuple(links)
        names = [d.name for d in devices]
        check_device_names(names)
        known = set(names)
        pairs = [(link.src, link.dst) for link in links]
        repeated = sorted({pair for pair in pairs if pairs.count(pair) > 1})
        if repeated:
            raise ClusterError(f"links {repeated} are given more than once; give each directed link once")
        for link in links:
            for end in (link.src, link.dst):
                if end not in known:
                    raise ClusterError(
                        f"link {link.src!r} -> {link.dst!r} names unknown device {end!r}; devices are {names}"
                    )
            if link.src == link.dst:
                raise ClusterError(f"link {link.src!r} -> {link.dst!r} connects a device to itself; remove it")
            if not link.bandwidth_bytes_per_s > 0:
                raise ClusterError(f"link {link.src!r} -> {link.dst!r} needs a positive bandwidth")
            if not link.latency_s >= 0:
                raise ClusterError(f"link {link.src!r} -> {link.dst!r} needs a non-negative latency")
        bandwidth, latency = _route_matrices(names, links)
        return cls(devices, bandwidth, latency, links, name)

    @classmethod
    def from_dict(cls, description: Mapping[str, Any]) -> Cluster:
        """A cluster from the parsed contents of a cluster file (see the module docstring)."""
        devices, links, name = cluster_description(description)
        return cls.from_links(devices, links, name)

    @classmethod
    def from_file(cls, path: str | Path) -> Cluster:
        """Read a cluster file (TOML)."""
        description = read_cluster_file(path)
        try:
            return cls.from_dict(description)
        except ClusterError as error:
            raise ClusterError(f"{path}: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        """The cluster-file contents of this cluster; ``from_dict(to_dict())`` rebuilds it."""
        links = self.links or _links_of_matrices(self.names, self.bandwidth_bytes_per_s, self.latency_s)
        return {
            "name": self.name,
            "devices": [device_to_dict(d) for d in self.devices],
            "links": [
                {
                    "src": link.src,
                    "dst": link.dst,
                    "bandwidth_gbps": in_unit(link.bandwidth_bytes_per_s, GBPS_IN_BYTES_PER_S),
                    "latency_us": in_unit(link.latency_s, MICROSECOND),
                }
                for link in links
            ],
        }

    def to_file(self, path: str | Path) -> None:
        """Write this cluster as a cluster file (TOML); a path that cannot take it is a :class:`ClusterError`."""
        write_output(path, to_toml(self.to_dict()), "the cluster file", ClusterError)

    @classmethod
    def presets(cls) -> tuple[str, ...]:
        """Names of the built-in clusters (the paper's two testbeds and a few of ours)."""
        return preset_names()

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """A built-in cluster by name, e.g. ``"moirai-inter-server"`` (paper Table III)."""
        if name not in cls.presets():
            raise ClusterError(f"no preset cluster {name!r}; presets are {list(cls.presets())}")
        return cls.from_dict(preset_description(name))

    @classmethod
    def detect(cls) -> Cluster:
        """The local CPU and every visible accelerator; accelerators talk over PCIe, or through the host."""
        devices = [detect_device(CPU.name, CPU.name, share=1)]
        for kind in accelerator_kinds():
            devices += [detect_device(f"{kind.name}:{i}", f"{kind.name}{i}", share=1) for i in range(kind.count())]
        links = []
        for a in devices:
            for b in devices:
                # Accelerators without peer access exchange tensors through host memory: no direct link.
                kind = kind_of(a.torch_device)
                peers = kind.accelerator and kind_of(b.torch_device) is kind
                if a is b or (peers and not kind.can_access_peer(device_index(a), device_index(b))):
                    continue
                links.append(Link(a.name, b.name, *local_link(kind_of(a), kind_of(b))))
        return cls.from_links(devices, links, name="detected")

    @classmethod
    def from_devices(cls, torch_devices: Sequence[str], hosts: Sequence[str] | None = None) -> Cluster:
        """Describe local devices by detection; a device string repeated gives separate logical devices.

        ``hosts`` (one per device; torchrun's ranks across hosts) puts each device on its host: devices share a
        physical device only with those of their host, and a device on another host is described by this host's
        hardware (the hosts are assumed alike)."""
        # A dict would give its keys, its counts unread ({"cpu": 2} as one CPU).
        if isinstance(torch_devices, (str, torch.device, Mapping)) or not isinstance(torch_devices, Iterable):
            raise ClusterError(
                f"devices={torch_devices!r} is not a list; give one torch device per part, e.g. ['cpu', 'cpu'] or "
                "['cuda:0', 'cuda:1'], or a moirai.Cluster"
                + (f" (a preset: moirai.Cluster.preset({torch_devices!r}))" if torch_devices in preset_names() else "")
            )
        torch_devices = [torch_device_name(spec, f"devices[{i}]") for i, spec in enumerate(torch_devices)]
        if not torch_devices:
            raise ClusterError("give at least one device, e.g. ['cpu', 'cpu'] or ['cuda:0', 'cuda:1']")
        hosts = [LOCAL_HOST] * len(torch_devices) if hosts is None else [str(h) for h in hosts]
        if len(hosts) != len(torch_devices):
            raise ClusterError(f"{len(hosts)} hosts given for {len(torch_devices)} devices; give one host per device")
        keys = [host_key(h) for h in hosts]  # localhost, 127.0.0.1 and the hostname are one machine
        on_host = list(zip(keys, torch_devices, strict=True))
        counts = {d: torch_devices.count(d) for d in torch_devices}
        seen: dict[str, int] = {}
        devices = []
        for host, (key, spec) in zip(hosts, on_host, strict=True):
            torch_device = str(torch.device(spec))
            index = seen.get(spec, 0)
            seen[spec] = index + 1
            name = torch_device.replace(":", "") + (f"_{index}" if counts[spec] > 1 else "")
            # Logical devices split a physical one only on their own host.
            share, share_index = on_host.count((key, spec)), on_host[: len(devices)].count((key, spec))
            device = detect_device(torch_device, name, share=share, index=share_index)
            devices.append(device if host == LOCAL_HOST else dataclasses.replace(device, host=host))
        for key in dict.fromkeys(keys):
            _warn_if_oversubscribed([d for d, k in zip(devices, keys, strict=True) if k == key])
        k = len(devices)
        bandwidth, latency = np.zeros((k, k)), np.zeros((k, k))
        for a in range(k):
            for b in range(k):
                bandwidth[a, b], latency[a, b] = local_link(kind_of(devices[a]), kind_of(devices[b]))
        np.fill_diagonal(latency, 0.0)
        return cls(tuple(devices), bandwidth, latency)


def _warn_if_oversubscribed(devices: Sequence[Device], why: str = "the plan counts it so") -> None:
    """Logical devices of a pinned kind (the CPU) beyond the host's cores share cores: say so, with the numbers.

    The runtime splits the cores no device claims (``cores`` in a cluster file) among the pinned devices that claim
    none (:func:`moirai.runtime.resources.rank_resources`); ``why`` says what that means for the plan.
    """
    claimed = {core for d in devices for core in d.cores or ()}
    pinned = [d for d in devices if kind_of(d).pinned and d.cores is None]
    cores = tuple(c for c in available_cores() if c not in claimed) or available_cores()
    if len(pinned) <= len(cores):
        return
    shared = [d.name for d, share in zip(pinned, core_shares(cores, len(pinned)), strict=True) if share < 1]
    warnings.warn(
        f"{len(pinned)} logical CPU devices on {len(cores)} cores: {', '.join(shared)} share cores, so each of them "
        f"computes at a fraction of a core ({why}); give at most {len(cores)} CPU devices",
        OversubscriptionWarning,
        stacklevel=user_stacklevel(),
    )


def warn_if_oversubscribed_here(cluster: Cluster) -> None:
    """The warning :meth:`Cluster.from_devices` gives, for a cluster (a file, a preset) about to be compiled or
    loaded to run here: one whose devices are all on this host (no ``host``, or this host's name)."""
    if all(d.on_this_host for d in cluster.devices):
        why = "when run on this host; a CPU device's speed from a cluster file is used as given"
        _warn_if_oversubscribed(cluster.devices, why)


# --- routes ---------------------------------------------------------------------------------


def _link_graph(names: Sequence[str], links: Iterable[Link]) -> nx.DiGraph:
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(names)
    for link in links:
        graph.add_edge(link.src, link.dst, bandwidth=link.bandwidth_bytes_per_s, latency=link.latency_s)
    return graph


def _widest_path(graph: nx.DiGraph, src: str, dst: str) -> list[str]:
    """The path ``src -> dst`` with the widest bottleneck, lowest latency among the widest."""
    import networkx as nx

    for width in sorted({w for _, _, w in graph.edges(data="bandwidth")}, reverse=True):
        wide_enough = nx.subgraph_view(graph, filter_edge=lambda u, v, w=width: graph.edges[u, v]["bandwidth"] >= w)
        if nx.has_path(wide_enough, src, dst):
            return nx.dijkstra_path(wide_enough, src, dst, weight="latency")
    raise ClusterError(
        f"device {dst!r} cannot be reached from {src!r}; add a link (or a path of links) from {src!r} to {dst!r}"
    )


def _route_matrices(names: Sequence[str], links: Sequence[Link]) -> tuple[np.ndarray, np.ndarray]:
    k = len(names)
    graph = _link_graph(names, links)
    bandwidth, latency = np.full((k, k), np.inf), np.zeros((k, k))
    for a, src in enumerate(names):
        for b, dst in enumerate(names):
            if a == b:
                continue
            path = [src, dst] if graph.has_edge(src, dst) else _widest_path(graph, src, dst)
            hops = [graph.edges[u, v] for u, v in itertools.pairwise(path)]
            bandwidth[a, b] = min(hop["bandwidth"] for hop in hops)
            latency[a, b] = sum(hop["latency"] for hop in hops)
    return bandwidth, latency


def _links_of_matrices(names: Sequence[str], bandwidth: np.ndarray, latency: np.ndarray) -> tuple[Link, ...]:
    return tuple(
        Link(names[a], names[b], float(bandwidth[a, b]), float(latency[a, b]))
        for a in range(len(names))
        for b in range(len(names))
        if a != b
    )
