"""Colocation: sets of tasks that must share one device, and the contraction that makes every placer keep them.

Generation adds mutable buffers (a layer's KV cache) that live on one device together with every op group that reads
or writes them; :attr:`moirai.planning.problem.Problem.colocated` lists such sets of tasks. :func:`contract` merges
each set into one task of a smaller problem, together with

* every task on a path between two of its members (its convex hull): merged alone, the set would both feed those
  tasks and wait for them, a cycle;
* every other set it would wait for both ways (one feeds the other by one path and is fed by it by another), for
  the same reason;

repeated until nothing changes, so the contracted problem is a DAG. A group's compute and memory are its members'
sums, the tensors between groups keep their own transfer times, those inside a group vanish, and its per-request
costs are merged (:meth:`moirai.planning.costs.RequestCosts.merge`). The placer registry
(:attr:`moirai.planning.placers.PlacerSpec.checked`) places the contracted problem with whichever placer was asked and
maps the plan back with :meth:`Contraction.expand`, so every placer, the MILP included, keeps every set on one device.
The simulator refuses a plan that separates a set (:func:`check_colocated`).

The price: the placer sees a group as one task that starts once all of its inputs are there and sends its outputs
once it has finished. The expanded plan runs each member as soon as its own inputs are there, so it simulates no
slower than the placer predicted with the orders it gave, and :func:`moirai.place` also tries the placement
list-scheduled (:func:`moirai.planning.placers.unbundled_if_better`, as the milp placer does with its start
plans); but placements are judged by the contracted problem, which misses what interleaving a group's members with
other tasks would gain.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable

import networkx as nx
import numpy as np
from networkx.utils import UnionFind

from moirai.errors import InfeasibleError, PlanError, ProblemError
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import BoundSource, StopReason

_SHOWN_NAMES = 6  # names listed in a message before "and N more"


@dataclasses.dataclass(frozen=True, eq=False)
class Contraction:
    """``problem``, ``original`` with every colocation group merged into one task, and the maps between them.

    ``members[c]``: the original tasks of contracted task ``c``, in the original topological order.
    ``task_of[i]``: the contracted task of original task ``i``. ``tensor_of[t]``: the original tensor behind
    contracted tensor ``t`` (tensors that stay inside a group are not in ``problem``).
    """

    original: Problem
    problem: Problem
    members: tuple[tuple[int, ...], ...]
    task_of: np.ndarray
    tensor_of: np.ndarray

    @property
    def groups(self) -> tuple[int, ...]:
        """The contracted tasks that stand for more than one original task."""
        return tuple(c for c, tasks in enumerate(self.members) if len(tasks) > 1)

    def of(self, other: Problem) -> Problem:
        """``other``, a problem of the same tasks (the same graph priced otherwise: a generation step's prefill),
        contracted into the same groups."""
        if other.num_tasks != self.original.num_tasks:
            raise ProblemError(
                f"cannot contract a problem of {other.num_tasks} tasks like one of {self.original.num_tasks}"
            )
        return _contract(other, tuple(group for group in self.members if len(group) > 1)).problem

    def describe(self, task: int) -> str:
        """The original tasks of contracted ``task``, by name, for messages: those the problem colocates, and apart
        those only grouped with them (:func:`group_words`)."""
        return group_words(self.original, self.members[task])

    def expand(self, plan: Plan) -> Plan:
        """``plan`` (of :attr:`problem`) for :attr:`original`: members run on their group's device, in topological
        order at the group's place in its device's order; links send the same tensors in the same order.

        The plan's lower bound and predicted makespan are the contracted problem's, which the original, where
        members need not wait for each other's inputs, can beat: they move to ``report.notes["colocation"]``, and a
        gap closed is one of the contracted problem (:attr:`StopReason.GAP_CLOSED_GROUPED`).
        """
        plan.check(self.problem)
        order = None
        if plan.order is not None:
            order = tuple(tuple(i for task in sequence for i in self.members[task]) for sequence in plan.order)
        transfer_order = None
        if plan.transfer_order is not None:
            transfer_order = {
                link: tuple(int(self.tensor_of[t]) for t in tensors) for link, tensors in plan.transfer_order.items()
            }
        report = plan.report
        report.notes["colocation"] = {
            "groups": len(self.groups),
            "contracted_tasks": self.problem.num_tasks,
            "contracted_lower_bound_s": plan.lower_bound_s,
            "contracted_predicted_makespan_s": report.predicted_makespan_s,
        }
        report.predicted_makespan_s = None
        if getattr(report, "bound_source", None) is BoundSource.SOLVER:
            report.bound_source = BoundSource.BOUNDS  # type: ignore[attr-defined]
        if getattr(report, "stop_reason", None) is StopReason.GAP_CLOSED:
            report.stop_reason = StopReason.GAP_CLOSED_GROUPED  # type: ignore[attr-defined]
        return dataclasses.replace(
            plan,
            placement=plan.placement[self.task_of],
            order=order,
            transfer_order=transfer_order,
            makespan_s=None,
            objective_s=None,
            lower_bound_s=None,
            report=report,
        )


def no_common_device(described: str) -> InfeasibleError:
    """The refusal of colocated tasks (``described``) that no one device can run."""
    return InfeasibleError(
        f"colocated tasks {described} have no device that can run them all (each has an infinite compute time on "
        "some device); allow them a common device or drop the set"
    )


_CACHE: weakref.WeakKeyDictionary[Problem, Contraction] = weakref.WeakKeyDictionary()


def contract(problem: Problem) -> Contraction:
    """``problem`` with every colocation group (:func:`colocation_groups`) merged into one task; computed once per
    problem. Raises :class:`InfeasibleError` when a group's tasks have no device that can run them all."""
    if problem not in _CACHE:
        _CACHE[problem] = _contract(problem, colocation_groups(problem))
    return _CACHE[problem]


def colocated_sets(problem: Problem) -> tuple[tuple[int, ...], ...]:
    """The colocated sets, those that overlap merged, each sorted: the tasks that must share one device, and no
    more (:func:`colocation_groups` adds the tasks between members)."""
    merged = UnionFind(range(problem.num_tasks))
    for members in problem.colocated:
        merged.union(*members)
    return tuple(sorted(tuple(sorted(g)) for g in merged.to_sets() if len(g) > 1))


def colocation_groups(problem: Problem) -> tuple[tuple[int, ...], ...]:
    """The sets of tasks :func:`contract` merges: the colocated sets, each with the tasks on paths between its
    members, and sets that would wait for each other both ways merged, until the merged graph is a DAG. Each is
    sorted; every colocated set lies in one of them."""
    if not problem.colocated:
        return ()
    merged = UnionFind(range(problem.num_tasks))
    for members in colocated_sets(problem):
        merged.union(*members)
    while True:
        groups = sorted(tuple(sorted(g)) for g in merged.to_sets() if len(g) > 1)
        outside = [(members[0], _between(problem, members) - set(members)) for members in groups]
        if any(between for _, between in outside):
            for first, between in outside:
                merged.union(first, *between)
            continue
        quotient = nx.DiGraph()
        quotient.add_edges_from((merged[u], merged[v]) for u, v in problem.graph.edges if merged[u] != merged[v])
        tangled = [c for c in nx.strongly_connected_components(quotient) if len(c) > 1]
        if not tangled:
            return tuple(groups)
        for component in tangled:
            merged.union(*component)


def _between(problem: Problem, members: tuple[int, ...]) -> set[int]:
    """The tasks on a path from one of ``members`` to another, ends included: reached from them and reaching them."""
    return _reach(problem.successors, members) & _reach(problem.predecessors, members)


def _reach(neighbours: tuple[tuple[int, ...], ...], start: Iterable[int]) -> set[int]:
    """Tasks reached from ``start`` by one step or more along ``neighbours``."""
    seen: set[int] = set()
    stack = [j for i in start for j in neighbours[i]]
    while stack:
        i = stack.pop()
        if i not in seen:
            seen.add(i)
            stack.extend(neighbours[i])
    return seen


def _contract(problem: Problem, groups: tuple[tuple[int, ...], ...]) -> Contraction:
    n = problem.num_tasks
    leader = np.arange(n)  # every task's group, named by its lowest member
    for group in groups:
        leader[list(group)] = group[0]
    position = problem.topological_position
    members_of: dict[int, list[int]] = {}
    for i in range(n):
        members_of.setdefault(int(leader[i]), []).append(i)
    members = tuple(tuple(sorted(tasks, key=position.__getitem__)) for _, tasks in sorted(members_of.items()))
    task_of = np.empty(n, int)
    for c, tasks in enumerate(members):
        task_of[list(tasks)] = c
    k = problem.num_devices
    compute = np.array([problem.compute_s[list(tasks)].sum(axis=0) for tasks in members]).reshape(-1, k)
    for c, tasks in enumerate(members):
        if len(tasks) > 1 and not np.isfinite(compute[c]).any():
            raise no_common_device(group_words(problem, tasks))
    kept, producers, consumers = [], [], []
    for t, tensor_consumers in enumerate(problem.tensor_consumers):
        source = int(task_of[problem.tensor_producer[t]])
        targets = sorted({int(task_of[c]) for c in tensor_consumers} - {source})
        if targets:
            kept.append(t)
            producers.append(source)
            consumers.append(tuple(targets))
    tensor_of = np.array(kept, int)
    contracted = Problem(
        device_names=problem.device_names,
        memory_capacity_bytes=problem.memory_capacity_bytes,
        memory_reserve_bytes=problem.memory_reserve_bytes,
        task_names=_unique_names(problem, members),
        compute_s=compute,
        memory_bytes=np.array([problem.memory_bytes[list(tasks)].sum() for tasks in members]),
        tensor_names=tuple(problem.tensor_names[t] for t in kept),
        tensor_producer=np.array(producers, int),
        tensor_consumers=tuple(consumers),
        transfer_s=problem.transfer_s[tensor_of].reshape(-1, k, k),
        tensor_bytes=problem.tensor_bytes[tensor_of],
        send_cpu_s=problem.send_cpu_s[tensor_of].reshape(-1, k, k),
        recv_cpu_s=problem.recv_cpu_s[tensor_of].reshape(-1, k, k),
        costs=problem.costs.merge(members),
    )
    return Contraction(problem, contracted, members, task_of, tensor_of)


def _unique_names(problem: Problem, members: tuple[tuple[int, ...], ...]) -> tuple[str, ...]:
    """A task's own name, or its members' joined by ``+`` (with ``#2``... should that name be taken)."""
    names = ["+".join(problem.task_names[i] for i in tasks) for tasks in members]
    taken = set(problem.task_names)
    for c, tasks in enumerate(members):
        if len(tasks) > 1 and names[c] in taken:
            suffix = 2
            while f"{names[c]}#{suffix}" in taken:
                suffix += 1
            names[c] = f"{names[c]}#{suffix}"
        taken.add(names[c])
    return tuple(names)


def group_words(problem: Problem, tasks: Iterable[int]) -> str:
    """``'a', 'b' (grouped with 'm', ...)``: a group's tasks for messages, the ones the problem colocates first, then
    those :func:`colocation_groups` only added because they lie on a path between members (or join sets that would
    wait for each other), which the user never asked to share a device."""
    tasks = list(tasks)
    asked = {i for members in problem.colocated for i in members}
    colocated = [i for i in tasks if i in asked]
    added = [i for i in tasks if i not in asked]
    if not added:
        return names_of(problem, colocated)
    return (
        f"{names_of(problem, colocated)} (grouped with {names_of(problem, added)}, on a path between members: "
        "moirai's placers place a colocated set and the tasks between its members as one task)"
    )


def names_of(problem: Problem, tasks: Iterable[int]) -> str:
    """``'a', 'b', 'c'`` (and ``and 4 more``): task names for messages."""
    tasks = list(tasks)
    shown = ", ".join(repr(problem.task_names[i]) for i in tasks[:_SHOWN_NAMES])
    return shown + (f" and {len(tasks) - _SHOWN_NAMES} more" if len(tasks) > _SHOWN_NAMES else "")


def check_colocated(problem: Problem, placement: np.ndarray) -> None:
    """Raise :class:`PlanError` when ``placement`` puts the tasks of a colocated set on more than one device."""
    for members in problem.colocated:
        devices = np.unique(placement[list(members)])
        if devices.size > 1:
            raise PlanError(
                f"colocated tasks {names_of(problem, members)} are placed on devices "
                f"{[problem.device_names[d] for d in devices]}; a colocated set (a mutable buffer and the tasks that "
                "use it) must run on one device: place the problem with moirai.place, which keeps every set together"
            )
