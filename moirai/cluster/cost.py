"""Cost model: Cluster x OpGraph -> Problem (plain numbers).

Compute time of every node (op or op group) on every device, two modes:

* ``analytic``: roofline per node and device,
  ``max(flops / peak_flops[dtype], bytes_moved / memory_bandwidth) / efficiency`` plus one launch
  overhead per op (peaks, bandwidth, efficiency and overhead from the device, see
  :mod:`moirai.cluster.devices`). Ops the FLOP counter does not cover have 0 FLOPs and cost their bytes
  moved (:func:`moirai.frontend.graph.build_op_graph`: none for a view, the gathered rows for a lookup). The dtype
  of a node is that of its largest floating-point output (read from the traced model when one is given; float32
  otherwise).
* ``measured``: every node is timed inside runs of the whole model on the real device, with
  random inputs of the traced shapes (integer inputs are zeros; weights on the meta device become
  random). The traced graph is regenerated with each node's ops contiguous (nodes in a
  topological order of ``graph``, ties in the model's op order; ops of a node in the model's
  order) and a clock reading between nodes; a parameter is fetched by the first node that reads
  it, and fx frees every value after its last use, as in the model's own run. So a node's time
  is that of its ops with the memory and caches the model leaves them (fresh allocations,
  outputs that stay live, the previous node's data in cache) and without a per-call overhead the
  model does not have: the times add up to the run of the traced graph, which is what moirai
  runs (each part is such a graph). Each node's time is the median over the repeats,
  after warm-up runs, minus the clock's own cost (the median of spans with no op between two
  readings). Readings use wall time unless another ``clock`` is given (``time.thread_time``
  suits single-threaded CPU profiling on a shared machine). Times are cached on disk
  (``$MOIRAI_CACHE_DIR``, else ``~/.cache/moirai``) keyed by the node's op signature (targets,
  argument shapes, dtypes, strides, constants) and the device: nodes of one signature share the
  median of their times, and a second compile reads the cache instead of profiling. Every device
  of the cluster must be on this machine; devices sharing a torch device share its
  measurements, taken with the current ``torch.get_num_threads()``. ``steady_state=True`` (plans whose devices
  compute at once: several requests or decode steps in flight) profiles while the other devices that share the
  profile run the model over and over on their own cores, so the times include what ranks computing at once cost
  each other (memory bandwidth, shared caches; [Note: steady-state profile]); cached apart from the lone profile.

Communication: what a tensor, the runtime's header and the model outputs cost on the cluster's links
(:mod:`moirai.cluster.messages`).

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

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import select
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args

import networkx as nx
import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from rich.progress import Progress

from moirai.cluster.devices import Cluster, Device
from moirai.cluster.hardware import LOCAL_HOST
from moirai.cluster.host import cpu_model
from moirai.cluster.kinds import Spans, kind_of
from moirai.cluster.messages import header_s, input_messages, output_messages, recv_cpu_s, send_cpu_s, transfer_s
from moirai.errors import ClusterError, did_you_mean
from moirai.file_numbers import float_fault
from moirai.files import default_cache_dir, private_cache_folder, read_own_text, set_aside_corrupt, write_atomically
from moirai.frontend.graph import OpGraph
from moirai.frontend.symbolic_shapes import concrete_shape, example_int, sizes_at
from moirai.frontend.trace import TracedModel, devices_mentioned, retarget_devices
from moirai.planning.costs import RequestCosts
from moirai.planning.problem import Problem
from moirai.progress import stage
from moirai.runtime.resources import apply_resources, rank_resources, restore_resources

CostMode = Literal["analytic", "measured"]
# The cost modes build_problem prices with: compile's, compile_lm's and the command line's choices.
COST_MODES: tuple[CostMode, ...] = get_args(CostMode)
# The mode where none is given (build_problem, compile, compile_lm, the command line): it needs no local devices.
DEFAULT_COST_MODE: CostMode = "analytic"
_EMPTY_SPANS = 4  # spans with no op in profiling runs, to time the clock itself
# A cached profile whose groups add up to more than 25% off a run of the whole graph is measured again.
_STALE_PROFILE = 0.25
_STALE_PROFILE_FLOOR_S = 0.2e-3  # and more than this apart: a graph of microseconds is all call overhead and noise
_STALE_CHECK_RUNS = 3


def check_cost_mode(mode: object) -> CostMode:
    """``mode`` if it is one of :data:`COST_MODES`, else a :class:`ClusterError` naming the closest one.

    compile and compile_lm ask it before tracing, so a misspelt mode is refused at once rather than after the
    trace (and a first calibration's link measurement)."""
    if mode not in COST_MODES:
        raise ClusterError(
            f"unknown cost mode {mode!r}{did_you_mean(mode, COST_MODES)}; use one of {', '.join(map(repr, COST_MODES))}"
        )
    return mode  # type: ignore[return-value]


@stage("cost")
def build_problem(
    graph: OpGraph,
    cluster: Cluster,
    mode: CostMode = DEFAULT_COST_MODE,
    traced: TracedModel | None = None,
    *,
    cache_dir: str | Path | None = None,
    warmup: int = 3,
    repeats: int = 11,
    progress: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    symbol_values: Mapping[str, int] | None = None,
    colocated: Sequence[Sequence[int]] = (),
    remote_alike: bool = False,
    steady_state: bool = False,
) -> Problem:
    """The placement problem of ``graph`` on ``cluster``.

    ``mode="measured"`` needs ``traced``, the model ``graph`` was built from; ``analytic`` uses it,
    when given, only to read each node's dtype. ``symbol_values`` (a dynamic dimension's symbol -> size): measure
    at those sizes rather than the example inputs' (``graph`` should be built under
    :func:`moirai.frontend.symbolic_shapes.sizes_at` with the same values). ``colocated``: sets of node indices that
    must share one device (:attr:`moirai.planning.problem.Problem.colocated`). ``remote_alike``: a device on another
    host is measured here, as its kind of device of this host (torchrun's hosts, which compile assumes alike); else it
    is an error. ``steady_state``: measured with the devices computing at once (:func:`measured_compute_s`).
    """
    if check_cost_mode(mode) == "analytic":
        dtypes = None if traced is None else node_dtypes(graph, traced)
        compute = analytic_compute_s(graph, cluster, dtypes)
    else:
        if traced is None:
            raise ClusterError("mode='measured' runs the model's ops: pass traced=, the TracedModel of the graph")
        compute = measured_compute_s(
            graph,
            cluster,
            traced,
            cache_dir=cache_dir,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
            clock=clock,
            symbol_values=symbol_values,
            remote_alike=remote_alike,
            steady_state=steady_state,
        )

    # Reserved at the sizes priced here, and kept with the problem: a summary adds back this reserve, not one
    # derived again from another graph (compile_lm's decode is priced at other sizes than it was traced).
    memory = np.array([d.memory_bytes for d in cluster.devices], float)
    reserve = np.minimum(activation_peak_bytes(graph), memory)
    return _problem_of(
        graph,
        cluster,
        traced,
        compute_s=compute,
        memory_bytes=np.array([n.param_bytes for n in graph.nodes]),
        memory_capacity_bytes=memory - reserve,
        memory_reserve_bytes=reserve,
        colocated=colocated,
    )


def unfused_problem(
    graph: OpGraph,
    groups: Sequence[Sequence[int]],
    problem: Problem,
    cluster: Cluster,
    traced: TracedModel | None = None,
) -> Problem:
    """``graph``'s problem op by op, where ``problem`` is that of ``graph`` merged by ``groups`` (coarsened).

    Each op gets its share of its group's compute time on every device (in proportion to its analytic time there)
    and of its group's memory (in proportion to its parameter bytes); capacities are ``problem``'s. A plan of
    ``problem`` is then a plan of this one that keeps each group together, with the same compute, so this problem's
    lower bounds hold for ``problem``'s plans too and are never above ``problem``'s own: the difference is what
    grouping the ops may cost, whatever the cost mode (measured times are shared out, not measured again).
    """
    share_s = analytic_compute_s(graph, cluster, None if traced is None else node_dtypes(graph, traced))
    param_bytes = np.array([n.param_bytes for n in graph.nodes], float)
    compute = np.zeros_like(share_s)
    memory = np.zeros(len(graph.nodes))
    for g, members in enumerate(groups):
        ops = list(members)
        group_s = problem.compute_s[g]
        runs = np.isfinite(group_s)  # a group that cannot run on a device leaves every op of it unable to
        compute[ops] = np.where(runs, _shares(share_s[ops]) * np.where(runs, group_s, 0.0), np.inf)
        memory[ops] = _shares(param_bytes[ops, None])[:, 0] * problem.memory_bytes[g]
    return _problem_of(
        graph,
        cluster,
        traced,
        compute_s=compute,
        memory_bytes=memory,
        memory_capacity_bytes=problem.memory_capacity_bytes,
        memory_reserve_bytes=problem.memory_reserve_bytes,
    )


def _shares(weights: np.ndarray) -> np.ndarray:
    """Each row's fraction of its column's total (equal fractions in a column that sums to 0)."""
    total = weights.sum(axis=0, keepdims=True)
    even = np.full_like(weights, 1.0 / len(weights))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, weights / np.where(total > 0, total, 1.0), even)


