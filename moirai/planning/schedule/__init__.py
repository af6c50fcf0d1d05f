"""The one schedule-building core that the simulator, the list schedulers, HEFT and the MILP's start plans share.

The project's communication rule lives here and nowhere else:

* :func:`transfer_duration_s` is the one place that says what a transfer costs the link, :func:`send_cpu_s`
  what it costs the sending device (added to its producer's time) and :func:`recv_cpu_s` what it costs the
  receiving device (added to its receiver's time; both in :func:`task_duration_s`);
* the runtime's own work per request, beyond tasks and messages, falls on every device with a task and on
  device 0, the driver, and a model output's message takes CPU time from its maker's device and from device 0
  (:func:`runtime_cpu_s`): they count towards the period, not the latency;
* a tensor crosses to a device once: every consumer on that device reuses it
  (:func:`implied_transfers` for a whole placement, :class:`ScheduleBuilder` task by task), and the first of them in
  topological order holds the receive (:func:`receiving_task`);
* one transfer at a time per directed link, first ready first sent (:func:`send_priority`).

:class:`ScheduleBuilder` estimates what a task would take on a device, without booking anything, so that a placer
can try every device, and books it there (appended, or inserted in the earliest idle slot) with the transfers its
inputs need, re-timing what the booking moves, so that its times stay the simulator's. Nothing here knows which
task to schedule next: that is the placers' business.
"""

from moirai.planning.schedule.builder import BusyIntervals, Estimate, ScheduleBuilder
from moirai.planning.schedule.transfers import (
    ImpliedTransfers,
    implied_transfers,
    output_arrival_s,
    receiving_task,
    recv_cpu_s,
    runtime_cpu_s,
    send_cpu_s,
    send_priority,
    task_duration_s,
    transfer_duration_s,
)

__all__ = [
    "BusyIntervals",
    "Estimate",
    "ImpliedTransfers",
    "ScheduleBuilder",
    "implied_transfers",
    "output_arrival_s",
    "receiving_task",
    "recv_cpu_s",
    "runtime_cpu_s",
    "send_cpu_s",
    "send_priority",
    "task_duration_s",
    "transfer_duration_s",
]
