"""The command line: compile a model from a factory, plan a Problem, errors as one red line."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

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

NOT_CALLABLE = 5

def gives_text():
    return torch.nn.Linear(2, 2), "abc"

class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, *, scale):
        return self.linear(x) * scale

def with_keywords():
    torch.manual_seed(0)
    return Scaled(), (torch.randn(2, 8),), {"scale": torch.full((1,), 3.0)}

def keywords_not_a_dict():
    return Scaled(), (torch.randn(2, 8),), [3.0]
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
        # Before the factory builds the model; a folder was a file that "does not exist".
        (
            ["compile", "{factory}:missing", "--devices", "cpu,cpu", "--calibration", "{tmp}"],
            "is a folder, not a calibration file",
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
        # The picture replaced the plan, and the plan the problem or the factory's file, with exit code 0.
        (
            ["plan", "{factory}", "--output", "{tmp}/same.png", "--gantt", "{tmp}/./same.png"],
            "--gantt '{tmp}/./same.png' name one file: the picture would replace the plan",
        ),
        (["plan", "{factory}", "--output", "{factory}"], "is the problem file this command reads"),
        (["plan", "{factory}", "--output", "{tmp}/../{tmp_name}/my_models.py"], "is the problem file"),
        (["compile", "{factory}:make", "--devices", "cpu", "--output", "{factory}"], "is the factory's file"),
        # Options that were dropped: an empty path wrote nothing, an empty device name was left out, a limit unused.
        (["plan", "{factory}", "--output", ""], "cannot write the plan to '': the path is empty"),
        (["compile", "{factory}:make", "--devices", "cpu", "--gantt", ""], "Gantt picture to '': the path is empty"),
        (["compile", "{factory}:make", "--devices", "cpu,,cpu"], "--devices 'cpu,,cpu': device 2 of the list is empty"),
        (["compile", "{factory}:make", "--devices", "cpu,"], "device 2 of the list is empty"),
        (
            ["plan", "{factory}", "--placer", "heft", "--time-limit", "5"],
            "--time-limit: placer 'heft' takes no time limit; leave --time-limit out, or choose a placer that takes "
            "one (getf, milp, pesto)",
        ),
        (["demo", "--placer", "heft", "--time-limit", "-5"], "--time-limit: placer 'heft' takes no time limit"),
        (["demo", "--placer", "pesto", "--time-limit", "-5"], "--time-limit -5.0: give a non-negative number"),
        # One line: the placement's progress line came first.
        (["plan", "{factory}", "--placer", "milp", "--time-limit", "nan"], "--time-limit nan: give a non-negative"),
        # Nothing printed before: the demo's banner came first.
        (["demo", "--placer", "nope"], "unknown placer 'nope'; choose one of contiguous, cp_pct, "),
        (["plan", "{factory}", "--placer", "nope"], "unknown placer 'nope'; choose one of contiguous, cp_pct, "),
        (["plan", "{factory}", "--objective", "x"], "--objective 'x': unknown objective 'x'; choose one of latency, "),
        (["plan", "{factory}", "--output", "{factory}/x.json"], "'{factory}' is a file, not a folder"),
        (["compile", "{factory}:NOT_CALLABLE", "--devices", "cpu"], ":NOT_CALLABLE is not callable (it is int 5)"),
        (["compile", "{factory}:gives_text", "--devices", "cpu"], "gave example inputs of type str; give a tensor"),
        (["compile", "{factory}:keywords_not_a_dict", "--devices", "cpu"], "gave example_kwargs of type list"),
        (["compile", "{tmp}:make", "--devices", "cpu"], "cannot import {tmp}: it is a folder; name the .py file"),
        (["compile", "{tmp}/tiny.txt:make", "--devices", "cpu"], "there is no file '{tmp}/tiny.txt'"),
        # A minute of measuring, then nothing saved; a world of 100000 ranks hung.
        (["calibrate", "--save", "", "--output", "{tmp}/c.toml"], "cannot write the calibration to '': the path is"),
        (
            ["calibrate", "--world-size", "100000", "--output", "{tmp}/c.toml"],
            "calibration runs 100000 local gloo ranks",
        ),
        # Twenty seconds of measuring nothing, then an error naming neither option.
        (["calibrate", "--max-size-mb", "0", "--output", "{tmp}/c.toml"], "--max-size-mb 0: give a number of MiB"),
        (["calibrate", "--max-size-mb", "nan", "--output", "{tmp}/c.toml"], "--max-size-mb nan: give a number"),
        (["calibrate", "--max-size-mb", "1e6", "--output", "{tmp}/c.toml"], "--max-size-mb 1e+06: give a number"),
        (["calibrate", "--repeats", "0", "--output", "{tmp}/c.toml"], "--repeats 0: give at least 1"),
        # Fifty seconds of measuring, then the calibration in place of the cluster file.
        (["calibrate", "--output", "{tmp}/c.toml", "--save", "{tmp}/./c.toml"], "name one file: the calibration"),
    ],
)
def test_errors_are_one_red_line_without_traceback(args, message, factory_file: Path, capsys) -> None:
    tmp = factory_file.parent
    fill = {"{factory}": str(factory_file), "{tmp_name}": tmp.name, "{tmp}": str(tmp)}
    args, message = [_filled(a, fill) for a in args], _filled(message, fill)
    code = main(args)
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""  # no banner, summary or table before the error
    assert factory_file.read_text() == textwrap.dedent(FACTORY)  # nothing written over an input
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out


def test_output_over_a_factory_named_as_a_module_is_refused(factory_file: Path, monkeypatch, capsys) -> None:
    """``my_models:make`` (the README's form) names the factory's file by module: --output my_models.py replaced it
    with the plan, exit code 0."""
    monkeypatch.chdir(factory_file.parent)
    monkeypatch.delitem(sys.modules, "my_models", raising=False)  # another test's file of that name, imported
    code = main(["compile", "my_models:make", "--devices", "cpu", "--output", "my_models.py", "--calibration", "none"])
    assert code == 2 and "is the factory's file this command reads" in capsys.readouterr().err
    assert factory_file.read_text() == textwrap.dedent(FACTORY)


def _filled(text: str, fill: dict[str, str]) -> str:
    for key, value in fill.items():
        text = text.replace(key, value)
    return text


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch, capsys) -> None:
    """Ctrl-C printed a traceback of 16 to 28 frames."""
    import moirai.cli

    def interrupted(*args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(moirai.cli, "_plan", interrupted)
    assert main(["plan", "p.json"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "moirai: interrupted\n" and captured.out == ""
    with pytest.raises(KeyboardInterrupt):
        main(["--debug", "plan", "p.json"])


def _readme_problem(tmp_path: Path) -> Path:
    root = Path(__file__).resolve().parent.parent
    (example,) = re.findall(r"```json\n(.+?)\n```", (root / "README.md").read_text(), re.DOTALL)
    problem = tmp_path / "problem.json"
    problem.write_text(example)
    return problem


def test_a_warning_is_one_moirai_line_and_the_api_user_sees_their_own_line(tmp_path: Path, capsys) -> None:
    """The milp placer's warning showed moirai's source file and line, a UserWarning of Python's form."""
    import warnings

    import moirai

    problem = _readme_problem(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["plan", str(problem), "--placer", "milp", "--time-limit", "0"]) == 0
    err = capsys.readouterr().err
    assert "moirai: warning: the time budget ran out building the MILP" in err
    assert "UserWarning" not in err and ".py:" not in err
    with pytest.warns(moirai.MoiraiWarning, match="time budget ran out") as record:
        moirai.place(moirai.Problem.from_json(problem), placer="milp", time_limit_s=0)
    assert record[0].filename == __file__


@pytest.mark.parametrize("command", ["plan", "compile"])
def test_quiet_leaves_out_the_progress_lines(command: str, factory_file: Path, tmp_path: Path, capsys) -> None:
    args = [str(_readme_problem(tmp_path))] if command == "plan" else [f"{factory_file}:make", "--devices", "cpu"]
    assert main([command, *args, "--placer", "heft"]) == 0
    assert "moirai: place" in capsys.readouterr().err
    assert main([command, *args, "--placer", "heft", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "predicted" in captured.out


def test_outputs_that_differ_go_to_stderr(factory_file: Path, monkeypatch, capsys) -> None:
    def differ(actual: object, expected: object) -> None:
        raise AssertionError("Tensor-likes are not close!")

    monkeypatch.setattr("torch.testing.assert_close", differ)
    assert main(["compile", f"{factory_file}:make", "--devices", "cpu", "--placer", "heft", "--check"]) == 1
    captured = capsys.readouterr()
    assert "outputs differ" in captured.err and "not close" in captured.err and "differ" not in captured.out


def test_a_factory_in_a_file_that_is_not_python_says_so(tmp_path: Path, capsys) -> None:
    """Fault injected: a JSON file named as the module, which gave "cannot import ...: AssertionError: "."""
    problem = tmp_path / "good.json"
    problem.write_text("{}")
    assert main(["compile", f"{problem}:make", "--devices", "cpu", "--placer", "heft"]) == 2
    err = capsys.readouterr().err
    assert f"cannot import {problem}: it is not a Python file (.py)" in err and "AssertionError" not in err


def test_missing_file_from_the_shell_is_one_line_and_debug_shows_the_traceback(tmp_path: Path, capsys) -> None:
    result = moirai_cli("plan", "missing.json", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == "error: problem file 'missing.json' does not exist"
    result = moirai_cli("--debug", "plan", "missing.json", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" in result.stderr  # was 1: the error raised out of main
    for command in ("demo", "placers", "calibrate"):  # after the command too, as after compile and plan
        with pytest.raises(SystemExit) as exited:  # in this process: the parser is the shell's
            main([command, "--debug", "--help"])
        assert exited.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: moirai {command}")


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


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two GPUs: NCCL calibration can run here")
def test_calibrating_nccl_without_two_gpus_says_what_the_machine_lacks(tmp_path, capsys) -> None:
    """It said to give a world size of 0 or fewer, where calibration needs at least two ranks."""
    assert main(["calibrate", "--backend", "nccl", "--output", str(tmp_path / "c.toml")]) == 2
    error = capsys.readouterr().err
    assert "at least 2 local nccl ranks" in error and "--backend gloo" in error and "or fewer" not in error


def test_a_factory_gives_keyword_inputs_as_a_third_item(factory_file: Path, capsys) -> None:
    """A model with keyword inputs could not be compiled from the shell: the error said to pass example_kwargs."""
    code = main(["compile", f"{factory_file}:with_keywords", "--devices", "cpu", "--placer", "heft", "--check"])
    assert code == 0, capsys.readouterr().err
    assert "match" in capsys.readouterr().out
