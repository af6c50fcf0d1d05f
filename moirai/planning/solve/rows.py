"""The objectives' parts of the MILP (:meth:`moirai.planning.objective.Objective.milp_rows`): latency's makespan
rows, throughput's period rows, and the :class:`MilpRows` that bundle an objective's rows, cuts, variable and
warm start.

:mod:`moirai.planning.objective` imports this module lazily for ``LATENCY_ROWS``/``THROUGHPUT_ROWS``; this module
names the objective for annotations only, so the two never import each other at runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import pyomo.environ as pyo

from moirai.errors import MoiraiError
from moirai.planning.schedule.transfers import send_cpu_s, transfer_duration_s
from moirai.planning.solve.cuts import latency_cuts
from moirai.planning.solve.parts import MODEL_TIME_SCALE

if TYPE_CHECKING:  # the objective asks this module for its rows: annotations only here
    from pyomo.common.collections import ComponentMap

    from moirai.planning.objective import Objective
    from moirai.planning.simulate import Timeline
    from moirai.planning.solve.model import MilpModel
    from moirai.planning.solve.parts import ModelParts, Transfers


def _latency_rows(c: ModelParts, objective: Objective | None = None) -> None:
    """The latency objective: T covers every free task plus what runs after it on its device, and the transfer of
    the model outputs it makes to device 0 (:func:`moirai.planning.schedule.output_arrival_s`)."""
    for f, i in enumerate(c.free):
        c.add(c.m.T >= c.finish[i] + sum(c.scaled(c.window.tail_s[f, k]) * c.m.x[i, k] for k in c.allowed[i]))
        output_s = c.problem.costs.output_s
        output = {k: c.scaled(output_s[i, k]) for k in c.allowed[i] if output_s[i, k] > 0}
        if output:
            c.add(c.m.T >= c.finish[i] + sum(seconds * c.m.x[i, k] for k, seconds in output.items()))


def _period_rows(c: ModelParts, objective: Objective) -> None:
    """Throughput: the period P covers every device's compute per request; with a latency limit (then the
    window's horizon), T covers every finish and stays within it."""
    if len(c.free) != c.problem.num_tasks:
        raise MoiraiError("the throughput objective is modelled for the whole problem only, not windows")
    m = c.m
    # No upper bound: the runtime's work per request counts in a period, not in a latency, so a period may exceed
    # a latency limit (the horizon then).
    m.P = pyo.Var(domain=pyo.NonNegativeReals)
    problem = c.problem
    # The simulator's charges (RequestCosts.charges, the sum of every term of PERIOD_TERMS), linear in x and in
    # u[k] = 1 when device k has a task.
    charges = problem.costs.charges
    charged = [
        k for k in range(problem.num_devices) if charges.taking_part_s[k] > 0 or charges.driver_taking_part_s[k] > 0
    ]
    m.u = pyo.Var(charged, domain=pyo.Binary)
    for k in charged:
        for i in c.free:
            if k in c.allowed[i]:
                c.add(m.u[k] >= m.x[i, k])
    _input_rows(c)
    for k in range(problem.num_devices):
        users = [i for i in c.free if k in c.allowed[i]]
        runtime = c.scaled(charges.always_s[k]) + (c.scaled(charges.taking_part_s[k]) * m.u[k] if k in charged else 0)
        outputs = sum(c.scaled(charges.own_s[i, k]) * m.x[i, k] for i in users if charges.own_s[i, k] > 0)
        outputs += sum(c.scaled(charges.input_own_s[j, d]) * m.v[j, d] for j, d in m.v if d == k)
        if k == 0:
            outputs += sum(
                c.scaled(charges.driver_s[i, d]) * m.x[i, d]
                for i in c.free
                for d in c.allowed[i]
                if charges.driver_s[i, d] > 0
            )
            outputs += sum(c.scaled(charges.input_driver_s[j, d]) * m.v[j, d] for j, d in m.v)
            outputs += sum(c.scaled(charges.driver_taking_part_s[d]) * m.u[d] for d in charged)
        if users:
            c.add(
                m.P
                >= sum(c.scaled(problem.compute_s[i, k]) * m.x[i, k] for i in users)
                + _sender_time(c, k)
                + _receiver_time(c, k)
                + runtime
                + outputs
            )
        elif k == 0:
            c.add(m.P >= runtime + outputs)
    if objective.latency_limit_s is not None:
        _latency_rows(c)
        c.add(m.T <= MODEL_TIME_SCALE)


