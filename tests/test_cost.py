"""Cost model: analytic roofline, measured profiles and their cache (moirai/cluster/cost.py)."""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import moirai.cluster.cost as cost
from moirai.cluster.cost import (
    activation_peak_bytes,
    analytic_compute_s,
    build_problem,
    node_dtypes,
    profile_nodes,
    unfused_problem,
)
from moirai.cluster.devices import Cluster, Device, Link
from moirai.cluster.kinds import CPU, HostSpans
from moirai.errors import ClusterError
from moirai.frontend.graph import OpEdge, OpGraph, OpNode, build_op_graph
from moirai.frontend.trace import trace
from moirai.planning.bounds import lower_bounds
from moirai.runtime.resources import rank_resources
from moirai.runtime.split import split_module


def device(name: str, **overrides: float) -> Device:
    numbers = dict(memory_bytes=1e9, peak_flops=1e11, memory_bandwidth_bytes_per_s=1e10, launch_overhead_s=5e-6)
    return Device(name, "cpu", **{**numbers, **overrides}, peak_flops_bf16=4e11, efficiency=0.5)


def hand_graph() -> OpGraph:
    compute_bound = OpNode("mm", ("aten.mm",), ("mm",), 1e9, 1e6, 4e5, frozenset({"w"}), 2e5)
    memory_bound = OpNode("add_relu", ("aten.add", "aten.relu"), ("add", "relu"), 0.0, 1e8, 3e5, frozenset(), 0.0)
    return OpGraph((compute_bound, memory_bound), (OpEdge(0, 1, "mm", 4e5),), {"w": 2e5})


def two_device_cluster() -> Cluster:
    devices = [device("fast"), device("slow", peak_flops=1e10, memory_bandwidth_bytes_per_s=1e9)]
    return Cluster.from_links(devices, [Link("fast", "slow", 1e8, 1e-5), Link("slow", "fast", 5e7, 2e-5)])


def test_analytic_roofline_by_hand() -> None:
    compute = analytic_compute_s(hand_graph(), two_device_cluster())
    # mm: compute bound, max(1e9 / 1e11, 1e6 / 1e10) / 0.5 + 1 launch; on slow: 1e9 / 1e10.
    assert compute[0, 0] == pytest.approx(1e-2 / 0.5 + 5e-6)
    assert compute[0, 1] == pytest.approx(1e-1 / 0.5 + 5e-6)
    # add+relu: bytes bound, 1e8 / 1e10 (fast) and 1e8 / 1e9 (slow), two launches.
    assert compute[1, 0] == pytest.approx(1e-2 / 0.5 + 2 * 5e-6)
    assert compute[1, 1] == pytest.approx(1e-1 / 0.5 + 2 * 5e-6)


def test_analytic_uses_the_dtype_peak() -> None:
    compute = analytic_compute_s(hand_graph(), two_device_cluster(), ["bfloat16", "bfloat16"])
    assert compute[0, 0] == pytest.approx(1e9 / 4e11 / 0.5 + 5e-6)
    assert compute[0, 1] == pytest.approx(1e9 / 4e11 / 0.5 + 5e-6)  # bf16 peak set on both devices
    assert compute[1, 0] == pytest.approx(1e-2 / 0.5 + 2 * 5e-6)  # memory bound: dtype does not matter


def test_a_scalar_of_the_input_shapes_launches_nothing_and_costs_nothing() -> None:
    """Priced at a launch each, shape scalars (nodes without out-edges) were moved to an idle device to "save" their
    launches, and the server started a process for them (a Cohere2 step planned by milp)."""

    class Flatten(nn.Module):
        def forward(self, x):
            return torch.relu(x.reshape(x.shape[0], -1))

    batch = torch.export.Dim("batch", min=2, max=8)
    graph = build_op_graph(trace(Flatten(), (torch.randn(3, 4, 5),), dynamic_shapes=({0: batch},)))
    shape_nodes = [i for i, node in enumerate(graph.nodes) if node.shape_ops]
    assert shape_nodes and all(graph.nodes[i].targets == ("aten.sym_size.int",) for i in shape_nodes)
    compute = analytic_compute_s(graph, two_device_cluster())
    assert (compute[shape_nodes] == 0).all()
    assert (np.delete(compute, shape_nodes, axis=0) > 0).all()
    merged = graph.merge([list(range(len(graph.nodes)))])  # a group keeps its count of them
    assert merged.nodes[0].shape_ops == len(shape_nodes)
    assert analytic_compute_s(merged, two_device_cluster())[0] == pytest.approx(compute.sum(axis=0))


