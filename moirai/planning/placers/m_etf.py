"""``m_etf``: Baechi's memory-constrained Earliest Time First (Jeon et al., SoCC 2020, §4.2).

ETF (Hwang et al. 1989) repeatedly takes, among the ready tasks and the devices, the pair
that can start earliest, counting the time the task's inputs need to reach that device.
Baechi's m-ETF only considers devices that still have memory for the task, and breaks
ties by topological order. Start times here include link contention and send a tensor once
per device, as the simulator does, so the plan replays the schedule the placer built.
"""

from __future__ import annotations

from functools import partial

from moirai.planning.placers import register
from moirai.planning.placers._list_scheduling import earliest_time_first, list_schedule, to_plan
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.schedule import ScheduleBuilder


@register("m_etf", minimises=True, respects_memory=True, start_plan=6)
def place_m_etf(problem: Problem, contention: bool = True) -> Plan:
    return to_plan(m_etf_schedule(problem, contention), "m_etf")


def m_etf_schedule(problem: Problem, contention: bool = True) -> ScheduleBuilder:
    """The m-ETF schedule of ``problem`` (start time of every task included)."""
    choose = partial(earliest_time_first, priority=problem.topological_position)
    return list_schedule(problem, choose, "m_etf", contention)
