"""What a request costs beyond its tasks and tensors: one value, :class:`RequestCosts`, and its charge rules.

The runtime does work of its own for every request: the driver on device 0 sends every other device with work a
header (:attr:`RequestCosts.header_s`, when a device can start), takes the model outputs back
(:attr:`RequestCosts.output_s`, when a request is done) and spends CPU time on both ends of those messages and on
its own loops. :class:`RequestCosts` holds these numbers, per device or per task and device; it validates, zeroes,
reads and writes them in one place.

The CPU time counts towards the period of pipelined requests, not one request's latency. Who pays it is said by
:data:`PERIOD_TERMS`, one small class per rule, each giving its share as :class:`Charges` (what every request costs
each device whatever the placement, what a device pays when it takes part, what a task charges its own device and
what it charges the driver). The simulator (:func:`moirai.planning.schedule.runtime_cpu_s`), the stream, the
pipeline placer's DP and the MILP's period rows all read the sum of those charges, :attr:`RequestCosts.charges`.
A new per-request cost is one field here, one term class appended to :data:`PERIOD_TERMS` (or read where latency
is modelled) and its calibration (:mod:`moirai.cluster.cost`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from moirai.errors import ProblemError


class Per(Enum):
    """What one cost is given for: each device (``[k]``), or each task on each device (``[n, k]``)."""

    DEVICE = "device"
    TASK = "task"


def _cost(per: Per, meaning: str) -> Any:
    return field(default=None, metadata={"per": per, "meaning": meaning})


@dataclass(frozen=True, eq=False)
class RequestCosts:
    """The runtime's per-request costs of one problem (seconds; all default to 0).

    ``header_s[k]``: how long after a request starts device ``k`` can start its first task: until the header the
    driver, on device 0, sends every other device with work has come and been taken in.
    ``request_cpu_s[k]``: the runtime's own work per request on device ``k`` beyond its tasks and messages (on
    device 0 the driver's: taking the request, its headers, settling its future).
    ``output_s[i, k]``: how long after task ``i`` finishes on device ``k`` the model outputs it makes are with the
    driver on device 0 (their send, transfer and receive; 0 on device 0 and for tasks that make no output).
    ``output_send_cpu_s[i, k]`` and ``output_recv_cpu_s[i, k]``: the CPU time that message takes from device ``k``
    and from device 0.
    """

    header_s: np.ndarray = _cost(Per.DEVICE, "when each device can start a request")
    request_cpu_s: np.ndarray = _cost(Per.DEVICE, "the runtime's own work per request on each device")
    output_s: np.ndarray = _cost(Per.TASK, "when a task's model outputs reach device 0")
    output_send_cpu_s: np.ndarray = _cost(Per.TASK, "sending a task's model outputs, on its device")
    output_recv_cpu_s: np.ndarray = _cost(Per.TASK, "receiving a task's model outputs, on device 0")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                raise ProblemError(f"RequestCosts needs {f.name}; build one with RequestCosts.build or zeros")
            object.__setattr__(self, f.name, np.asarray(value, float))
        self._validate()

    @classmethod
    def build(cls, num_tasks: int, num_devices: int, **seconds: Any) -> RequestCosts:
        """Costs for ``num_tasks`` tasks on ``num_devices`` devices: those given (arrays, by field name), else 0."""
        unknown = sorted(set(seconds) - set(cls.names()))
        if unknown:
            raise ProblemError(f"unknown per-request costs {unknown}; they are {list(cls.names())}")
        values = {}
        for name, per in cls.names().items():
            shape = (num_devices,) if per is Per.DEVICE else (num_tasks, num_devices)
            given = seconds.get(name)
            value = np.zeros(shape) if given is None else np.asarray(given, float)
            if value.size != int(np.prod(shape)):
                raise ProblemError(f"{name} must hold {' x '.join(map(str, shape))} numbers, got shape {value.shape}")
            values[name] = value.reshape(shape)
        return cls(**values)

    @classmethod
    def zeros(cls, num_tasks: int, num_devices: int) -> RequestCosts:
        return cls.build(num_tasks, num_devices)

    @staticmethod
    def names() -> dict[str, Per]:
        """Every cost's name and what it is given for."""
        return {f.name: f.metadata["per"] for f in dataclasses.fields(RequestCosts)}

    @property
    def num_devices(self) -> int:
        return self.header_s.shape[0]

    @property
    def num_tasks(self) -> int:
        return self.output_s.shape[0]

    def _validate(self) -> None:
        if self.header_s.ndim != 1 or self.output_s.ndim != 2:
            raise ProblemError("header_s must be one number per device and output_s one row per task")
        k, n = len(self.header_s), len(self.output_s)
        for f in dataclasses.fields(self):
            value, per = getattr(self, f.name), f.metadata["per"]
            shape = (k,) if per is Per.DEVICE else (n, k)
            if value.shape != shape:
                raise ProblemError(f"{f.name} ({f.metadata['meaning']}) must have shape {shape}, got {value.shape}")
            if not np.all(np.isfinite(value)) or np.any(value < 0):
                raise ProblemError(f"{f.name} ({f.metadata['meaning']}) must be non-negative finite numbers")

    def replace(self, **seconds: Any) -> RequestCosts:
        """These costs with some replaced (arrays by field name)."""
        return RequestCosts.build(self.num_tasks, self.num_devices, **{**self.to_arrays(), **seconds})

    def same_for(self, a: int, b: int) -> bool:
        """Whether devices ``a`` and ``b`` have the same costs, every one of them."""
        return all(np.array_equal(value[..., a], value[..., b]) for value in self.to_arrays().values())

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.names()}

    def to_dict(self) -> dict[str, list[Any]]:
        return {name: value.tolist() for name, value in self.to_arrays().items()}

    @classmethod
    def from_dict(
        cls, d: dict[str, Any] | None, devices: list[dict[str, Any]], tasks: list[dict[str, Any]]
    ) -> RequestCosts:
        """Costs from a problem description: its ``request_costs`` object (``d``, as :meth:`to_dict` writes it) or,
        as older files give them, one key per cost in every device's or task's entry."""
        n, k = len(tasks), len(devices)
        if d is not None:
            if not isinstance(d, dict):
                raise ProblemError(f"'request_costs' must be an object of named arrays, got {type(d).__name__}")
            return cls.build(n, k, **{name: d[name] for name in cls.names() if name in d})
        values = {}
        for name, per in cls.names().items():
            entries = devices if per is Per.DEVICE else tasks
            if any(name in entry for entry in entries):
                zero = 0.0 if per is Per.DEVICE else [0.0] * k
                try:
                    values[name] = np.array([entry.get(name, zero) for entry in entries], float)
                except (TypeError, ValueError):
                    raise ProblemError(f"{name} of every {per.value} must hold numbers ({k} per task)") from None
        return cls.build(n, k, **values)

    def merge(self, groups: Sequence[Sequence[int]]) -> RequestCosts:
        """The costs of the tasks merged into ``groups`` (lists of task indices): a group's per-task costs are the
        sum of its tasks'."""
        k = self.num_devices
        merged = {
            name: np.array([getattr(self, name)[list(group)].sum(axis=0) for group in groups]).reshape(-1, k)
            for name, per in self.names().items()
            if per is Per.TASK
        }
        return RequestCosts.build(len(groups), self.num_devices, **{**self.to_arrays(), **merged})

    def for_stream(self, num_requests: int) -> RequestCosts:
        """The costs of ``num_requests`` copies of the task graph (:func:`moirai.planning.stream.unroll`): the
        outputs' delays repeat per request; only the first request waits for its header (the driver sends later
        ones ahead); the CPU time, which the stream folds into each device's tasks, is 0."""
        return RequestCosts.build(
            self.num_tasks * num_requests,
            self.num_devices,
            header_s=self.header_s,
            output_s=np.tile(self.output_s, (num_requests, 1)),
        )

    @cached_property
    def charges(self) -> Charges:
        """The CPU time per request every term of :data:`PERIOD_TERMS` charges, summed."""
        total = Charges.zeros(self.num_tasks, self.num_devices)
        for term in PERIOD_TERMS:
            total = total + term.charges(self)
        return total


