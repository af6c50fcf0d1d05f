"""The placement problem, as plain numbers: what every placer and the simulator read. Its answer,
:class:`moirai.planning.plan.Plan`, is re-exported here.

A :class:`Problem` knows no torch. Tasks (op groups) have a compute time on every
device and a memory footprint; tensors have one producer task, one or more
consumer tasks and a transfer time for every ordered device pair. A tensor is
sent at most once to each device that consumes it, as the runtime does.

Example::

    problem = Problem.from_dict({
        "devices": [{"name": "gpu0", "memory_bytes": 8e9}, {"name": "gpu1", "memory_bytes": 8e9}],
        "tasks": [{"name": "a", "compute_s": [1.0, 2.0]}, {"name": "b", "compute_s": [1.0, 1.0]}],
        "edges": [{"src": "a", "dst": "b", "transfer_s": [[0, 0.5], [0.5, 0]]}],
    })
    plan = moirai.place(problem, placer="heft")
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
from networkx.utils import UnionFind

from moirai.errors import ProblemError
from moirai.files import write_atomically
from moirai.planning.costs import RequestCosts
from moirai.planning.plan import Plan

__all__ = ["Plan", "Problem"]


@dataclass(frozen=True, eq=False)
class Problem:
    """Tasks, tensors and devices as arrays; indices everywhere, names for people.

    ``compute_s[i, k]``: time of task ``i`` on device ``k`` (``inf``: cannot run there).
    ``transfer_s[t, a, b]``: time to send tensor ``t`` from device ``a`` to ``b`` (0 on the diagonal).
    ``memory_bytes[i]``: memory task ``i`` holds on its device for the whole run
    (its parameters and buffers plus the activations it produces).
    ``send_cpu_s[t, a, b]``: time sending tensor ``t`` to ``b`` keeps device ``a`` itself busy, and
    ``recv_cpu_s[t, a, b]`` the time receiving it keeps device ``b`` busy (default 0; see
    :mod:`moirai.planning.schedule.transfers` for how a schedule books them).
    ``costs``: what a request costs beyond its tasks and tensors, the runtime's headers, output messages and own
    work (:class:`moirai.planning.costs.RequestCosts`; default 0). They delay when devices start and when a
    request is done, and their CPU time limits the period of pipelined requests
    (:func:`moirai.planning.schedule.runtime_cpu_s`); of one request's latency only the driver's own work counts
    (:attr:`RequestCosts.release_s`).
    ``colocated``: sets of task indices that must share one device (a mutable buffer, such as a layer's KV cache,
    and every task that reads or writes it). Sets that overlap are merged, as colocation is transitive, and sets of
    fewer than two tasks dropped; each is kept sorted. :func:`moirai.place` enforces them for every placer and the
    simulator refuses a plan that separates one (:mod:`moirai.planning.colocation`).
    """

    device_names: tuple[str, ...]
    memory_capacity_bytes: np.ndarray
    task_names: tuple[str, ...]
    compute_s: np.ndarray
    memory_bytes: np.ndarray
    tensor_names: tuple[str, ...]
    tensor_producer: np.ndarray
    tensor_consumers: tuple[tuple[int, ...], ...]
    transfer_s: np.ndarray
    tensor_bytes: np.ndarray = field(default=None)  # type: ignore[assignment]
    send_cpu_s: np.ndarray = field(default=None)  # type: ignore[assignment]
    recv_cpu_s: np.ndarray = field(default=None)  # type: ignore[assignment]
    costs: RequestCosts = field(default=None)  # type: ignore[assignment]
    colocated: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        n, k, t = len(self.task_names), len(self.device_names), len(self.tensor_names)
        object.__setattr__(self, "memory_capacity_bytes", np.asarray(self.memory_capacity_bytes, float))
        object.__setattr__(self, "compute_s", np.asarray(self.compute_s, float).reshape(n, k))
        object.__setattr__(self, "memory_bytes", np.asarray(self.memory_bytes, float).reshape(n))
        object.__setattr__(self, "tensor_producer", np.asarray(self.tensor_producer, int).reshape(t))
        object.__setattr__(self, "transfer_s", np.asarray(self.transfer_s, float).reshape(t, k, k))
        tensor_bytes = np.zeros(t) if self.tensor_bytes is None else np.asarray(self.tensor_bytes, float)
        object.__setattr__(self, "tensor_bytes", tensor_bytes.reshape(t))
        for label in ("send_cpu_s", "recv_cpu_s"):
            value = getattr(self, label)
            object.__setattr__(
                self, label, (np.zeros((t, k, k)) if value is None else np.asarray(value, float)).reshape(t, k, k)
            )
        if self.costs is None:
            object.__setattr__(self, "costs", RequestCosts.zeros(n, k))
        object.__setattr__(self, "colocated", _merged_sets(self.colocated, n))
        self._validate()

    def _validate(self) -> None:
        if len(set(self.device_names)) != len(self.device_names):
            raise ProblemError(f"duplicate device names in {list(self.device_names)}; give each device its own name")
        if len(set(self.task_names)) != len(self.task_names):
            raise ProblemError("duplicate task names; give each task its own name")
        if self.num_devices == 0:
            raise ProblemError("a problem needs at least one device")
        if self.memory_capacity_bytes.shape != (self.num_devices,):
            raise ProblemError("memory_capacity_bytes must have one entry per device")
        if np.any(self.compute_s < 0) or np.any(np.isnan(self.compute_s)):
            raise ProblemError("compute times must be non-negative numbers (inf: cannot run on that device)")
        if np.any(self.transfer_s < 0) or np.any(np.isnan(self.transfer_s)):
            raise ProblemError("transfer times must be non-negative numbers")
        for label, whose in (("send_cpu_s", "a sender's"), ("recv_cpu_s", "a receiver's")):
            value = getattr(self, label)
            if not np.all(np.isfinite(value)) or np.any(value < 0):
                raise ProblemError(f"{label} ({whose} time per transfer) must be non-negative finite numbers")
        if not isinstance(self.costs, RequestCosts):
            raise ProblemError(f"costs must be a RequestCosts, got {type(self.costs).__name__}")
        if (self.costs.num_tasks, self.costs.num_devices) != (self.num_tasks, self.num_devices):
            raise ProblemError(
                f"costs are for {self.costs.num_tasks} tasks on {self.costs.num_devices} devices, the problem has "
                f"{self.num_tasks} on {self.num_devices}; build them with RequestCosts.build(num_tasks, num_devices)"
            )
        for t, consumers in enumerate(self.tensor_consumers):
            producer = int(self.tensor_producer[t])
            if not 0 <= producer < self.num_tasks or any(not 0 <= c < self.num_tasks for c in consumers):
                raise ProblemError(f"tensor {self.tensor_names[t]!r} names a task index out of range")
            if producer in consumers:
                raise ProblemError(f"tensor {self.tensor_names[t]!r} is consumed by its own producer")
        if not nx.is_directed_acyclic_graph(self.graph):
            cycle = nx.find_cycle(self.graph)
            names = " -> ".join(self.task_names[u] for u, _ in cycle)
            raise ProblemError(f"the task graph has a cycle ({names}); placement needs a DAG")

    def with_costs(self, **seconds: Any) -> Problem:
        """This problem with some per-request costs replaced (arrays by :class:`RequestCosts` field name)."""
        return replace(self, costs=self.costs.replace(**seconds))

    def __repr__(self) -> str:
        """Its sizes in one line: the dataclass's own lists every cost array (tens of kB for a small model)."""
        colocated = f", {len(self.colocated)} colocated sets" if self.colocated else ""
        return (
            f"<Problem: {self.num_tasks} tasks, {self.num_tensors} tensors, {self.num_devices} devices "
            f"({', '.join(self.device_names)}){colocated}>"
        )

    @property
    def num_tasks(self) -> int:
        return len(self.task_names)

    @property
    def num_devices(self) -> int:
        return len(self.device_names)

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_names)

    @cached_property
    def graph(self) -> nx.DiGraph:
        """Task DAG; edge attribute ``tensors`` lists the tensor indices carried from ``u`` to ``v``."""
        g = nx.DiGraph()
        g.add_nodes_from(range(self.num_tasks))
        for t, consumers in enumerate(self.tensor_consumers):
            u = int(self.tensor_producer[t])
            for v in consumers:
                if g.has_edge(u, v):
                    g.edges[u, v]["tensors"].append(t)
                else:
                    g.add_edge(u, v, tensors=[t])
        return g

    @cached_property
    def topological_order(self) -> tuple[int, ...]:
        return tuple(nx.lexicographical_topological_sort(self.graph))

    @cached_property
    def predecessors(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.graph.predecessors(i)) for i in range(self.num_tasks))

    @cached_property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.graph.successors(i)) for i in range(self.num_tasks))

    @cached_property
    def input_tensors(self) -> tuple[tuple[int, ...], ...]:
        """For every task, the tensors it consumes."""
        inputs: list[list[int]] = [[] for _ in range(self.num_tasks)]
        for t, consumers in enumerate(self.tensor_consumers):
            for c in consumers:
                inputs[c].append(t)
        return tuple(tuple(x) for x in inputs)

    @cached_property
    def output_tensors(self) -> tuple[tuple[int, ...], ...]:
        """For every task, the tensors it produces."""
        outputs: list[list[int]] = [[] for _ in range(self.num_tasks)]
        for t, producer in enumerate(self.tensor_producer):
            outputs[int(producer)].append(t)
        return tuple(tuple(x) for x in outputs)

    def tensors_among(self, tasks: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """The tensors one of ``tasks`` makes and another reads, by index, each with the positions in ``tasks`` of
        those that read it (a piece of the graph as a problem of its own)."""
        position = {int(v): j for j, v in enumerate(tasks)}
        among = []
        for t in sorted(t for v in position for t in self.output_tensors[v]):
            readers = tuple(position[c] for c in self.tensor_consumers[t] if c in position)
            if readers:
                among.append((t, readers))
        return among

    # --- facts every placer, bound and model uses, each computed once here ------------

    @cached_property
    def topological_position(self) -> np.ndarray:
        """``position[i]``: the index of task ``i`` in :attr:`topological_order` (the placers' usual tie-break)."""
        position = np.empty(self.num_tasks, int)
        position[list(self.topological_order)] = np.arange(self.num_tasks)
        return position

    @cached_property
    def runs_on(self) -> np.ndarray:
        """``runs_on[i, k]``: task ``i`` can run on device ``k`` (its compute time there is finite)."""
        return np.isfinite(self.compute_s)

    @cached_property
    def fits(self) -> np.ndarray:
        """``fits[i, k]``: task ``i`` can run on device ``k`` and its memory alone fits there."""
        return self.runs_on & (self.memory_bytes[:, None] <= self.memory_capacity_bytes[None, :])

    @cached_property
    def device_speed(self) -> np.ndarray:
        """Relative speed of every device, summing to 1: the inverse of its total compute time on the tasks
        every device can run (equal speeds when no task runs everywhere or a device takes no time on them).
        The one definition of device speed the placers use (single, cp_pct, hash, round_robin, getf)."""
        runs_everywhere = self.runs_on.all(axis=1)
        total = self.compute_s[runs_everywhere].sum(axis=0)
        if not runs_everywhere.any() or np.any(total <= 0):
            return np.full(self.num_devices, 1.0 / self.num_devices)
        speed = 1.0 / total
        return speed / speed.sum()

    @cached_property
    def mean_compute_s(self) -> np.ndarray:
        """Every task's mean compute time over the devices that can run it (0 where none can)."""
        return np.where(self.runs_on, self.compute_s, 0.0).sum(axis=1) / np.maximum(self.runs_on.sum(axis=1), 1)

    @cached_property
    def mean_transfer_s(self) -> np.ndarray:
        """Every tensor's mean transfer time over the ordered pairs of distinct devices (0 with one device)."""
        if self.num_devices < 2:
            return np.zeros(self.num_tensors)
        return self.transfer_s[:, ~np.eye(self.num_devices, dtype=bool)].mean(axis=1)

    @cached_property
    def consumer_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(tensor, consumer)`` of every consumption, as two index arrays (a tensor to one task counted once)."""
        tensor = [t for t, consumers in enumerate(self.tensor_consumers) for _ in consumers]
        consumer = [c for consumers in self.tensor_consumers for c in consumers]
        return np.array(tensor, int), np.array(consumer, int)

    def longest_path_to_sink_s(self, task_s: np.ndarray, pair_s: np.ndarray | float = 0.0) -> np.ndarray:
        """``rank[u] = task_s[u] + max over consumptions (t, c) of u's tensors of (pair_s + rank[c])``: the
        longest path from every task to a sink, with ``pair_s`` per entry of :attr:`consumer_pairs` (or one
        number for all). HEFT's upward rank, the simulator's PCT priority and ETF's static level are this."""
        tensor, consumer = self.consumer_pairs
        edge = np.broadcast_to(np.asarray(pair_s, float), tensor.shape).tolist()
        out: list[list[tuple[int, float]]] = [[] for _ in range(self.num_tasks)]
        for c, t, seconds in zip(consumer.tolist(), tensor.tolist(), edge, strict=True):
            out[int(self.tensor_producer[t])].append((c, seconds))
        duration = np.asarray(task_s, float).tolist()
        rank = [0.0] * self.num_tasks
        for u in reversed(self.topological_order):
            tail = 0.0
            for c, seconds in out[u]:
                value = seconds + rank[c]
                if value > tail:
                    tail = value
            rank[u] = duration[u] + tail
        return np.array(rank)

    def reachable(self) -> np.ndarray:
        """``reach[i, j]``: a path leads from task ``i`` to task ``j`` (an n x n matrix: for small graphs)."""
        reach = np.zeros((self.num_tasks, self.num_tasks), bool)
        for task in reversed(self.topological_order):
            for successor in self.successors[task]:
                reach[task, successor] = True
                reach[task] |= reach[successor]
        return reach

    def task_index(self, name: str) -> int:
        try:
            return self._task_index[name]
        except KeyError:
            raise ProblemError(f"no task named {name!r}") from None

    def device_index(self, name: str) -> int:
        try:
            return self.device_names.index(name)
        except ValueError:
            raise ProblemError(f"no device named {name!r}; devices are {list(self.device_names)}") from None

    @cached_property
    def _task_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.task_names)}

    # --- plain-number input format -------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Problem:
        """Build a problem from the documented JSON-like format (see README, "Plan your own graph")."""
        _check_description(d)
        devices = d["devices"]
        tasks = d["tasks"]
        device_names = tuple(str(dev["name"]) for dev in devices)
        k = len(device_names)
        capacity = [float(dev.get("memory_bytes", np.inf)) for dev in devices]
        task_names = tuple(str(task["name"]) for task in tasks)
        index = {name: i for i, name in enumerate(task_names)}
        compute = np.array([task["compute_s"] for task in tasks], float).reshape(len(tasks), k)
        memory = [float(task.get("memory_bytes", 0.0)) for task in tasks]
        links = _link_matrices(d.get("links"), k)

        tensor_key_index: dict[tuple[str, str], int] = {}
        names: list[str] = []
        producers: list[int] = []
        consumers: list[list[int]] = []
        transfers: list[np.ndarray] = []
        send_cpu: list[np.ndarray] = []
        recv_cpu: list[np.ndarray] = []
        sizes: list[float] = []
        for edge in d.get("edges", []):
            src, dst = str(edge["src"]), str(edge["dst"])
            for end in (src, dst):
                if end not in index:
                    raise ProblemError(f"edge {src!r} -> {dst!r} names unknown task {end!r}")
            tensor = str(edge.get("tensor", f"{src}->{dst}"))
            size = float(edge.get("bytes", 0.0))
            if "transfer_s" in edge:
                transfer = np.array(edge["transfer_s"], float)
                if transfer.shape != (k, k):
                    raise ProblemError(f"edge {src!r} -> {dst!r}: transfer_s must be {k}x{k}, got {transfer.shape}")
            elif "bytes" in edge and links is not None:
                bandwidth, latency = links
                transfer = latency + size / bandwidth
                np.fill_diagonal(transfer, 0.0)
            else:
                raise ProblemError(
                    f"edge {src!r} -> {dst!r} needs 'transfer_s', or 'bytes' with a top-level 'links' description"
                )
            sender = np.array(edge.get("send_cpu_s", np.zeros((k, k))), float)
            receiver = np.array(edge.get("recv_cpu_s", np.zeros((k, k))), float)
            for label, matrix in (("send_cpu_s", sender), ("recv_cpu_s", receiver)):
                if matrix.shape != (k, k):
                    raise ProblemError(f"edge {src!r} -> {dst!r}: {label} must be {k}x{k}, got {matrix.shape}")
            key = (src, tensor)
            if key in tensor_key_index:
                t = tensor_key_index[key]
                if not np.allclose(transfers[t], transfer):
                    raise ProblemError(f"tensor {tensor!r} of {src!r} is given two different transfer times")
                if not np.allclose(send_cpu[t], sender) or not np.allclose(recv_cpu[t], receiver):
                    raise ProblemError(f"tensor {tensor!r} of {src!r} is given two different send_cpu_s or recv_cpu_s")
                if index[dst] not in consumers[t]:
                    consumers[t].append(index[dst])
                continue
            tensor_key_index[key] = len(names)
            names.append(tensor if tensor not in names else f"{src}:{tensor}")
            producers.append(index[src])
            consumers.append([index[dst]])
            transfers.append(transfer)
            send_cpu.append(sender)
            recv_cpu.append(receiver)
            sizes.append(size)
        return cls(
            device_names=device_names,
            memory_capacity_bytes=np.array(capacity),
            task_names=task_names,
            compute_s=compute,
            memory_bytes=np.array(memory),
            tensor_names=tuple(names),
            tensor_producer=np.array(producers, int),
            tensor_consumers=tuple(tuple(c) for c in consumers),
            transfer_s=np.array(transfers).reshape(len(names), k, k),
            tensor_bytes=np.array(sizes),
            send_cpu_s=np.array(send_cpu).reshape(len(names), k, k),
            recv_cpu_s=np.array(recv_cpu).reshape(len(names), k, k),
            costs=RequestCosts.from_dict(d.get("request_costs"), devices, tasks),
            colocated=tuple(tuple(index[str(name)] for name in names) for names in d.get("colocated", [])),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": [
                {"name": name, "memory_bytes": float(cap)}
                for name, cap in zip(self.device_names, self.memory_capacity_bytes, strict=True)
            ],
            "tasks": [
                {"name": name, "compute_s": self.compute_s[i].tolist(), "memory_bytes": float(self.memory_bytes[i])}
                for i, name in enumerate(self.task_names)
            ],
            "request_costs": self.costs.to_dict(),
            "colocated": [[self.task_names[i] for i in members] for members in self.colocated],
            "edges": [
                {
                    "src": self.task_names[int(self.tensor_producer[t])],
                    "dst": self.task_names[c],
                    "tensor": self.tensor_names[t],
                    "bytes": float(self.tensor_bytes[t]),
                    "transfer_s": self.transfer_s[t].tolist(),
                    "send_cpu_s": self.send_cpu_s[t].tolist(),
                    "recv_cpu_s": self.recv_cpu_s[t].tolist(),
                }
                for t in range(self.num_tensors)
                for c in self.tensor_consumers[t]
            ],
        }

    @classmethod
    def from_json(cls, path: str | Path) -> Problem:
        try:
            with open(path) as f:
                description = json.load(f)
        except FileNotFoundError:
            raise ProblemError(f"problem file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as error:
            raise ProblemError(f"problem file {str(path)!r} is not valid JSON: {error}") from None
        try:
            return cls.from_dict(description)
        except ProblemError as error:
            raise ProblemError(f"{path}: {error}") from None

    def to_json(self, path: str | Path) -> None:
        write_atomically(path, json.dumps(self.to_dict(), allow_nan=True))


def _check_description(d: Any) -> None:
    """Every list, key and length ``from_dict`` reads, named by its place (``tasks[3].compute_s``)."""
    if not isinstance(d, dict):
        raise ProblemError(f"a problem description is an object with 'devices' and 'tasks', got {type(d).__name__}")
    for key in ("devices", "tasks"):
        if key not in d:
            raise ProblemError(f"problem description lacks {key!r}; it needs 'devices' and 'tasks'")
    for key, required in (("devices", ("name",)), ("tasks", ("name", "compute_s")), ("edges", ("src", "dst"))):
        entries = d.get(key, [])
        if not isinstance(entries, list):
            raise ProblemError(f"{key!r} must be a list of objects, got {type(entries).__name__}")
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise ProblemError(f"{key}[{i}] must be an object, got {entry!r}")
            missing = [k for k in required if k not in entry]
            if missing:
                raise ProblemError(f"{key}[{i}] lacks {missing}; every entry of {key!r} needs {list(required)}")
    _check_colocated_description(d)
    k = len(d["devices"])
    for i, task in enumerate(d["tasks"]):
        try:
            compute = np.asarray(task["compute_s"], float)
        except (TypeError, ValueError):
            got = task["compute_s"]
            raise ProblemError(f"tasks[{i}] ({task['name']!r}): compute_s must hold numbers, got {got!r}") from None
        if compute.shape != (k,):
            raise ProblemError(
                f"tasks[{i}] ({task['name']!r}): compute_s must list one time per device ({k}), got {compute.size}"
            )


def _check_colocated_description(d: dict[str, Any]) -> None:
    """``colocated``: a list of lists of task names, each naming a task of ``tasks``."""
    sets = d.get("colocated", [])
    if not isinstance(sets, list):
        raise ProblemError(f"'colocated' must be a list of lists of task names, got {type(sets).__name__}")
    names = {str(task["name"]) for task in d["tasks"]}
    for i, members in enumerate(sets):
        if not isinstance(members, list) or not all(isinstance(name, str) for name in members):
            raise ProblemError(f"colocated[{i}] must be a list of task names, got {members!r}")
        unknown = [name for name in members if name not in names]
        if unknown:
            raise ProblemError(f"colocated[{i}] names unknown tasks {unknown}; name tasks listed in 'tasks'")


def _merged_sets(sets: Any, num_tasks: int) -> tuple[tuple[int, ...], ...]:
    """``sets`` of task indices checked, overlapping ones merged (union-find), those of one task dropped, each
    sorted, in order of their first task: the one form of :attr:`Problem.colocated`."""
    try:
        sets = list(sets)
    except TypeError:
        raise ProblemError(f"colocated must be a list of sets of task indices, got {type(sets).__name__}") from None
    if not sets:
        return ()
    merged = UnionFind()
    for s, members in enumerate(sets):
        indices = [int(i) for i in members] if _is_index_list(members) else None
        if indices is None or any(not 0 <= i < num_tasks for i in indices):
            raise ProblemError(
                f"colocated[{s}] must list task indices in 0..{num_tasks - 1}, got {members!r}; "
                "give every set as task indices (JSON: task names)"
            )
        merged.union(*indices)
    return tuple(sorted(tuple(sorted(group)) for group in merged.to_sets() if len(group) > 1))


def _is_index_list(members: Any) -> bool:
    try:
        return all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in members)
    except TypeError:
        return False


def _link_matrices(links: dict[str, Any] | None, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Bandwidth (bytes/s) and latency (s) matrices from a ``links`` description, or None."""
    if links is None:
        return None
    try:
        bandwidth = np.array(links["bandwidth_bytes_per_s"], float)
    except KeyError:
        raise ProblemError("'links' needs 'bandwidth_bytes_per_s' (a KxK matrix) and optional 'latency_s'") from None
    latency = np.array(links.get("latency_s", np.zeros((k, k))), float)
    if bandwidth.shape != (k, k) or latency.shape != (k, k):
        raise ProblemError(f"'links' matrices must be {k}x{k} (one row and column per device)")
    off_diagonal = ~np.eye(k, dtype=bool)
    if np.any(bandwidth[off_diagonal] <= 0):
        raise ProblemError("'links' bandwidth must be positive between every pair of distinct devices")
    with np.errstate(divide="ignore"):
        return np.where(off_diagonal, bandwidth, np.inf), latency
