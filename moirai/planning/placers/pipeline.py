"""``pipeline``: stages of a topological order for throughput, by dynamic programming (PipeEdge, Hu et al. 2022).

The tasks, in topological order, are cut into contiguous stages, one per device used, each device used at most once
and in any order. A partial split (a label) is priced exactly as the simulator prices its plan
(:attr:`moirai.planning.simulate.Timeline.period_s`, :mod:`moirai.planning.schedule.transfers`): a tensor crosses
once to every later stage that reads it, straight from the device that made it, occupying that link, its sender's
device (``send_cpu_s``) and the stage's device (``recv_cpu_s``); every device pays its share of
:attr:`moirai.planning.costs.RequestCosts.charges` (device 0 the driver's, which grows with every stage). A label
carries every device's load so far and which device holds each tensor still to be read, since a sender's load grows
when a later stage reads what it made; its value, the busiest device or link so far, is the period of the split so
far and never shrinks. So the DP's value of the plan it returns is the simulator's period of that plan.

Over (tasks placed, devices used, last device) the DP keeps two labels: the one of least value, and the one PipeEdge's
own price picks (every tensor crossing a cut is charged to the link from the previous stage's device, as if
forwarded stage by stage; optimal substructure, so that label is the best split by that price). The exact price
has no optimal substructure (a label's later sends are not in its value yet), so neither label alone is the best
split; keeping both, the plan returned is never worse than PipeEdge's price would pick, and on graphs whose
tensors never skip a stage the two prices agree. Stages must fit their device's memory and run only tasks the
device can run.

With more than :data:`SUBSET_DP_MAX_DEVICES` devices the device order is fixed (fastest first by
:attr:`moirai.planning.problem.Problem.device_speed`) and the DP chooses only where to cut, which devices to skip
included. Each device runs its stage in topological order; the simulator judges the plan.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from moirai.errors import InfeasibleError
from moirai.planning.placers import register
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import PlacerReport
from moirai.planning.schedule import recv_cpu_s, send_cpu_s, transfer_duration_s

SUBSET_DP_MAX_DEVICES = 6


class _Label(NamedTuple):
    """A split of the first ``end`` tasks: its period so far, PipeEdge's price of it, and how it was reached."""

    value_s: float  # the busiest device or link so far (device loads only grow)
    cut_priced_s: float  # PipeEdge's price: every crossing tensor charged to the last cut's link
    loads_s: np.ndarray  # [k] every device's CPU time per request so far
    links_s: float  # the busiest link so far (a link into a stage is done when the stage is)
    holding: dict[int, int]  # which device holds every tensor made before ``end`` and read at or after it
    end: int
    device: int
    parent: _Label | None


class _Best:
    """Of the splits that end with one (devices used, last device), the best by one measure for every end: numbers
    in arrays, made a :class:`_Label` only when the DP extends it (most are replaced before)."""

    def __init__(self, n: int, k: int, by_price: bool, made: list[_Label]) -> None:
        self.by_price, self.made = by_price, made  # made: every label extended, by index
        self.value_s, self.price_s = np.full(n + 1, np.inf), np.full(n + 1, np.inf)
        self.loads_s, self.links_s = np.zeros((n + 1, k)), np.zeros(n + 1)
        self.parent = np.full(n + 1, -1)  # index in ``made``; -1: no split ends there

    def measure(self) -> np.ndarray:
        return self.price_s if self.by_price else self.value_s

    def update(self, ends: np.ndarray, better: np.ndarray, value, price, loads, links, parent: int) -> None:
        at = ends[better]
        self.value_s[at], self.price_s[at] = value[better], price[better]
        self.loads_s[at], self.links_s[at] = loads[:, better].T, links[better]
        self.parent[at] = parent

    def label(self, p: _Prices, end: int, device: int) -> _Label:
        parent = self.made[self.parent[end]]
        holding = {t: device if p.made_at[t] >= parent.end else parent.holding[t] for t in p.crossing[end]}
        loads = self.loads_s[end].copy()
        return _Label(
            float(self.value_s[end]),
            float(self.price_s[end]),
            loads,
            float(self.links_s[end]),
            holding,
            end,
            device,
            parent,
        )


