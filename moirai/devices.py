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
    rank = 0                      # optional: the torch.distributed rank serving this device
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
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import torch

from moirai.device_kinds import accelerator_kinds, kind_of
from moirai.errors import ClusterError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

GB = 1e9
GBPS_IN_BYTES_PER_S = 1e9 / 8
TFLOPS = 1e12
MICROSECOND = 1e-6

# A loopback gloo link between two processes on one host, as measured on a 2-core machine.
_LOCAL_PROCESS_BANDWIDTH_BYTES_PER_S = 2e9
_LOCAL_PROCESS_LATENCY_S = 50e-6
# A PCIe 3 x16 link, the slowest path between two local GPUs or a GPU and the host.
_PCIE_BANDWIDTH_BYTES_PER_S = 12e9
_PCIE_LATENCY_S = 10e-6
_CPU_MEMORY_BANDWIDTH_BYTES_PER_S = 10e9
_CPU_CLOCK_HZ_IF_UNKNOWN = 2.5e9
# fp32 FLOPs per cycle and core of the widest vector FMA the CPU flags announce (2 FMA units).
_FP32_FLOPS_PER_CYCLE_BY_FLAG = (("avx512f", 64), ("fma", 32), ("avx", 16))
_FP32_FLOPS_PER_CYCLE_BASELINE = 8
# Eager PyTorch spends about this long in Python and the dispatcher on every op on a CPU.
_CPU_LAUNCH_OVERHEAD_S = 10e-6