def _problem_of(
    graph: OpGraph,
    cluster: Cluster,
    traced: TracedModel | None,
    *,
    compute_s: np.ndarray,
    memory_bytes: np.ndarray,
    memory_capacity_bytes: np.ndarray,
    memory_reserve_bytes: np.ndarray,
    colocated: Sequence[Sequence[int]] = (),
) -> Problem:
    """The problem of ``graph`` on ``cluster`` with these tasks' costs: its tensors and what they and a request cost
    on the links."""
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
    outputs = output_messages(graph, traced, cluster)
    inputs = input_messages(graph, traced, cluster)
    return Problem(
        device_names=cluster.names,
        memory_capacity_bytes=memory_capacity_bytes,
        memory_reserve_bytes=memory_reserve_bytes,
        task_names=tuple(n.name for n in graph.nodes),
        compute_s=compute_s,
        memory_bytes=memory_bytes,
        tensor_names=tuple(names),
        tensor_producer=np.array(producers, int),
        tensor_consumers=tuple(tuple(c) for c in consumers),
        transfer_s=transfer_s(sizes_array, cluster),
        tensor_bytes=sizes_array,
        send_cpu_s=send_cpu_s(sizes_array, cluster),
        recv_cpu_s=recv_cpu_s(sizes_array, cluster),
        costs=RequestCosts.build(
            len(graph.nodes),
            len(cluster),
            inputs.readers,
            header_s=header_s(cluster),
            output_s=outputs.delay_s,
            output_send_cpu_s=outputs.send_cpu_s,
            output_recv_cpu_s=outputs.recv_cpu_s,
            output_link_s=outputs.link_s,
            input_s=inputs.delay_s,
            input_send_cpu_s=inputs.send_cpu_s,
            input_recv_cpu_s=inputs.recv_cpu_s,
            input_link_s=inputs.link_s,
            request_cpu_s=cluster.request_cpu_s,
            driver_part_cpu_s=cluster.driver_part_cpu_s,
        ),
        colocated=tuple(tuple(members) for members in colocated),
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


def analytic_compute_s(graph: OpGraph, cluster: Cluster, dtypes: Sequence[str] | None = None) -> np.ndarray:
    """``[node, device]`` roofline times; ``dtypes`` (torch dtype names per node) default to float32."""
    dtypes = ["float32"] * len(graph.nodes) if dtypes is None else list(dtypes)
    flops = np.array([n.flops for n in graph.nodes], float)
    moved = np.array([n.bytes_moved for n in graph.nodes], float)
    # A scalar of the input shapes launches nothing: priced at a launch each, a plan moved three such ops to
    # another device to "save" 30 us, and the server started a process for them.
    op_count = np.array([len(n.targets) - n.shape_ops for n in graph.nodes], float)
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
    symbol_values: Mapping[str, int] | None = None,
    remote_alike: bool = False,
    steady_state: bool = False,
) -> np.ndarray:
    """``[node, device]`` measured times; devices sharing a torch device share one profile (``remote_alike``: as
    :func:`build_problem`'s), taken on the cores and thread count the first such device's rank will get (a logical
    CPU device's rank runs on its share of the cores: profiled with the caller's threads instead, a compute-bound
    prefill was predicted 1.5x faster than it ran). ``steady_state``: while the others of those devices with cores of
    their own run the model on them, as their ranks compute while this one does when requests are pipelined
    ([Note: steady-state profile])."""
    local = [dataclasses.replace(d, host=LOCAL_HOST) if remote_alike else d for d in cluster.devices]
    for device in local:
        _check_local(device)
    resources = rank_resources(local)
    profiles = {}
    for torch_device in dict.fromkeys(d.torch_device for d in cluster.devices):
        sharing = [k for k, d in enumerate(cluster.devices) if d.torch_device == torch_device]
        first = sharing[0]
        co_running = tuple(
            (resources[k].cores, resources[k].threads)
            for k in sharing[1:]
            if steady_state and resources[k].cores is not None and resources[k].cores != resources[first].cores
        )
        before = apply_resources(resources[first], cluster.devices[first].name, own_process=False)
        try:
            profiles[torch_device] = profile_nodes(
                graph,
                traced,
                torch_device,
                cache_dir=cache_dir,
                warmup=warmup,
                repeats=repeats,
                progress=progress,
                clock=clock,
                symbol_values=symbol_values,
                co_running=co_running,
            )
        finally:
            restore_resources(before)
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
    symbol_values: Mapping[str, int] | None = None,
    co_running: Sequence[tuple[Sequence[int], int]] = (),
) -> np.ndarray:
    """Median time (s) of every node of ``graph`` on ``torch_device``, timed inside a run of the whole model.

    ``clock`` times the runs: wall time by default; ``time.thread_time`` counts only this thread's
    CPU time, which suits single-threaded CPU profiling on a machine shared with other work.
    Nodes with equal op signatures share the median of their times; times are disk-cached.
    ``symbol_values``: run at those sizes of the dynamic dimensions instead of the example inputs'. ``co_running``:
    blocks of (cores, threads) that run the model over and over meanwhile, each in a process of its own (the steady
    state of ranks computing at once, [Note: steady-state profile]); its profile is cached apart.
    """
    if warmup < 0 or repeats < 1:
        raise ClusterError(f"profiling needs warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    device = torch.device(torch_device)
    fx_nodes = {n.name: n for n in traced.graph_module.graph.nodes}
    with sizes_at(symbol_values or {}):
        signatures = [_signature(traced.graph_module, [fx_nodes[f] for f in node.fx_names]) for node in graph.nodes]
    device_key = _device_key(device, clock) + _co_running_key(co_running)
    cache = _ProfileCache(Path(cache_dir) if cache_dir is not None else default_cache_dir(), device_key)
    missing = list(dict.fromkeys(s for s in signatures if s not in cache.times_s))
    spans = kind_of(device).spans(device, clock)
    cached_s = [cache.times_s[s] for s in signatures] if not missing else []
    if cached_s and not co_running and _stale_profile(traced, device, symbol_values, spans, cached_s):
        missing = list(dict.fromkeys(signatures))
    if missing:
        module = _module_on(traced.graph_module, device)
        order = _group_order(graph, traced.graph_module)
        timed = _timed_module(module, [graph.nodes[i].fx_names for i in order], spans)
        inputs = _profiling_inputs(traced, device, symbol_values)
        beside = f" beside {len(co_running)} computing" if co_running else ""
        what = f"{len(order)} op groups on {device}{beside}"
        with _computing_meanwhile(module, inputs, co_running):
            times = _in_situ_times_s(timed, spans, inputs, warmup, repeats, progress, what)
            if not co_running:  # [Note: a cached profile checked], for a fresh one: measured once more if off
                whole_s = _whole_graph_s(module, inputs, spans)
                if not _adds_up(float(times.sum()), whole_s):
                    again = _in_situ_times_s(timed, spans, inputs, warmup, repeats, progress, what)
                    times = min(times, again, key=lambda t: abs(math.log(max(float(t.sum()), 1e-12) / whole_s)))
        occurrences: dict[str, list[float]] = {}
        for index, time_s in zip(order, times, strict=True):
            occurrences.setdefault(signatures[index], []).append(float(time_s))
        cache.times_s.update({s: statistics.median(occurrences[s]) for s in missing})
        cache.save()
    return np.array([cache.times_s[s] for s in signatures])


def _profiling_inputs(
    traced: TracedModel, device: torch.device, symbol_values: Mapping[str, int] | None
) -> list[torch.Tensor]:
    """Random model inputs on ``device`` at the example inputs' sizes, or at ``symbol_values``'."""
    shapes = [concrete_shape(s, symbol_values) if symbol_values else s.shape for s in traced.input_specs]
    specs = zip(shapes, traced.input_specs, strict=True)
    return [_random_like(torch.empty(shape, dtype=spec.dtype, device=device)) for shape, spec in specs]


def _stale_profile(
    traced: TracedModel,
    device: torch.device,
    symbol_values: Mapping[str, int] | None,
    spans: Spans,
    cached_s: Sequence[float],
) -> bool:
    """Whether the cached times of a graph's groups fail to add up to a run of the whole graph ([Note: a cached
    profile checked]). A model with weights on the meta device is not checked: its cache is read as it is."""
    tensors = [*traced.graph_module.parameters(), *traced.graph_module.buffers()]
    if any(t.is_meta for t in tensors):
        return False
    module = _module_on(traced.graph_module, device)
    whole_s = _whole_graph_s(module, _profiling_inputs(traced, device, symbol_values), spans)
    return not _adds_up(float(sum(cached_s)), whole_s)


def _whole_graph_s(module: fx.GraphModule, inputs: Sequence[torch.Tensor], spans: Spans) -> float:
    """A run of the whole graph, timed as its groups are: the median of a few runs after one (which allocates)."""
    runs_s = []
    with torch.no_grad():
        module(*inputs)
        for _ in range(_STALE_CHECK_RUNS):
            begun = spans.read()
            module(*inputs)
            first, last = spans.seconds([begun, spans.read()])
            runs_s.append(last - first)
    return statistics.median(runs_s)


def _adds_up(groups_s: float, whole_s: float) -> bool:
    """Whether groups that take ``groups_s`` together are a graph that runs whole in ``whole_s``: within
    :data:`_STALE_PROFILE` either way, or :data:`_STALE_PROFILE_FLOOR_S`."""
    if whole_s <= 0 or groups_s <= 0 or abs(groups_s - whole_s) <= _STALE_PROFILE_FLOOR_S:
        return True
    return abs(math.log(groups_s / whole_s)) <= math.log(1 + _STALE_PROFILE)


def _co_running_key(co_running: Sequence[tuple[Sequence[int], int]]) -> str:
    """What a steady-state profile adds to the device key: the thread counts of the ranks computing meanwhile, on
    weights of their own (profiles taken beside shared weights, which read faster, are not reused)."""
    threads = sorted(threads for _, threads in co_running)
    return f"|steady state beside {threads} threads, own weights" if co_running else ""


@contextlib.contextmanager
def _computing_meanwhile(
    module: fx.GraphModule, inputs: Sequence[torch.Tensor], blocks: Sequence[tuple[Sequence[int], int]]
):
    """While the body runs, ``module`` runs over and over in a forked process per block of (cores, threads), pinned
    there: the ranks of the other devices computing at once. Forked, so a child has the model without pickling it
    and without importing the caller's script; :class:`ClusterError` if a child failed (the profile would be a lone
    one's)."""
    if not blocks:
        yield
        return
    if not (hasattr(os, "fork") and hasattr(os, "sched_setaffinity")):
        raise ClusterError(
            "a steady-state profile runs the other ranks' compute in forked processes pinned to their cores, which "
            "this platform lacks (os.fork, os.sched_setaffinity); profile without steady_state"
        )
    children: list[tuple[int, int]] = []
    try:
        for cores, threads in blocks:
            stop_read, stop_write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(stop_write)
                _compute_until_closed(module, inputs, threads, stop_read)
            os.close(stop_read)
            children.append((pid, stop_write))
            # Pinned here, not by the child, so before the profile starts; a child already ended says so below.
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(pid, cores)
        yield
    finally:
        for _, stop_write in children:
            os.close(stop_write)  # the children's signal to stop
        failed = [pid for pid, _ in children if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    if failed:
        raise ClusterError(
            f"{len(failed)} of the {len(children)} processes computing beside the steady-state profile failed, so it "
            "measured a rank alone; profile without steady_state, or see the process's error above"
        )


def _compute_until_closed(
    module: fx.GraphModule, inputs: Sequence[torch.Tensor], threads: int, stop_fd: int
) -> NoReturn:
    """A forked child's whole life (the parent pins it): ``module`` run with ``threads`` threads until ``stop_fd``
    closes (the parent closed it, or died), on a copy of its weights: a rank streams its own part's from memory, and
    the forked pages it shares with the profile would serve the profile's reads from a shared cache ([Note:
    steady-state profile]: a step of 4 sequences profiled 1.4x faster beside a process that shares them)."""
    code = 1
    try:
        torch.set_num_threads(threads)
        _take_own_weights(module)
        with torch.no_grad():
            while not select.select([stop_fd], [], [], 0)[0]:
                module(*inputs)
        code = 0
    except BaseException as error:  # the parent says that a child failed; this says why
        os.write(2, f"moirai: a process computing beside a steady-state profile failed: {error!r}\n".encode())
    finally:
        os._exit(code)


def _take_own_weights(module: fx.GraphModule) -> bool:
    """In a forked child, give ``module`` a copy of its tensors of its own where the machine has room for one (half
    its available memory), and say whether it did: a model that fills the memory is profiled beside its shared pages
    rather than not at all. (Only the child's module changes: the fork has its own.)"""
    import psutil

    tensors = [*module.parameters(), *module.buffers()]
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")
    if tensor_bytes > psutil.virtual_memory().available / 2:
        return False
    with torch.no_grad():
        for tensor in tensors:
            tensor.data = tensor.data.clone()
    return True


class _ProfileCache:
    """One JSON file per device: op-group signature -> median seconds."""

    def __init__(self, cache_dir: Path, device_key: str) -> None:
        digest = hashlib.sha256(device_key.encode()).hexdigest()[:16]
        self.path = private_cache_folder(cache_dir, "profiles") / f"{digest}.json"
        self.device_key = device_key
        self.times_s: dict[str, float] = {}
        if self.path.exists():
            self.times_s = self._read()

    def _read(self) -> dict[str, float]:
        """The cached times, or none (the file renamed ``.corrupt`` with a warning, so it is measured again): a time
        must be what a measurement gives, a finite number of seconds >= 0 a float holds
        (:func:`moirai.file_numbers.float_fault`; ``10**400`` was an OverflowError, ``-1.0`` a problem error naming
        no cache, on every compile after)."""
        what = "not the JSON moirai writes"
        try:
            times_s = json.loads(read_own_text(self.path)).get("times_s")
            if isinstance(times_s, dict):
                faults = ((op, float_fault(t)) for op, t in times_s.items())
                wrong = next(((op, fault) for op, fault in faults if fault is not None), None)
                if wrong is None:
                    return {op: float(t) for op, t in times_s.items()}
                what = f"the time of op group {wrong[0][:16]} {wrong[1]}"
        except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):  # nested past the parser
            pass
        set_aside_corrupt(self.path, "the profile cache", what)
        return {}

    def save(self) -> None:
        private_cache_folder(self.path.parent.parent, self.path.parent.name)  # made again if removed meanwhile
        text = json.dumps({"device": self.device_key, "times_s": self.times_s}, indent=0)
        write_atomically(self.path, text, private=True)


def _check_local(device: Device) -> None:
    torch_device = torch.device(device.torch_device)
    available = kind_of(torch_device).available(torch_device)
    if not (device.on_this_host and available):
        raise ClusterError(
            f"device {device.name!r} ({device.torch_device} on host {device.host!r}) is not on this machine, "
            "so it cannot be measured; use mode='analytic', or profile on that host"
        )


def _device_key(device: torch.device, clock: Callable[[], float]) -> str:
    """What a measurement depends on besides the ops: the hardware, the thread count, torch, the clock
    and how nodes are timed (in situ: profiles of nodes run alone, taken by earlier versions, differ)."""
    kind = kind_of(device)
    hardware = kind.hardware_name(device) or f"{cpu_model()} threads={torch.get_num_threads()}"
    return f"{device.type}|{hardware}|torch {torch.__version__}|{kind.spans(device, clock).name}|in situ"


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
    # Sizes as numbers: a symbolic size prints as its symbol, the same whatever size a profile ran at.
    shape, stride = (tuple(example_int(size) for size in sizes) for sizes in (t.shape, t.stride()))
    return f"T{shape}{t.dtype}{stride}"


def _module_on(module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """``module`` with real weights on ``device`` and its ops creating tensors there; weights on the meta device
    become random."""
    tensors = list(module.parameters()) + list(module.buffers())
    if all(t.device == device for t in tensors):
        if devices_mentioned(module) <= {device}:
            return module
        moved = copy.deepcopy(module)
    elif not any(t.is_meta for t in tensors):
        moved = copy.deepcopy(module).to(device)
    else:
        moved = copy.deepcopy(module).to_empty(device=device)
        with torch.no_grad():
            for t in list(moved.parameters()) + list(moved.buffers()):
                t.copy_(_random_like(t))
    retarget_devices(moved, device)
    return moved


def _random_like(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.randn(t.shape, dtype=t.dtype, device=t.device)
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device)


def _group_order(graph: OpGraph, module: fx.GraphModule) -> list[int]:
    """Node indices in a topological order of ``graph``, ties broken by the model's own op order."""
    position = {n.name: p for p, n in enumerate(module.graph.nodes)}
    covered = {f for node in graph.nodes for f in node.fx_names}
    compute = {n.name for n in module.graph.nodes if n.op in ("call_function", "call_method", "call_module")}
    if covered != compute:
        raise ClusterError(
            f"the graph's nodes cover {len(covered)} fx nodes but the traced model has {len(compute)} ops; "
            "profile a graph built from this traced model (build_op_graph, then merges of it)"
        )
    first_op = [min(position[f] for f in node.fx_names) for node in graph.nodes]
    try:
        return list(nx.lexicographical_topological_sort(graph.to_networkx(), key=first_op.__getitem__))
    except nx.NetworkXUnfeasible as cycle:
        raise ClusterError(
            "the op groups depend on each other in a cycle, so no run of the model executes each group in one "
            "piece; merge only groups that keep the coarse graph acyclic"
        ) from cycle


def _timed_module(module: fx.GraphModule, groups: Sequence[Sequence[str]], spans: Spans) -> fx.GraphModule:
    """``module``'s graph with every group's ops contiguous, groups in the given order, and a clock read
    (``spans.read``, [Note: timing a GPU's ops]) before the first and after every group; it returns ``(clock
    readings, model outputs)``, the readings starting with ``_EMPTY_SPANS + 1`` empty spans.

    Inputs come first, outside the timed spans; a parameter or buffer is fetched just before the
    first op that reads it, in that op's span, as the model's run (or a part holding that op)
    fetches it. fx code generation frees every value after its last use, as in the model's own
    run, so the ops allocate and reuse memory as they will when the model runs.
    """
    timestamp = spans.read
    position = {n.name: p for p, n in enumerate(module.graph.nodes)}
    own = {n.name: n for n in module.graph.nodes}
    graph = fx.Graph()
    copies = {node: graph.node_copy(node) for node in module.graph.find_nodes(op="placeholder")}
    # Empty spans time the clock's own cost, which every span includes; the first reading after the
    # inputs is slower than the rest (its code is cold), so the first span is only a warm-up.
    stamps = [graph.call_function(timestamp) for _ in range(_EMPTY_SPANS + 2)]
    for group in groups:
        for name in sorted(group, key=position.__getitem__):
            node = own[name]
            # A parameter is looked up (through the module tree) by the first group that reads it.
            for attribute in node.all_input_nodes:
                if attribute.op == "get_attr" and attribute not in copies:
                    copies[attribute] = graph.node_copy(attribute)
            copies[node] = graph.node_copy(node, copies.__getitem__)
        stamps.append(graph.call_function(timestamp))
    (output,) = module.graph.find_nodes(op="output")
    for attribute in module.graph.find_nodes(op="get_attr"):
        copies.setdefault(attribute, graph.node_copy(attribute))
    graph.output((tuple(stamps), fx.node.map_arg(output.args[0], copies.__getitem__)))
    return fx.GraphModule(module, graph)


def _in_situ_times_s(
    timed: fx.GraphModule,
    spans: Spans,
    inputs: Sequence[torch.Tensor],
    warmup: int,
    repeats: int,
    progress: bool,
    what: str,
) -> np.ndarray:
    """Per group of ``timed`` (see :func:`_timed_module`), the median over ``repeats`` runs of the time
    between its clock readings, after ``warmup`` runs and at least ``spans.warmup_s`` seconds of them, minus the
    clock's own cost (the median empty span)."""
    runs = []
    with torch.no_grad(), Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task(f"profiling {what}", total=warmup + repeats)
        warm_from = time.perf_counter() + spans.warmup_s  # [Note: a GPU's clocks]
        for _ in range(warmup):
            spans.seconds(timed(*inputs)[0])
            bar.advance(task)
        while time.perf_counter() < warm_from:
            spans.seconds(timed(*inputs)[0])
        for _ in range(repeats):
            stamps, _ = timed(*inputs)
            runs.append(np.diff(spans.seconds(stamps)))
            bar.advance(task)
    durations = np.array(runs)[:, 1:]
    clock_cost = np.median(durations[:, :_EMPTY_SPANS])
    return np.maximum(np.median(durations[:, _EMPTY_SPANS:], axis=0) - clock_cost, 0.0)
