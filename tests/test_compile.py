"""moirai.compile end to end: plan, split, run locally and distributed, save and load."""

import dataclasses
import io
import json

import numpy as np
import pytest
import torch
from rich.console import Console

import moirai
from moirai.errors import InputError, PlanError, PlanVersionWarning
from moirai.frontend.coarsen import RuleSet
from moirai.frontend.graph import build_op_graph


class Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x + skip


@pytest.fixture(scope="module")
def compiled() -> moirai.CompiledModel:
    torch.manual_seed(0)
    return moirai.compile(
        Residual().eval(), ["cpu", "cpu", "cpu"], example_inputs=(torch.randn(4, 32),), placer="round_robin"
    )


def test_compiled_model_matches_original_locally_and_uses_every_device(compiled: moirai.CompiledModel) -> None:
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), compiled.traced.graph_module(x)[0])
    assert set(compiled.node_device.values()) == {0, 1, 2}


def test_a_compiled_model_prints_as_one_short_line_as_a_notebook_shows_it(compiled: moirai.CompiledModel) -> None:
    text = repr(compiled)  # the dataclass's own repr was about 100 kB
    assert "\n" not in text and len(text) < 300, text
    assert text.startswith("<CompiledModel of Residual: round_robin's plan of ") and "cpu_2" in text, text
    assert "ms a request predicted" in text, text
    assert repr(
        compiled.problem
    ) == f"<Problem: {compiled.problem.num_tasks} tasks, {compiled.problem.num_tensors} " + (
        "tensors, 3 devices (cpu_0, cpu_1, cpu_2)>"
    )


def test_compiled_model_runs_distributed(compiled: moirai.CompiledModel) -> None:
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled.run_distributed(x), compiled(x))


def test_plan_carries_simulated_makespan_and_lower_bound(compiled: moirai.CompiledModel) -> None:
    plan = compiled.plan
    assert plan.makespan_s == pytest.approx(moirai.simulate(compiled.problem, plan).makespan_s)
    assert 0 < plan.lower_bound_s <= plan.makespan_s


def test_the_report_carries_the_unfused_bound_through_save_and_load(compiled: moirai.CompiledModel, tmp_path) -> None:
    # Default rules fuse each linear with its relu, so the ops ungrouped have a bound of their own, never
    # above the coarsened problem's (a coarse plan is a plan of the ungrouped ops with the same work).
    unfused_s = compiled.plan.report.unfused_lower_bound_s
    assert len(compiled.graph.nodes) < len(build_op_graph(compiled.traced).nodes)
    assert unfused_s is not None and 0 < unfused_s <= compiled.plan.lower_bound_s * (1 + 1e-6)
    path = tmp_path / "plan.json"
    compiled.save(path)
    loaded = moirai.load(path, Residual().eval(), example_inputs=(torch.randn(4, 32),))
    assert loaded.plan.report.unfused_lower_bound_s == unfused_s


