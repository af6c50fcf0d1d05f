"""Mistakes and failures in a distributed run end in one moirai error that names the option or the guilty rank."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

import moirai
from moirai.errors import DistributedError, InputError
from moirai.runtime import DistributedRunner, run_distributed
from moirai.runtime.distributed import run_rank

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def chain():
    """A plan through three devices: rank 0 -> rank 1 -> rank 2 -> outputs back to rank 0."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)]).eval()
    compiled = moirai.compile(model, ["cpu"] * 3, example_inputs=(torch.randn(2, 32),), placer="round_robin")
    assert [(t.src, t.dst) for t in compiled.program.transfers] == [(0, 1), (1, 2)]
    return model, compiled


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), True, "60"])
def test_timeout_must_be_positive(chain, timeout_s) -> None:
    _, compiled = chain
    x = torch.randn(2, 32)
    for call in (
        lambda: DistributedRunner(["cpu", "cpu"], timeout_s=timeout_s),
        lambda: run_distributed(compiled.program, [x], ["cpu"] * 3, timeout_s=timeout_s),
        lambda: compiled.run_distributed(x, timeout_s=timeout_s),
        lambda: compiled.server(timeout_s=timeout_s),
        lambda: run_rank(compiled.program, 0, 3, [x], ["cpu"] * 3, timeout_s=timeout_s),
    ):
        with pytest.raises(InputError, match="timeout_s must be a positive number of seconds"):
            call()


@pytest.mark.parametrize("max_in_flight", [0, -2, 1.5, True, 2050])
def test_max_in_flight_must_be_an_integer_the_message_tags_allow(chain, max_in_flight) -> None:
    """Over the tags' window, requests in flight reused each other's tags (every one failed as if forged)."""
    _, compiled = chain
    with pytest.raises(InputError, match="max_in_flight must be an integer from 1 to 2040"):
        DistributedRunner(["cpu"], max_in_flight=max_in_flight)
    with pytest.raises(InputError, match="max_in_flight must be an integer from 1 to 2040"):
        compiled.server(max_in_flight=max_in_flight)


@pytest.mark.slow
def test_script_without_main_guard_gets_one_error_saying_to_add_it(tmp_path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import moirai

            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).eval()
            x = torch.randn(2, 8)
            compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="round_robin")
            print(compiled.run_distributed(x))
            """
        )
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stderr.count("Traceback") == 1, result.stderr[-3000:]
    assert "moirai.errors.DistributedError" in result.stderr
    assert "the worker processes re-import your script, and it starts a distributed run" in result.stderr
    assert 'if __name__ == "__main__":' in result.stderr
    assert "bootstrapping phase" not in result.stderr


def test_world_size_must_equal_the_plans_devices(chain) -> None:
    _, compiled = chain
    with pytest.raises(InputError, match="needs exactly 3 ranks, one per device.*this run has 4 ranks"):
        run_rank(compiled.program, 1, 4, None, ["cpu"] * 4)


@pytest.mark.slow
def test_hung_rank_is_named_by_the_driver_and_by_the_rank_waiting_for_it(chain, capfd) -> None:
    model, compiled = chain
    timeout_s = 3.0
    x = torch.randn(2, 32)
    with DistributedRunner(["cpu"] * 3, timeout_s=60.0) as runner:
        with torch.no_grad():
            torch.testing.assert_close(runner.run(compiled.program, [x])[0], model(x))
        hung = runner._workers[0].pid  # rank 1
        os.kill(hung, signal.SIGSTOP)
        try:
            started = time.monotonic()
            futures = [runner.submit(compiled.program, [x], timeout_s=timeout_s) for _ in range(3)]
            errors = []
            for future in futures:
                with pytest.raises(DistributedError) as failure:
                    future.result(timeout=120.0)
                errors.append(str(failure.value))
            elapsed_s = time.monotonic() - started
            # Rank 2 gives up on rank 1 a little after rank 0 does: let it name rank 1 first, before the close.
            deadline, said = time.monotonic() + 30.0, ""
            while "moirai rank 2:" not in said and time.monotonic() < deadline:
                time.sleep(0.1)
                said += capfd.readouterr().err
        finally:
            with contextlib.suppress(ProcessLookupError):  # the restart after the failure kills the hung rank
                os.kill(hung, signal.SIGCONT)
    assert all(error.startswith("rank 1 (cpu) hung or died") for error in errors), errors[0]
    assert elapsed_s < timeout_s + 15.0
    said += capfd.readouterr().err
    rank_2 = [line for line in said.splitlines() if line.startswith("moirai rank 2:")]
    assert rank_2 and all(re.search(r"rank 1 \(cpu\) hung or died", line) for line in rank_2), rank_2


@pytest.mark.slow
def test_dead_middle_rank_is_named_not_the_rank_waiting_for_it(chain) -> None:
    _, compiled = chain
    x = torch.randn(2, 32)
    with DistributedRunner(["cpu"] * 3, timeout_s=5.0) as runner:
        runner.run(compiled.program, [x])
        os.kill(runner._workers[0].pid, signal.SIGKILL)  # rank 1; rank 2 waits for it, rank 0 waits for rank 2
        with pytest.raises(DistributedError) as failure:
            runner.run(compiled.program, [x])
    message = str(failure.value)
    assert message.startswith("rank 1 (cpu) hung or died"), message
    assert "exited with code -9" in message.splitlines()[0]


TORCHRUN_SCRIPT = """
import os, signal, threading, time
from pathlib import Path
import torch
import moirai

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)]).eval()
x = torch.randn(2, 32)
compiled = moirai.compile(model, ["cpu"] * 3, example_inputs=(x,), placer="round_robin")
rank = int(os.environ["RANK"])


def stop_once_serving():  # rank 1 stops itself once rank 0 has had an answer: the ranks are serving
    while not Path("served").exists():
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGSTOP)


if rank == 1:
    threading.Thread(target=stop_once_serving, daemon=True).start()
try:
    if rank == 0:
        with compiled.server(timeout_s=3) as server:
            while True:
                server.submit(x).result()
                Path("served").touch()
                time.sleep(0.05)
    else:
        moirai.serve_rank(compiled, timeout_s=3)
except moirai.DistributedError as error:
    print(f"RANK {rank} ERROR: {str(error).splitlines()[0]}", flush=True)
    os._exit(0)
"""


@pytest.mark.slow
def test_stopped_torchrun_rank_is_named_by_every_other_rank(tmp_path) -> None:
    (tmp_path / "hang.py").write_text(TORCHRUN_SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    process = subprocess.Popen(
        [str(torchrun), "--nproc-per-node", "3", "hang.py"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 240.0
    assert process.stdout is not None
    while time.monotonic() < deadline and len([line for line in lines if line.startswith("RANK ")]) < 2:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        lines.append(line)
    # torchrun starts its ranks in sessions of their own: kill them by name, or the stopped rank 1 stays forever.
    try:
        ranks = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    os.killpg(process.pid, signal.SIGKILL)
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
    process.wait()
    reports = sorted(line.strip() for line in lines if line.startswith("RANK "))
    assert [r.split(" ERROR")[0] for r in reports] == ["RANK 0", "RANK 2"], "".join(lines[-40:])
    assert all("rank 1 (cpu) hung or died" in r for r in reports), reports