class _Prices(NamedTuple):
    """The problem's numbers the DP reads, by position in the topological order."""

    order: np.ndarray
    work: np.ndarray  # [n + 1, k] prefix sums of finite compute plus what a task charges its own device
    unrunnable: np.ndarray  # [n + 1, k] prefix counts of tasks a device cannot run
    to_driver: np.ndarray  # [n + 1, k] prefix sums of what tasks on each device charge device 0
    memory: np.ndarray  # [n + 1] prefix sums of memory
    taking_part: np.ndarray  # [k]
    driver_taking_part: np.ndarray  # [k] what a device taking part charges device 0
    made_at: np.ndarray  # [tensors] position of each tensor's producer
    read_at: list[list[int]]  # per tensor, its consumers' positions, sorted
    crossing: list[list[int]]  # per cut position, tensors made before it and read at or after it
    transfer: np.ndarray  # [tensors, k, k]
    send: np.ndarray
    recv: np.ndarray
    cut: np.ndarray  # [n + 2, k, k] PipeEdge's transfer price of each cut
    input_read_at: list[list[int]]  # per model input, its readers' positions, sorted
    input_own: np.ndarray  # [inputs, k] what receiving each model input charges its device
    input_driver: np.ndarray  # [inputs, k] what sending it there charges device 0
    input_link: np.ndarray  # [inputs, k] its time on the link from device 0
    output_link: np.ndarray  # [n + 1, k] prefix sums of the outputs' time on the link to device 0


def _prices(problem: Problem) -> _Prices:
    n, k = problem.num_tasks, problem.num_devices
    order = np.array(problem.topological_order, int)
    charges = problem.costs.charges
    runs = np.isfinite(problem.compute_s)
    work = np.where(runs, problem.compute_s, 0.0) + charges.own_s
    position = np.empty(n, int)
    position[order] = np.arange(n)
    made_at = position[problem.tensor_producer] if problem.num_tensors else np.zeros(0, int)
    read_at = [sorted(int(position[c]) for c in consumers) for consumers in problem.tensor_consumers]
    crossing: list[list[int]] = [[] for _ in range(n + 2)]
    for t, positions in enumerate(read_at):
        for cut in range(int(made_at[t]) + 1, positions[-1] + 1):
            crossing[cut].append(t)
    tensors, devices = np.arange(problem.num_tensors)[:, None, None], np.arange(k)
    src, dst = devices[None, :, None], devices[None, None, :]

    def prefix(values: np.ndarray) -> np.ndarray:
        return np.vstack([np.zeros((1,) + values.shape[1:]), np.cumsum(values[order], axis=0)])

    return _Prices(
        order,
        prefix(work),
        prefix((~runs).astype(float)),
        prefix(charges.driver_s),
        np.r_[0.0, np.cumsum(problem.memory_bytes[order])],
        charges.taking_part_s,
        charges.driver_taking_part_s,
        made_at,
        read_at,
        crossing,
        transfer_duration_s(problem, tensors, src, dst),
        send_cpu_s(problem, tensors, src, dst),
        recv_cpu_s(problem, tensors, src, dst),
        _cut_transfer_s(problem, order, made_at, read_at),
        [sorted(int(position[i]) for i in readers) for readers in problem.costs.input_readers],
        charges.input_own_s,
        charges.input_driver_s,
        problem.costs.input_link_s,
        prefix(problem.costs.output_link_s),
    )


@register("pipeline", minimises=True, respects_memory=True, objectives=("throughput",), start_plan=10)
def place_pipeline(problem: Problem) -> Plan:
    n, k = problem.num_tasks, problem.num_devices
    if n == 0:
        return Plan(np.zeros(0, int), problem.device_names)  # no stage to cut, as every placer places no task
    p = _prices(problem)
    always = problem.costs.charges.always_s
    subsets = k <= SUBSET_DP_MAX_DEVICES
    devices = list(range(k)) if subsets else [int(d) for d in np.argsort(-problem.device_speed, kind="stable")]
    start = _Label(float(always.max(initial=0.0)), 0.0, always.astype(float), 0.0, {}, 0, -1, None)
    start = start._replace(cut_priced_s=start.value_s)
    # Per (devices used, last device): the best splits by value and by PipeEdge's price, for every end.
    tables: dict[tuple[int, int], tuple[_Best, _Best]] = {}
    made: list[_Label] = []
    for s in range(n):
        for used, last in [(0, -1)] if s == 0 else sorted(tables):
            if s == 0:
                labels = [start]
            else:
                by_value, by_price = tables[used, last]
                if by_price.parent[s] < 0:
                    continue
                # PipeEdge's label first, so that on ties its own choices stay as they were.
                labels = [by_price.label(p, s, last)]
                if by_value.parent[s] != by_price.parent[s]:
                    labels.append(by_value.label(p, s, last))
            position = devices.index(last) if last >= 0 else -1
            candidates = devices if subsets else devices[position + 1 :]
            for label in labels:
                made.append(label)
                for d in candidates:
                    if subsets and used >> d & 1:
                        continue
                    key = (used | 1 << d if subsets else 0, d)  # a fixed order needs no used set
                    if key not in tables:
                        tables[key] = (_Best(n, k, False, made), _Best(n, k, True, made))
                    _extend(problem, p, label, len(made) - 1, last, d, tables[key])
    finals = [
        table.label(p, n, last)
        for (_, last), tables_ in sorted(tables.items())
        for table in tables_[::-1]
        if table.parent[n] >= 0
    ]
    if not finals:
        raise InfeasibleError(
            "pipeline finds no split of the topological order into stages that fit the devices' memory and run "
            "every task where it can run; try 'heft' or 'milp'"
        )
    best = min(finals, key=lambda label: label.value_s)
    by_price = min(finals, key=lambda label: label.cut_priced_s)
    placement = np.empty(n, int)
    label: _Label | None = best
    while label is not None and label.parent is not None:
        placement[p.order[label.parent.end : label.end]] = label.device
        label = label.parent
    per_device = tuple(tuple(int(i) for i in p.order if placement[i] == d) for d in range(k))
    notes = {"dp_period_s": best.value_s, "cut_priced_period_s": by_price.value_s}
    return Plan(placement, problem.device_names, order=per_device, placer="pipeline", report=PlacerReport(notes=notes))


