"""Requests pipelined through a plan: the simulator run on a stream of requests.

The server (:meth:`moirai.CompiledModel.server`) keeps several requests in flight: every device
runs its part for request after request in submission order, and each request's tensors cross
the links as they do for one request. That is the simulator's own semantics on an *unrolled*
problem: ``num_requests`` copies of the task graph, each device's order the plan's order
repeated request after request, every request submitted at time 0 (a saturated server). The
simulated finish of each request gives the steady-state period the server reaches, which
:attr:`moirai.planning.simulate.Timeline.period_s` (the busiest device or link per request) bounds
from below: back-and-forth transfers between two devices can keep a pipeline from reaching it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moirai.errors import MoiraiError
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.schedule import output_arrival_s, runtime_cpu_s
from moirai.planning.simulate import Timeline, simulate


class Stream(NamedTuple):
    """The simulated stream: the unrolled problem, plan and timeline, and when each request finished."""

    problem: Problem
    plan: Plan
    timeline: Timeline
    num_requests: int
    request_finish_s: np.ndarray

    @property
    def period_s(self) -> float:
        """Seconds between consecutive requests' completions once the pipeline is full: the later half's mean gap,
        and never less than the busiest device's or link's time per request, which no stream beats (a few requests'
        gaps can: the last may finish close behind the one before when the busiest device served it early)."""
        finish = np.sort(self.request_finish_s)
        if len(finish) < 2:
            return float(finish[-1]) if len(finish) else 0.0
        half = len(finish) // 2
        observed_s = float((finish[-1] - finish[half - 1]) / (len(finish) - half))
        return max(observed_s, self.timeline.period_s / self.num_requests)

    def request_of_task(self) -> np.ndarray:
        """The request every task of the unrolled problem belongs to."""
        return np.repeat(np.arange(self.num_requests), self.problem.num_tasks // self.num_requests)


def unroll(problem: Problem, plan: Plan, num_requests: int) -> tuple[Problem, Plan]:
    """``num_requests`` copies of ``problem``, placed as ``plan`` and ordered request after request.

    Task ``i`` of request ``r`` is task ``r * n + i`` (``n`` tasks per request), tensors likewise.
    The plan's device orders are those the simulator gives one request. Memory is counted once,
    for the first request: weights are shared, and the stream is judged by time only. A device's CPU
    time per request outside its tasks and transfers (the runtime's own work and the outputs' messages,
    :func:`moirai.planning.schedule.runtime_cpu_s`) is added to each request's first task there (a device 0
    without tasks has none to add it to: its driver then works beside the others).
    """
    if num_requests < 1:
        raise MoiraiError(f"a stream needs at least one request, not {num_requests}")
    n, t = problem.num_tasks, problem.num_tensors
    order = simulate(problem, plan).device_order()
    copies = range(num_requests)
    compute = problem.compute_s.copy()
    runtime_s = runtime_cpu_s(problem, plan.placement)
    for device, sequence in enumerate(order):
        if sequence:
            compute[sequence[0], device] += runtime_s[device]
    unrolled = Problem(
        device_names=problem.device_names,
        memory_capacity_bytes=problem.memory_capacity_bytes,
        memory_reserve_bytes=problem.memory_reserve_bytes,
        task_names=tuple(f"{name}#{r}" for r in copies for name in problem.task_names),
        compute_s=np.tile(compute, (num_requests, 1)),
        memory_bytes=np.concatenate([problem.memory_bytes, np.zeros(n * (num_requests - 1))]),
        tensor_names=tuple(f"{name}#{r}" for r in copies for name in problem.tensor_names),
        tensor_producer=np.concatenate([problem.tensor_producer + r * n for r in copies]),
        tensor_consumers=tuple(
            tuple(c + r * n for c in consumers) for r in copies for consumers in problem.tensor_consumers
        ),
        transfer_s=np.tile(problem.transfer_s, (num_requests, 1, 1)),
        tensor_bytes=np.tile(problem.tensor_bytes, num_requests),
        send_cpu_s=np.tile(problem.send_cpu_s, (num_requests, 1, 1)),
        recv_cpu_s=np.tile(problem.recv_cpu_s, (num_requests, 1, 1)),
        costs=problem.costs.for_stream(num_requests),
        colocated=tuple(tuple(i + r * n for i in members) for r in copies for members in problem.colocated),
    )
    unrolled_plan = Plan(
        placement=np.tile(plan.placement, num_requests),
        device_names=plan.device_names,
        order=tuple(tuple(i + r * n for r in copies for i in sequence) for sequence in order),
        transfer_order=None
        if plan.transfer_order is None
        else {
            link: tuple(tensor + r * t for r in copies for tensor in tensors)
            for link, tensors in plan.transfer_order.items()
        },
        placer=plan.placer,
        objective=plan.objective,
    )
    return unrolled, unrolled_plan


def simulate_stream(problem: Problem, plan: Plan, num_requests: int = 8) -> Stream:
    """Simulate ``num_requests`` requests pipelined through ``plan`` (see the module docstring)."""
    unrolled, unrolled_plan = unroll(problem, plan, num_requests)
    timeline = simulate(unrolled, unrolled_plan)
    done = output_arrival_s(unrolled, unrolled_plan.placement, timeline.task_finish)
    finish = done.reshape(num_requests, problem.num_tasks).max(axis=1, initial=0.0)
    return Stream(unrolled, unrolled_plan, timeline, num_requests, finish)
