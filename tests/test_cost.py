"""Cost model: analytic roofline, measured profiles and their cache (moirai/cost.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import moirai.cost as cost
from moirai.calibrate import calibrate, fit_link
from moirai.cost import activation_peak_bytes, analytic_compute_s, build_problem, node_dtypes, profile_nodes
from moirai.devices import Cluster, Device, Link
from moirai.errors import ClusterError
from moirai.graph import OpEdge, OpGraph, OpNode, build_op_graph
from moirai.trace import trace


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


def test_measured_profiles_once_then_reads_the_cache(traced_two_layers, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    measured_groups = []
    real_timer = cost._median_times_s

    def counting_timer(groups, *args):  # noqa: ANN001, ANN002, ANN202
        measured_groups.extend(groups)
        return real_timer(groups, *args)

    monkeypatch.setattr(cost, "_median_times_s", counting_timer)
    cluster = Cluster.from_devices(["cpu", "cpu"])
    first = build_problem(graph, cluster, "measured", traced, cache_dir=tmp_path, repeats=3, progress=False)
    # The two Linear layers have the same signature: measured once. Linear, relu, (same Linear).
    assert len(graph.nodes) == 3 and len(measured_groups) == 2
    assert first.compute_s.shape == (3, 2) and np.all(first.compute_s > 0)
    assert first.compute_s[0, 0] == first.compute_s[2, 0] == first.compute_s[0, 1]
    second = build_problem(graph, cluster, "measured", traced, cache_dir=tmp_path, repeats=3, progress=False)
    assert len(measured_groups) == 2
    np.testing.assert_array_equal(first.compute_s, second.compute_s)
    assert list((tmp_path / "profiles").glob("*.json"))


def test_measured_cache_dir_from_environment(traced_two_layers, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    monkeypatch.setenv("MOIRAI_CACHE_DIR", str(tmp_path))
    profile_nodes(graph.merge([[0, 1, 2]]), traced, "cpu", repeats=2, progress=False)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1


def test_measured_group_runs_its_ops(traced_two_layers, tmp_path: Path) -> None:  # noqa: ANN001
    traced, graph = traced_two_layers
    values = cost._node_values(traced.graph_module, traced, torch.device("cpu"))
    whole = [n for n in traced.graph_module.graph.nodes if n.name in graph.merge([[0, 1, 2]]).nodes[0].fx_names]
    module, inputs = cost._group_module(traced.graph_module, whole, values)
    outputs = module(*inputs)
    torch.testing.assert_close(outputs[-1], values[whole[-1].name])


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


# --- link calibration ------------------------------------------------------------------------


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    sizes = np.array([1e3, 1e5, 1e6, 1e7])
    times = 2 * 30e-6 + sizes / 2e9  # message and acknowledgement each pay the latency
    latency, bandwidth = fit_link(sizes, times)
    assert latency == pytest.approx(30e-6, rel=1e-6)
    assert bandwidth == pytest.approx(2e9, rel=1e-6)


def test_fit_link_rejects_timings_that_do_not_grow() -> None:
    with pytest.raises(ClusterError, match="does not grow with size"):
        fit_link([1e3, 1e6], [2e-3, 1e-3])
    with pytest.raises(ClusterError, match="two different message sizes"):
        fit_link([1e3, 1e3], [1e-3, 1e-3])


@pytest.mark.slow
def test_calibrate_two_gloo_ranks_writes_a_cluster_file(tmp_path: Path) -> None:
    path = tmp_path / "calibrated.toml"
    cluster = calibrate(world_size=2, sizes_bytes=(1 << 20, 8 << 20, 32 << 20), repeats=3, output=path)
    assert cluster.names == ("rank0", "rank1")
    assert [d.rank for d in cluster.devices] == [0, 1]
    assert {(link.src, link.dst) for link in cluster.links} == {("rank0", "rank1"), ("rank1", "rank0")}
    # Loopback gloo moves between 10 MB/s and 100 GB/s on any machine this runs on.
    measured = cluster.bandwidth_bytes_per_s[[0, 1], [1, 0]]
    assert np.all((measured > 1e7) & (measured < 1e11))
    again = Cluster.from_file(path)
    np.testing.assert_allclose(again.bandwidth_bytes_per_s, cluster.bandwidth_bytes_per_s)


def test_calibrate_needs_two_ranks() -> None:
    with pytest.raises(ClusterError, match="at least two ranks"):
        calibrate(world_size=1)