def _extend(
    problem: Problem, p: _Prices, label: _Label, index: int, last: int, d: int, tables: tuple[_Best, _Best]
) -> None:
    """Every stage on ``d`` after ``label`` (number ``index`` of those made), priced and kept where it improves a
    table."""
    n, k, s = problem.num_tasks, problem.num_devices, label.end
    ends = np.arange(s + 1, n + 1)
    m = len(ends)
    ok = (p.unrunnable[ends, d] == p.unrunnable[s, d]) & (
        p.memory[ends] - p.memory[s] <= problem.memory_capacity_bytes[d]
    )
    if not ok[0]:
        return
    # Tensors held elsewhere that the stage reads: received once, at its first reader in the stage.
    sends, links, received = np.zeros((k, m)), np.zeros((k, m)), np.zeros(m)
    for t, a in label.holding.items():
        first = p.read_at[t][bisect.bisect_left(p.read_at[t], s)] - s
        if first < m:
            sends[a, first] += p.send[t, a, d]
            links[a, first] += p.transfer[t, a, d]
            received[first] += p.recv[t, a, d]
    # Model inputs the stage reads: the driver sends each once, by its first reader in the stage.
    for j, positions in enumerate(p.input_read_at):
        at = bisect.bisect_left(positions, s)
        first = positions[at] - s if at < len(positions) else m
        if first < m:
            sends[0, first] += p.input_driver[j, d]
            links[0, first] += p.input_link[j, d]
            received[first] += p.input_own[j, d]
    np.cumsum(sends, axis=1, out=sends)
    np.cumsum(links, axis=1, out=links)
    loads = label.loads_s[:, None] + sends
    loads[d] += p.taking_part[d] + p.work[ends, d] - p.work[s, d] + np.cumsum(received)
    loads[0] += p.to_driver[ends, d] - p.to_driver[s, d] + p.driver_taking_part[d]
    # The outputs' link to device 0 is taken apart from the tensors a later stage there receives on it.
    outputs_link = p.output_link[ends, d] - p.output_link[s, d]
    link_s = np.maximum(np.maximum(links.max(axis=0), outputs_link), label.links_s)
    value = np.maximum(loads.max(axis=0), link_s)
    incoming = p.cut[s, last, d] if last >= 0 else 0.0
    price = np.maximum(np.maximum(np.maximum(loads[d], loads[0]), incoming), label.cut_priced_s)
    ok &= np.isfinite(value)
    for table, measure in zip(tables, (value, price), strict=True):
        better = ok & (measure < table.measure()[ends])
        if better.any():
            table.update(ends, better, value, price, loads, link_s, index)


def _cut_transfer_s(problem: Problem, order: np.ndarray, made_at: np.ndarray, read_at: list[list[int]]) -> np.ndarray:
    """``cut[b, a, d]``: PipeEdge's price of cut ``b``, the time to send from device ``a`` to ``d`` every tensor made
    before position ``b`` of ``order`` and read at or after it: Infinity where one of them has no link from ``a`` to
    ``d``. Infinite times are counted apart, as a running sum of them would subtract Infinity from Infinity (NaN)."""
    n, k = problem.num_tasks, problem.num_devices
    change, unlinked = np.zeros((n + 2, k, k)), np.zeros((n + 2, k, k))
    devices = np.arange(k)
    for t, positions in enumerate(read_at):
        made, last_read = int(made_at[t]) + 1, positions[-1]
        if last_read >= made:
            seconds = transfer_duration_s(problem, t, devices[:, None], devices[None, :])
            missing = np.isinf(seconds)
            seconds = np.where(missing, 0.0, seconds)
            change[made] += seconds
            change[last_read + 1] -= seconds
            unlinked[made] += missing
            unlinked[last_read + 1] -= missing
    return np.where(np.cumsum(unlinked, axis=0) > 0, np.inf, np.cumsum(change, axis=0))
