"""``hash``: Mayer et al.'s Hash partitioning (DIDL'17 §3.1), scheduled by PCT.

Every task goes to a device drawn by a hash of its name, with probability proportional to
the device's speed, among the devices that can run it and still have room for its memory
(devices are filled in topological order). It ignores locality, as the paper says, and is
the locality-agnostic reference. The order on every device is the simulator's list schedule
(longest remaining path first, Mayer et al.'s PCT).
Options: ``seed`` changes the hash; ``contention`` (default True) is the link model of the list schedule.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np

from moirai.planning.bounds import memory_error
from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate


def _uniform_hash(name: str, seed: int) -> float:
    """A number in [0, 1) fixed by ``name`` and ``seed`` (stable across runs, unlike ``hash``)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / 2.0**53  # 53 bits: exact in a float, always below 1


@register("hash", minimises=False, respects_memory=True, start_plan=9)
def place_hash(problem: Problem, seed: int = 0, contention: bool = True) -> Plan:
    speed = problem.device_speed.tolist()
    capacity = problem.memory_capacity_bytes.tolist()
    runnable = problem.runs_on.tolist()
    memory = problem.memory_bytes.tolist()
    used = [0.0] * problem.num_devices
    placement = np.zeros(problem.num_tasks, int)
    for i in problem.topological_order:
        weight = [
            s if ok and u + memory[i] <= c else 0.0
            for s, ok, u, c in zip(speed, runnable[i], used, capacity, strict=True)
        ]
        if not any(weight):
            raise memory_error(problem, "hash", i, np.array(used))
        # Walk the cumulative speed shares of the allowed devices to where the hash falls.
        point = _uniform_hash(problem.task_names[i], seed) * sum(weight)
        last_allowed = max(d for d, w in enumerate(weight) if w > 0)  # where rounding may push the top end
        shares = enumerate(itertools.accumulate(weight))
        device = next((d for d, total in shares if total > point and weight[d] > 0), last_allowed)
        placement[i] = device
        used[device] += memory[i]
    partition = Plan(placement, problem.device_names)
    order = simulate(problem, partition, contention=contention).device_order()
    return Plan(placement, problem.device_names, order=order, placer="hash")
