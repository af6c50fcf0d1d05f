"""Ranks forked from the fork server take rank 0's environment and standard streams as they are when they start
([Note: ranks fork from a server that imported torch once]), and run the user's main-guard check as spawned ones did."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from moirai.runtime.rank_processes import RankInheritance, rank_context

_VARIABLE = "MOIRAI_TEST_RANK_INHERITANCE"


def _report(inheritance: RankInheritance | None) -> None:
    """A rank's first steps: what it sees of rank 0's environment, on the streams it writes to."""
    if inheritance is not None:
        inheritance.apply()
    print(f"out {os.environ.get(_VARIABLE)}", flush=True)
    print(f"err {os.environ.get(_VARIABLE)}", file=sys.stderr, flush=True)


def _run(inheritance: RankInheritance | None) -> None:
    process = rank_context().Process(target=_report, args=(inheritance,))
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 0


@contextmanager
def _streams_to(out: Path, err: Path):  # noqa: ANN202
    """This process's descriptors 1 and 2 into files, as a notebook or pytest redirects them between runs."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    targets = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for path in (out, err)]
    try:
        os.dup2(targets[0], 1), os.dup2(targets[1], 2)
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for descriptor in (*saved, *targets):
            os.close(descriptor)


def test_a_rank_takes_rank_0s_environment_and_streams_as_they_are_when_it_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(_VARIABLE, "when the server started")
    _run(None)  # the fork server runs from here on, with this environment and these streams
    monkeypatch.setenv(_VARIABLE, "now")
    with _streams_to(tmp_path / "out", tmp_path / "err"):
        _run(RankInheritance.of_this_process())
    assert (tmp_path / "out").read_text() == "out now\n"
    assert (tmp_path / "err").read_text() == "err now\n"


def test_without_what_it_inherits_a_forked_rank_would_see_the_servers_environment_and_streams(
    tmp_path, monkeypatch
) -> None:
    """Why RankInheritance exists: the fork server's environment and streams are those of its own start."""
    if rank_context().get_start_method() != "forkserver":
        pytest.skip("ranks are spawned here: they take rank 0's environment and streams at their start anyway")
    monkeypatch.setenv(_VARIABLE, "when the server started")
    _run(None)
    monkeypatch.setenv(_VARIABLE, "now")
    with _streams_to(tmp_path / "out", tmp_path / "err"):
        _run(None)
    assert (tmp_path / "out").read_text() == (tmp_path / "err").read_text() == ""


def _report_limit(inheritance: RankInheritance) -> None:
    inheritance.apply()
    print(f"nofile {resource.getrlimit(resource.RLIMIT_NOFILE)}", flush=True)


def test_a_rank_takes_rank_0s_resource_limits_as_they_are_when_it_starts(tmp_path) -> None:
    """A limit set after the fork server started (a script's open-files cap, a notebook's memory cap) held in
    spawned ranks only: a forked one had the server's."""
    _run(None)  # the fork server runs from here on, with this process's limits as they are now
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = (min(before[0], 512) - 1, before[1])
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, lowered)
        with _streams_to(tmp_path / "out", tmp_path / "err"):
            process = rank_context().Process(target=_report_limit, args=(RankInheritance.of_this_process(),))
            process.start()
            process.join(timeout=120)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
    assert process.exitcode == 0
    assert (tmp_path / "out").read_text() == f"nofile {lowered}\n"


# A script that does its slow work at top level, outside its __main__ guard (loading a model, say): a rank re-imports
# it before it runs any of moirai's code.
_SLOW_AT_TOP_LEVEL = """
import os, sys, time
from pathlib import Path
import torch, moirai

if __name__ == "__mp_main__":
    Path(sys.argv[1]).write_text(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).eval()
    compiled = moirai.compile(model, ["cpu", "cpu"], (torch.randn(2, 8),), placer="round_robin", progress=False)
    compiled.run_distributed(torch.randn(2, 8))
"""