def test_problem_transfers_and_memory() -> None:
    problem = build_problem(hand_graph(), two_device_cluster())
    assert problem.tensor_names == ("mm",)
    assert problem.transfer_s[0, 0, 1] == pytest.approx(1e-5 + 4e5 / 1e8)
    assert problem.transfer_s[0, 1, 0] == pytest.approx(2e-5 + 4e5 / 5e7)
    assert problem.transfer_s[0, 0, 0] == 0 and problem.transfer_s[0, 1, 1] == 0
    # Tasks hold their parameters; every device keeps the activation peak free:
    # mm's 4e5 live until add_relu has run, add_relu's 3e5 live to the end (a model output).
    np.testing.assert_allclose(problem.memory_bytes, [2e5, 0])
    np.testing.assert_allclose(problem.memory_capacity_bytes, [1e9 - 7e5, 1e9 - 7e5])


def test_colocated_node_sets_pass_through_to_the_problem() -> None:
    assert build_problem(hand_graph(), two_device_cluster(), colocated=[[1, 0]]).colocated == ((0, 1),)
    assert build_problem(hand_graph(), two_device_cluster()).colocated == ()


def test_activation_peak_frees_tensors_after_their_last_consumer() -> None:
    def node(name: str, output_bytes: float) -> OpNode:
        return OpNode(name, ("aten.relu",), (name,), 0.0, 0.0, output_bytes, frozenset(), 0.0)

    # a -> b -> c -> d with a skip a -> d: a lives to the end, b dies after c, c after d.
    nodes = (node("a", 100), node("b", 10), node("c", 1), node("d", 1000))
    edges = (OpEdge(0, 1, "a", 100), OpEdge(1, 2, "b", 10), OpEdge(2, 3, "c", 1), OpEdge(0, 3, "a", 100))
    assert activation_peak_bytes(OpGraph(nodes, edges)) == 100 + 1 + 1000


