"""Progress lines: one per long stage where stderr is a log, silent with progress=False or outside compile."""

import io
import re

import torch
from rich.console import Console

import moirai
from moirai import progress


def log_console() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, force_jupyter=False)


def test_a_stage_reports_its_time_once_inside_shown_and_never_outside() -> None:
    console = log_console()
    with progress.stage("outside"):
        pass
    with progress.shown(console=console):
        with progress.stage("place"):
            with progress.stage("heft inside place"):
                pass
    with progress.shown(enabled=False, console=console), progress.stage("silenced"):
        pass
    assert re.fullmatch(r"moirai: place \d+(\.\d+)? [mun]?s\n", console.file.getvalue())


def test_a_terminal_gets_a_tick_and_the_time() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, color_system=None, force_jupyter=False)
    with progress.shown(console=console), progress.stage("trace"):
        pass
    assert "✓ trace" in console.file.getvalue()


def test_compile_reports_every_stage_on_stderr_unless_progress_is_false(capfd) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="heft")
    stages = re.findall(r"^moirai: ([a-z ]+) \S+ \S+$", capfd.readouterr().err, re.MULTILINE)
    assert stages == ["trace", "op graph", "coarsen", "cost", "place", "split"]
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="heft", progress=False)
    assert "moirai:" not in capfd.readouterr().err


def test_format_seconds_is_compact() -> None:
    assert [progress.format_seconds(s) for s in (3e-8, 1.5e-5, 0.0123, 0.999, 1.0, 75.0, 7200.0)] == [
        "30 ns",
        "15 us",
        "12.3 ms",
        "999 ms",
        "1 s",
        "1.25 min",
        "120 min",
    ]


def test_load_reports_its_stages_unless_progress_is_false(tmp_path, capfd) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="heft", progress=False).save(tmp_path / "p.json")
    capfd.readouterr()
    moirai.load(tmp_path / "p.json", model, example_inputs=(x,), progress=False)
    assert "moirai:" not in capfd.readouterr().err
    loaded = moirai.load(tmp_path / "p.json", model, example_inputs=(x,))
    assert re.findall(r"^moirai: (trace|split) ", capfd.readouterr().err, re.MULTILINE) == ["trace", "split"]
    torch.testing.assert_close(loaded(x), model(x))