def _input_rows(c: ModelParts) -> None:
    """v[j, k] = 1 when device ``k`` has a task that reads model input ``j``, for the inputs and devices whose
    message costs something: the driver sends the input there once (``RequestCosts.input_readers``)."""
    m, costs = c.m, c.problem.costs
    charges = costs.charges
    priced = costs.input_link_s + charges.input_own_s + charges.input_driver_s
    pairs = [(j, k) for j in range(costs.num_inputs) for k in range(c.problem.num_devices) if priced[j, k] > 0]
    m.v = pyo.Var(pairs, domain=pyo.Binary)
    for j, k in pairs:
        for i in costs.input_readers[j]:
            if k in c.allowed[i]:
                c.add(m.v[j, k] >= m.x[i, k])


def _link_period_rows(c: ModelParts, objective: Objective, transfers: Transfers) -> None:
    """Throughput: the period covers every directed link's transfers per request (a tensor sent once per device)
    and the driver's messages on it: the model inputs it sends and the outputs it gets back."""
    on_link: dict[tuple[int, int], list[Any]] = {}
    for (t, b), sources in transfers.sources.items():
        for a in sources:
            on_link.setdefault((a, b), []).append(c.scaled(transfer_duration_s(c.problem, t, a, b)) * c.m.w[t, a, b])
    costs = c.problem.costs
    for j, k in c.m.v:
        if costs.input_link_s[j, k] > 0:
            on_link.setdefault((0, k), []).append(c.scaled(costs.input_link_s[j, k]) * c.m.v[j, k])
    for i in c.free:
        for k in c.allowed[i]:
            if costs.output_link_s[i, k] > 0:
                on_link.setdefault((k, 0), []).append(c.scaled(costs.output_link_s[i, k]) * c.m.x[i, k])
    for terms in on_link.values():
        c.add(c.m.P >= sum(terms))


def _receiver_time(c: ModelParts, device: int) -> Any:
    """The receiver's time device ``device`` spends on the transfers its free tasks receive (model units)."""
    return sum(c.m.r[t, i, b] for t, i, b in c.receive_terms if b == device)


def _sender_time(c: ModelParts, device: int) -> Any:
    """The sender's time device ``device`` spends on the transfers of free producers (model units)."""
    free_set = set(c.free)
    return sum(
        c.scaled(float(send_cpu_s(c.problem, t, device, b))) * c.m.w[t, device, b]
        for (t, b), sources in c.transfer_sources.items()
        if device in sources and int(c.problem.tensor_producer[t]) in free_set
    )


def _no_rows(*args: Any) -> None:
    return None


def _period_warm_start(values: ComponentMap, built: MilpModel, timeline: Timeline) -> None:
    """The period P of the start plan (the busiest device or link), which devices its free tasks use (u) and
    where it sends the model inputs (v)."""
    m = built.model
    values[m.P] = timeline.period_s / built.unit_s
    used = {int(timeline.placement[i]) for i in built.window.free_tasks}
    for k in m.u:
        values[m.u[k]] = float(k in used)
    reading = built.problem.costs.input_devices(timeline.placement)
    for j, k in m.v:
        values[m.v[j, k]] = float(k in reading[j])


class MilpRows(NamedTuple):
    """An objective's part of the MILP (:meth:`moirai.planning.objective.Objective.milp_rows`)."""

    before_transfers: Callable[..., None]
    after_transfers: Callable[..., None]
    cuts: Callable[[ModelParts], None]  # added by a formulation that cuts (the strong one)
    variable: Callable[[pyo.ConcreteModel], Any]  # the variable it minimises
    warm_start: Callable[[ComponentMap, MilpModel, Timeline], None]  # its own variables' start values


LATENCY_ROWS = MilpRows(_latency_rows, _no_rows, latency_cuts, lambda m: m.T, _no_rows)
THROUGHPUT_ROWS = MilpRows(_period_rows, _link_period_rows, _no_rows, lambda m: m.P, _period_warm_start)
