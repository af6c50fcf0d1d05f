"""Seeing a plan: the Gantt picture, the text timeline, the critical path and the 80-column summary."""

import io
import json
import sys

import numpy as np
import pytest
import torch
from rich.console import Console
from rich.text import Text

import moirai
from moirai import viz

# Two devices, a fan-out whose branches run on both, so one link carries tensors.
PROBLEM = {
    "devices": [{"name": "gpu0", "memory_bytes": 8e9}, {"name": "gpu1", "memory_bytes": 4e9}],
    "tasks": [
        {"name": "embed", "compute_s": [0.002, 0.004], "memory_bytes": 2e9},
        {"name": "left", "compute_s": [0.010, 0.020], "memory_bytes": 3e9},
        {"name": "right", "compute_s": [0.010, 0.020], "memory_bytes": 3e9},
        {"name": "head", "compute_s": [0.001, 0.002], "memory_bytes": 1e9},
    ],
    "edges": [
        {"src": "embed", "dst": "left", "tensor": "hidden", "bytes": 4e6},
        {"src": "embed", "dst": "right", "tensor": "hidden", "bytes": 4e6},
        {"src": "left", "dst": "head", "bytes": 4e6},
        {"src": "right", "dst": "head", "bytes": 4e6},
    ],
    "links": {"bandwidth_bytes_per_s": [[0, 1e9], [2e9, 0]], "latency_s": [[0, 1e-5], [1e-5, 0]]},
}


def split_plan(problem: moirai.Problem) -> moirai.Plan:
    """embed, left and head on gpu0, right on gpu1: one tensor goes each way."""
    return moirai.Plan(np.array([0, 0, 1, 0]), problem.device_names, placer="by hand")


@pytest.fixture
def problem() -> moirai.Problem:
    return moirai.Problem.from_dict(PROBLEM)


def test_gantt_writes_a_png_with_one_lane_per_device_and_per_link_in_use(problem, tmp_path) -> None:
    plan = split_plan(problem)
    path = tmp_path / "plan.png"
    figure = moirai.gantt(problem, plan, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000
    (axes,) = figure.axes
    labels = [label.get_text() for label in axes.get_yticklabels()]
    assert labels == ["gpu0", "gpu1", "gpu0 → gpu1", "gpu1 → gpu0"]
    timeline = moirai.simulate(problem, plan)
    bars = [bar for c in axes.containers if c.get_label() != "critical path" for bar in c.patches]
    assert len(bars) == problem.num_tasks + len(timeline.transfers) == 6
    (underlines,) = [c for c in axes.containers if c.get_label() == "critical path"]
    assert len(underlines.patches) == len(viz.critical_path(problem, timeline).tasks) + 2  # and 2 transfers
    # Every bar sits on its device's or link's lane, from the task's (transfer's) start to its finish.
    spans = sorted((round(b.get_y() + b.get_height() / 2), b.get_x(), b.get_x() + b.get_width()) for b in bars)
    expected = [(int(timeline.placement[i]), timeline.task_start[i], timeline.task_finish[i]) for i in range(4)]
    expected += [(2 if x.src == 0 else 3, x.start, x.finish) for x in timeline.transfers]
    np.testing.assert_allclose(np.array(spans), np.array(sorted(expected)) * [1, 1e3, 1e3])  # drawn in ms
    title = axes.get_title(loc="left")
    assert (
        f"predicted {viz.format_seconds(viz.predicted_latency_s(timeline))}" in title
        and "bound" in title
        and "gap" in title
    )
    svg = tmp_path / "plan.svg"
    moirai.gantt(problem, plan, svg)
    assert svg.read_text().lstrip().startswith("<?xml")


def test_the_driver_messages_fill_the_picture_to_the_latency(problem) -> None:
    """The latency counts the header's way to a device and a model output's way back to device 0: the bars ended
    before the latency did, with nothing drawn in between."""
    import dataclasses

    costs = dataclasses.replace(
        problem.costs, header_s=np.array([0.0, 0.003]), output_s=np.array([[0.0, 0.0]] * 3 + [[0.0, 0.004]])
    )
    costed = dataclasses.replace(problem, costs=costs)
    plan = moirai.Plan(np.array([0, 0, 1, 1]), costed.device_names, placer="by hand")  # the output made on gpu1
    timeline = moirai.simulate(costed, plan)
    figure = moirai.gantt(costed, plan)
    (axes,) = figure.axes
    (driver,) = [c for c in axes.containers if c.get_label() == "the driver's messages"]
    spans = sorted((b.get_x(), b.get_x() + b.get_width()) for b in driver.patches)
    head = costed.task_index("head")
    expected = [(0.0, 3.0), (timeline.task_finish[head] * 1e3, timeline.makespan_s * 1e3)]  # ms
    np.testing.assert_allclose(np.array(spans), np.array(expected))
    assert "the driver's messages" in [t.get_text() for t in axes.get_legend().get_texts()]


def test_the_legend_of_many_kinds_fits_in_the_picture() -> None:
    """A 2-layer BERT's 12 kinds, the transfers and the critical path: the legend ran off the picture's bottom."""
    problem_of_many = moirai.Problem.from_dict(
        {
            "devices": PROBLEM["devices"],
            "tasks": [{"name": f"op{k}", "compute_s": [0.001, 0.002]} for k in range(14)],
            "edges": [{"src": f"op{k}", "dst": f"op{k + 1}", "bytes": 1e6} for k in range(13)],
            "links": PROBLEM["links"],
        }
    )
    plan = moirai.Plan(np.array([k % 2 for k in range(14)]), problem_of_many.device_names, placer="by hand")
    drawn = moirai.gantt(problem_of_many, plan, groups=[f"kind {k}" for k in range(14)])
    drawn.canvas.draw()
    (legend,) = [axes.get_legend() for axes in drawn.axes]
    assert len(legend.get_texts()) >= 14
    box = legend.get_window_extent()
    assert 0 <= box.y0 and box.y1 <= drawn.bbox.height, (box, drawn.bbox)


def test_critical_path_is_a_gapless_chain_from_zero_to_the_latency(problem) -> None:
    plan = split_plan(problem)
    timeline = moirai.simulate(problem, plan)
    path = viz.critical_path(problem, timeline)
    spans = [(timeline.task_start[i], timeline.task_finish[i]) for i in path.tasks]
    spans += [(timeline.transfers[q].start, timeline.transfers[q].finish) for q in path.transfers]
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] == pytest.approx(viz.predicted_latency_s(timeline))
    for (_, finish), (start, _) in zip(spans, spans[1:], strict=False):
        assert start == pytest.approx(finish)
    # right runs on the slow gpu1: its result's transfer back is on the path, left (on gpu0) is not.
    assert path.tasks == {problem.task_index(n) for n in ("embed", "right", "head")}
    assert len(path.transfers) == 2


