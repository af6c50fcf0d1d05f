"""What a request costs beyond its tasks and tensors: one value, :class:`RequestCosts`, and its charge rules.

The runtime does work of its own for every request: the driver on device 0 sends every other device with work a
header (:attr:`RequestCosts.header_s`, when a device can start) and the model inputs its tasks read
(:attr:`RequestCosts.input_s`, when they can start: :attr:`RequestCosts.release_s`), takes the model outputs back
(:attr:`RequestCosts.output_s`, when a request is done) and spends CPU time on both ends of those messages and on
its own loops; the input and output messages hold their links too (:meth:`RequestCosts.link_s`).
:class:`RequestCosts` holds these numbers, per device, per task and device or per model input and device; it
validates, zeroes, reads and writes them in one place.

The CPU time counts towards the period of pipelined requests; of one request's latency only the driver's own work
(``request_cpu_s[0]``, a release time of every task: [Note: the driver on a lone request's way]). Who pays it is said by
:data:`PERIOD_TERMS`, one small class per rule, each giving its share as :class:`Charges` (what every request costs
each device whatever the placement, what a device pays when it takes part, what a task charges its own device and
what it charges the driver). The simulator (:func:`moirai.planning.schedule.runtime_cpu_s`), the stream, the
pipeline placer's DP and the MILP's period rows all read the sum of those charges, :attr:`RequestCosts.charges`.
A new per-request cost is one field here, one term class appended to :data:`PERIOD_TERMS` (or read where latency
is modelled) and its calibration (:mod:`moirai.cluster.cost`).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from moirai.errors import ProblemError
from moirai.file_numbers import is_number
from moirai.planning.description import SECONDS, checked_list, checked_numbers, checked_object, shown


class Per(Enum):
    """What one cost is given for: each device (``[k]``), each task on each device (``[n, k]``), or each model input
    on each device (``[j, k]``)."""

    DEVICE = "device"
    TASK = "task"
    INPUT = "input"


def _cost(per: Per, meaning: str) -> Any:
    return field(default=None, metadata={"per": per, "meaning": meaning})


@dataclass(frozen=True, eq=False)
class RequestCosts:
    """The runtime's per-request costs of one problem (seconds; all default to 0).

    ``header_s[k]``: how long after a request starts device ``k`` can start its first task: until the header the
    driver, on device 0, sends every other device with work has come and been taken in.
    ``request_cpu_s[k]``: the runtime's own work per request on device ``k`` beyond its tasks and messages (on
    device 0 the driver's when it works alone: taking the request, settling its future).
    ``driver_part_cpu_s[k]``: the driver's more work per request, on device 0, when device ``k`` takes part too
    (its header, its status, their hand-offs; 0 for device 0).
    ``output_s[i, k]``: how long after task ``i`` finishes on device ``k`` the model outputs it makes are with the
    driver on device 0 (their send, transfer and receive; 0 on device 0 and for tasks that make no output).
    ``output_send_cpu_s[i, k]`` and ``output_recv_cpu_s[i, k]``: the CPU time that message takes from device ``k``
    and from device 0; ``output_link_s[i, k]`` the time it holds the link from ``k`` to device 0.
    ``input_readers[j]``: the tasks that read model input ``j``. The driver sends the input once to every other
    device where one of them runs: ``input_s[j, k]`` after a request starts it is there (send, transfer and receive;
    0 on device 0), ``input_send_cpu_s[j, k]`` and ``input_recv_cpu_s[j, k]`` are the CPU time that message takes
    from device 0 and from device ``k``, and ``input_link_s[j, k]`` the time it holds the link from device 0 to ``k``.
    """

    header_s: np.ndarray = _cost(Per.DEVICE, "when each device can start a request")
    request_cpu_s: np.ndarray = _cost(Per.DEVICE, "the runtime's own work per request on each device")
    driver_part_cpu_s: np.ndarray = _cost(Per.DEVICE, "the driver's work per request for each other device")
    output_s: np.ndarray = _cost(Per.TASK, "when a task's model outputs reach device 0")
    output_send_cpu_s: np.ndarray = _cost(Per.TASK, "sending a task's model outputs, on its device")
    output_recv_cpu_s: np.ndarray = _cost(Per.TASK, "receiving a task's model outputs, on device 0")
    output_link_s: np.ndarray = _cost(Per.TASK, "a task's model outputs on the link to device 0")
    input_s: np.ndarray = _cost(Per.INPUT, "when each model input is on each device")
    input_send_cpu_s: np.ndarray = _cost(Per.INPUT, "sending a model input, on device 0")
    input_recv_cpu_s: np.ndarray = _cost(Per.INPUT, "receiving a model input, on its device")
    input_link_s: np.ndarray = _cost(Per.INPUT, "a model input on the link from device 0")
    input_readers: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_readers", tuple(tuple(sorted({int(i) for i in r})) for r in self.input_readers))
        for f in _cost_fields():
            value = getattr(self, f.name)
            if value is None:
                raise ProblemError(f"RequestCosts needs {f.name}; build one with RequestCosts.build or zeros")
            object.__setattr__(self, f.name, np.asarray(value, float))
        self._validate()

    @classmethod
    def build(
        cls, num_tasks: int, num_devices: int, input_readers: Sequence[Sequence[int]] = (), **seconds: Any
    ) -> RequestCosts:
        """Costs for ``num_tasks`` tasks on ``num_devices`` devices, with model inputs read by ``input_readers``:
        those given (arrays, by field name), else 0."""
        unknown = sorted(set(seconds) - set(cls.names()))
        if unknown:
            raise ProblemError(f"unknown per-request costs {unknown}; they are {list(cls.names())}")
        rows = {Per.DEVICE: (), Per.TASK: (num_tasks,), Per.INPUT: (len(input_readers),)}
        values = {}
        for name, per in cls.names().items():
            shape = (*rows[per], num_devices)
            given = seconds.get(name)
            try:
                value = np.zeros(shape) if given is None else np.asarray(given, float)
            except (TypeError, ValueError):
                raise ProblemError(f"{name} must hold numbers (seconds), got {shown(given)}") from None
            if value.size != int(np.prod(shape)):
                raise ProblemError(f"{name} must hold {' x '.join(map(str, shape))} numbers, got shape {value.shape}")
            values[name] = value.reshape(shape)
        return cls(**values, input_readers=tuple(tuple(r) for r in input_readers))

    @classmethod
    def zeros(cls, num_tasks: int, num_devices: int) -> RequestCosts:
        return cls.build(num_tasks, num_devices)

    @staticmethod
    def names() -> dict[str, Per]:
        """Every cost's name and what it is given for."""
        return {f.name: f.metadata["per"] for f in _cost_fields()}

    @property
    def num_devices(self) -> int:
        return self.header_s.shape[0]

    @property
    def num_tasks(self) -> int:
        return self.output_s.shape[0]

    @property
    def num_inputs(self) -> int:
        return len(self.input_readers)

    def _validate(self) -> None:
        if self.header_s.ndim != 1 or self.output_s.ndim != 2:
            raise ProblemError("header_s must be one number per device and output_s one row per task")
        k, n = len(self.header_s), len(self.output_s)
        rows = {Per.DEVICE: (), Per.TASK: (n,), Per.INPUT: (self.num_inputs,)}
        for f in _cost_fields():
            value, per = getattr(self, f.name), f.metadata["per"]
            shape = (*rows[per], k)
            if value.shape != shape:
                raise ProblemError(f"{f.name} ({f.metadata['meaning']}) must have shape {shape}, got {value.shape}")
            wrong = np.argwhere(SECONDS.wrong(value))
            if wrong.size:
                index = tuple(int(i) for i in wrong[0])
                raise ProblemError(
                    f"{f.name}{list(index)} ({f.metadata['meaning']}) is {shown(value[index])}; give {SECONDS.rule()}"
                )
        for j, readers in enumerate(self.input_readers):
            if not readers or readers[0] < 0 or readers[-1] >= n:
                raise ProblemError(f"model input {j} must be read by one or more of the {n} tasks, got {readers}")

    def replace(self, **seconds: Any) -> RequestCosts:
        """These costs with some replaced (arrays by field name)."""
        return RequestCosts.build(
            self.num_tasks, self.num_devices, self.input_readers, **{**self.to_arrays(), **seconds}
        )

    def same_for(self, a: int, b: int) -> bool:
        """Whether devices ``a`` and ``b`` have the same costs, every one of them."""
        return all(np.array_equal(value[..., a], value[..., b]) for value in self.to_arrays().values())

    @cached_property
    def inputs_of_task(self) -> tuple[tuple[int, ...], ...]:
        """The model inputs every task reads."""
        read: list[list[int]] = [[] for _ in range(self.num_tasks)]
        for j, readers in enumerate(self.input_readers):
            for i in readers:
                read[i].append(j)
        return tuple(map(tuple, read))

    @cached_property
    def release_s(self) -> np.ndarray:
        """``[n, k]``: when task ``i`` on device ``k`` can start, at the earliest: the driver has taken the request
        (its own work, ``request_cpu_s[0]``, as if all before the first task: taking the request and settling its
        future are both on a lone request's way; [Note: the driver on a lone request's way]), its device's header has
        come and the model inputs it reads are there."""
        release = np.tile(self.request_cpu_s[0] + self.header_s, (self.num_tasks, 1))
        for j, readers in enumerate(self.input_readers):
            release[list(readers)] = np.maximum(release[list(readers)], self.input_s[j])
        return release

    def link_s(self, placement: np.ndarray) -> np.ndarray:
        """``[a, b]``: how long ``placement``'s input and output messages hold each directed link per request."""
        placement = np.asarray(placement, int)
        k = self.num_devices
        seconds = np.zeros((k, k))
        np.add.at(seconds, (placement, 0), self.output_link_s[np.arange(len(placement)), placement])
        for j, devices in enumerate(self.input_devices(placement)):
            seconds[0, devices] += self.input_link_s[j, devices]
        return seconds

    def input_devices(self, placement: np.ndarray) -> list[list[int]]:
        """For every model input, the devices ``placement`` puts a reader of it on."""
        return [reader_devices(readers, placement) for readers in self.input_readers]

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.names()}

    def to_dict(self) -> dict[str, list[Any]]:
        arrays: dict[str, list[Any]] = {name: value.tolist() for name, value in self.to_arrays().items()}
        return {**arrays, "input_readers": [list(r) for r in self.input_readers]}

    @staticmethod
    def keys() -> tuple[str, ...]:
        """The keys of a ``request_costs`` object: every cost's name and ``input_readers``."""
        return (*RequestCosts.names(), "input_readers")

    @classmethod
    def from_dict(
        cls, d: dict[str, Any] | None, devices: list[dict[str, Any]], tasks: list[dict[str, Any]]
    ) -> RequestCosts:
        """Costs from a problem description: its ``request_costs`` object (``d``, as :meth:`to_dict` writes it) or,
        as older files give them, one key per cost in every device's or task's entry; every number checked and
        named by its place (``request_costs.header_s[1]``)."""
        n, k = len(tasks), len(devices)
        if d is None:
            return cls._from_entries(devices, tasks)
        d = checked_object(d, "request_costs", cls.keys())
        flat = [
            f"{where}[{i}].{name}"
            for where, entries in (("devices", devices), ("tasks", tasks))
            for i, entry in enumerate(entries)
            for name in cls.names()
            if name in entry
        ]
        if flat:  # one of the two would be dropped
            raise ProblemError(f"{flat[0]} is a per-request cost outside 'request_costs'; give every one in it")
        readers = _input_readers(d.get("input_readers", []), n)
        rows = {Per.DEVICE: (), Per.TASK: (n,), Per.INPUT: (len(readers),)}
        values = {
            name: checked_numbers(d[name], (*rows[per], k), f"request_costs.{name}", SECONDS, _MEANING[per])
            for name, per in cls.names().items()
            if name in d
        }
        return cls.build(n, k, readers, **values)

    @classmethod
    def _from_entries(cls, devices: list[dict[str, Any]], tasks: list[dict[str, Any]]) -> RequestCosts:
        """Costs given as older files give them: one key per cost in every device's or task's entry (0 where an
        entry has none)."""
        k = len(devices)
        values = {}
        for name, per in cls.names().items():
            if per is Per.INPUT:
                continue  # files written before model inputs were priced have none
            entries, where, shape = (devices, "devices", ()) if per is Per.DEVICE else (tasks, "tasks", (k,))
            if any(name in entry for entry in entries):
                rows = [
                    checked_numbers(
                        entry.get(name, np.zeros(shape)), shape, f"{where}[{i}].{name}", SECONDS, _MEANING[per]
                    )
                    for i, entry in enumerate(entries)
                ]
                values[name] = np.array(rows, float).reshape(len(entries), *shape)
        return cls.build(len(tasks), k, **values)

    def merge(self, groups: Sequence[Sequence[int]]) -> RequestCosts:
        """The costs of the tasks merged into ``groups`` (lists of task indices): a group's per-task costs are the
        sum of its tasks'."""
        k = self.num_devices
        merged = {
            name: np.array([getattr(self, name)[list(group)].sum(axis=0) for group in groups]).reshape(-1, k)
            for name, per in self.names().items()
            if per is Per.TASK
        }
        group_of = {i: g for g, group in enumerate(groups) for i in group}
        readers = [{group_of[i] for i in r} for r in self.input_readers]
        return RequestCosts.build(len(groups), self.num_devices, readers, **{**self.to_arrays(), **merged})

    def for_stream(self, num_requests: int) -> RequestCosts:
        """The costs of ``num_requests`` copies of the task graph (:func:`moirai.planning.stream.unroll`): the
        outputs' delays and the input and output messages' link times repeat per request (each request's copy of
        every model input is read by that request's copies of its readers); only the first request waits for its
        header and inputs (the driver sends later ones ahead); the CPU time, which the stream folds into each
        device's tasks, is 0."""
        n, copies = self.num_tasks, range(num_requests)
        readers = [tuple(i + r * n for i in reader) for r in copies for reader in self.input_readers]
        sent_ahead = np.zeros(((num_requests - 1) * self.num_inputs, self.num_devices))
        return RequestCosts.build(
            n * num_requests,
            self.num_devices,
            readers,
            header_s=self.header_s,
            output_s=np.tile(self.output_s, (num_requests, 1)),
            output_link_s=np.tile(self.output_link_s, (num_requests, 1)),
            input_s=np.concatenate([self.input_s, sent_ahead]),
            input_link_s=np.tile(self.input_link_s, (num_requests, 1)),
        )

    @cached_property
    def charges(self) -> Charges:
        """The CPU time per request every term of :data:`PERIOD_TERMS` charges, summed."""
        total = Charges.zeros(self.num_tasks, self.num_devices, self.input_readers)
        for term in PERIOD_TERMS:
            total = total + term.charges(self)
        return total


