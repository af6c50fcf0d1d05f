"""The cut-task latency bound (moirai.planning.solve.segment_bound) against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from moirai.planning.bounds import lower_bound
from moirai.planning.problem import Problem
from moirai.planning.solve.segment_bound import cut_tasks, segment_lower_bound
from moirai.testing import brute_force_optimum, random_problem


def graph_problem(
    names: tuple[str, ...], tensors: list[tuple[int, tuple[int, ...]]], compute_s: np.ndarray, transfer_s: np.ndarray
) -> Problem:
    """Tasks ``names`` with ``compute_s`` (a row per task, a column per device), ``tensors`` as (producer, consumers)
    with ``transfer_s`` (one per tensor, each k x k), no memory."""
    k = compute_s.shape[1]
    return Problem(
        device_names=tuple(f"dev{d}" for d in range(k)),
        memory_capacity_bytes=np.full(k, np.inf),
        task_names=names,
        compute_s=compute_s,
        memory_bytes=np.zeros(len(names)),
        tensor_names=tuple(f"t{t}" for t in range(len(tensors))),
        tensor_producer=np.array([u for u, _ in tensors]),
        tensor_consumers=tuple(c for _, c in tensors),
        transfer_s=transfer_s,
    )


def fork_join(branches: int, compute_s: np.ndarray, transfer_s: float) -> Problem:
    """``s`` -> ``branches`` tasks -> ``j`` on ``compute_s.shape[1]`` devices; every tensor takes ``transfer_s``."""
    n, k = branches + 2, compute_s.shape[1]
    tensors = [(0, tuple(range(1, branches + 1)))] + [(b, (n - 1,)) for b in range(1, branches + 1)]
    transfer = np.full((len(tensors), k, k), transfer_s)
    transfer[:, np.arange(k), np.arange(k)] = 0.0
    return graph_problem(("s", *(f"b{i}" for i in range(branches)), "j"), tensors, compute_s, transfer)


def test_on_a_fork_join_the_cut_bound_is_the_optimum_where_the_critical_path_is_not():
    # Four 2 s branches, 1 s transfers, two devices: sending two branches away shares one link and one device, which
    # the per-task bound cannot see (it lets every branch start at 1 s elsewhere).
    compute = np.array([[1.0, 1.0]] + [[2.0, 2.0]] * 4 + [[1.0, 1.0]])
    problem = fork_join(4, compute, transfer_s=1.0)
    optimum = brute_force_optimum(problem)
    bound = segment_lower_bound(problem)
    assert bound.cuts == 2 and bound.pieces_optimal == bound.pieces_solved > 0
    assert bound.bound_s == pytest.approx(optimum, abs=1e-6)
    assert lower_bound(problem) < optimum - 0.5


@pytest.mark.parametrize("seed", range(20))
def test_the_cut_bound_never_exceeds_the_brute_force_optimum(seed):
    """Random DAGs (most have cut tasks) with every per-request cost and device-side communication."""
    rng = np.random.default_rng(3000 + seed)
    problem = random_problem(
        rng,
        int(rng.integers(4, 7)),
        2 if seed % 4 else 3,
        slowdown=1.5,
        send_cpu_s=0.3 if seed % 2 else 0.0,
        recv_cpu_s=0.3 if seed % 2 else 0.0,
        header_s=0.3,
        output_s=0.4,
    )
    bound = segment_lower_bound(problem)
    assert lower_bound(problem) <= bound.bound_s <= brute_force_optimum(problem) + 1e-6


def test_a_cut_task_may_leave_out_a_dead_end_beside_it():
    # s -> a, b; a -> c -> j; b (a dead end) reads s: c is a cut task though b neither leads to it nor follows it.
    compute = np.array([[1.0, 1.0], [2.0, 2.0], [0.5, 0.5], [2.0, 2.0], [1.0, 1.0]])
    tensors = [(0, (1, 2)), (1, (3,)), (3, (4,))]
    transfer = np.full((3, 2, 2), 1.5)
    transfer[:, [0, 1], [0, 1]] = 0.0
    problem = graph_problem(("s", "a", "b", "c", "j"), tensors, compute, transfer)
    assert cut_tasks(problem, problem.reachable()) == [0, 1, 3, 4]
    assert segment_lower_bound(problem).bound_s <= brute_force_optimum(problem) + 1e-9


def test_without_cut_tasks_it_is_the_critical_path_bound():
    # Two independent tasks: neither leads to the other.
    problem = fork_join(2, np.ones((4, 2)), transfer_s=1.0)
    independent = Problem(
        device_names=problem.device_names,
        memory_capacity_bytes=problem.memory_capacity_bytes,
        task_names=("a", "b"),
        compute_s=np.ones((2, 2)),
        memory_bytes=np.zeros(2),
        tensor_names=(),
        tensor_producer=np.zeros(0, int),
        tensor_consumers=(),
        transfer_s=np.zeros((0, 2, 2)),
    )
    bound = segment_lower_bound(independent)
    assert bound.cuts == 0 and bound.bound_s == lower_bound(independent)


def decoder_block(rng: np.random.Generator) -> Problem:
    """A decoder layer's shape on two devices of different speeds: ``s`` (the residual stream) -> ``norm`` -> ``q``,
    ``k``; a rotary table ``rot`` computed from nothing but the model's input feeds both ``rope`` tasks; ``q``,
    ``k`` -> ``att`` -> ``out`` (the residual add, reading ``s`` too)."""
    names = ("s", "rot", "norm", "q", "k", "rope_q", "rope_k", "att", "out")
    tensors = [(0, (2, 8)), (1, (5, 6)), (2, (3, 4)), (3, (5,)), (4, (6,)), (5, (7,)), (6, (7,)), (7, (8,))]
    n, k = len(names), 2
    compute = rng.uniform(0.5, 2.0, n)[:, None] * np.array([1.0, 1.5])
    compute[1] = 0.1  # the table is cheap
    transfer = rng.uniform(0.2, 1.0, len(tensors))[:, None, None] * (1 - np.eye(k))
    return graph_problem(names, tensors, compute, transfer)


@pytest.mark.parametrize("seed", range(4))
def test_a_side_input_does_not_stop_a_cut_and_the_bound_holds(seed):
    # ``norm`` is a cut though ``rot`` is beside it and feeds its descendants (``rot`` follows no cut task), and so
    # is ``att``; ``q`` is not: ``k`` beside it follows the cut before (``norm``), and would be left out of every piece.
    problem = decoder_block(np.random.default_rng(seed))
    names = [problem.task_names[c] for c in cut_tasks(problem, problem.reachable())]
    assert names == ["s", "norm", "att", "out"]
    bound = segment_lower_bound(problem)
    assert bound.pieces_optimal == bound.pieces_solved > 0
    assert lower_bound(problem) <= bound.bound_s <= brute_force_optimum(problem) + 1e-6
