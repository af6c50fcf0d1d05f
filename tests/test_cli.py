"""The command line: compile a model from a factory, plan a Problem, errors as one red line."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moirai.cli import main

FACTORY = """
import torch

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, (torch.randn(4, 32),)

class WithInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.example_inputs = torch.randn(2, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))

def broken():
    raise ValueError("no weights here")
"""


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_models.py"
    path.write_text(textwrap.dedent(FACTORY))
    return path


def moirai_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moirai", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_compile_a_factory_checks_outputs_and_writes_plan_and_picture(factory_file: Path, tmp_path: Path) -> None:
    plan, picture = tmp_path / "plan.json", tmp_path / "plan.png"
    result = moirai_cli(
        "compile", "my_models:make", "--devices", "cpu,cpu", "--placer", "round_robin", "--check",
        "--output", str(plan), "--gantt", str(picture), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "match" in result.stdout and "differ" not in result.stdout
    assert "cpu_0" in result.stdout and "predicted" in result.stdout
    assert json.loads(plan.read_text())["format"] == 1
    assert picture.read_bytes()[:4] == b"\x89PNG"
    assert re.search(r"^moirai: place ", result.stderr, re.MULTILINE)  # progress lines go to stderr


@pytest.mark.slow
def test_demo_runs_the_split_decoder_on_three_processes_and_its_outputs_match() -> None:
    # The README's first command; the ranks compute with one thread each whatever the host's cores, and the demo
    # compares them with the original run so (with this process's threads, a CPU's sums may go in another order).
    result = moirai_cli("demo", "--placer", "heft")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "outputs match" in result.stdout and "on 3 processes" in result.stdout


def test_the_cli_and_the_api_plan_the_same_devices_alike(factory_file: Path, tmp_path: Path) -> None:
    """``--devices cpu,cpu,cpu`` builds the cluster and its calibration as ``moirai.compile(model, ["cpu"] * 3)``."""
    import inspect
    import warnings

    import moirai
    from moirai.cli import _parser
    from moirai.cluster.calibration import RequestCost, TransferCost, write_calibration

    assert _parser().parse_args(["compile", "m:f", "--devices", "cpu"]).calibration == (
        inspect.signature(moirai.compile).parameters["calibration"].default
    )
    calibration = tmp_path / "links.json"  # slower than the detected default (50 us), so a skipped calibration shows
    write_calibration(calibration, {"cpu->cpu": TransferCost(2e-3, 1e8, 1e-4, 0.0, 1e-4, 0.0)}, RequestCost(3e-4, 1e-4))
    plan = tmp_path / "plan.json"
    args = ["--devices", "cpu,cpu,cpu", "--calibration", str(calibration), "--placer", "heft", "--output", str(plan)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", moirai.OversubscriptionWarning)  # on a host of fewer than 3 cores
        assert main(["compile", f"{factory_file}:make", *args]) == 0
        sys.path.insert(0, str(factory_file.parent))
        try:
            from my_models import make
        finally:
            sys.path.remove(str(factory_file.parent))
        model, example_inputs = make()
        api = moirai.compile(model.eval(), ["cpu"] * 3, example_inputs, placer="heft", calibration=calibration)
    saved = json.loads(plan.read_text())
    assert saved["problem"] == api.problem.to_dict()
    assert max(max(row) for row in saved["problem"]["edges"][0]["send_cpu_s"]) == pytest.approx(1e-4)  # calibrated
    assert saved["node_device"] == api.node_device


def test_compile_a_py_path_whose_model_carries_example_inputs_on_a_preset(factory_file: Path, capsys) -> None:
    code = main(["compile", f"{factory_file}:WithInputs", "--cluster", "moirai-intra-server", "--placer", "heft"])
    assert code == 0
    assert "predicted" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "no/such/problem.json"], "problem file 'no/such/problem.json' does not exist"),
        (["compile", "{factory}:broken", "--devices", "cpu"], "raised ValueError: no weights here"),
        (["compile", "{factory}:missing", "--devices", "cpu"], "has no function 'missing'"),
        (["compile", "no_such_module_xyz:make", "--devices", "cpu"], "cannot import no_such_module_xyz"),
        (["compile", "{factory}:make", "--cluster", "nowhere"], "neither a cluster file nor a preset"),
        # An empty list was taken for --cluster left out: a raw TypeError from the preset lookup.
        (["compile", "{factory}:make", "--devices", ""], "--devices '': give at least one device"),
        (["compile", "{factory}:make", "--devices", " , "], "give at least one device"),
        (["compile", "{factory}:make", "--devices", "cpu", "--objective", "cheapest"], "--objective 'cheapest'"),
        (["compile", "{factory}:make", "--devices", "cpu", "--placer", "best"], "unknown placer 'best'"),
        (["compile", "{factory}:make", "--devices", "cpu", "--placer", "heft", "--gantt", "plan.xyz"], "plan.xyz"),
        # Checked before the problem is read and placed; the temporary file's name was printed after.
        (
            ["plan", "no/such/problem.json", "--output", "no/such/plan.json"],
            "cannot write the plan to 'no/such/plan.json': folder 'no/such' does not exist",
        ),
        (["plan", "no/such/problem.json", "--output", "."], "cannot write the plan to '.': it is a folder"),
        # Accepted, unread, on one device.
        (
            ["compile", "{factory}:make", "--devices", "cpu", "--placer", "heft", "--calibration", "off"],
            "calibration='off' is not a calibration word nor a file",
        ),
        # Before the model is imported, traced and placed: the picture said "no such file" after a compile.
        (
            ["compile", "{factory}:missing", "--devices", "cpu", "--gantt", "no/such/plan.png"],
            "cannot write the Gantt picture to 'no/such/plan.png': folder 'no/such' does not exist",
        ),
        (
            ["compile", "{factory}:missing", "--devices", "cpu", "--output", "no/such/plan.json"],
            "cannot write the plan to 'no/such/plan.json': folder 'no/such' does not exist",
        ),
        (
            ["plan", "no/such/problem.json", "--gantt", "no/such/plan.png"],
            "cannot write the Gantt picture to 'no/such/plan.png': folder 'no/such' does not exist",
        ),
    ],
)
def test_errors_are_one_red_line_without_traceback(args, message, factory_file: Path, capsys) -> None:
    code = main([a.replace("{factory}", str(factory_file)) for a in args])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out


def test_a_factory_in_a_file_that_is_not_python_says_so(tmp_path: Path, capsys) -> None:
    """Fault injected: a JSON file named as the module, which gave "cannot import ...: AssertionError: "."""
    problem = tmp_path / "good.json"
    problem.write_text("{}")
    assert main(["compile", f"{problem}:make", "--devices", "cpu", "--placer", "heft"]) == 2
    err = capsys.readouterr().err
    assert f"cannot import {problem}: it is not a Python file (.py)" in err and "AssertionError" not in err


def test_missing_file_from_the_shell_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = moirai_cli("plan", "missing.json", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == "error: problem file 'missing.json' does not exist"
    result = moirai_cli("--debug", "plan", "missing.json", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_version() -> None:
    result = moirai_cli("--version")
    assert result.returncode == 0 and re.fullmatch(r"moirai \d+\.\d+\.\d+.*\n", result.stdout)


def test_plan_prints_the_summary_and_draws_the_schedule(tmp_path: Path, capsys) -> None:
    root = Path(__file__).resolve().parent.parent
    (example,) = re.findall(r"```json\n(.+?)\n```", (root / "README.md").read_text(), re.DOTALL)
    problem = tmp_path / "problem.json"
    problem.write_text(example)
    picture = tmp_path / "plan.svg"
    assert main(["plan", str(problem), "--placer", "milp", "--gantt", str(picture), "--timeline"]) == 0
    out = capsys.readouterr().out
    assert "gpu0" in out and "gpu1" in out and "gap 0.0%" in out and "stopped: gap closed" in out
    assert picture.read_text().lstrip().startswith("<?xml")


def test_a_missing_folder_is_named_as_the_folder_not_as_a_missing_file(tmp_path: Path) -> None:
    """An output path in a folder that does not exist read 'no such file: .../missing/plan.json'."""
    from moirai.cli import _os_error_message

    into_missing = str(tmp_path / "missing" / "plan.json")
    message = _os_error_message(FileNotFoundError(2, "No such file or directory", into_missing))
    assert message == f"no such folder: {tmp_path / 'missing'} (for {into_missing})"
    missing_file = str(tmp_path / "plan.json")
    assert _os_error_message(FileNotFoundError(2, "No such file", missing_file)) == f"no such file: {missing_file}"
