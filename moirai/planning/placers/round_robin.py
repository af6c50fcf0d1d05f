"""``round_robin``: contiguous chunks of the topological order, one per device.

Chunks are sized by device speed (:attr:`moirai.planning.problem.Problem.device_speed`: a faster device gets
proportionally more work), the hand split people write for pipeline stages. Every device gets at least
one task when there are enough tasks, so tests use it to force real splits. Memory is ignored: a plan
may exceed a device's capacity (the simulator's ``fits_memory`` says so).
"""

from __future__ import annotations

import numpy as np

from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem


@register("round_robin", minimises=False, respects_memory=False, start_plan=3)
def place_round_robin(problem: Problem) -> Plan:
    order = list(problem.topological_order)
    k = problem.num_devices
    work_share = problem.device_speed
    cuts = np.round(np.cumsum(work_share)[:-1] * len(order)).astype(int)
    if len(order) >= k:
        # Every chunk non-empty: cut d lies in [d + 1, n - (k - 1 - d)] and cuts strictly increase.
        for d in range(k - 1):
            low = d + 1 if d == 0 else cuts[d - 1] + 1
            cuts[d] = min(max(cuts[d], low), len(order) - (k - 1 - d))
    chunks = tuple(tuple(int(i) for i in chunk) for chunk in np.split(np.array(order, int), cuts))
    placement = np.zeros(problem.num_tasks, int)
    for device, chunk in enumerate(chunks):
        placement[list(chunk)] = device
    return Plan(placement, problem.device_names, order=chunks, placer="round_robin")