class Charges(NamedTuple):
    """CPU time per request outside tasks and their transfers, by whom it falls on (seconds).

    A placement charges device ``k`` ``always_s[k]``, plus ``taking_part_s[k]`` if a task runs there (and device 0
    ``driver_taking_part_s[k]`` then), plus
    ``own_s[i, k]`` for every task ``i`` on it, plus (device 0) ``driver_s[i, d]`` for every task ``i`` on any
    device ``d``; and for every model input ``j`` and every device ``k`` with a task of ``input_readers[j]``,
    ``input_own_s[j, k]`` to ``k`` and ``input_driver_s[j, k]`` to device 0.
    """

    always_s: np.ndarray  # [k]
    taking_part_s: np.ndarray  # [k]
    driver_taking_part_s: np.ndarray  # [k]
    own_s: np.ndarray  # [n, k]
    driver_s: np.ndarray  # [n, k]
    input_own_s: np.ndarray  # [j, k]
    input_driver_s: np.ndarray  # [j, k]
    input_readers: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def zeros(cls, num_tasks: int, num_devices: int, input_readers: tuple[tuple[int, ...], ...] = ()) -> Charges:
        k, j = num_devices, len(input_readers)
        tasks, inputs = np.zeros((num_tasks, k)), np.zeros((j, k))
        return cls(np.zeros(k), np.zeros(k), np.zeros(k), tasks, tasks.copy(), inputs, inputs.copy(), input_readers)

    def __add__(self, other: object) -> Charges:  # type: ignore[override]
        assert isinstance(other, Charges) and other.input_readers == self.input_readers
        return Charges(*(a + b for a, b in zip(self[:-1], other[:-1], strict=True)), self.input_readers)

    def device_s(self, placement: np.ndarray) -> np.ndarray:
        """``[k]``: what ``placement`` (task -> device) charges every device per request."""
        placement = np.asarray(placement, int)
        k = len(self.always_s)
        tasks = np.arange(len(placement))
        taking_part = np.bincount(placement, minlength=k) > 0
        seconds = self.always_s + np.where(taking_part, self.taking_part_s, 0.0)
        seconds[0] += self.driver_taking_part_s[taking_part].sum()
        seconds += np.bincount(placement, weights=self.own_s[tasks, placement], minlength=k)
        seconds[0] += self.driver_s[tasks, placement].sum()
        for j, readers in enumerate(self.input_readers):
            devices = reader_devices(readers, placement)
            seconds[devices] += self.input_own_s[j, devices]
            seconds[0] += self.input_driver_s[j, devices].sum()
        return seconds

    def singles_out_driver(self) -> bool:
        """Whether device 0 is charged something no other device is (so it cannot stand in for another)."""
        return bool(
            self.always_s[0] > 0 or self.driver_s.any() or self.input_driver_s.any() or self.driver_taking_part_s.any()
        )

    def driver_floor_s(self) -> float:
        """The least any placement charges device 0, whose driver works on every request."""
        floor = float(self.always_s[0])
        if self.driver_s.size:
            floor += float(self.driver_s.min(axis=1).sum())
        return floor