class TwoBranches(torch.nn.Module):
    """Issue 24's example: two branches of four Linear(2048) joined by an add."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4)))
        self.b = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def test_default_fusion_plans_joined_branches_as_fast_as_no_fusion() -> None:
    # Fusing one branch's last linear with the add made it wait for the other branch (bench/RESULTS.md, section 17).
    torch.manual_seed(0)
    model, x = TwoBranches().eval(), torch.randn(128, 2048)
    latency_s = {}
    for name, rules in (("default", "default"), ("none", RuleSet((), ("none",)))):
        compiled = moirai.compile(
            model, ["cpu", "cpu"], (x,), placer="milp", fusion_rules=rules, calibration="none", progress=False
        )
        latency_s[name] = compiled.plan.makespan_s
    assert latency_s["default"] <= latency_s["none"] * 1.01


def test_save_and_load_rebuild_the_same_split(compiled: moirai.CompiledModel, tmp_path) -> None:
    path = tmp_path / "plan.json"
    compiled.save(path)
    model = Residual().eval()  # fresh weights: the loaded split must run these, not the planned ones
    loaded = moirai.load(path, model, example_inputs=(torch.randn(4, 32),))
    assert loaded.node_device == compiled.node_device
    np.testing.assert_array_equal(loaded.plan.placement, compiled.plan.placement)
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


@pytest.fixture(scope="module")
def calibrated_cluster() -> moirai.Cluster:
    """Two CPUs whose links and per-request work are nothing like the defaults that load() could rebuild."""
    base = moirai.Cluster.from_devices(["cpu", "cpu"])
    off_diagonal = 1.0 - np.eye(2)
    return dataclasses.replace(
        base,
        latency_s=base.latency_s * 7.0,
        send_cpu_s=off_diagonal * 3e-5,
        recv_cpu_s=off_diagonal * 4e-5,
        request_cpu_s=np.array([2e-5, 1e-5]),
    )


def summary_text(compiled: moirai.CompiledModel) -> str:
    console = Console(file=io.StringIO(), width=120)
    compiled.summary(console)
    return console.file.getvalue()


def test_load_keeps_the_planned_problem_and_its_summary(calibrated_cluster, tmp_path) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    compiled = moirai.compile(Residual().eval(), calibrated_cluster, example_inputs=(x,), placer="heft")
    path = tmp_path / "plan.json"
    compiled.save(path)
    loaded = moirai.load(path, Residual().eval(), example_inputs=(x,))  # devices from the file: default links
    assert loaded.problem.to_dict() == compiled.problem.to_dict()
    assert moirai.simulate(loaded.problem, loaded.plan).makespan_s == compiled.plan.makespan_s
    assert summary_text(loaded) == summary_text(compiled)

    old = json.loads(path.read_text())
    del old["problem"]  # a plan file written before the problem was saved
    path.write_text(json.dumps(old))
    with pytest.warns(PlanVersionWarning, match="does not hold the planned problem") as warned:
        rebuilt = moirai.load(path, Residual().eval(), example_inputs=(x,))
    assert [w.filename for w in warned if w.category is PlanVersionWarning] == [__file__]  # the user's line
    assert rebuilt.problem.to_dict() != compiled.problem.to_dict(), "the test's cluster must differ from the default"
    np.testing.assert_array_equal(rebuilt.plan.placement, compiled.plan.placement)


def _describes_itself(compiled: moirai.CompiledModel, names: tuple[str, ...]) -> None:
    """Its cluster, problem and plan call the devices ``names``, and what describes it works."""
    assert compiled.cluster.names == compiled.problem.device_names == compiled.plan.device_names == names
    assert all(name in repr(compiled) for name in names)
    assert all(name in summary_text(compiled) for name in names)
    compiled.text_gantt(console=Console(file=io.StringIO()))
    compiled.with_plan(compiled.plan)


def test_load_calls_the_devices_as_planned_or_as_the_devices_given(calibrated_cluster, tmp_path) -> None:
    # A plan compiled on a cluster keeps its names; devices given to load bring theirs (summary() was a PlanError:
    # "plan is for devices ['cpu_0', 'cpu_1'], problem has ['a', 'b']").
    x = torch.randn(4, 32)
    compiled = moirai.compile(
        Residual().eval(), calibrated_cluster.renamed(["a", "b"]), example_inputs=(x,), placer="round_robin"
    )
    path = tmp_path / "plan.json"
    compiled.save(path)
    loaded = moirai.load(path, Residual().eval(), example_inputs=(x,))
    _describes_itself(loaded, ("a", "b"))
    assert loaded.cluster.devices[0].torch_device == "cpu"
    assert summary_text(loaded) == summary_text(compiled)
    _describes_itself(
        moirai.load(path, Residual().eval(), example_inputs=(x,), devices=["cpu", "cpu"]), ("cpu_0", "cpu_1")
    )
    others = moirai.Cluster.from_devices(["cpu", "cpu"]).renamed(["p", "q"])
    _describes_itself(moirai.load(path, Residual().eval(), example_inputs=(x,), devices=others), ("p", "q"))


def test_load_rejects_a_problem_that_does_not_match_the_plan(compiled: moirai.CompiledModel, tmp_path) -> None:
    path = tmp_path / "plan.json"
    compiled.save(path)
    record = json.loads(path.read_text())
    dropped = record["problem"]["tasks"].pop()["name"]
    record["problem"]["edges"] = [e for e in record["problem"]["edges"] if dropped not in (e["src"], e["dst"])]
    path.write_text(json.dumps(record))
    with pytest.raises(PlanError, match="edited or mixed"):
        moirai.load(path, Residual().eval(), example_inputs=(torch.randn(4, 32),))


def test_load_names_the_file_where_its_device_order_contradicts_the_data(
    compiled: moirai.CompiledModel, tmp_path
) -> None:
    """An edited device_order that runs an op before one it reads was the splitter's error, naming no file."""
    path = tmp_path / "plan.json"
    compiled.save(path)
    record = json.loads(path.read_text())
    busiest = max(record["device_order"], key=len)
    busiest.reverse()  # a device's ops run in data order: reversed, the first reads one run after it
    path.write_text(json.dumps(record))
    with pytest.raises(
        PlanError,
        match=r"plan.json: 'node_device' and 'device_order' do not split Residual: device_order "
        r"contradicts the data dependencies.*; the file was edited or mixed: save the plan again",
    ):
        moirai.load(path, Residual().eval(), example_inputs=(torch.randn(4, 32),))


