"""Progress lines: one per long stage where stderr is a log, silent with progress=False or outside compile."""

import contextlib
import io
import re

import pytest
import torch
from rich.console import Console

import moirai
from moirai import progress
from moirai.cluster.calibration import cache as calibration_cache
from moirai.cluster.calibration.fit import TransferCost, link_kind
from moirai.cluster.calibration.request_cost import RequestCost


def log_console() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, force_jupyter=False)


def fake_calibration(monkeypatch, tmp_path) -> list[str]:  # noqa: ANN001
    """An empty calibration cache whose measurements return at once; the list names each measurement made."""
    monkeypatch.setenv("MOIRAI_CACHE_DIR", str(tmp_path / "cache"))
    made: list[str] = []

    def links(pair: tuple[str, str]) -> dict[str, TransferCost]:
        made.append("calibrate links")
        return {link_kind(*pair): TransferCost(1e-4, 1e9, 1e-5, 1e-10, 1e-5, 1e-10)}

    def requests(link: TransferCost) -> RequestCost:
        made.append("calibrate requests")
        return RequestCost(driver_cpu_s=3e-4, worker_cpu_s=2e-4)

    monkeypatch.setattr(calibration_cache, "_measured_again_if_noise", links)
    monkeypatch.setattr(calibration_cache, "measure_request_cost", requests)
    return made


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


def test_compile_reports_every_stage_on_stderr_unless_progress_is_false(capfd, monkeypatch, tmp_path) -> None:
    calibrations = fake_calibration(monkeypatch, tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="heft")
    stages = re.findall(r"^moirai: ([a-z ]+) \S+ \S+$", capfd.readouterr().err, re.MULTILINE)
    # This machine's first compile calibrates it (seconds, once): the log says so; the next reads the cache.
    calibrating = ["calibrate links", "calibrate requests"]
    assert stages == [*calibrating, "trace", "op graph", "coarsen", "cost", "place", "split"]
    assert calibrations == calibrating
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="heft")
    # Tracing a large model takes seconds: a log says it has started before it ends.
    again = capfd.readouterr().err
    assert re.search(r"^moirai: trace: torch.export", again, re.MULTILINE)
    assert "calibrate" not in again and calibrations == calibrating
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
    # Beyond 999 min, larger units: --time-limit 1e308 printed a limit of some 300 digits of minutes.
    assert [progress.format_seconds(s) for s in (6e4, 3.6e6, 1e308)] == ["16.7 h", "41.7 d", "3.17e+300 years"]
    # A value that rounds to 1000 of its unit shows in the next: "1000 min", "1000 h", "1e+03 ms" before.
    near = (59990.0, 3.5998e6, 86400 * 999.9, 0.9996, float("inf"))
    assert [progress.format_seconds(s) for s in near] == ["16.7 h", "41.7 d", "2.74 years", "1 s", "inf"]


def test_load_reports_its_stages_unless_progress_is_false(tmp_path, capfd) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="heft", progress=False).save(tmp_path / "p.json")
    capfd.readouterr()
    moirai.load(tmp_path / "p.json", model, example_inputs=(x,), progress=False)
    assert "moirai:" not in capfd.readouterr().err
    loaded = moirai.load(tmp_path / "p.json", model, example_inputs=(x,))
    stages = re.findall(r"^moirai: ([a-z ]+) \S+ \S+$", capfd.readouterr().err, re.MULTILINE)
    assert stages == ["trace", "op graph", "split"]  # in compile's order
    torch.testing.assert_close(loaded(x), model(x))


def _small_model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).eval(), torch.randn(2, 8)


def test_progress_false_silences_every_stage_and_the_milps_own_status_line(capfd, monkeypatch) -> None:
    import sys

    import moirai.planning.placers.milp as milp

    opened = []

    class OwnStatusLine(contextlib.nullcontext):
        def update(self, text: str) -> None:
            opened.append(text)

    def own_status_line() -> OwnStatusLine:
        opened.append("status")
        return OwnStatusLine()

    monkeypatch.setattr(milp, "_status", own_status_line)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # where the milp would draw its own line
    model, x = _small_model()
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), time_limit_s=3, progress=False)
    assert capfd.readouterr() == ("", "") and opened == []
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), time_limit_s=3)
    assert opened == [], "inside compile the milp reports through the place stage's line, never a second one"


def test_a_log_gets_a_start_line_with_the_budget_of_a_long_stage(capfd) -> None:
    model, x = _small_model()
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), time_limit_s=3)
    err = capfd.readouterr().err
    assert re.search(r"^moirai: place: milp, limit 3 s\n(.*\n)*moirai: place \S+ \S+$", err, re.MULTILINE), err
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="heft")
    assert "moirai: place:" not in capfd.readouterr().err, "a placer without a time budget is quick: no start line"


def test_a_stage_shows_updates_in_a_log_at_most_every_few_seconds(monkeypatch) -> None:
    console = log_console()
    clock = iter([0.0, 0.0, 1.0, 6.0, 7.0, 7.5, 8.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    with progress.shown(console=console), progress.stage("place", "milp, limit 60 s"):
        progress.update("incumbent 2 ms")  # 1 s after the start: too soon
        progress.update("incumbent 1 ms")  # 6 s: shown
        progress.update("incumbent 0.9 ms")  # 7 s: too soon after the last
    assert console.file.getvalue().splitlines() == [
        "moirai: place: milp, limit 60 s",
        "moirai: place: incumbent 1 ms",
        "moirai: place 7.5 s",
    ]


def test_only_rank_0_reports_under_torchrun(monkeypatch) -> None:
    def reported() -> str:
        console = log_console()
        with progress.shown(console=console), progress.stage("place"):
            pass
        return console.file.getvalue()

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert reported() == ""
    monkeypatch.setenv("RANK", "0")
    assert "moirai: place" in reported()
    # RANK alone (no WORLD_SIZE) is no torchrun world, as compile, server() and run_rank take it: this rank reports.
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "1")
    assert "moirai: place" in reported()


@pytest.mark.slow
def test_a_compiled_models_workers_report_as_it_was_compiled_unless_a_call_says(capfd) -> None:
    """progress=False at compile left run_distributed printing "moirai: start workers" to a log."""
    model, x = _small_model()
    quiet = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="round_robin", progress=False)
    with torch.no_grad():
        torch.testing.assert_close(quiet.run_distributed(x), model(x))
        with quiet.server() as server:
            server.submit(x).result()
        assert "moirai:" not in capfd.readouterr().err
        quiet.run_distributed(x, progress=True)  # the call's own argument wins
        assert "moirai: start workers" in capfd.readouterr().err
        loud = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="round_robin")
        capfd.readouterr()
        with loud.server() as server:  # its workers start at the first request, after server() returned
            server.submit(x).result()
        assert "moirai: start workers" in capfd.readouterr().err
        loud.run_distributed(x, progress=False)
        assert "moirai:" not in capfd.readouterr().err


def test_a_log_gets_each_line_whole_however_long() -> None:
    """A log's lines were cut at 80 columns, the rest on a line of its own without the moirai: prefix."""
    console = log_console()
    long_plan = "the runtime's own work per request, once for this machine (then cached) " + "x" * 60
    with progress.shown(console=console), progress.stage("calibrate requests", long_plan):
        pass
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 2 and all(line.startswith("moirai: calibrate requests") for line in lines), lines
    assert lines[0] == f"moirai: calibrate requests: {long_plan}"