class PeriodTerm(ABC):
    """One rule of who pays which per-request CPU time: its share of :class:`Charges`."""

    @abstractmethod
    def charges(self, costs: RequestCosts) -> Charges: ...


@dataclass(frozen=True)
class RuntimeWork(PeriodTerm):
    """The runtime's own work per request (``request_cpu_s``) falls on every device with a task, and always on
    device 0, whose driver takes every request; the driver works more for every other device with a task
    (``driver_part_cpu_s``)."""

    def charges(self, costs: RequestCosts) -> Charges:
        zero = _zero_charges(costs)
        always = np.zeros(costs.num_devices)
        always[0] = costs.request_cpu_s[0]
        taking_part = costs.request_cpu_s.copy()
        taking_part[0] = 0.0
        driver_taking_part = costs.driver_part_cpu_s.copy()
        driver_taking_part[0] = 0.0
        return zero._replace(always_s=always, taking_part_s=taking_part, driver_taking_part_s=driver_taking_part)


@dataclass(frozen=True)
class OutputSend(PeriodTerm):
    """Sending a task's model outputs to the driver takes CPU time from the task's device."""

    def charges(self, costs: RequestCosts) -> Charges:
        return _zero_charges(costs)._replace(own_s=costs.output_send_cpu_s)


@dataclass(frozen=True)
class OutputReceive(PeriodTerm):
    """Receiving a task's model outputs takes CPU time from device 0, the driver."""

    def charges(self, costs: RequestCosts) -> Charges:
        return _zero_charges(costs)._replace(driver_s=costs.output_recv_cpu_s)