def test_wrong_input_shape_is_a_clear_error(compiled: moirai.CompiledModel) -> None:
    with pytest.raises(InputError, match="compile again with example inputs"):
        compiled(torch.randn(5, 32))


def test_load_rejects_a_plan_for_another_model(compiled: moirai.CompiledModel, tmp_path) -> None:
    path = tmp_path / "plan.json"
    compiled.save(path)
    other = torch.nn.Sequential(torch.nn.Linear(32, 32)).eval()
    with pytest.raises(PlanError, match="compile again"):
        moirai.load(path, other, example_inputs=(torch.randn(4, 32),))


def test_loading_with_a_model_that_has_more_ops_blames_the_model_not_the_file(tmp_path) -> None:
    """A ReLU more than the plan's model was said to be a plan file "edited or mixed"."""
    layers = [torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)]
    x = torch.randn(4, 16)
    path = tmp_path / "plan.json"
    compiled = moirai.compile(torch.nn.Sequential(*layers).eval(), ["cpu", "cpu"], (x,), placer="heft", progress=False)
    compiled.save(path)
    longer = torch.nn.Sequential(*layers, torch.nn.ReLU()).eval()
    with pytest.raises(PlanError, match=r"has ops \['relu_1'\] that the plan never saw.*compile again") as error:
        moirai.load(path, longer, example_inputs=(x,), progress=False)
    assert "edited" not in str(error.value)


def test_with_plan_splits_the_same_problem_by_another_plan(compiled: moirai.CompiledModel) -> None:
    problem = compiled.problem
    stages = moirai.Plan(np.arange(problem.num_tasks) * 3 // problem.num_tasks, problem.device_names)
    stages.placement[list(problem.topological_order)] = stages.placement.copy()
    split = compiled.with_plan(stages)
    assert split.problem is problem and split.plan is stages
    assert set(split.node_device.values()) == {0, 1, 2}
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(split(x), compiled(x))
    with pytest.raises(PlanError, match="places .* tasks"):
        compiled.with_plan(moirai.Plan(np.zeros(1, int), problem.device_names))


def test_plan_with_unknown_device_or_missing_task_is_rejected(compiled: moirai.CompiledModel) -> None:
    problem = compiled.problem
    bad_device = moirai.Plan(np.full(problem.num_tasks, 7), problem.device_names)
    with pytest.raises(PlanError, match="unknown device"):
        bad_device.check(problem)
    missing = moirai.Plan(np.zeros(problem.num_tasks - 1, int), problem.device_names)
    with pytest.raises(PlanError, match="places .* tasks"):
        missing.check(problem)


SERVE_SCRIPT = """
import sys, torch, moirai
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)]).eval()
x = torch.randn(4, 32)
plan = sys.argv[2]
if sys.argv[1] == "plan":
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="round_robin").save(plan)
else:
    compiled = moirai.load(plan, model, example_inputs=(x,))
    with torch.no_grad():
        for _ in range(2):
            y = compiled.run_rank(x)
            if y is not None:
                torch.testing.assert_close(y, model(x))
                print("rank 0 outputs match")
    torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_saved_plan_serves_under_torchrun(tmp_path, monkeypatch) -> None:
    import runpy
    import subprocess
    import sys

    script, plan = tmp_path / "serve.py", tmp_path / "plan.json"
    script.write_text(SERVE_SCRIPT)
    # The plan is made and saved in this process, not in an interpreter of its own that imports torch again.
    with torch.random.fork_rng(), monkeypatch.context() as patch:
        patch.setattr(sys, "argv", [str(script), "plan", str(plan)])
        runpy.run_path(str(script))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*torchrun, str(script), "serve", str(plan)], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.count("rank 0 outputs match") == 2


def test_compile_with_measured_costs_profiles_the_fused_groups(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOIRAI_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = Residual().eval()
    compiled = moirai.compile(
        model,
        ["cpu", "cpu"],
        example_inputs=(torch.randn(4, 32),),
        placer="heft",
        cost="measured",
        calibration="none",  # tests/test_calibrate.py covers the links; this test is about the profiles
    )
    times = compiled.problem.compute_s
    assert np.all(np.isfinite(times)) and np.all(times >= 0) and times.sum() > 0
    np.testing.assert_array_equal(times[:, 0], times[:, 1])  # both logical devices are this CPU: one profile
    assert list((tmp_path / "profiles").glob("*.json"))
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
