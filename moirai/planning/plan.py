"""A placer's answer, as plain numbers: the device of every task and, optionally, the order on every device and
link, with what the placer reports about it. :mod:`moirai.planning.problem` re-exports it.
"""

from __future__ import annotations

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
        self.placement = np.asarray(self.placement, int)

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
        if self.placement.shape != (problem.num_tasks,):
            raise PlanError(f"plan places {self.placement.size} tasks, problem has {problem.num_tasks}")
        bad = np.flatnonzero((self.placement < 0) | (self.placement >= problem.num_devices))
        if bad.size:
            raise PlanError(f"plan puts task {problem.task_names[bad[0]]!r} on unknown device {self.placement[bad[0]]}")
        if self.order is not None:
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
            "order": None if self.order is None else [list(o) for o in self.order],
            "transfer_order": None
            if self.transfer_order is None
            else [[a, b, list(tensors)] for (a, b), tensors in self.transfer_order.items()],
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
        order = d.get("order")
        transfer_order = d.get("transfer_order")
        return cls(
            placement=np.array(d["placement"], int),
            device_names=tuple(d["device_names"]),
            order=None if order is None else tuple(tuple(o) for o in order),
            transfer_order=None
            if transfer_order is None
            else {(int(a), int(b)): tuple(tensors) for a, b, tensors in transfer_order},
            placer=d.get("placer", ""),
            makespan_s=d.get("makespan_s"),
            objective=d.get("objective", "latency"),
            objective_s=d.get("objective_s"),
            lower_bound_s=d.get("lower_bound_s"),
            placement_time_s=d.get("placement_time_s"),
            report=PlacerReport.from_dict(d.get("report", {})),
        )


def check_plan(plan: object, where: str) -> None:
    """A :class:`PlanError` unless ``plan`` is a :class:`Plan`; ``where`` names the argument
    (``"moirai.simulate's plan"``)."""
    if not isinstance(plan, Plan):
        raise PlanError(
            f"{where} must be a moirai.Plan, got {repr(plan)[:80]} ({type(plan).__name__}); make one with "
            "moirai.place(problem, placer=...), or take a compiled model's (compiled.plan)"
        )