@dataclass(frozen=True)
class InputSend(PeriodTerm):
    """Sending a model input to a device that reads it takes CPU time from device 0, the driver (once per device,
    however many of its tasks read it)."""

    def charges(self, costs: RequestCosts) -> Charges:
        return _zero_charges(costs)._replace(input_driver_s=costs.input_send_cpu_s)


@dataclass(frozen=True)
class InputReceive(PeriodTerm):
    """Receiving a model input takes CPU time from the device that reads it."""

    def charges(self, costs: RequestCosts) -> Charges:
        return _zero_charges(costs)._replace(input_own_s=costs.input_recv_cpu_s)


# What a cost's entries are for, by what it is given for: said when a file gives a list of another length.
_MEANING = {
    Per.DEVICE: "one per device",
    Per.TASK: "a row per task, a column per device",
    Per.INPUT: "a row per model input, a column per device",
}


def _input_readers(value: Any, num_tasks: int) -> list[list[int]]:
    """``request_costs.input_readers``: for every model input, the indices of the tasks that read it (one or more)."""
    readers = checked_list(value, "request_costs.input_readers", "lists of task indices, one per model input")
    for j, tasks in enumerate(readers):
        if not (
            isinstance(tasks, list)
            and tasks
            and all(is_number(i) and math.isfinite(i) and int(i) == i and 0 <= i < num_tasks for i in tasks)
        ):
            raise ProblemError(
                f"request_costs.input_readers[{j}] is {shown(tasks)}; give the indices (0..{num_tasks - 1}) of the "
                f"tasks that read model input {j}, one or more"
            )
    return [[int(i) for i in tasks] for tasks in readers]


def reader_devices(readers: Sequence[int], placement: np.ndarray) -> list[int]:
    """The devices ``placement`` puts one of a model input's ``readers`` on: the driver sends it to each once."""
    return sorted({int(placement[i]) for i in readers})


def _zero_charges(costs: RequestCosts) -> Charges:
    return Charges.zeros(costs.num_tasks, costs.num_devices, costs.input_readers)


def _cost_fields() -> list[dataclasses.Field[Any]]:
    """The fields of :class:`RequestCosts` that hold seconds (all but ``input_readers``)."""
    return [f for f in dataclasses.fields(RequestCosts) if "per" in f.metadata]


PERIOD_TERMS: tuple[PeriodTerm, ...] = (RuntimeWork(), OutputSend(), OutputReceive(), InputSend(), InputReceive())
