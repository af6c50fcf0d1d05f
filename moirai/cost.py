"""Cost model: Cluster x OpGraph -> Problem (plain numbers).

Compute time of every node (op or op group) on every device, two modes:

* ``analytic``: roofline per node and device,
  ``max(flops / peak_flops[dtype], bytes_moved / memory_bandwidth) / efficiency`` plus one launch
  overhead per op (peaks, bandwidth, efficiency and overhead from the device, see
  :mod:`moirai.devices`). Ops the FLOP counter does not cover have 0 FLOPs and cost their bytes
  moved. The dtype of a node is that of its largest floating-point output (read from the traced
  model when one is given; float32 otherwise).
* ``measured``: every node runs on the real device, as a small ``fx.GraphModule`` of its ops fed
  with the values the full model produces on random inputs (integer inputs are zeros, weights on
  the meta device are random): warm-up runs, then the median of repeated runs, each repeat
  running every group once in graph order (so caches are as cold as in the model); runs are timed
  with wall time unless another ``clock`` is given. Profiling holds the activations of one forward
  pass of the model in memory. Times are cached
  on disk (``$MOIRAI_CACHE_DIR``, else ``~/.cache/moirai``) keyed by the node's op signature
  (targets, argument shapes, dtypes, strides, constants) and the device, so a second compile,
  or a second identical layer, does not profile again. Every device of the cluster must be on
  this machine; devices sharing a torch device share its measurements, taken with the current
  ``torch.get_num_threads()``.

Communication: tensor ``t`` from device ``a`` to ``b`` takes ``latency[a, b] + bytes / bandwidth[a, b]``
on the cluster's (routed) link matrices, 0 on one device.

Memory: a node holds its parameters and buffers on its device for the whole run
(``Problem.memory_bytes``). Activations are transient: every device keeps free the activation
peak of the whole model run in graph order (:func:`activation_peak_bytes`: a tensor lives from
its producer to its last consumer, views allocate nothing), so a device's capacity in the
problem is its memory minus that reserve. A part of the model never holds more live activations
than the whole model run on one device, so the reserve is a safe bound; it is loose when the
model is split, since the paper's alternative (charging every activation for the whole run)
made a 13B decoder need 48 GB for 26 GB of weights.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from rich.progress import Progress

from moirai.devices import Cluster, Device
from moirai.errors import ClusterError
from moirai.graph import OpGraph
from moirai.problem import Problem
from moirai.trace import TensorSpec, TracedModel

_LOCAL_HOSTS = {"localhost", "127.0.0.1", socket.gethostname()}


def build_problem(
    graph: OpGraph,
    cluster: Cluster,
    mode: Literal["analytic", "measured"] = "analytic",
    traced: TracedModel | None = None,
    *,
    cache_dir: str | Path | None = None,
    warmup: int = 3,
    repeats: int = 11,
    progress: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> Problem:
    """The placement problem of ``graph`` on ``cluster``.

    ``mode="measured"`` needs ``traced``, the model ``graph`` was built from; ``analytic`` uses it,
    when given, only to read each node's dtype.
    """
    if mode == "analytic":
        dtypes = None if traced is None else node_dtypes(graph, traced)
        compute = analytic_compute_s(graph, cluster, dtypes)
    elif mode == "measured":
        if traced is None:
            raise ClusterError("mode='measured' runs the model's ops: pass traced=, the TracedModel of the graph")
        compute = measured_compute_s(
            graph, cluster, traced, cache_dir=cache_dir, warmup=warmup, repeats=repeats, progress=progress, clock=clock
        )
    else:
        raise ClusterError(f"unknown cost mode {mode!r}; use 'analytic' or 'measured'")

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
    reserve = activation_peak_bytes(graph)
    return Problem(
        device_names=cluster.names,
        memory_capacity_bytes=np.array([max(d.memory_bytes - reserve, 0.0) for d in cluster.devices]),
        task_names=tuple(n.name for n in graph.nodes),
        compute_s=compute,
        memory_bytes=np.array([n.param_bytes for n in graph.nodes]),
        tensor_names=tuple(names),
        tensor_producer=np.array(producers, int),
        tensor_consumers=tuple(tuple(c) for c in consumers),
        transfer_s=transfer_s(sizes_array, cluster),
        tensor_bytes=sizes_array,
    )


def activation_peak_bytes(graph: OpGraph) -> float:
    """Peak bytes of live activations when ``graph``'s nodes run one after another in index order.

    A node's outputs (``output_bytes``) are live from the node until its last consumer, or to
    the end when nothing in the graph consumes them (model outputs).
    """
    n = len(graph.nodes)
    last_use = np.arange(n)
    for e in graph.edges:
        last_use[e.src] = max(last_use[e.src], e.dst)
    consumed = np.zeros(n, bool)
    consumed[[e.src for e in graph.edges]] = True
    last_use[~consumed] = n - 1
    # Difference array: +bytes when a node runs, -bytes after its last consumer has run.
    change = np.zeros(n + 1)
    allocated = np.array([node.output_bytes for node in graph.nodes])
    np.add.at(change, np.arange(n), allocated)
    np.add.at(change, last_use + 1, -allocated)
    return float(np.cumsum(change)[:n].max()) if n else 0.0


def transfer_s(tensor_bytes: np.ndarray, cluster: Cluster) -> np.ndarray:
    """``[t, a, b]``: time to send tensor ``t`` from device ``a`` to ``b`` (0 on the diagonal)."""
    off_diagonal = ~np.eye(len(cluster), dtype=bool)
    with np.errstate(divide="ignore"):
        per_byte = np.where(off_diagonal, 1.0 / cluster.bandwidth_bytes_per_s, 0.0)
    latency = cluster.latency_s * off_diagonal
    return latency[None, :, :] + np.asarray(tensor_bytes, float)[:, None, None] * per_byte[None, :, :]


def analytic_compute_s(graph: OpGraph, cluster: Cluster, dtypes: Sequence[str] | None = None) -> np.ndarray:
    """``[node, device]`` roofline times; ``dtypes`` (torch dtype names per node) default to float32."""
    dtypes = ["float32"] * len(graph.nodes) if dtypes is None else list(dtypes)
    flops = np.array([n.flops for n in graph.nodes], float)
    moved = np.array([n.bytes_moved for n in graph.nodes], float)
    op_count = np.array([len(n.targets) for n in graph.nodes], float)
    peak = np.array([[d.peak_flops_for(dtype) for d in cluster.devices] for dtype in dtypes]).reshape(len(flops), -1)
    memory_bandwidth = np.array([d.memory_bandwidth_bytes_per_s for d in cluster.devices])
    efficiency = np.array([d.efficiency for d in cluster.devices])
    launch = np.array([d.launch_overhead_s for d in cluster.devices])
    roofline = np.maximum(flops[:, None] / peak, moved[:, None] / memory_bandwidth)
    return roofline / efficiency + op_count[:, None] * launch


def node_dtypes(graph: OpGraph, traced: TracedModel) -> list[str]:
    """Per node, the dtype (name) of its largest floating-point output; float32 when it has none."""
    fx_nodes = {n.name: n for n in traced.graph_module.graph.nodes}
    dtypes = []
    for node in graph.nodes:
        outputs = [
            t
            for name in node.fx_names
            for t in pytree.tree_leaves(fx_nodes[name].meta.get("val"))
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point
        ]
        largest = max(outputs, key=lambda t: t.numel() * t.element_size(), default=None)
        dtypes.append("float32" if largest is None else str(largest.dtype).removeprefix("torch."))
    return dtypes


# --- measured mode ---------------------------------------------------------------------------


def measured_compute_s(
    graph: OpGraph,
    cluster: Cluster,
    traced: TracedModel,
    *,
    cache_dir: str | Path | None = None,
    warmup: int = 3,
    repeats: int = 11,
    progress: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> np.ndarray:
    """``[node, device]`` measured times; devices sharing a torch device share one profile."""
    for device in cluster.devices:
        _check_local(device)
    profiles = {
        torch_device: profile_nodes(
            graph, traced, torch_device, cache_dir=cache_dir, warmup=warmup, repeats=repeats, progress=progress,
            clock=clock,
        )
        for torch_device in dict.fromkeys(d.torch_device for d in cluster.devices)
    }
    return np.stack([profiles[d.torch_device] for d in cluster.devices], axis=1)


def profile_nodes(
    graph: OpGraph,
    traced: TracedModel,
    torch_device: str,
    *,
    cache_dir: str | Path | None = None,
    warmup: int = 3,
    repeats: int = 11,
    progress: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> np.ndarray:
    """Median time (s) of every node of ``graph`` run alone on ``torch_device``; disk-cached.

    ``clock`` times the runs: wall time by default; ``time.thread_time`` counts only this thread's
    CPU time, which suits single-threaded CPU profiling on a machine shared with other work.
    """
    if warmup < 0 or repeats < 1:
        raise ClusterError(f"profiling needs warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    device = torch.device(torch_device)
    fx_nodes = {n.name: n for n in traced.graph_module.graph.nodes}
    signatures = [_signature(traced.graph_module, [fx_nodes[f] for f in node.fx_names]) for node in graph.nodes]
    cache = _ProfileCache(Path(cache_dir) if cache_dir is not None else default_cache_dir(), _device_key(device, clock))
    missing = list(dict.fromkeys(s for s in signatures if s not in cache.times_s))
    if missing:
        module = _module_on(traced.graph_module, device)
        values = _node_values(module, traced, device)
        first_node_of = {s: i for i, s in reversed(list(enumerate(signatures)))}
        groups = [
            _group_module(module, [fx_nodes[f] for f in graph.nodes[first_node_of[s]].fx_names], values)
            for s in missing
        ]
        medians = _median_times_s(groups, device, warmup, repeats, progress, clock)
        cache.times_s.update(zip(missing, medians, strict=True))
        cache.save()
    return np.array([cache.times_s[s] for s in signatures])


def default_cache_dir() -> Path:
    """Where measured profiles live: ``$MOIRAI_CACHE_DIR``, else ``~/.cache/moirai``."""
    return Path(os.environ.get("MOIRAI_CACHE_DIR") or Path.home() / ".cache" / "moirai")


class _ProfileCache:
    """One JSON file per device: op-group signature -> median seconds."""

    def __init__(self, cache_dir: Path, device_key: str) -> None:
        digest = hashlib.sha256(device_key.encode()).hexdigest()[:16]
        self.path = cache_dir / "profiles" / f"{digest}.json"
        self.device_key = device_key
        self.times_s: dict[str, float] = {}
        if self.path.exists():
            self.times_s = json.loads(self.path.read_text()).get("times_s", {})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"device": self.device_key, "times_s": self.times_s}, indent=0))
        os.replace(partial, self.path)  # atomic: a concurrent reader never sees half a file


def _check_local(device: Device) -> None:
    on_this_host = device.host in _LOCAL_HOSTS
    torch_device = torch.device(device.torch_device)
    available = torch_device.type == "cpu" or (
        torch_device.type == "cuda" and (torch_device.index or 0) < torch.cuda.device_count()
    )
    if not (on_this_host and available):
        raise ClusterError(
            f"device {device.name!r} ({device.torch_device} on host {device.host!r}) is not on this machine, "
            "so it cannot be measured; use mode='analytic', or profile on that host"
        )


def _device_key(device: torch.device, clock: Callable[[], float]) -> str:
    """What a measurement depends on besides the ops: the hardware, the thread count, torch, the clock."""
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device.index or 0)
    else:
        hardware = f"{_cpu_model()} threads={torch.get_num_threads()}"
    return f"{device.type}|{hardware}|torch {torch.__version__}|{clock.__name__}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _signature(module: fx.GraphModule, nodes: Sequence[fx.Node]) -> str:
    """A hash of the ops of a group, independent of node names: equal groups share a profile."""
    position = {n: i for i, n in enumerate(nodes)}

    def describe(arg: Any) -> Any:
        if isinstance(arg, fx.Node):
            if arg in position:
                return f"%{position[arg]}"
            return pytree.tree_map_only(torch.Tensor, _tensor_signature, arg.meta.get("val"))
        return arg

    parts = []
    for node in nodes:
        target = repr(module.get_submodule(node.target)) if node.op == "call_module" else str(node.target)
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), describe)
        parts.append(f"{node.op} {target} {args!r} {kwargs!r}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _tensor_signature(t: torch.Tensor) -> str:
    return f"T{tuple(t.shape)}{t.dtype}{tuple(t.stride())}"


def _module_on(module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """``module`` with real weights on ``device``; weights on the meta device become random."""
    tensors = list(module.parameters()) + list(module.buffers())
    if all(t.device == device for t in tensors):
        return module
    if not any(t.is_meta for t in tensors):
        return copy.deepcopy(module).to(device)
    materialized = copy.deepcopy(module).to_empty(device=device)
    with torch.no_grad():
        for t in list(materialized.parameters()) + list(materialized.buffers()):
            t.copy_(_random_like(t))
    return materialized


def _random_like(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.randn(t.shape, dtype=t.dtype, device=t.device)
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device)


class _ValueRecorder(fx.Interpreter):
    """Runs the whole graph on random inputs of the traced specs and keeps every node's value."""

    def __init__(self, module: fx.GraphModule, input_specs: Sequence[TensorSpec], device: torch.device) -> None:
        super().__init__(module, garbage_collect_values=False)
        self.pending_inputs = iter(input_specs)
        self.device = device

    def placeholder(self, target: Any, args: tuple, kwargs: dict) -> Any:
        spec = next(self.pending_inputs)
        return _random_like(torch.empty(spec.shape, dtype=spec.dtype, device=self.device))


