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

import itertools
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
from networkx.utils import UnionFind

from moirai.errors import ProblemError
from moirai.planning.costs import Per, RequestCosts
from moirai.planning.description import (
    SECONDS,
    Quantity,
    checked_list,
    checked_name,
    checked_number,
    checked_numbers,
    checked_object,
    checked_objects,
    known_name,
    shown,
    unique_names,
)
from moirai.planning.plan import Plan
from moirai.user_files import check_input_path, load_json, parsing, read_text, write_output

__all__ = ["Plan", "Problem"]


@dataclass(frozen=True, eq=False)
class Problem:
    """Tasks, tensors and devices as arrays; indices everywhere, names for people.

    ``compute_s[i, k]``: time of task ``i`` on device ``k`` (``inf``: cannot run there).
    ``transfer_s[t, a, b]``: time to send tensor ``t`` from device ``a`` to ``b`` (0 on the diagonal).
    ``tensor_consumers[t]``: the tasks that read tensor ``t``, at least one (a tensor no task reads moves nowhere;
    model outputs are ``costs``' ``output_s``), so that the JSON form, one edge per consumer, keeps every tensor and
    a plan's ``transfer_order`` names the same tensors after a round trip.
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
    ``memory_reserve_bytes[k]``: memory device ``k`` keeps free besides its tasks', already taken off its
    ``memory_capacity_bytes`` (default 0; :func:`moirai.cluster.cost.build_problem` reserves the activation peak at
    the sizes it priced, so capacity plus reserve is the device's memory). Placers do not read it; a summary adds it
    to the memory in use and the capacity it shows.
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
    memory_reserve_bytes: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        for label in ("device_names", "task_names", "tensor_names"):
            object.__setattr__(self, label, _names(getattr(self, label), label))
        n, k, t = len(self.task_names), len(self.device_names), len(self.tensor_names)
        object.__setattr__(
            self, "memory_capacity_bytes", _array(self.memory_capacity_bytes, (k,), "memory_capacity_bytes")
        )
        reserve = np.zeros(k) if self.memory_reserve_bytes is None else self.memory_reserve_bytes
        object.__setattr__(self, "memory_reserve_bytes", _array(reserve, (k,), "memory_reserve_bytes"))
        object.__setattr__(self, "compute_s", _array(self.compute_s, (n, k), "compute_s"))
        object.__setattr__(self, "memory_bytes", _array(self.memory_bytes, (n,), "memory_bytes"))
        object.__setattr__(self, "tensor_producer", _task_indices(self.tensor_producer, (t,), "tensor_producer"))
        object.__setattr__(self, "tensor_consumers", _consumer_indices(self.tensor_consumers))
        if len(self.tensor_consumers) != t:
            raise ProblemError(
                f"tensor_consumers has {len(self.tensor_consumers)} entries for the {t} tensors of tensor_names; give "
                "one tuple of consumer task indices per tensor, in the same order"
            )
        object.__setattr__(self, "transfer_s", _array(self.transfer_s, (t, k, k), "transfer_s"))
        tensor_bytes = np.zeros(t) if self.tensor_bytes is None else self.tensor_bytes
        object.__setattr__(self, "tensor_bytes", _array(tensor_bytes, (t,), "tensor_bytes"))
        for label in ("send_cpu_s", "recv_cpu_s"):
            value = getattr(self, label)
            object.__setattr__(self, label, _array(np.zeros((t, k, k)) if value is None else value, (t, k, k), label))
        if self.costs is None:
            object.__setattr__(self, "costs", RequestCosts.zeros(n, k))
        object.__setattr__(self, "colocated", _merged_sets(self.colocated, n))
        self._validate()

    def _validate(self) -> None:
        if self.num_devices == 0:
            raise ProblemError("a problem needs at least one device")
        for what, names in (("device", self.device_names), ("task", self.task_names), ("tensor", self.tensor_names)):
            repeated = [name for name, count in Counter(names).items() if count > 1]
            if repeated:
                # Problem files, plans and messages name them: two of one name would read as one.
                raise ProblemError(f"duplicate {what} names {repeated[:5]}; give each {what} its own name")
        for label, (quantity, axes) in _ARRAYS.items():
            values = getattr(self, label)
            wrong = np.argwhere(quantity.wrong(values))
            if wrong.size:
                index = tuple(int(i) for i in wrong[0])
                raise ProblemError(
                    f"{label}[{', '.join(map(str, index))}] ({self._named(axes, index)}) is {shown(values[index])}; "
                    f"give {quantity.rule()}"
                )
        for label in ("transfer_s", "send_cpu_s", "recv_cpu_s"):
            values = getattr(self, label)
            on_diagonal = np.argwhere(values[:, np.arange(self.num_devices), np.arange(self.num_devices)] != 0)
            if on_diagonal.size:
                t, d = (int(i) for i in on_diagonal[0])
                raise ProblemError(
                    f"{label}[{t}, {d}, {d}] ({self._named(('tensor', 'device'), (t, d))}) is "
                    f"{shown(values[t, d, d])}; a tensor does not move to the device it is on: give 0"
                )
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
            if not consumers:
                raise ProblemError(
                    f"tensor {self.tensor_names[t]!r} (tensor_consumers[{t}]) has no consumers; a tensor no task "
                    "reads moves nowhere: leave it out (a model output's way to the driver is costs' output_s)"
                )
        if not nx.is_directed_acyclic_graph(self.graph):
            cycle = nx.find_cycle(self.graph)
            names = " -> ".join(self.task_names[u] for u, _ in cycle)
            raise ProblemError(f"the task graph has a cycle ({names}); placement needs a DAG")

    def _named(self, axes: tuple[str, ...], index: tuple[int, ...]) -> str:
        """The task, tensor and devices an entry of an array is for ("task 'head', device 'gpu1'")."""
        names = {"task": self.task_names, "tensor": self.tensor_names, "device": self.device_names}
        return ", ".join(f"{axis} {names[axis.split()[-1]][i]!r}" for axis, i in zip(axes, index, strict=True))

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

    @cached_property
    def reading_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Every distinct (tensor, task reading it) pair, as two arrays sorted by tensor then task: what a placement
        turns into transfers (:func:`moirai.planning.schedule.transfers.implied_transfers`)."""
        pairs = sorted({(t, c) for t, consumers in enumerate(self.tensor_consumers) for c in consumers})
        tensors = np.fromiter((t for t, _ in pairs), int, count=len(pairs))
        readers = np.fromiter((c for _, c in pairs), int, count=len(pairs))
        return tensors, readers

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
        """Build a problem from the documented JSON-like format (see README, "Plan your own graph"), every field
        checked as it is read (:mod:`moirai.planning.description`)."""
        d = checked_object(d, "the problem description", _TOP_KEYS, required=("devices", "tasks"))
        devices = checked_objects(d["devices"], "devices", _DEVICE_KEYS, ("name",))
        tasks = checked_objects(d["tasks"], "tasks", _TASK_KEYS, ("name", "compute_s"))
        k = len(devices)
        index = {name: i for i, name in enumerate(unique_names(tasks, "tasks"))}
        edges = checked_objects(d.get("edges", []), "edges", _EDGE_KEYS, ("src", "dst"))
        links = _link_matrices(d["links"], k) if "links" in d else None
        # An explicit null is refused here: from_dict reads None as "no request_costs", so it would read as zeros.
        costs = (
            checked_object(d["request_costs"], "request_costs", RequestCosts.keys()) if "request_costs" in d else None
        )
        return cls(
            device_names=unique_names(devices, "devices"),
            memory_capacity_bytes=_each(devices, "devices", "memory_bytes", np.inf, "memory_capacity_bytes"),
            memory_reserve_bytes=_each(devices, "devices", "reserve_bytes", 0.0, "memory_reserve_bytes"),
            task_names=tuple(index),
            compute_s=_each(tasks, "tasks", "compute_s", None, "compute_s", (k,), "one time per device"),
            memory_bytes=_each(tasks, "tasks", "memory_bytes", 0.0, "memory_bytes"),
            costs=RequestCosts.from_dict(costs, devices, tasks),
            colocated=_colocated_sets(d.get("colocated", []), index),
            **_edge_tensors(edges, index, k, links),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": [
                {"name": name, "memory_bytes": float(cap)} | ({"reserve_bytes": float(reserve)} if reserve else {})
                for name, cap, reserve in zip(
                    self.device_names, self.memory_capacity_bytes, self.memory_reserve_bytes, strict=True
                )
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
        """The problem a JSON file describes (:meth:`from_dict`); every fault of the file is a :class:`ProblemError`
        naming it."""
        check_input_path(
            path,
            "problem file",
            "a problem's JSON (a description already read goes to Problem.from_dict)",
            ProblemError,
        )
        try:
            subject = f"problem file {str(path)!r}"
            with parsing("JSON", subject, ProblemError):
                description = load_json(read_text(path), subject, ProblemError)
        except FileNotFoundError:
            raise ProblemError(f"problem file {str(path)!r} does not exist") from None
        except OSError as error:  # a folder, a file we may not read
            raise ProblemError(f"problem file {str(path)!r} cannot be read: {error.strerror or error}") from None
        try:
            return cls.from_dict(description)
        except ProblemError as error:
            raise ProblemError(f"{path}: {error}") from None

    def to_json(self, path: str | Path) -> None:
        """Write the problem as JSON (:meth:`from_json` reads it back); a path that cannot take it is a
        :class:`ProblemError` naming it."""
        write_output(path, json.dumps(self.to_dict(), allow_nan=True), "the problem", ProblemError)


# What every array of a problem may hold and what its axes index, by field: the one rule that Problem(...) and the
# JSON reader (whose fields are named alike) check.
_ARRAYS: dict[str, tuple[Quantity, tuple[str, ...]]] = {
    "memory_capacity_bytes": (Quantity("bytes", infinite="unlimited memory"), ("device",)),
    "memory_reserve_bytes": (Quantity("bytes"), ("device",)),
    "compute_s": (Quantity("seconds", infinite="the task cannot run on that device"), ("task", "device")),
    "memory_bytes": (Quantity("bytes"), ("task",)),
    "transfer_s": (
        Quantity("seconds", infinite="no link between the two devices"),
        ("tensor", "from device", "to device"),
    ),
    "tensor_bytes": (Quantity("bytes"), ("tensor",)),
    "send_cpu_s": (SECONDS, ("tensor", "from device", "to device")),
    "recv_cpu_s": (SECONDS, ("tensor", "from device", "to device")),
}

# The keys of a problem description and of its edges and links (devices and tasks: _DEVICE_KEYS, _TASK_KEYS).
_TOP_KEYS = ("devices", "tasks", "edges", "links", "request_costs", "colocated")
_EDGE_KEYS = ("src", "dst", "tensor", "bytes", "transfer_s", "send_cpu_s", "recv_cpu_s")
_LINK_KEYS = ("bandwidth_bytes_per_s", "latency_s")
_SQUARE = "a row per sending device, a column per receiving one"  # what a K x K matrix's rows and columns are
_BANDWIDTH = Quantity(
    "bytes per second", infinite="a link whose bytes take no time"
)  # and not 0 between distinct devices: _link_matrices checks that
_LATENCY = Quantity("seconds", infinite="no link between the two devices")


def check_problem(problem: object, where: str) -> None:
    """A :class:`ProblemError` unless ``problem`` is a :class:`Problem`; ``where`` names the argument
    (``"moirai.place's problem"``). A description or its file is read into one first, never taken for one."""
    if not isinstance(problem, Problem):
        raise ProblemError(
            f"{where} must be a moirai.Problem, got {repr(problem)[:80]} ({type(problem).__name__}); read a "
            "description with moirai.Problem.from_dict(description) or a file with moirai.Problem.from_json(path), "
            "or take a compiled model's (compiled.problem)"
        )


def _quantity(label: str) -> Quantity:
    return _ARRAYS[label][0]


def _entry_keys(per: Per, *keys: str) -> tuple[str, ...]:
    """The keys of a device's or task's entry: ``keys`` and, as older files give them, its per-request costs."""
    return (*keys, *(name for name, given_per in RequestCosts.names().items() if given_per is per))


_DEVICE_KEYS = _entry_keys(Per.DEVICE, "name", "memory_bytes", "reserve_bytes")
_TASK_KEYS = _entry_keys(Per.TASK, "name", "compute_s", "memory_bytes")


def _each(
    entries: list[dict[str, Any]],
    where: str,
    key: str,
    default: Any,
    label: str,
    shape: tuple[int, ...] = (),
    meaning: str = "",
) -> np.ndarray:
    """Every entry's ``key`` (``default`` where it has none), by the rule of the problem's array ``label``, stacked."""
    rows = [
        checked_numbers(entry.get(key, default), shape, f"{where}[{i}].{key}", _quantity(label), meaning)
        for i, entry in enumerate(entries)
    ]
    return np.array(rows, float).reshape(len(entries), *shape)


def _array(value: Any, shape: tuple[int, ...], label: str) -> np.ndarray:
    """``value`` as a float array of ``shape``; a :class:`ProblemError` naming ``label`` where it is not one."""
    try:
        array = np.asarray(value, float)
    except (TypeError, ValueError):
        raise ProblemError(f"{label} must hold numbers, got {shown(value)}") from None
    if array.size != math.prod(shape):
        raise ProblemError(
            f"{label} must hold {' x '.join(map(str, shape))} numbers, got an array of shape {array.shape}"
        )
    return array.reshape(shape)


def _names(names: Any, label: str) -> tuple[str, ...]:
    """``names`` as a tuple of strings; :class:`ProblemError` for one string (``"ab"`` read as devices a and b) or
    anything but a sequence of strings."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (Sequence, np.ndarray)):
        raise ProblemError(f"{label} must be a list of names, one per entry, got {repr(names)[:80]}")
    wrong = [name for name in names if not isinstance(name, str)]
    if wrong:
        raise ProblemError(f"{label} must be strings, got {repr(wrong[0])[:80]} ({type(wrong[0]).__name__})")
    return tuple(str(name) for name in names)  # numpy's strings as Python's


def _task_indices(value: Any, shape: tuple[int, ...], label: str) -> np.ndarray:
    """``value`` as an int array of ``shape``; a :class:`ProblemError` naming ``label`` where an entry is no whole
    number (1.7 was read as task 1)."""
    array = _array(value, shape, label)
    wrong = np.argwhere(_not_whole(array))
    if wrong.size:
        index = tuple(int(i) for i in wrong[0])
        raise ProblemError(f"{label}[{', '.join(map(str, index))}] is {shown(array[index])}; give a task index")
    return array.astype(int)


def _not_whole(array: np.ndarray) -> np.ndarray:
    """Where ``array`` holds no whole number (NaN and infinities included)."""
    return ~np.isfinite(array) | (array != np.round(array))


def _consumer_indices(consumers: Any) -> tuple[tuple[int, ...], ...]:
    """Every tensor's consumers as task indices, each once, checked in one pass (a problem of 20,000 tasks is rebuilt
    often); a :class:`ProblemError` naming ``tensor_consumers[t][j]`` where one is no whole number."""
    lists = [list(c) for c in consumers]
    ends = np.cumsum([len(c) for c in lists], dtype=int)
    flat = _array([i for c in lists for i in c], (int(ends[-1]) if lists else 0,), "tensor_consumers")
    wrong = np.flatnonzero(_not_whole(flat))
    if wrong.size:
        t = int(np.searchsorted(ends, wrong[0], side="right"))
        j = int(wrong[0] - (ends[t - 1] if t else 0))
        raise ProblemError(f"tensor_consumers[{t}][{j}] is {shown(flat[wrong[0]])}; give a task index")
    # A task that reads a tensor twice receives it once: listed once, so that no cost can count its transfer twice.
    values, bounds = flat.astype(int).tolist(), [0, *ends.tolist()]
    return tuple(tuple(dict.fromkeys(values[start:end])) for start, end in itertools.pairwise(bounds))


def _edge_tensors(
    edges: list[dict[str, Any]], index: dict[str, int], k: int, links: tuple[np.ndarray, np.ndarray] | None
) -> dict[str, Any]:
    """The tensors ``edges`` carry, as :class:`Problem`'s fields. Edges of one ``src`` naming one ``tensor`` carry one
    tensor to each of their ``dst``, and must give it the same numbers; a name a tensor of another task has already
    becomes ``src:name``, so that every tensor has a name of its own."""
    tensor_of: dict[tuple[str, str], int] = {}  # (src, tensor) -> its index
    first_edge: list[int] = []  # for every tensor, the edge that gave it first
    names: list[str] = []
    taken: set[str] = set()
    producers: list[int] = []
    consumers: list[list[int]] = []
    numbers: list[dict[str, Any]] = []
    for e, edge in enumerate(edges):
        where = f"edges[{e}]"
        src = known_name(edge["src"], f"{where}.src", index, "task")
        dst = known_name(edge["dst"], f"{where}.dst", index, "task")
        src_name = edge["src"]
        if src == dst:
            raise ProblemError(f"{where} goes from task {src_name!r} to itself; an edge joins two tasks")
        tensor = checked_name(edge["tensor"], f"{where}.tensor") if "tensor" in edge else f"{src_name}->{edge['dst']}"
        given = _edge_numbers(edge, where, k, links)
        key = (src_name, tensor)
        if key in tensor_of:
            t = tensor_of[key]
            differ = [label for label, value in given.items() if not np.allclose(value, numbers[t][label])]
            if differ:
                raise ProblemError(
                    f"{where} gives tensor {tensor!r} of {src_name!r} other {differ} than edges[{first_edge[t]}]; "
                    "edges of one src naming one tensor carry that tensor: give them the same numbers, or name "
                    "the tensors apart"
                )
            if dst not in consumers[t]:
                consumers[t].append(dst)
            continue
        name = tensor if tensor not in taken else f"{src_name}:{tensor}"
        if name in taken:
            raise ProblemError(
                f"{where}.tensor is {tensor!r}, the name of another task's tensor, and {name!r}, which it would be "
                "called, is taken too; give it a name of its own"
            )
        tensor_of[key] = len(names)
        first_edge.append(e)
        names.append(name)
        taken.add(name)
        producers.append(src)
        consumers.append([dst])
        numbers.append(given)
    shapes = {"tensor_bytes": (), "transfer_s": (k, k), "send_cpu_s": (k, k), "recv_cpu_s": (k, k)}
    return {
        "tensor_names": tuple(names),
        "tensor_producer": np.array(producers, int),
        "tensor_consumers": tuple(tuple(c) for c in consumers),
        **{
            label: np.array([n[label] for n in numbers], float).reshape(len(names), *shape)
            for label, shape in shapes.items()
        },
    }


def _edge_numbers(
    edge: dict[str, Any], where: str, k: int, links: tuple[np.ndarray, np.ndarray] | None
) -> dict[str, Any]:
    """An edge's tensor's size and times, as :class:`Problem`'s fields: ``transfer_s`` as given, else its ``bytes``
    over the top-level ``links``."""
    size = checked_number(edge.get("bytes", 0.0), f"{where}.bytes", _quantity("tensor_bytes"))
    if "transfer_s" in edge:
        transfer = checked_numbers(edge["transfer_s"], (k, k), f"{where}.transfer_s", _quantity("transfer_s"), _SQUARE)
    elif "bytes" in edge and links is not None:
        bandwidth, latency = links
        transfer = latency + size / bandwidth
        np.fill_diagonal(transfer, 0.0)
    else:
        raise ProblemError(
            f"{where} ({edge['src']!r} -> {edge['dst']!r}) needs 'transfer_s', or 'bytes' with a top-level 'links' "
            "description"
        )
    cpu = {
        label: checked_numbers(edge.get(label, np.zeros((k, k))), (k, k), f"{where}.{label}", SECONDS, _SQUARE)
        for label in ("send_cpu_s", "recv_cpu_s")
    }
    for label, matrix in (("transfer_s", transfer), *cpu.items()):
        if label in edge:
            _check_zero_diagonal(matrix, f"{where}.{label}")
    return {"tensor_bytes": size, "transfer_s": transfer, **cpu}


def _check_zero_diagonal(matrix: np.ndarray, where: str) -> None:
    """A :class:`ProblemError` naming ``where[d][d]`` unless a K x K matrix of times is 0 on its diagonal."""
    on_diagonal = np.flatnonzero(np.diagonal(matrix))
    if on_diagonal.size:
        d = int(on_diagonal[0])
        raise ProblemError(
            f"{where}[{d}][{d}] is {shown(matrix[d, d])}; a tensor does not move to the device it is on: give 0"
        )


def _link_matrices(links: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth (bytes/s, infinite on the diagonal) and latency (s) matrices from a ``links`` description."""
    links = checked_object(links, "links", _LINK_KEYS, required=("bandwidth_bytes_per_s",))
    where = "links.bandwidth_bytes_per_s"
    bandwidth = checked_numbers(links["bandwidth_bytes_per_s"], (k, k), where, _BANDWIDTH, _SQUARE)
    latency = checked_numbers(links.get("latency_s", np.zeros((k, k))), (k, k), "links.latency_s", _LATENCY, _SQUARE)
    off_diagonal = ~np.eye(k, dtype=bool)
    zero = np.argwhere(off_diagonal & (bandwidth == 0))
    if zero.size:
        a, b = zero[0]
        raise ProblemError(
            f"{where}[{a}][{b}] is 0; give a positive number of bytes per second between every two devices (for "
            "devices without a link, give each edge its transfer_s, with Infinity between them)"
        )
    with np.errstate(divide="ignore"):
        return np.where(off_diagonal, bandwidth, np.inf), latency


def _colocated_sets(value: Any, index: dict[str, int]) -> tuple[tuple[int, ...], ...]:
    """``colocated``: lists of task names, each naming a task of ``tasks``, as sets of task indices."""
    sets = checked_list(value, "colocated", "lists of task names")
    found = []
    for i, members in enumerate(sets):
        if not isinstance(members, list) or not all(isinstance(name, str) for name in members):
            raise ProblemError(f"colocated[{i}] must be a list of task names, got {shown(members)}")
        unknown = [name for name in members if name not in index]
        if unknown:
            raise ProblemError(f"colocated[{i}] names unknown tasks {unknown}; name tasks listed in 'tasks'")
        found.append(tuple(index[name] for name in members))
    return tuple(found)


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