@pytest.mark.slow
def test_a_rank_still_importing_the_main_script_ends_with_rank_0(tmp_path) -> None:
    (tmp_path / "script.py").write_text(_SLOW_AT_TOP_LEVEL)
    pid_file = tmp_path / "rank.pid"
    driver = subprocess.Popen([sys.executable, "script.py", str(pid_file)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert driver.poll() is None and time.monotonic() < deadline, "no rank re-imported the script"
            time.sleep(0.05)
        rank = psutil.Process(int(pid_file.read_text()))
    finally:
        driver.kill()
        driver.wait()
    _, alive = psutil.wait_procs([rank], timeout=5.0)
    assert not alive, "a rank outlived rank 0 while it re-imported the main script"


def test_a_process_forked_from_one_whose_fork_server_runs_spawns_its_ranks() -> None:
    """The server is the child of the process that started it; a forked copy of that process cannot use it."""
    first = rank_context()
    pid = os.fork()
    if pid == 0:  # the child: as a server (gunicorn's workers, say) forked from an app that served already
        os._exit(0 if rank_context().get_start_method() == "spawn" else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert rank_context().get_start_method() == first.get_start_method()


@pytest.mark.slow
def test_a_stopped_rank_whose_fork_server_died_is_killed_at_close_and_the_next_run_starts_a_server() -> None:
    import torch

    import moirai
    from moirai.runtime import DistributedRunner
    from moirai.runtime.rank_processes import started_ranks

    if rank_context().get_start_method() != "forkserver":
        pytest.skip("ranks are spawned here")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    compiled = moirai.compile(model, ["cpu", "cpu"], (x,), placer="round_robin", progress=False, calibration="none")
    runner = DistributedRunner(["cpu", "cpu"], timeout_s=3.0)
    try:
        runner.run(compiled.program, [x])
        (rank,) = started_ranks()
        (server,) = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
        rank.suspend()
        server.kill()
        deadline = time.monotonic() + 10  # left unreaped, as by the kernel's OOM killer: multiprocessing reaps it
        while server.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        runner.close()
    _, alive = psutil.wait_procs([rank], timeout=10.0)
    assert not alive, "a rank whose fork server died outlived its runner's close"
    with torch.no_grad():
        torch.testing.assert_close(compiled.run_distributed(x), model(x))


# A script whose process started a fork server of its own, then forked (a server that forks workers after loading):
# the child's multiprocessing state names a server that is not its child.
_FORKED_AFTER_ITS_OWN_FORK_SERVER = """
import multiprocessing, os, sys
import torch, moirai

def nothing():
    pass

if __name__ == "__main__":
    own = multiprocessing.get_context("forkserver").Process(target=nothing)
    own.start()
    own.join()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    compiled = moirai.compile(model, ["cpu", "cpu"], (x,), placer="round_robin", progress=False, calibration="none")
    pid = os.fork()
    if pid == 0:
        with torch.no_grad():
            same = torch.allclose(compiled.run_distributed(x), model(x), atol=1e-6)
        sys.stdout.flush()
        os._exit(0 if same else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.slow
def test_a_process_forked_from_one_with_its_own_fork_server_still_starts_its_ranks(tmp_path) -> None:
    (tmp_path / "script.py").write_text(_FORKED_AFTER_ITS_OWN_FORK_SERVER)
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_an_unknown_start_method_is_an_input_error_before_anything_starts(monkeypatch) -> None:
    import torch

    import moirai

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    compiled = moirai.compile(model, ["cpu", "cpu"], (x,), placer="round_robin", progress=False, calibration="none")
    monkeypatch.setenv("MOIRAI_RANK_START", "fork")
    with pytest.raises(moirai.InputError, match="MOIRAI_RANK_START is 'fork'; set it to 'fork-server'"):
        compiled.run_distributed(x)
    monkeypatch.setenv("MOIRAI_RANK_START", "spawn")
    assert rank_context().get_start_method() == "spawn"


# Rank 0's script, run from elsewhere: its own sys.path holds its folder, not the working directory.
_STARTS_ONE_RANK = """
import sys
from moirai.runtime.rank_processes import RankStarter

def nothing(rank, inheritance):
    pass

if __name__ == "__main__":
    process = RankStarter().start(1, nothing, (), "moirai-rank1")
    process.join(120)
    sys.exit(process.exitcode)
"""

# What another local user leaves in a shared working directory: modules named as ones a started interpreter imports.
_PLANTED = """
from pathlib import Path
Path({marker!r}).write_text("a planted {name} ran")
raise ImportError("planted")
"""


@pytest.mark.parametrize("method", ["fork-server", "spawn"])
def test_a_rank_process_imports_nothing_from_the_current_directory(tmp_path, method) -> None:
    """Fault injected: a torch.py and a multiprocessing package in rank 0's working directory. multiprocessing starts
    the fork server (which imports torch) and a spawned rank as ``python -c``, which put the directory first on
    sys.path: the planted files ran as this user. Started in safe-path mode, they are never looked at."""
    code, shared = tmp_path / "code", tmp_path / "shared"
    code.mkdir(), (shared / "multiprocessing").mkdir(parents=True)
    (code / "script.py").write_text(_STARTS_ONE_RANK)
    marker = tmp_path / "planted-module-ran"
    for name, path in (("torch", shared / "torch.py"), ("multiprocessing", shared / "multiprocessing" / "__init__.py")):
        path.write_text(_PLANTED.format(marker=str(marker), name=name))
    env = {**os.environ, "MOIRAI_RANK_START": method}
    done = subprocess.run(
        [sys.executable, str(code / "script.py")], cwd=shared, env=env, capture_output=True, text=True, timeout=300
    )
    assert not marker.exists(), marker.read_text()
    assert done.returncode == 0, done.stderr[-3000:]