def _node_values(module: fx.GraphModule, traced: TracedModel, device: torch.device) -> dict[str, Any]:
    """Value of every node of ``module`` (by name) when the model runs on random inputs."""
    recorder = _ValueRecorder(module, traced.input_specs, device)
    with torch.no_grad():
        recorder.run()
    return {n.name: value for n, value in recorder.env.items()}


def _group_module(
    module: fx.GraphModule, nodes: Sequence[fx.Node], values: dict[str, Any]
) -> tuple[fx.GraphModule, list[Any]]:
    """A GraphModule running ``nodes`` alone, and the values of its inputs."""
    # ``nodes`` come from the traced graph; ``module`` may be a copy of it on another device.
    own = {n.name: n for n in module.graph.nodes}
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    inputs: list[Any] = []
    for original in nodes:
        node = own[original.name]
        for producer in node.all_input_nodes:
            if producer not in copies:
                copies[producer] = graph.placeholder(f"input_{len(inputs)}")
                inputs.append(values[producer.name])
        copies[node] = graph.node_copy(node, lambda n: copies[n])
    graph.output(tuple(copies[own[n.name]] for n in nodes))
    return fx.GraphModule(module, graph), inputs


def _median_times_s(
    groups: Sequence[tuple[fx.GraphModule, list[Any]]],
    device: torch.device,
    warmup: int,
    repeats: int,
    progress: bool,
    clock: Callable[[], float],
) -> list[float]:
    """Median time of every group; each repeat runs all groups in graph order, as the model does,
    so a group finds the caches as the groups before it left them, not warm from its own last run."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: list[list[float]] = [[] for _ in groups]
    with torch.no_grad(), Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task(f"profiling {len(groups)} op groups on {device}", total=warmup + repeats)
        for run in range(warmup + repeats):
            for (group, inputs), group_times in zip(groups, times, strict=True):
                synchronize()
                start = clock()
                group(*inputs)
                synchronize()
                if run >= warmup:
                    group_times.append(clock() - start)
            bar.advance(task)
    return [statistics.median(t) for t in times]