# torch dtype name -> the precision column of the device table.
_PRECISION_OF_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_DEVICE_KEYS = {
    "name", "torch_device", "host", "rank", "kind", "type", "memory_gb", "peak_tflops",
    "memory_bandwidth_gb_per_s", "launch_overhead_us", "efficiency", "cores", "threads",
}
_LINK_KEYS = {"src", "dst", "bandwidth_gbps", "latency_us", "both_directions"}
_FILE_KEYS = {"name", "description", "devices", "links", "matrix"}
# The type every typed key of a [[devices]] or [[links]] entry must have (checked before any is read).
_NUMBER_KEYS = set(
    "memory_gb memory_bandwidth_gb_per_s launch_overhead_us efficiency bandwidth_gbps latency_us".split()
)
_INTEGER_KEYS = {"rank"}
_BOOLEAN_KEYS = {"both_directions"}
_SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class Device:
    """One device a part of the model runs on.

    ``torch_device`` is where its tensors live (``"cpu"``, ``"cuda:1"``) on ``host``; several
    logical devices may share a torch device (they are separate processes in a distributed run).
    ``peak_flops`` is the fp32 peak; ``peak_flops_fp16`` / ``peak_flops_bf16`` are ``None`` where
    the device has no faster path for that dtype (the fp32 peak applies).
    """

    name: str
    torch_device: str
    memory_bytes: float
    peak_flops: float
    memory_bandwidth_bytes_per_s: float
    launch_overhead_s: float = 5e-6
    kind: str = "cpu"
    device_type: str | None = None
    peak_flops_fp16: float | None = None
    peak_flops_bf16: float | None = None
    efficiency: float = 0.5
    host: str = "localhost"
    rank: int | None = None
    cores: tuple[int, ...] | None = None
    threads: int | None = None

    def peak_flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for a torch dtype name (``"float16"``); other dtypes use the fp32 peak."""
        precision = _PRECISION_OF_DTYPE.get(dtype.removeprefix("torch."), "fp32")
        peak = {"fp16": self.peak_flops_fp16, "bf16": self.peak_flops_bf16}.get(precision)
        return self.peak_flops if peak is None else peak


@dataclass(frozen=True)
class Link:
    """A direct, directed link ``src -> dst`` between two devices (names)."""

    src: str
    dst: str
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0


@dataclass(frozen=True, eq=False)
class Cluster:
    """Devices and the effective directed link matrices (``bandwidth[a, b]`` is a -> b).

    The matrices are full-mesh: pairs without a direct link hold the numbers of their route.
    ``links`` are the direct links the cluster was described with (empty when it was given as
    matrices). ``send_cpu_s[a, b] + bytes * send_cpu_s_per_byte[a, b]``: the time a send over ``a -> b``
    keeps device ``a`` busy (default 0; a calibration measures it, :func:`moirai.calibrate.calibrated_cluster`).
    """

    devices: tuple[Device, ...]
    bandwidth_bytes_per_s: np.ndarray
    latency_s: np.ndarray
    links: tuple[Link, ...] = ()
    name: str = ""
    send_cpu_s: np.ndarray = None  # type: ignore[assignment]
    send_cpu_s_per_byte: np.ndarray = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        k = len(self.devices)
        if k == 0:
            raise ClusterError("a cluster needs at least one device")
        _check_device_names([d.name for d in self.devices])
        object.__setattr__(self, "bandwidth_bytes_per_s", np.asarray(self.bandwidth_bytes_per_s, float))
        object.__setattr__(self, "latency_s", np.asarray(self.latency_s, float))
        for label in ("send_cpu_s", "send_cpu_s_per_byte"):
            value = getattr(self, label)
            object.__setattr__(self, label, np.zeros((k, k)) if value is None else np.asarray(value, float))
        matrices = {
            "bandwidth": self.bandwidth_bytes_per_s,
            "latency": self.latency_s,
            "send_cpu_s": self.send_cpu_s,
            "send_cpu_s_per_byte": self.send_cpu_s_per_byte,
        }
        for label, matrix in matrices.items():
            if matrix.shape != (k, k):
                raise ClusterError(f"{label} matrix is {matrix.shape}, must be {k}x{k} (one row per device)")
        for label in ("send_cpu_s", "send_cpu_s_per_byte"):
            if not np.all(np.isfinite(matrices[label])) or np.any(matrices[label] < 0):
                raise ClusterError(f"{label} (a sender's time per transfer) must be non-negative finite numbers")
        off_diagonal = ~np.eye(k, dtype=bool)
        if np.any(~(self.bandwidth_bytes_per_s[off_diagonal] > 0)):
            raise ClusterError("every link between two distinct devices needs a positive bandwidth")
        if np.any(~(self.latency_s >= 0)):
            raise ClusterError("link latencies must be non-negative")
        for d in self.devices:
            _check_device(d)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def index(self, name: str) -> int:
        """Position of the device called ``name``."""
        try:
            return self.names.index(name)
        except ValueError:
            raise ClusterError(f"no device named {name!r}; devices are {list(self.names)}") from None

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
        _check_device_names(names)
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
        _check_keys(description, _FILE_KEYS, "the cluster file")
        _check_arrays_of_tables(description)
        entries = description.get("devices")
        if not entries:
            raise ClusterError("a cluster file needs at least one [[devices]] entry")
        devices = tuple(_device_from_dict(entry) for entry in entries)
        names = [d.name for d in devices]
        _check_device_names(names)
        has_links, has_matrix = "links" in description, "matrix" in description
        if has_links and has_matrix:
            raise ClusterError("give either [[links]] or [matrix] in a cluster file, not both")
        if has_matrix:
            links = _links_from_matrix(description["matrix"], names)
        elif has_links:
            links = [link for entry in description["links"] for link in _links_from_dict(entry)]
        elif len(devices) == 1:
            links = []
        else:
            raise ClusterError("a cluster file with several devices needs [[links]] or a [matrix] between them")
        return cls.from_links(devices, links, str(description.get("name", "")))

    @classmethod
    def from_file(cls, path: str | Path) -> Cluster:
        """Read a cluster file (TOML)."""
        try:
            with open(path, "rb") as f:
                description = tomllib.load(f)
        except FileNotFoundError:
            raise ClusterError(f"cluster file {str(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as error:
            raise ClusterError(f"cluster file {str(path)!r} is not valid TOML: {error}") from None
        try:
            return cls.from_dict(description)
        except ClusterError as error:
            raise ClusterError(f"{path}: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        """The cluster-file contents of this cluster; ``from_dict(to_dict())`` rebuilds it."""
        links = self.links or _links_of_matrices(self.names, self.bandwidth_bytes_per_s, self.latency_s)
        return {
            "name": self.name,
            "devices": [_device_to_dict(d) for d in self.devices],
            "links": [
                {
                    "src": link.src,
                    "dst": link.dst,
                    "bandwidth_gbps": link.bandwidth_bytes_per_s / GBPS_IN_BYTES_PER_S,
                    "latency_us": link.latency_s / MICROSECOND,
                }
                for link in links
            ],
        }

    def to_file(self, path: str | Path) -> None:
        """Write this cluster as a cluster file (TOML)."""
        Path(path).write_text(_to_toml(self.to_dict()))

    @classmethod
    def presets(cls) -> tuple[str, ...]:
        """Names of the built-in clusters (the paper's two testbeds and a few of ours)."""
        return tuple(sorted(entry.name.removesuffix(".toml") for entry in _preset_files().iterdir()
                            if entry.name.endswith(".toml")))

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """A built-in cluster by name, e.g. ``"moirai-inter-server"`` (paper Table III)."""
        if name not in cls.presets():
            raise ClusterError(f"no preset cluster {name!r}; presets are {list(cls.presets())}")
        description = tomllib.loads(_preset_files().joinpath(f"{name}.toml").read_text())
        return cls.from_dict(description)

    @classmethod
    def detect(cls) -> Cluster:
        """The local CPU and every visible accelerator; accelerators talk over PCIe, or through the host."""
        devices = [_detect("cpu", "cpu", share=1)]
        for kind in accelerator_kinds():
            devices += [_detect(f"{kind.name}:{i}", f"{kind.name}{i}", share=1) for i in range(kind.count())]
        links = []
        for a in devices:
            for b in devices:
                # Accelerators without peer access exchange tensors through host memory: no direct link.
                kind = kind_of(a.torch_device)
                peers = kind.accelerator and kind_of(b.torch_device) is kind
                if a is b or (peers and not kind.can_access_peer(_index(a), _index(b))):
                    continue
                links.append(Link(a.name, b.name, _PCIE_BANDWIDTH_BYTES_PER_S, _PCIE_LATENCY_S))
        return cls.from_links(devices, links, name="detected")

    @classmethod
    def from_devices(cls, torch_devices: Sequence[str]) -> Cluster:
        """Describe local devices by detection; a device string repeated gives separate logical devices."""
        if isinstance(torch_devices, (str, torch.device)) or not isinstance(torch_devices, Iterable):
            raise ClusterError(
                f"devices={torch_devices!r} is not a list; give one torch device per part, e.g. ['cpu', 'cpu'] or "
                "['cuda:0', 'cuda:1'], or a moirai.Cluster"
            )
        torch_devices = [torch_device_name(spec, f"devices[{i}]") for i, spec in enumerate(torch_devices)]
        if not torch_devices:
            raise ClusterError("give at least one device, e.g. ['cpu', 'cpu'] or ['cuda:0', 'cuda:1']")
        counts = {d: list(torch_devices).count(d) for d in torch_devices}
        seen: dict[str, int] = {}
        devices = []
        for spec in torch_devices:
            torch_device = str(torch.device(spec))
            index = seen.get(spec, 0)
            seen[spec] = index + 1
            name = torch_device.replace(":", "") + (f"_{index}" if counts[spec] > 1 else "")
            devices.append(_detect(torch_device, name, share=counts[spec]))
        k = len(devices)
        bandwidth = np.full((k, k), _LOCAL_PROCESS_BANDWIDTH_BYTES_PER_S)
        latency = np.full((k, k), _LOCAL_PROCESS_LATENCY_S)
        for a in range(k):
            for b in range(k):
                if kind_of(devices[a].torch_device).accelerator or kind_of(devices[b].torch_device).accelerator:
                    bandwidth[a, b], latency[a, b] = _PCIE_BANDWIDTH_BYTES_PER_S, _PCIE_LATENCY_S
        np.fill_diagonal(latency, 0.0)
        return cls(tuple(devices), bandwidth, latency)


# --- device table and validation ---------------------------------------------------------


@cache
def device_types() -> dict[str, dict[str, Any]]:
    """The built-in device table (``moirai/data/device_types.toml``), by type name."""
    return tomllib.loads(resources.files("moirai").joinpath("data/device_types.toml").read_text())


def _check_device_names(names: Sequence[str]) -> None:
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ClusterError(f"duplicate device names {duplicates}; give every device its own name")


def _check_device(d: Device) -> None:
    if not d.memory_bytes > 0:
        raise ClusterError(f"device {d.name!r} has memory {d.memory_bytes} bytes; give it a positive memory_gb")
    peaks = [d.peak_flops, d.peak_flops_fp16, d.peak_flops_bf16]
    if any(not p > 0 for p in peaks if p is not None) or not d.memory_bandwidth_bytes_per_s > 0:
        raise ClusterError(f"device {d.name!r} needs positive peak FLOP/s and memory bandwidth")
    if not 0 < d.efficiency <= 1 or not d.launch_overhead_s >= 0:
        raise ClusterError(f"device {d.name!r}: efficiency must be in (0, 1] and launch overhead non-negative")
    if d.kind not in ("cpu", "gpu"):
        raise ClusterError(f"device {d.name!r} has kind {d.kind!r}; use 'cpu' or 'gpu'")


def torch_device_name(spec: object, where: str) -> str:
    """The torch device string of ``spec`` (``"cpu"``, ``"cuda:1"``); :class:`ClusterError` naming ``where`` if none."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise ClusterError(
            f"{where} is {spec!r} of type {type(spec).__name__}; give a torch device string such as 'cpu' or 'cuda:0'"
        )
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ClusterError(f"{where} is {spec!r}, which is not a torch device; use 'cpu' or 'cuda:N'") from None
    if device.type not in _SUPPORTED_DEVICE_TYPES:
        raise ClusterError(f"{where} is {spec!r}: moirai runs parts on 'cpu' and 'cuda:N' devices, not {device.type}")
    return str(device)


def _check_arrays_of_tables(description: Mapping[str, Any]) -> None:
    """``[[devices]]`` and ``[[links]]`` must be arrays of tables; ``[devices]`` (one table) is a common slip."""
    for key in ("devices", "links"):
        entries = description.get(key)
        if entries is None or (isinstance(entries, list) and all(isinstance(e, Mapping) for e in entries)):
            continue
        got = f"a single table [{key}]" if isinstance(entries, Mapping) else f"{entries!r}"
        raise ClusterError(f"{key} must be an array of tables, one [[{key}]] entry each, got {got}; write [[{key}]]")
    if "matrix" in description and not isinstance(description["matrix"], Mapping):
        raise ClusterError(f"matrix must be a table ([matrix]), got {description['matrix']!r}")


def _check_types(entry: Mapping[str, Any], where: str) -> None:
    """Every number a number, before any is read: ``memory_gb = "lots"`` names the device and key."""
    for key, value in entry.items():
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in _NUMBER_KEYS and not is_number:
            raise ClusterError(f"{where}: {key} must be a number, got {value!r}")
        if key in _INTEGER_KEYS and (not isinstance(value, int) or isinstance(value, bool)):
            raise ClusterError(f"{where}: {key} must be an integer, got {value!r}")
        if key in _BOOLEAN_KEYS and not isinstance(value, bool):
            raise ClusterError(f"{where}: {key} must be true or false, got {value!r}")
        if key == "peak_tflops" and (
            not isinstance(value, Mapping)
            or any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in value.values())
        ):
            raise ClusterError(f"{where}: peak_tflops must be a table of numbers like {{ fp32 = 10.0 }}, got {value!r}")


def _check_keys(entry: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ClusterError(f"{where} has unknown keys {unknown}; allowed keys are {sorted(allowed)}")


def _device_from_dict(entry: Mapping[str, Any]) -> Device:
    name = entry.get("name")
    if not name:
        raise ClusterError(f"a [[devices]] entry has no name: {dict(entry)}")
    _check_keys(entry, _DEVICE_KEYS, f"device {name!r}")
    _check_types(entry, f"device {name!r}")
    type_name = entry.get("type")
    type_row: dict[str, Any] = {}
    if type_name is not None:
        if type_name not in device_types():
            raise ClusterError(
                f"device {name!r} has unknown type {type_name!r}; known types are {sorted(device_types())}"
            )
        type_row = device_types()[type_name]
    numbers = {**{key: value for key, value in type_row.items() if key in _DEVICE_KEYS}, **entry}
    peaks = {**type_row.get("peak_tflops", {}), **entry.get("peak_tflops", {})}
    for key in ("memory_gb", "memory_bandwidth_gb_per_s"):
        if key not in numbers:
            raise ClusterError(f"device {name!r} needs {key} (or a type from the device table that gives it)")
    if "fp32" not in peaks:
        raise ClusterError(f"device {name!r} needs peak_tflops = {{ fp32 = ... }} or a type from the device table")
    unknown_precisions = sorted(set(peaks) - set(_PRECISION_OF_DTYPE.values()))
    if unknown_precisions:
        raise ClusterError(f"device {name!r}: unknown peak_tflops keys {unknown_precisions}; use fp32, fp16, bf16")
    torch_device = torch_device_name(entry.get("torch_device", "cpu"), f"device {name!r}: torch_device")
    return Device(
        name=str(name),
        torch_device=torch_device,
        memory_bytes=float(numbers["memory_gb"]) * GB,
        peak_flops=float(peaks["fp32"]) * TFLOPS,
        memory_bandwidth_bytes_per_s=float(numbers["memory_bandwidth_gb_per_s"]) * GB,
        launch_overhead_s=float(numbers.get("launch_overhead_us", 5.0)) * MICROSECOND,
        kind=str(numbers.get("kind", "gpu" if kind_of(torch_device).accelerator else "cpu")),
        device_type=type_name,
        peak_flops_fp16=float(peaks["fp16"]) * TFLOPS if "fp16" in peaks else None,
        peak_flops_bf16=float(peaks["bf16"]) * TFLOPS if "bf16" in peaks else None,
        efficiency=float(numbers.get("efficiency", 0.5)),
        host=str(entry.get("host", "localhost")),
        rank=None if entry.get("rank") is None else int(entry["rank"]),
        **_cores_and_threads(entry, str(name)),
    )


def _cores_and_threads(entry: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The optional ``cores`` and ``threads`` keys of a device entry, checked."""
    cores, threads = entry.get("cores"), entry.get("threads")
    if cores is not None:
        if not isinstance(cores, list) or not cores or any(type(c) is not int or c < 0 for c in cores):
            raise ClusterError(f"device {name!r}: cores must be a non-empty list of core numbers, got {cores!r}")
        if len(set(cores)) != len(cores):
            raise ClusterError(f"device {name!r}: cores {cores} lists a core twice")
        cores = tuple(cores)
    if threads is not None and (type(threads) is not int or threads < 1):
        raise ClusterError(f"device {name!r}: threads must be a positive integer, got {threads!r}")
    if cores is not None and threads is not None and threads > len(cores):
        raise ClusterError(
            f"device {name!r}: {threads} threads on {len(cores)} cores would oversubscribe them; "
            "give at most one thread per core"
        )
    return {"cores": cores, "threads": threads}


def _device_to_dict(d: Device) -> dict[str, Any]:
    """Explicit numbers for every field, so the file does not depend on the table's version."""
    peaks = {"fp32": d.peak_flops, "fp16": d.peak_flops_fp16, "bf16": d.peak_flops_bf16}
    entry: dict[str, Any] = {"name": d.name, "torch_device": d.torch_device, "host": d.host}
    if d.rank is not None:
        entry["rank"] = d.rank
    if d.cores is not None:
        entry["cores"] = list(d.cores)
    if d.threads is not None:
        entry["threads"] = d.threads
    entry["kind"] = d.kind
    if d.device_type is not None:
        entry["type"] = d.device_type
    entry.update(
        memory_gb=d.memory_bytes / GB,
        peak_tflops={key: value / TFLOPS for key, value in peaks.items() if value is not None},
        memory_bandwidth_gb_per_s=d.memory_bandwidth_bytes_per_s / GB,
        launch_overhead_us=d.launch_overhead_s / MICROSECOND,
        efficiency=d.efficiency,
    )
    return entry


def _links_from_dict(entry: Mapping[str, Any]) -> list[Link]:
    src, dst = entry.get("src"), entry.get("dst")
    if src is None or dst is None:
        raise ClusterError(f"a [[links]] entry needs src and dst: {dict(entry)}")
    _check_keys(entry, _LINK_KEYS, f"link {src!r} -> {dst!r}")
    _check_types(entry, f"link {src!r} -> {dst!r}")
    if "bandwidth_gbps" not in entry:
        raise ClusterError(f"link {src!r} -> {dst!r} has no bandwidth_gbps; give its bandwidth in Gbit/s")
    bandwidth = float(entry["bandwidth_gbps"])
    if not bandwidth > 0:
        raise ClusterError(f"link {src!r} -> {dst!r} has bandwidth {bandwidth} Gbps; it must be positive")
    latency = float(entry.get("latency_us", 0.0))
    if not latency >= 0:
        raise ClusterError(f"link {src!r} -> {dst!r} has latency {latency} us; it must be non-negative")
    forward = Link(str(src), str(dst), bandwidth * GBPS_IN_BYTES_PER_S, latency * MICROSECOND)
    if entry.get("both_directions", False):
        return [forward, dataclasses.replace(forward, src=forward.dst, dst=forward.src)]
    return [forward]


def _links_from_matrix(matrix: Mapping[str, Any], names: Sequence[str]) -> list[Link]:
    _check_keys(matrix, {"bandwidth_gbps", "latency_us"}, "[matrix]")
    if "bandwidth_gbps" not in matrix:
        raise ClusterError("[matrix] needs bandwidth_gbps, a square matrix with one row and column per device")
    k = len(names)
    bandwidth = _square(matrix["bandwidth_gbps"], k, "bandwidth_gbps")
    latency_entry = matrix.get("latency_us", 0.0)
    if isinstance(latency_entry, (str, bool)):
        raise ClusterError(f"[matrix] latency_us must be a number or a {k}x{k} matrix, got {latency_entry!r}")
    latency = np.full((k, k), float(latency_entry)) if np.isscalar(latency_entry) else _square(
        latency_entry, k, "latency_us"
    )
    links = []
    for a in range(k):
        for b in range(k):
            if a == b:
                continue
            if not bandwidth[a, b] > 0:
                raise ClusterError(
                    f"[matrix] bandwidth {names[a]!r} -> {names[b]!r} is {bandwidth[a, b]} Gbps; every off-diagonal "
                    "entry must be positive (describe a partial topology with [[links]] instead)"
                )
            if not latency[a, b] >= 0:
                raise ClusterError(f"[matrix] latency {names[a]!r} -> {names[b]!r} is negative")
            links.append(
                Link(names[a], names[b], bandwidth[a, b] * GBPS_IN_BYTES_PER_S, latency[a, b] * MICROSECOND)
            )
    return links


def _square(rows: Any, k: int, label: str) -> np.ndarray:
    if not isinstance(rows, list) or any(not isinstance(row, list) or len(row) != k for row in rows) or len(rows) != k:
        shape = [len(row) if isinstance(row, list) else 1 for row in rows] if isinstance(rows, list) else rows
        raise ClusterError(f"[matrix] {label} must be {k}x{k} (one row and column per device), got rows {shape}")
    try:
        return np.array(rows, float)
    except (TypeError, ValueError):
        raise ClusterError(f"[matrix] {label} must hold numbers, got {rows!r}") from None


# --- routes ---------------------------------------------------------------------------------


def _link_graph(names: Sequence[str], links: Iterable[Link]) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(names)
    for link in links:
        graph.add_edge(link.src, link.dst, bandwidth=link.bandwidth_bytes_per_s, latency=link.latency_s)
    return graph


def _widest_path(graph: nx.DiGraph, src: str, dst: str) -> list[str]:
    """The path ``src -> dst`` with the widest bottleneck, lowest latency among the widest."""
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
            hops = [graph.edges[u, v] for u, v in nx.utils.pairwise(path)]
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


# --- files ---------------------------------------------------------------------------------


def _preset_files() -> Any:
    return resources.files("moirai").joinpath("data/clusters")


def _to_toml(description: Mapping[str, Any]) -> str:
    """TOML for the cluster-file schema: top-level scalars, then arrays of tables."""
    lines = [f"{key} = {_toml_value(value)}" for key, value in description.items() if not isinstance(value, list)]
    for key, entries in description.items():
        if isinstance(entries, list):
            for entry in entries:
                lines += ["", f"[[{key}]]"] + [f"{k} = {_toml_value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
        return repr(float(value))
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {type(value).__name__}")


# --- local detection -------------------------------------------------------------------------


def _matches(patterns: Sequence[str], device_name: str) -> bool:
    """Whole-word match, so that ``"P4"`` names a Tesla P4 but not a Tesla P40."""
    return any(re.search(rf"\b{re.escape(p)}\b", device_name) for p in patterns)


def _index(device: Device) -> int:
    return torch.device(device.torch_device).index or 0


def _detect(torch_device: str, name: str, share: int) -> Device:
    """Properties of a local device; ``share`` logical devices split one physical device."""
    kind = kind_of(torch_device)
    if kind.accelerator:
        if kind.count() == 0:
            raise ClusterError(f"{torch_device} requested but {kind.name.upper()} is not available on this machine")
        index = torch.device(torch_device).index or 0
        if index >= kind.count():
            raise ClusterError(f"{torch_device} requested but this machine has {kind.count()} {kind.name} devices")
        props = kind.properties(index)
        known = next((key for key, row in device_types().items() if _matches(row["match"], props.name)), None)
        if known is not None:
            row = device_types()[known]
            peaks = {key: value * TFLOPS for key, value in row["peak_tflops"].items()}
            return Device(
                name, torch_device, props.total_memory / share, peaks["fp32"],
                row["memory_bandwidth_gb_per_s"] * GB, row["launch_overhead_us"] * MICROSECOND, "gpu", known,
                peaks.get("fp16"), peaks.get("bf16"), row["efficiency"],
            )
        # 2 FLOPs per FMA, 128 FP32 lanes per SM on recent NVIDIA parts: a datasheet-level estimate.
        peak = 2 * 128 * props.multi_processor_count * 1.5e9
        bandwidth = 2 * getattr(props, "memory_bus_width", 256) / 8 * getattr(props, "memory_clock_rate", 7e6) * 1e3
        return Device(name, torch_device, props.total_memory / share, peak, bandwidth, 10e-6, "gpu")
    if torch_device != "cpu":
        raise ClusterError(f"unsupported device {torch_device!r}; use 'cpu' or 'cuda:N'")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(split_cores(available_cores(), share)[0])
    flags, clock_hz = _cpu_flags_and_clock()
    per_cycle = next((flops for flag, flops in _FP32_FLOPS_PER_CYCLE_BY_FLAG if flag in flags),
                     _FP32_FLOPS_PER_CYCLE_BASELINE)
    peak = per_cycle * clock_hz * cores
    # AVX512-BF16 dot products run two bf16 pairs per fp32 lane.
    peak_bf16 = 2 * peak if "avx512_bf16" in flags else None
    return Device(
        name, "cpu", memory / share, peak, _CPU_MEMORY_BANDWIDTH_BYTES_PER_S, _CPU_LAUNCH_OVERHEAD_S, "cpu",
        peak_flops_bf16=peak_bf16,
    )


def available_cores() -> tuple[int, ...]:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def split_cores(cores: Sequence[int], share: int) -> list[tuple[int, ...]]:
    """``share`` disjoint blocks of ``cores`` of equal size, one per logical device (cores left over stay idle).

    The cost model gives each of ``share`` logical CPU devices one block's worth of peak FLOP/s
    and the runtime pins each rank to its block: one rule for both. With more devices than
    cores, each gets one core and the blocks wrap around.
    """
    size = max(1, len(cores) // share)
    return [tuple(cores[(k * size + i) % len(cores)] for i in range(size)) for k in range(share)]


def _cpu_flags_and_clock() -> tuple[set[str], float]:
    """The CPU's feature flags and clock from /proc/cpuinfo (empty and a typical clock elsewhere)."""
    flags: set[str] = set()
    clock_hz = _CPU_CLOCK_HZ_IF_UNKNOWN
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return flags, clock_hz
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "cpu MHz" and clock_hz == _CPU_CLOCK_HZ_IF_UNKNOWN:
            clock_hz = float(value) * 1e6
    return flags, clock_hz
