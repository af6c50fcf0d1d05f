"""``heft``: Heterogeneous Earliest Finish Time (Topcuoglu, Hariri and Wu, IEEE TPDS 2002), insertion-based.

Task prioritising: upward rank from average costs, ``rank(i) = w̄_i + max_j (c̄_ij + rank(j))``,
where ``w̄_i`` is the task's mean time over the devices that can run it and ``c̄_ij`` the mean
transfer time of the tensor over every ordered pair of distinct devices. Tasks are taken by
decreasing rank (ties: topological position, so the list is a topological order).

Processor selection: each task goes to the device where it finishes earliest, starting in the
earliest idle slot of that device long enough for it after its inputs arrive (insertion
policy); ties go to the lower device index. Three extensions make the schedule the simulator's:

* communication follows :mod:`moirai.planning.simulate`: a tensor crosses to a device once (a later
  consumer there reuses it), and with ``contention=True`` (the default) a transfer also needs
  an idle slot on its directed link, found with the same insertion rule (inputs of one task on
  one link are booked in the order their producers finish). ``contention=False`` is the paper's
  model: a transfer starts as soon as its producer finishes.
* the devices' time for messages: a send lengthens its producer (and the transfer leaves after it), a receive its
  tensor's first consumer on the device in topological order, and booking a task re-times the tasks and transfers
  that moves (:class:`moirai.planning.schedule.ScheduleBuilder`). A device's finish time is chosen from an estimate
  that counts the task's own sends and receives but not how far they move tasks booked before it.
* memory: a device is a candidate only while it has room for the task (static memory model).

:func:`moirai.planning.schedule.heft.heft_schedule` takes the priority and an optional lookahead (a per task and device
time added to the finish time when choosing the device), so the milp placer's start plans
(:mod:`moirai.planning.solve.start_plans`) are this same schedule with a tail added.

The plan carries every device's order and, with contention, every link's transfer order, so
the simulator replays the schedule HEFT built: its makespan equals ``report.predicted_makespan_s``
under the same ``contention`` setting, model outputs' way to the driver included.
"""

from __future__ import annotations

from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.schedule.heft import heft_schedule, upward_rank_mean_costs


@register("heft", minimises=True, respects_memory=True, start_plan=0)
def place_heft(problem: Problem, contention: bool = True) -> Plan:
    return heft_schedule(problem, upward_rank_mean_costs(problem), contention=contention)