def test_views_allocate_no_activation_memory() -> None:
    class Views(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.transpose(0, 1).unsqueeze(0) * 2

    graph = build_op_graph(trace(Views(), (torch.randn(8, 4),)))
    assert [n.output_bytes for n in graph.nodes] == [0, 0, 8 * 4 * 4]


def test_unknown_mode_and_measured_without_trace() -> None:
    with pytest.raises(ClusterError, match="unknown cost mode"):
        build_problem(hand_graph(), two_device_cluster(), mode="guess")  # type: ignore[arg-type]
    with pytest.raises(ClusterError, match="pass traced="):
        build_problem(hand_graph(), two_device_cluster(), mode="measured")


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.second = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


@pytest.fixture(scope="module")
def traced_two_layers():  # noqa: ANN201
    torch.manual_seed(0)
    traced = trace(TwoLayers().eval(), (torch.randn(8, 64),))
    return traced, build_op_graph(traced)


def test_node_dtypes_follow_the_traced_model() -> None:
    model = nn.Linear(256, 256).to(torch.bfloat16)
    traced = trace(model, (torch.randn(256, 256, dtype=torch.bfloat16),))
    graph = build_op_graph(traced)
    assert node_dtypes(graph, traced) == ["bfloat16"] * len(graph.nodes)
    cluster = Cluster.from_links([device("d")], [])
    fp32 = build_problem(graph, cluster).compute_s
    bf16 = build_problem(graph, cluster, traced=traced).compute_s
    assert fp32[0, 0] > 3 * bf16[0, 0]  # compute bound: the bf16 peak is 4x the fp32 one


@pytest.fixture
def profiling_runs(monkeypatch) -> list:  # noqa: ANN001
    """Each profiling run of the whole graph (``cost._in_situ_times_s``), recorded as it runs."""
    runs = []
    real_timer = cost._in_situ_times_s

    def counting_timer(timed, *args):  # noqa: ANN001, ANN002, ANN202
        runs.append(timed)
        return real_timer(timed, *args)

    monkeypatch.setattr(cost, "_in_situ_times_s", counting_timer)
    return runs


def test_measured_profiles_once_then_reads_the_cache(traced_two_layers, tmp_path: Path, profiling_runs) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    cluster = Cluster.from_devices(["cpu", "cpu"])
    first = build_problem(graph, cluster, "measured", traced, cache_dir=tmp_path, repeats=3, progress=False)
    # Both devices are the local CPU: one profile. Linear, relu, Linear: the Linears share a signature.
    assert len(graph.nodes) == 3 and len(profiling_runs) == 1
    assert first.compute_s.shape == (3, 2) and np.all(first.compute_s > 0)
    assert first.compute_s[0, 0] == first.compute_s[2, 0] == first.compute_s[0, 1]
    second = build_problem(graph, cluster, "measured", traced, cache_dir=tmp_path, repeats=3, progress=False)
    assert len(profiling_runs) == 1
    np.testing.assert_array_equal(first.compute_s, second.compute_s)
    assert list((tmp_path / "profiles").glob("*.json"))


def test_measured_cache_dir_from_environment(traced_two_layers, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    monkeypatch.setenv("MOIRAI_CACHE_DIR", str(tmp_path))
    profile_nodes(graph.merge([[0, 1, 2]]), traced, "cpu", repeats=2, progress=False)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1


def test_unfused_problem_shares_out_each_groups_compute_and_memory(traced_two_layers) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    groups = [[0, 1], [2]]  # first linear with its relu, then the second linear
    cluster = two_device_cluster()
    coarse = build_problem(graph.merge(groups), cluster, traced=traced)
    fine = unfused_problem(graph, groups, coarse, cluster, traced)
    assert fine.num_tasks == 3 and fine.tensor_producer.tolist() == [0, 1]
    for g, members in enumerate(groups):
        np.testing.assert_allclose(fine.compute_s[members].sum(axis=0), coarse.compute_s[g])
        assert fine.memory_bytes[members].sum() == pytest.approx(coarse.memory_bytes[g])
    # Shares follow each op's own analytic time, device by device; memory follows the parameters (relu has none).
    alone = analytic_compute_s(graph, cluster)
    for k in range(2):
        assert fine.compute_s[0, k] / fine.compute_s[1, k] == pytest.approx(alone[0, k] / alone[1, k])
    assert fine.memory_bytes[1] == 0
    np.testing.assert_array_equal(fine.memory_capacity_bytes, coarse.memory_capacity_bytes)
    ungrouped, grouped = lower_bounds(fine), lower_bounds(coarse)
    assert ungrouped.critical_path_s <= grouped.critical_path_s and ungrouped.load_s <= grouped.load_s * (1 + 1e-6)


def test_unfused_problem_keeps_a_group_off_a_device_it_cannot_run_on(traced_two_layers) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    groups = [[0, 1], [2]]
    cluster = two_device_cluster()
    coarse = build_problem(graph.merge(groups), cluster, traced=traced)
    compute_s = coarse.compute_s.copy()
    compute_s[0, 1] = np.inf
    fine = unfused_problem(graph, groups, dataclasses.replace(coarse, compute_s=compute_s), cluster, traced)
    assert np.isinf(fine.compute_s[[0, 1], 1]).all() and np.isfinite(fine.compute_s[[0, 1], 0]).all()


class Branches(nn.Module):
    """relu feeds a chain neg -> exp -> tanh and, last in graph order, a sigmoid."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.relu(x)
        return torch.tanh(torch.exp(torch.neg(a))), torch.sigmoid(a)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run and the tensors they made that are still alive: fake clocks for profiling."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.live = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.live += 1
                weakref.finalize(t, self.free)
        return out

    def free(self) -> None:
        self.live -= 1


@pytest.fixture(scope="module")
def traced_branches():  # noqa: ANN201
    traced = trace(Branches(), (torch.randn(4, 8),))
    graph = build_op_graph(traced)
    assert [n.targets for n in graph.nodes] == [
        ("aten.relu.default",),
        ("aten.neg.default",),
        ("aten.exp.default",),
        ("aten.tanh.default",),
        ("aten.sigmoid.default",),
    ]
    return traced, graph


def profile_with_fake_clock(graph: OpGraph, traced, tmp_path: Path, reading: str) -> np.ndarray:  # noqa: ANN001
    counter = OpCounter()
    readings = iter(range(1_000_000))

    def fake_clock() -> float:
        # Each reading also advances the clock by 1: the clock's own cost, which profiling subtracts.
        return float(getattr(counter, reading) + next(readings))

    with counter:
        return profile_nodes(
            graph, traced, "cpu", cache_dir=tmp_path, warmup=1, repeats=3, progress=False, clock=fake_clock
        )


def test_measured_times_add_up_to_the_whole_run(traced_branches, tmp_path: Path) -> None:  # noqa: ANN001
    traced, graph = traced_branches
    # With a clock counting aten ops, a node's time is the number of its ops: nothing outside the ops
    # (the clock's own cost, inputs, parameters) is charged to a node.
    np.testing.assert_array_equal(profile_with_fake_clock(graph, traced, tmp_path, "ops"), [1, 1, 1, 1, 1])


def test_measured_runs_each_group_in_one_piece(traced_branches, tmp_path: Path) -> None:  # noqa: ANN001
    traced, graph = traced_branches
    # The group of relu and sigmoid runs first (sigmoid moves up from last), then neg -> exp -> tanh.
    grouped = graph.merge([[1, 2, 3], [0, 4]])
    np.testing.assert_array_equal(profile_with_fake_clock(grouped, traced, tmp_path, "ops"), [3, 2])


def test_measured_frees_values_after_their_last_use(traced_branches, tmp_path: Path) -> None:  # noqa: ANN001
    traced, graph = traced_branches
    # A clock reading the number of live tensors: each op adds its output, and its input is freed
    # right after it unless a later op reads it (relu's output lives until sigmoid).
    np.testing.assert_array_equal(profile_with_fake_clock(graph, traced, tmp_path, "live"), [1, 1, 0, 0, 0])


def test_measured_nodes_of_one_signature_share_the_median_of_their_times(traced_two_layers, tmp_path: Path) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    # Live tensors: the first Linear adds its output (its input is the caller's); relu and the second
    # Linear each free their input. The two Linears share a signature: both get the median of 1 and 0.
    np.testing.assert_array_equal(profile_with_fake_clock(graph, traced, tmp_path, "live"), [0.5, 0, 0.5])


def test_measured_needs_an_acyclic_grouping_of_all_ops(traced_branches, tmp_path: Path) -> None:  # noqa: ANN001
    traced, graph = traced_branches
    with pytest.raises(ClusterError, match="cycle"):
        profile_nodes(graph.merge([[0, 2], [1], [3], [4]]), traced, "cpu", cache_dir=tmp_path, progress=False)
    partial = OpGraph(graph.nodes[:4], tuple(e for e in graph.edges if e.dst < 4), graph.parameter_bytes)
    with pytest.raises(ClusterError, match="cover 4 fx nodes but the traced model has 5 ops"):
        profile_nodes(partial, traced, "cpu", cache_dir=tmp_path, progress=False)


def test_timed_module_returns_the_model_outputs(traced_two_layers) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    x = torch.randn(8, 64)
    timed = cost._timed_module(traced.graph_module, [n.fx_names for n in graph.nodes], HostSpans(time.perf_counter))
    stamps, outputs = timed(x)
    assert len(stamps) == cost._EMPTY_SPANS + 2 + len(graph.nodes) and list(stamps) == sorted(stamps)
    torch.testing.assert_close(outputs, traced.graph_module(x))


def test_measured_needs_local_devices(traced_two_layers, tmp_path: Path) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    with pytest.raises(ClusterError, match="'A' .cuda:0 on host 'server-a'. is not on this machine"):
        build_problem(graph, Cluster.preset("moirai-inter-server"), "measured", traced, cache_dir=tmp_path)


def test_measured_with_meta_weights(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = TwoLayers().eval()
    traced = trace(model, (torch.empty(8, 64, device="meta"),))
    graph = build_op_graph(traced)
    times = profile_nodes(graph, traced, "cpu", cache_dir=tmp_path, repeats=2, progress=False)
    assert times.shape == (3,) and np.all(np.isfinite(times)) and np.all(times > 0)


def _children() -> set[int]:
    """This process's child processes (Linux's /proc)."""
    pid = os.getpid()
    return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


@pytest.mark.skipif(
    not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists() or (os.cpu_count() or 1) < 2,
    reason="needs Linux's /proc and two cores",
)
def test_steady_state_profiles_beside_the_other_ranks_computing(traced_two_layers, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    seen: list[list[set[int]]] = []
    real_timer = cost._in_situ_times_s

    earlier = _children()  # other tests' processes, still ending

    def watching_timer(timed, *args):  # noqa: ANN001, ANN002, ANN202
        seen.append([os.sched_getaffinity(child) for child in sorted(_children() - earlier)])
        return real_timer(timed, *args)

    monkeypatch.setattr(cost, "_in_situ_times_s", watching_timer)
    cluster = Cluster.from_devices(["cpu", "cpu"])
    cores = [r.cores for r in rank_resources(cluster.devices)]
    build_problem(graph, cluster, "measured", traced, cache_dir=tmp_path, repeats=2, progress=False)
    steady = build_problem(
        graph, cluster, "measured", traced, cache_dir=tmp_path, repeats=2, progress=False, steady_state=True
    )
    # The lone profile had no process beside it (timed once, or twice when its parts did not add up to the whole:
    # [Note: a cached profile checked]); the steady state's had one, on device 1's cores, gone after.
    *lone, beside = seen
    assert lone in ([[]], [[], []]) and beside == [set(cores[1])], seen
    assert not _children() - earlier
    assert steady.compute_s.shape == (3, 2) and np.all(steady.compute_s > 0)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2  # cached apart


@pytest.mark.skipif(not hasattr(os, "fork") or (os.cpu_count() or 1) < 2, reason="needs os.fork and two cores")
def test_steady_state_profile_fails_when_its_other_rank_does(traced_two_layers, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    monkeypatch.setattr(cost, "_compute_until_closed", lambda *args: os._exit(1))
    cluster = Cluster.from_devices(["cpu", "cpu"])
    with pytest.raises(ClusterError, match="1 of the 1 processes computing beside the steady-state profile failed"):
        build_problem(
            graph, cluster, "measured", traced, cache_dir=tmp_path, repeats=2, progress=False, steady_state=True
        )
    assert not list((tmp_path / "profiles").glob("*.json"))  # nothing cached


def test_a_process_beside_a_steady_state_profile_computes_on_weights_of_its_own(monkeypatch) -> None:
    # Forked, it would read the profile's own pages, which a shared cache then serves to the profile faster than a
    # rank streaming its own part's weights is served (a step of 4 sequences priced 1.4x fast; RESULTS section 16).
    import psutil

    module = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(64, 64), nn.ReLU()))
    before = [(t.data_ptr(), t.clone()) for t in module.parameters()]
    assert cost._take_own_weights(module)
    pairs = zip(module.parameters(), before, strict=True)
    assert all(t.data_ptr() != pointer and torch.equal(t, value) for t, (pointer, value) in pairs)
    # No room for a copy (more than half the available memory): the module's own pages, not a process killed.
    Memory = type("Memory", (), {"available": 64 * 64 * 4})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    pointers = [t.data_ptr() for t in module.parameters()]
    assert not cost._take_own_weights(module) and [t.data_ptr() for t in module.parameters()] == pointers


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.third(self.second(self.first(x)) + y) + x.mean()


def test_model_inputs_are_priced_where_the_split_program_ships_them() -> None:
    """The driver sends each model input once to every other part that reads it (split.py's input_indices): the
    problem's input readers name exactly those devices, and price the bytes on the link from device 0."""
    traced = trace(_TwoInputs(), (torch.randn(8, 16), torch.randn(8, 16)))
    graph = build_op_graph(traced)
    problem = build_problem(graph, two_device_cluster(), traced=traced)
    costs = problem.costs
    assert costs.num_inputs == 2
    expected_link_s = (
        8 * 16 * 4 / two_device_cluster().bandwidth_bytes_per_s[0, 1] + two_device_cluster().latency_s[0, 1]
    )
    assert costs.input_link_s[:, 1] == pytest.approx([expected_link_s] * 2)
    assert not costs.input_s[:, 0].any() and (costs.input_s[:, 1] >= costs.input_link_s[:, 1]).all()
    rng = np.random.default_rng(0)
    for _ in range(12):
        placement = rng.integers(0, 2, len(graph.nodes))
        node_device = {name: int(placement[i]) for i, node in enumerate(graph.nodes) for name in node.fx_names}
        program = split_module(traced, node_device, 2)
        shipped = {index for part in program.parts[1:] for index in part.input_indices}
        priced = {j for j, devices in enumerate(costs.input_devices(placement)) if 1 in devices}
        assert shipped == priced
        seconds = costs.link_s(placement)
        assert seconds[0, 1] == pytest.approx(len(priced) * expected_link_s)


def test_profiling_warms_up_for_the_kinds_least_seconds_before_timing() -> None:
    """[Note: a GPU's clocks]: a kind whose spans ask for seconds of warm-up gets them, however few runs that is."""
    calls: list[float] = []

    class SlowToWarm(HostSpans):
        warmup_s = 0.05

    spans = SlowToWarm(time.perf_counter)

    def timed(*_):  # noqa: ANN002, ANN202
        calls.append(time.perf_counter())
        return [spans.read() for _ in range(cost._EMPTY_SPANS + 3)], None

    begun = time.perf_counter()
    times = cost._in_situ_times_s(timed, spans, [], warmup=1, repeats=2, progress=False, what="a fake")
    timed_from = calls[-2]  # the first of the two timed runs
    assert len(times) == 1 and timed_from - begun >= 0.05 and len(calls) > 3
    assert (
        CPU.spans(torch.device("cpu"), time.thread_time).read is time.thread_time
        and CPU.spans(torch.device("cpu"), time.thread_time).warmup_s == 0.0
    )


def test_profiles_that_do_not_add_up_to_the_whole_graph_are_measured_again(traced_two_layers, tmp_path, monkeypatch):  # noqa: ANN001
    """[Note: a cached profile checked], with the timings faked: a fresh profile whose groups add up to 2x the whole
    graph is measured once more (the closer kept); a cache that adds up is read; a cache the whole graph no longer
    adds up to (taken at a busy moment, or on a machine since changed) is measured again."""
    traced, graph = traced_two_layers
    whole = {"s": 3e-3}
    answers: list[list[float]] = []  # each profiling run's per-group times, in turn
    monkeypatch.setattr(cost, "_whole_graph_s", lambda module, inputs, spans: whole["s"])
    monkeypatch.setattr(cost, "_in_situ_times_s", lambda *args: np.array(answers.pop(0)))

    answers[:] = [[2e-3] * 3, [1e-3] * 3]
    first = profile_nodes(graph, traced, "cpu", cache_dir=tmp_path, progress=False)
    assert not answers and first.sum() == pytest.approx(3e-3)
    assert profile_nodes(graph, traced, "cpu", cache_dir=tmp_path, progress=False).tolist() == first.tolist()
    whole["s"] = 9e-3
    answers[:] = [[3e-3] * 3]
    again = profile_nodes(graph, traced, "cpu", cache_dir=tmp_path, progress=False)
    assert not answers and again.sum() == pytest.approx(9e-3)