class Charges(NamedTuple):
    """CPU time per request outside tasks and their transfers, by whom it falls on (seconds).

    A placement charges device ``k`` ``always_s[k]``, plus ``taking_part_s[k]`` if a task runs there, plus
    ``own_s[i, k]`` for every task ``i`` on it, plus (device 0) ``driver_s[i, d]`` for every task ``i`` on any
    device ``d``.
    """

    always_s: np.ndarray  # [k]
    taking_part_s: np.ndarray  # [k]
    own_s: np.ndarray  # [n, k]
    driver_s: np.ndarray  # [n, k]

    @classmethod
    def zeros(cls, num_tasks: int, num_devices: int) -> Charges:
        k = num_devices
        return cls(np.zeros(k), np.zeros(k), np.zeros((num_tasks, k)), np.zeros((num_tasks, k)))

    def __add__(self, other: object) -> Charges:  # type: ignore[override]
        assert isinstance(other, Charges)
        return Charges(*(a + b for a, b in zip(self, other, strict=True)))

    def device_s(self, placement: np.ndarray) -> np.ndarray:
        """``[k]``: what ``placement`` (task -> device) charges every device per request."""
        placement = np.asarray(placement, int)
        k = len(self.always_s)
        tasks = np.arange(len(placement))
        taking_part = np.bincount(placement, minlength=k) > 0
        seconds = self.always_s + np.where(taking_part, self.taking_part_s, 0.0)
        seconds += np.bincount(placement, weights=self.own_s[tasks, placement], minlength=k)
        seconds[0] += self.driver_s[tasks, placement].sum()
        return seconds

    def singles_out_driver(self) -> bool:
        """Whether device 0 is charged something no other device is (so it cannot stand in for another)."""
        return bool(self.always_s[0] > 0 or self.driver_s.any())

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
    device 0, whose driver takes every request."""

    def charges(self, costs: RequestCosts) -> Charges:
        zero = Charges.zeros(costs.num_tasks, costs.num_devices)
        always = np.zeros(costs.num_devices)
        always[0] = costs.request_cpu_s[0]
        taking_part = costs.request_cpu_s.copy()
        taking_part[0] = 0.0
        return zero._replace(always_s=always, taking_part_s=taking_part)


@dataclass(frozen=True)
class OutputSend(PeriodTerm):
    """Sending a task's model outputs to the driver takes CPU time from the task's device."""

    def charges(self, costs: RequestCosts) -> Charges:
        return Charges.zeros(costs.num_tasks, costs.num_devices)._replace(own_s=costs.output_send_cpu_s)


@dataclass(frozen=True)
class OutputReceive(PeriodTerm):
    """Receiving a task's model outputs takes CPU time from device 0, the driver."""

    def charges(self, costs: RequestCosts) -> Charges:
        return Charges.zeros(costs.num_tasks, costs.num_devices)._replace(driver_s=costs.output_recv_cpu_s)


PERIOD_TERMS: tuple[PeriodTerm, ...] = (RuntimeWork(), OutputSend(), OutputReceive())
