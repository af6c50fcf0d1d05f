"""How long the milp placer's steps take on this machine, measured by ``bench/start_plan_costs.py``.

The numbers live in ``moirai/data/start_plan_costs.toml``; the milp placer uses them to start only the start
plans and lookahead rounds its budget has time for.
"""

from __future__ import annotations

import functools
import importlib.resources
from dataclasses import dataclass
from types import MappingProxyType

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

COSTS_FILE = "start_plan_costs.toml"
SIZE_EXPONENT = 1.4  # a start plan's time grows as (tasks / 1,000) ** SIZE_EXPONENT


@dataclass(frozen=True)
class MeasuredCosts:
    start_plan_s: MappingProxyType[str, float]  # seconds per (1,000 tasks) ** SIZE_EXPONENT, by placer
    simulate_s_per_task: float
    lookahead_round_s_per_1000_tasks: float

    def start_plan_time_s(self, placer: str, num_tasks: int) -> float:
        """Predicted seconds for ``placer``'s plan and its simulation on ``num_tasks`` tasks (0 if unmeasured)."""
        scale = (num_tasks / 1000) ** SIZE_EXPONENT
        return self.start_plan_s.get(placer, 0.0) * scale + self.simulate_s_per_task * num_tasks


@functools.cache
def measured_costs() -> MeasuredCosts:
    """The costs in the bundled data file."""
    text = importlib.resources.files("moirai").joinpath("data", COSTS_FILE).read_text(encoding="utf-8")
    data = tomllib.loads(text)
    return MeasuredCosts(
        MappingProxyType({name: float(s) for name, s in data["start_plan_s"].items()}),
        float(data["simulate_s_per_task"]),
        float(data["lookahead_round_s_per_1000_tasks"]),
    )
