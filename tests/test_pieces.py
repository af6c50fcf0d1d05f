"""The ``pieces`` placer (moirai.planning.placers.pieces): exact within its patterns, and better than HEFT where
memory binds a stack of blocks."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from moirai.planning.placers import place
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate

SPEEDS = np.array([1.0, 1.6, 2.5])  # device d runs a task SPEEDS[d] times slower than device 0


def block_stack(
    blocks: int, rng: np.random.Generator, weight_bytes: float = 0.0, capacity_bytes: list[float] | None = None
) -> Problem:
    """A decoder-like stack: ``in`` and a rotary ``table`` (read by every block, follows nothing); each block
    ``b`` splits the stream into two projections ``b.a`` (reads the table too) and ``b.b``, each holding
    ``weight_bytes``, that ``b.add`` joins: the adds are the cut tasks."""
    names = ["in", "table"]
    tensors: list[tuple[int, tuple[int, ...]]] = []
    stream, table_readers = 0, []
    for b in range(blocks):
        a, p, add = len(names), len(names) + 1, len(names) + 2
        names += [f"{b}.a", f"{b}.b", f"{b}.add"]
        tensors += [(stream, (a, p)), (a, (add,)), (p, (add,))]
        table_readers.append(a)
        stream = add
    tensors.append((1, tuple(table_readers)))
    n, k = len(names), len(SPEEDS)
    work = rng.uniform(0.5, 2.0, n)
    work[:2] = 0.05
    work[[i for i, name in enumerate(names) if name.endswith(".add")]] = 0.1
    memory = np.array([weight_bytes if name.endswith((".a", ".b")) else 0.0 for name in names])
    transfer = rng.uniform(0.1, 0.6, len(tensors))[:, None, None] * (1 - np.eye(k))
    return Problem(
        device_names=("fast", "mid", "slow"),
        memory_capacity_bytes=np.full(k, np.inf) if capacity_bytes is None else np.array(capacity_bytes),
        task_names=tuple(names),
        compute_s=work[:, None] * SPEEDS,
        memory_bytes=memory,
        tensor_names=tuple(f"t{t}" for t in range(len(tensors))),
        tensor_producer=np.array([u for u, _ in tensors]),
        tensor_consumers=tuple(c for _, c in tensors),
        transfer_s=transfer,
    )


def best_list_scheduled_s(problem: Problem) -> float:
    """The best simulated makespan over every placement, each list-scheduled: the space ``pieces`` searches when
    every task of a piece is in its patterns."""
    k = problem.num_devices
    return min(
        simulate(problem, Plan(np.array(placement), problem.device_names)).makespan_s
        for placement in itertools.product(range(k), repeat=problem.num_tasks)
    )


@pytest.mark.parametrize("seed", range(3))
def test_where_patterns_cover_every_task_it_is_the_best_placement(seed):
    # Two blocks, seven tasks, three devices: every piece's inner tasks are in its patterns, no memory binds, and the
    # pieces run one after another, so the DP over them is exact.
    problem = block_stack(2, np.random.default_rng(seed))
    plan = place(problem, "pieces")
    assert "fallback" not in plan.report.notes
    assert plan.objective_s == pytest.approx(best_list_scheduled_s(problem), rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_where_memory_binds_a_stack_it_fits_and_beats_heft(seed):
    # Twelve blocks whose weights fill the fast device three times over: which blocks get the fast device, and which
    # split their two projections, is a choice over the whole stack that HEFT, finishing each task earliest, does not
    # make; the memory prices do.
    weight = 1.0
    capacity = [8.0 * weight, 10.0 * weight, 24.0 * weight]  # 24 projections in all
    problem = block_stack(12, np.random.default_rng(100 + seed), weight_bytes=weight, capacity_bytes=capacity)
    pieces = place(problem, "pieces")
    heft = place(problem, "heft")
    used = np.bincount(pieces.placement, weights=problem.memory_bytes, minlength=problem.num_devices)
    assert (used <= problem.memory_capacity_bytes).all()
    assert "fallback" not in pieces.report.notes
    assert pieces.objective_s < 0.97 * heft.objective_s, (pieces.objective_s, heft.objective_s)


def test_a_graph_without_cut_tasks_gets_heft_and_says_so():
    # Two independent chains: no task is related to every other.
    k = 2
    problem = Problem(
        device_names=("a", "b"),
        memory_capacity_bytes=np.full(k, np.inf),
        task_names=("x1", "x2", "y1", "y2"),
        compute_s=np.ones((4, k)),
        memory_bytes=np.zeros(4),
        tensor_names=("tx", "ty"),
        tensor_producer=np.array([0, 2]),
        tensor_consumers=((1,), (3,)),
        transfer_s=np.ones((2, k, k)) * (1 - np.eye(k)),
    )
    plan = place(problem, "pieces")
    assert plan.report.notes["fallback"].startswith("heft")
    assert plan.objective_s == pytest.approx(place(problem, "heft").objective_s)


def test_a_pattern_over_a_missing_link_is_priced_out_not_raised():
    # A chain whose tensors cross no link: a pattern splitting it cannot run, so it must be priced as never chosen
    # (the simulator refused it, and pieces passed that on though every task on d0 is a plan).
    k = 2
    problem = Problem(
        device_names=("d0", "d1"),
        memory_capacity_bytes=np.full(k, np.inf),
        task_names=("t0", "t1", "t2"),
        compute_s=np.tile([1.0, 2.0], (3, 1)),
        memory_bytes=np.zeros(3),
        tensor_names=("a", "b"),
        tensor_producer=np.array([0, 1]),
        tensor_consumers=((1,), (2,)),
        transfer_s=np.where(np.eye(k) > 0, 0.0, np.inf)[None].repeat(2, axis=0),
    )
    plan = place(problem, "pieces")
    assert "fallback" not in plan.report.notes
    assert plan.placement.tolist() == [0, 0, 0]
    assert plan.objective_s == pytest.approx(3.0)


def test_a_tensor_between_pieces_over_a_missing_link_falls_back_to_heft():
    # The rotary table is read by every block but priced only in the first block's piece; where it crosses no link,
    # the pieces' choice can still send it to a later block elsewhere, and HEFT stands in instead of a refusal.
    problem = block_stack(2, np.random.default_rng(4), weight_bytes=1.0, capacity_bytes=[3.0, 4.0, 40.0])
    transfer = problem.transfer_s.copy()
    transfer[-1] = np.where(np.eye(problem.num_devices) > 0, 0.0, np.inf)  # the table's tensor
    problem = dataclasses.replace(problem, transfer_s=transfer)
    plan = place(problem, "pieces")
    assert plan.report.notes["fallback"] == "heft: the pieces' patterns send a tensor over a missing link"
    assert np.isfinite(simulate(problem, plan).makespan_s)
