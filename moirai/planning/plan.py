"""A placer's answer, as plain numbers: the device of every task and, optionally, the order on every device and
link, with what the placer reports about it. :mod:`moirai.planning.problem` re-exports it.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from moirai.errors import PlanError
from moirai.planning.report import PlacerReport

if TYPE_CHECKING:
    from moirai.planning.problem import Problem


@dataclass
class Plan:
    """A placer's answer: the device of every task and, optionally, the order on every device.

    ``order[k]`` lists the tasks on device ``k`` in execution order; ``None`` lets the
    simulator list-schedule them (see :mod:`moirai.planning.simulate`). ``transfer_order[(a, b)]``
    lists the tensors sent over the directed link ``a -> b`` in order; ``None`` (or a
    missing link) means first ready, first sent.
    """

    placement: np.ndarray
    device_names: tuple[str, ...]
    order: tuple[tuple[int, ...], ...] | None = None
    transfer_order: dict[tuple[int, int], tuple[int, ...]] | None = None
    placer: str = ""
    makespan_s: float | None = None  # the simulated latency of one request
    objective: str = "latency"  # what the plan was made to minimise (moirai.planning.objective)
    objective_s: float | None = None  # the simulated value of that objective
    lower_bound_s: float | None = None  # a proven bound on the objective
    placement_time_s: float | None = None
    report: PlacerReport = field(default_factory=PlacerReport)

    def __post_init__(self) -> None:
        self.placement = _device_indices(self.placement)

    @property
    def gap(self) -> float | None:
        """Relative gap between the plan's objective value and the proven lower bound on it."""
        if self.objective_s is None or self.lower_bound_s is None or self.objective_s == 0:
            return None
        return (self.objective_s - self.lower_bound_s) / self.objective_s

    def check(self, problem: Problem) -> None:
        """Raise :class:`PlanError` unless this plan covers every task of ``problem`` with known devices."""
        if tuple(self.device_names) != tuple(problem.device_names):
            raise PlanError(f"plan is for devices {list(self.device_names)}, problem has {list(problem.device_names)}")
        if self.placement.ndim != 1:  # a table of 6 indices "placed 6 tasks, problem has 6"
            raise PlanError(
                f"plan's placement has shape {self.placement.shape}: give one device index per task, a flat list"
            )
        if self.placement.shape != (problem.num_tasks,):
            raise PlanError(f"plan places {self.placement.size} tasks, problem has {problem.num_tasks}")
        bad = np.flatnonzero((self.placement < 0) | (self.placement >= problem.num_devices))
        if bad.size:
            raise PlanError(f"plan puts task {problem.task_names[bad[0]]!r} on unknown device {self.placement[bad[0]]}")
        if self.order is not None:
            if len(self.order) != problem.num_devices:  # else an IndexError in the simulator, or one ignored
                raise PlanError(
                    f"plan order lists {len(self.order)} devices, the problem has {problem.num_devices}: give one "
                    "list of tasks per device (empty for a device without tasks)"
                )
            listed = sorted(i for tasks in self.order for i in tasks)
            if listed != list(range(problem.num_tasks)):
                raise PlanError("plan order must list every task exactly once")
            for k, tasks in enumerate(self.order):
                if any(self.placement[i] != k for i in tasks):
                    raise PlanError(f"plan order lists a task on device {k} that is placed elsewhere")
        devices = range(problem.num_devices)
        unknown_links = [(a, b) for a, b in self.transfer_order or () if a not in devices or b not in devices]
        if unknown_links:
            raise PlanError(f"plan's transfer_order names link {unknown_links[0]}, between devices it does not have")

    def to_dict(self) -> dict[str, Any]:
        return {
            "placement": self.placement.tolist(),
            "device_names": list(self.device_names),
            # Python ints: a placer's orders may hold numpy's (m_sct's did), which json cannot write.
            "order": None if self.order is None else [[int(i) for i in o] for o in self.order],
            "transfer_order": None
            if self.transfer_order is None
            else [[int(a), int(b), [int(t) for t in tensors]] for (a, b), tensors in self.transfer_order.items()],
            "placer": self.placer,
            "makespan_s": self.makespan_s,
            "objective": self.objective,
            "objective_s": self.objective_s,
            "lower_bound_s": self.lower_bound_s,
            "placement_time_s": self.placement_time_s,
            "report": self.report.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """The plan :meth:`to_dict` wrote; a :class:`PlanError` naming the field that is not as it writes it."""
        if not isinstance(d, dict):
            raise PlanError(f"a plan must be a table of fields, got {type(d).__name__}")
        if "placement" not in d or "device_names" not in d:
            raise PlanError("a plan needs 'placement' (a device index per task) and 'device_names'")
        names = d["device_names"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise PlanError(f"plan field 'device_names' must be a list of names, got {str(names)[:60]}")
        order, transfer_order, report = d.get("order"), d.get("transfer_order"), d.get("report")
        if not (report is None or isinstance(report, dict)):
            raise PlanError(f"plan field 'report' must be a table, got {type(report).__name__}")
        return cls(
            placement=_device_indices(d["placement"], "placement"),
            device_names=tuple(names),
            order=None if order is None else _order(order),
            transfer_order=None if transfer_order is None else _transfer_order(transfer_order),
            placer=_optional(d, "placer", str, ""),
            makespan_s=_optional(d, "makespan_s", float, None),
            objective=_optional(d, "objective", str, "latency"),
            objective_s=_optional(d, "objective_s", float, None),
            lower_bound_s=_optional(d, "lower_bound_s", float, None),
            placement_time_s=_optional(d, "placement_time_s", float, None),
            report=PlacerReport.from_dict(report or {}),
        )


def _device_indices(values: Any, field_name: str = "placement") -> np.ndarray:
    """``values`` as device indices: whole numbers (2.0 is 2), never truncated (1.9 was device 1)."""
    try:
        array = np.asarray(values)
    except ValueError as error:  # ragged lists
        raise PlanError(f"plan field {field_name!r} must be device indices: {error}") from None
    if array.dtype.kind == "f" and np.all(np.isfinite(array)) and np.all(array == np.round(array)):
        array = array.astype(int)
    if array.dtype.kind not in "iu":
        raise PlanError(
            f"plan field {field_name!r} must be whole device indices, got {reprlib.repr(array.tolist())} "
            f"({array.dtype})"
        )
    return array.astype(int, copy=False)


def _order(order: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(order, list) or not all(isinstance(tasks, list) for tasks in order):
        raise PlanError(f"plan field 'order' must be a list of task lists, one per device, got {str(order)[:60]}")
    return tuple(tuple(int(i) for i in _device_indices(tasks, "order").reshape(-1)) for tasks in order)


def _transfer_order(entries: Any) -> dict[tuple[int, int], tuple[int, ...]]:
    shape = "a list of [source device, destination device, [tensor, ...]] entries"
    if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) == 3 for e in entries):
        raise PlanError(f"plan field 'transfer_order' must be {shape}, got {str(entries)[:60]}")
    links = {}
    for a, b, tensors in entries:
        if not isinstance(tensors, list) or isinstance(a, bool) or isinstance(b, bool):
            raise PlanError(f"plan field 'transfer_order' must be {shape}, got {str([a, b, tensors])[:60]}")
        (a, b) = (int(x) for x in _device_indices([a, b], "transfer_order"))
        links[(a, b)] = tuple(int(t) for t in _device_indices(tensors, "transfer_order").reshape(-1))
    return links


def _optional(d: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    """Field ``name`` of a plan table: ``default`` where absent or null, else of ``kind`` (a number for float)."""
    value = d.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    raise PlanError(f"plan field {name!r} must be {'a number' if kind is float else 'text'}, got {value!r:.60}")


def check_plan(plan: object, where: str) -> None:
    """A :class:`PlanError` unless ``plan`` is a :class:`Plan`; ``where`` names the argument
    (``"moirai.simulate's plan"``)."""
    if not isinstance(plan, Plan):
        raise PlanError(
            f"{where} must be a moirai.Plan, got {repr(plan)[:80]} ({type(plan).__name__}); make one with "
            "moirai.place(problem, placer=...), or take a compiled model's (compiled.plan)"
        )
