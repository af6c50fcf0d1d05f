"""``pipeline``: stages of a topological order for throughput, by dynamic programming (PipeEdge, Hu et al. 2022).

The tasks, in topological order, are cut into contiguous stages, one per device used, each device used
at most once and in any order. A stage's cost is the larger of its compute time on its device and the
transfer into it: every tensor produced before the cut and read after it, sent from the previous stage's
device (tensors that skip a stage are charged to the cut they cross, as PipeEdge does), and the runtime's own
work per request on the stage's device and the model outputs' messages, as
:attr:`moirai.planning.costs.RequestCosts.charges` charges them; device 0's driver is charged for every stage's
outputs it receives, so its load grows stage by stage. The DP minimises the largest stage cost (or device 0's load),
the period of a pipelined stream of requests, over (tasks placed, devices used, last device); stages must fit their
device's memory and run only tasks the device can run.

With more than :data:`SUBSET_DP_MAX_DEVICES` devices the device order is fixed (fastest first by
:attr:`moirai.planning.problem.Problem.device_speed`) and the DP chooses only where to cut, which devices to skip
included. Each device runs its stage in topological order; the simulator judges the plan.
"""

from __future__ import annotations

import numpy as np

from moirai.errors import InfeasibleError
from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import PlacerReport
from moirai.planning.schedule import transfer_duration_s

SUBSET_DP_MAX_DEVICES = 6


@register("pipeline", minimises=True, respects_memory=True, objectives=("throughput",), start_plan=10)
def place_pipeline(problem: Problem) -> Plan:
    n, k = problem.num_tasks, problem.num_devices
    order = np.array(problem.topological_order, int)
    charges = problem.costs.charges
    with np.errstate(invalid="ignore"):
        # Prefix sums (inf stays) of each task's compute and of the per-request CPU time it charges its own device
        # and the driver on device 0 (RequestCosts.charges, as the simulator counts them).
        work = problem.compute_s + charges.own_s
        compute = np.vstack([np.zeros(k), np.cumsum(work[order], axis=0)])
    to_driver = np.vstack([np.zeros(k), np.cumsum(charges.driver_s[order], axis=0)])
    stage_fixed_s = charges.always_s + charges.taking_part_s
    memory = np.r_[0.0, np.cumsum(problem.memory_bytes[order])]
    cut = _cut_transfer_s(problem, order)
    devices = list(range(k)) if k <= SUBSET_DP_MAX_DEVICES else list(np.argsort(-problem.device_speed, kind="stable"))
    subsets = k <= SUBSET_DP_MAX_DEVICES
    # best[(start, used, last)] = (period so far, previous state, stage device, device 0's load so far); ``used`` a
    # bit mask. Device 0's driver works on every request and takes every stage's outputs, so its load grows with
    # every stage and no period is shorter than it.
    driver_s = float(charges.always_s[0])
    best: dict[tuple[int, int, int], tuple[float, tuple[int, int, int] | None, int, float]] = {
        (0, 0, -1): (max(driver_s, float(charges.always_s.max(initial=0.0))), None, -1, driver_s)
    }
    by_start: list[list[tuple[int, int, int]]] = [[] for _ in range(n + 1)]
    by_start[0].append((0, 0, -1))
    for start in range(n):
        for state in sorted(by_start[start]):
            period, _, _, driver_s = best[state]
            _, used, last = state
            position = devices.index(last) if last >= 0 else -1
            candidates = devices if subsets else devices[position + 1 :]
            for d in candidates:
                if used >> d & 1:
                    continue
                ends = np.arange(start + 1, n + 1)
                stage_s = compute[ends, d] - compute[start, d] + stage_fixed_s[d]
                driver = driver_s + to_driver[ends, d] - to_driver[start, d]
                if d == 0:
                    driver, stage_s = driver + stage_s - charges.always_s[0], 0.0
                incoming = cut[start, last, d] if last >= 0 else 0.0
                cost = np.maximum(np.maximum(np.maximum(stage_s, incoming), period), driver)
                ok = (memory[ends] - memory[start] <= problem.memory_capacity_bytes[d]) & np.isfinite(cost)
                for end, value, load in zip(ends[ok].tolist(), cost[ok].tolist(), driver[ok].tolist(), strict=True):
                    key = (end, used | 1 << d if subsets else 0, d)  # a fixed order needs no used set
                    if key not in best:
                        by_start[end].append(key)
                    if key not in best or value < best[key][0]:
                        best[key] = (value, state, d, load)
    finals = by_start[n]
    if not finals:
        raise InfeasibleError(
            "pipeline finds no split of the topological order into stages that fit the devices' memory and run "
            "every task where it can run; try 'heft' or 'milp'"
        )
    state: tuple[int, int, int] | None = min(finals, key=lambda s: (best[s][0], s))
    placement = np.empty(n, int)
    period_s = best[state][0]
    while state is not None and state[0] > 0:
        _, previous, d, _ = best[state]
        placement[order[previous[0] : state[0]]] = d
        state = previous
    per_device = tuple(tuple(int(i) for i in order if placement[i] == d) for d in range(k))
    return Plan(
        placement,
        problem.device_names,
        order=per_device,
        placer="pipeline",
        report=PlacerReport(notes={"dp_period_s": period_s}),
    )


def _cut_transfer_s(problem: Problem, order: np.ndarray) -> np.ndarray:
    """``cut[b, a, d]``: time to send from device ``a`` to ``d`` every tensor made before position ``b`` of
    ``order`` and read at or after it."""
    n, k = problem.num_tasks, problem.num_devices
    position = np.empty(n, int)
    position[order] = np.arange(n)
    change = np.zeros((n + 2, k, k))
    devices = np.arange(k)
    for t, consumers in enumerate(problem.tensor_consumers):
        made = position[problem.tensor_producer[t]] + 1
        last_read = max(position[c] for c in consumers)
        if last_read >= made:
            seconds = transfer_duration_s(problem, t, devices[:, None], devices[None, :])
            change[made] += seconds
            change[last_read + 1] -= seconds
    return np.cumsum(change, axis=0)