def test_gantt_without_matplotlib_is_a_moirai_error(problem, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(moirai.MoiraiError, match=r"needs matplotlib .*: pip install matplotlib"):
        moirai.gantt(problem, split_plan(problem))


def test_text_gantt_has_a_row_per_lane_of_the_given_width(problem) -> None:
    table = viz.text_gantt(problem, split_plan(problem), width=40)
    assert table.row_count == 4
    console = Console(width=120, file=io.StringIO(), color_system=None)
    console.print(table)
    lines = console.file.getvalue().splitlines()
    gpu1 = next(line for line in lines if line.strip().startswith("gpu1 ") and "→" not in line)
    timeline_cells = gpu1.split("gpu1", 1)[1].strip()
    assert len(timeline_cells) == 40 and timeline_cells.startswith("·")  # gpu1 waits for embed


def render(table, width: int = 80) -> list[str]:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.file.getvalue().splitlines()


def test_summary_fits_80_columns_and_marks_memory_over_capacity_red(problem) -> None:
    over = moirai.Plan(np.array([1, 1, 1, 1]), problem.device_names, placer="all on gpu1")
    table = viz.summary_table(problem, over)
    lines = render(table)
    assert all(len(line) <= 80 for line in lines)
    row = next(line for line in lines if line.strip().startswith("gpu1"))
    assert "9.00 GB / 4.00 GB" in row  # one line: units never wrap
    memory = table.columns[[c.header for c in table.columns].index("memory / capacity")]
    cells = list(memory.cells)
    assert cells[1].style == "bold red" and cells[0].style == ""
    assert "OVER MEMORY" in str(table.caption) and "bound" not in str(table.caption)  # bounds assume it fits


def test_summary_of_a_compiled_model_fits_80_columns_with_long_device_names() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    cluster = moirai.Cluster.preset("moirai-inter-server")
    compiled = moirai.compile(model, cluster, example_inputs=(torch.randn(2, 16),), placer="heft", progress=False)
    assert compiled.summary(Console(file=io.StringIO())) is None  # printed, not also shown as a result
    table = compiled.summary_table()
    lines = render(table)
    assert all(len(line) <= 80 for line in lines)
    assert sum(line.strip().split(" ")[0] in cluster.names for line in lines) == len(cluster)
    assert "predicted" in lines[-2] and "bound" in lines[-2] and "gap" in lines[-2]


def test_summary_says_why_the_milp_stopped(problem) -> None:
    plan = moirai.place(problem, placer="milp", time_limit_s=5)
    caption = str(viz.summary_table(problem, plan).caption)
    assert viz.stop_reason(plan) == "gap closed" and "stopped: gap closed" in caption
    assert f"bound {viz.format_seconds(viz.best_lower_bound_s(problem, plan))}" in caption


def test_compiled_gantt_colours_by_kind_or_layer(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(torch.randn(2, 16),), placer="round_robin")
    figure = compiled.gantt(tmp_path / "kind.png")
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert "linear" in legend and "critical path" in legend
    figure = compiled.gantt(color_by="layer")
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert {"0", "2"} <= set(legend)  # the Sequential's children
    with pytest.raises(moirai.MoiraiError, match="color_by"):
        compiled.gantt(color_by="colour")


def test_layer_of_module_path() -> None:
    assert viz.layer_of_module_path("blocks.3.mlp.fc1") == "blocks.3"
    assert viz.layer_of_module_path("transformer.h.11.attn") == "transformer.h.11"
    assert viz.layer_of_module_path("transformer.wte") == "transformer.wte"
    assert viz.layer_of_module_path("") == "(model)"


def test_compact_bytes() -> None:
    assert [viz.format_bytes_compact(b) for b in (512, 16e6, 812e9, 1.2e12, 999.6e9)] == [
        "512 B",
        "16.0 MB",
        "812 GB",
        "1.20 TB",
        "1000 GB",
    ]


def test_summary_fits_80_columns_with_16_character_device_names_and_large_numbers() -> None:
    names = ["gpu-server-a-0x1", "cpu-host-memory9"]
    problem = moirai.Problem.from_dict(
        {
            "devices": [{"name": names[0], "memory_bytes": 812e9}, {"name": names[1], "memory_bytes": 999e9}],
            "tasks": [{"name": f"t{i}", "compute_s": [123.4, 567.8], "memory_bytes": 401e9} for i in range(4)],
        }
    )
    plan = moirai.Plan(np.array([0, 0, 0, 1]), problem.device_names, placer="by hand")
    lines = render(viz.summary_table(problem, plan, torch_devices=["cuda:10", "cpu"], ops_per_task=[99999] * 4))
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    row = next(line for line in lines if line.startswith(names[0]))
    assert "1.20 TB / 812 GB" in row and "6.17 min" in row and "cuda:10" in row and "299997" in row  # busy: 370 s


def test_summary_counts_one_transfer_in_the_singular(problem) -> None:
    one = moirai.Plan(np.array([0, 1, 1, 1]), problem.device_names, placer="by hand")  # hidden crosses once
    caption = str(viz.summary_table(problem, one).caption)
    assert "1 transfer" in caption and "1 transfers" not in caption
    assert "2 transfers" in str(viz.summary_table(problem, split_plan(problem)).caption)


def test_kinds_never_name_internal_ops() -> None:
    assert viz.kind_of_targets(["aten._assert_tensor_metadata.default", "aten.add.Tensor"]) == "add"
    assert viz.kind_of_targets(["aten.to.dtype", "aten.addmm.default"]) == "addmm"
    assert viz.kind_of_targets(["aten._assert_tensor_metadata.default", "aten.to.dtype"]) == "other"


def test_summary_caption_is_not_wrapped_where_the_console_is_wide_enough(problem) -> None:
    plan = moirai.place(problem, placer="milp", time_limit_s=5)
    table = viz.summary_table(problem, plan, title="t")
    caption = Text.from_markup(str(table.caption)).plain.splitlines()
    assert max(len(line) for line in caption) > sum(len(c.header) + 2 for c in table.columns)  # wider than columns
    lines = [line.rstrip() for line in render(table, width=200)]
    assert all(line in lines for line in caption), "\n".join(lines)
    assert all(len(line) <= 50 for line in render(table, width=50))  # never wider than the console


def test_a_throughput_plan_shows_its_period_next_to_its_bound(problem) -> None:
    plan = moirai.place(problem, placer="pipeline", objective="throughput")
    timeline = moirai.simulate(problem, plan)
    caption = str(viz.summary_table(problem, plan).caption)
    served_s = timeline.served_period_s  # the period the runtime serves at, a round trip included
    period = f"period {viz.format_seconds(served_s)}, {viz.format_rate(1 / served_s)} req/s"
    assert f"predicted {viz.format_seconds(timeline.makespan_s)} · {period} · period bound" in caption


def test_summary_shows_the_gap_to_the_unfused_bound_where_it_differs(problem) -> None:
    plan = moirai.place(problem, placer="milp", time_limit_s=5)
    timeline = moirai.simulate(problem, plan)
    bound_s = viz.best_lower_bound_s(problem, plan)
    assert "unfused" not in str(viz.summary_table(problem, plan).caption)  # compile sets it only where it grouped ops
    plan.report.unfused_lower_bound_s = bound_s  # the same gap: the line would repeat the headline
    assert "unfused" not in str(viz.summary_table(problem, plan).caption)
    plan.report.unfused_lower_bound_s = bound_s / 2
    caption = str(viz.summary_table(problem, plan).caption).splitlines()
    gap = (timeline.makespan_s - bound_s / 2) / timeline.makespan_s
    assert caption[1] == f"unfused bound {viz.format_seconds(bound_s / 2)} · gap vs unfused {gap:.1%}"
    assert all(len(line) <= 80 for line in render(viz.summary_table(problem, plan)))


def test_summary_says_a_split_was_dropped_for_one_device() -> None:
    """A split 0.5% faster than one device is not made (placers.MIN_SPLIT_GAIN): the summary's gap then compares the
    single-device plan with a bound the split nearly reaches, so it says why the plan is on one device."""
    from moirai.planning.problem import Problem

    problem = Problem(
        ("a", "b"), np.full(2, np.inf), ("x", "y"), np.array([[1.0, 1.0], [0.005, 0.005]]), np.zeros(2), (),
        np.zeros(0, int), (), np.zeros((0, 2, 2)),
    )  # fmt: skip
    plan = moirai.place(problem, placer="milp", time_limit_s=5)
    assert len(set(plan.placement.tolist())) == 1
    caption = str(viz.summary_table(problem, plan).caption)
    assert "gap 0.5%" in caption and "one device kept: a split (1 s) gains under 1%" in caption
    split = moirai.Plan(np.array([0, 1]), problem.device_names)
    assert "one device kept" not in str(viz.summary_table(problem, split).caption)


def capacity_column(table) -> list[str]:
    """The capacity half of each row's "memory / capacity" cell."""
    column = next(c for c in table.columns if c.header == "memory / capacity")
    return [str(cell).split(" / ")[1] for cell in column._cells]


def test_a_compiled_models_summary_shows_each_devices_memory_as_its_capacity(tmp_path) -> None:
    """Also a device smaller than the activation reserve (its capacity for the tasks clipped at 0): the summary added
    the whole reserve back and showed the reserve as the device's memory. And so after save and load."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    memory_bytes = (100, 10_000_000)  # A: under the activation peak of a few kB
    devices = [
        {"name": n, "memory_gb": m / 1e9, "peak_tflops": {"fp32": 1.0}, "memory_bandwidth_gb_per_s": 10}
        for n, m in zip("AB", memory_bytes, strict=True)
    ]
    links = [{"src": "A", "dst": "B", "bandwidth_gbps": 10, "both_directions": True}]
    cluster = moirai.Cluster.from_dict({"devices": devices, "links": links})
    with pytest.warns(moirai.errors.OverMemoryWarning):
        compiled = moirai.compile(model, cluster, (torch.randn(2, 16),), placer="round_robin", progress=False)
    shown = [viz.format_bytes_compact(m) for m in memory_bytes]
    assert capacity_column(compiled.summary_table()) == shown
    compiled.save(tmp_path / "plan.json")
    loaded = moirai.load(tmp_path / "plan.json", model, (torch.randn(2, 16),), devices=cluster, progress=False)
    assert capacity_column(loaded.summary_table()) == shown
    # A file saved before problems kept their reserve: the loading devices' memory beyond the saved capacity is it.
    record = json.loads((tmp_path / "plan.json").read_text())
    for device in record["problem"]["devices"]:
        device.pop("reserve_bytes", None)
    (tmp_path / "old.json").write_text(json.dumps(record))
    old = moirai.load(tmp_path / "old.json", model, (torch.randn(2, 16),), devices=cluster, progress=False)
    assert capacity_column(old.summary_table()) == shown
