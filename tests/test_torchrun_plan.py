"""Under torchrun rank 0 plans and every other rank takes its plan through the store: no rank plans on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, os, sys
import torch
import moirai
import moirai.compile as compile_module

rank = int(os.environ["RANK"])
if rank != 0:
    def refuse(*args, **kwargs):
        raise AssertionError("a rank other than 0 planned")
    compile_module.place = refuse
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)]).eval()
x = torch.randn(2, 32)
# Two compiles: the second pairs with rank 0's second plan, not its first.
first = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="round_robin", calibration="none")
second = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="heft", calibration="none")
y = second.run_rank(x) if rank == 0 else second.run_rank()
if rank == 0:
    with torch.no_grad():
        assert torch.allclose(y, model(x), atol=1e-6)
print("PLANS " + json.dumps([rank, first.node_device, second.node_device, second.plan.objective_s]), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("secret", [None, "ab" * 32], ids=["torchrun store", "sealed store"])
def test_every_rank_gets_rank_0s_plan_through_the_store(tmp_path: Path, secret: str | None) -> None:
    (tmp_path / "plan.py").write_text(SCRIPT)
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.pop("MOIRAI_RUN_SECRET", None)
    if secret is not None:
        environment["MOIRAI_RUN_SECRET"] = secret
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "plan.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env=environment,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("PLANS ")]
    reports = sorted(json.loads(line.removeprefix("PLANS ")) for line in lines)
    assert [report[0] for report in reports] == [0, 1]
    assert reports[0][1:] == reports[1][1:]


@pytest.fixture(scope="module")
def rank_0s_record() -> dict:
    """What rank 0 hands over (``CompiledModel.plan_record``) for a small model on two CPUs."""
    import torch

    import moirai

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]).eval()
    compiled = moirai.compile(
        model, ["cpu", "cpu"], (torch.randn(2, 8),), placer="round_robin", calibration="none", progress=False
    )
    return json.loads(json.dumps(compiled.plan_record()))


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        # were a raw ValueError and TypeError inside from_plan_record
        ("node_device", "x", "'node_device' is"),
        ("groups", 5, "'groups' is '5', not a list of lists of op names"),
        ("format", 2, "not a moirai plan of format 1"),
    ],
)
def test_rank_0s_plan_is_checked_field_by_field_as_a_plan_file_is(rank_0s_record, key, value, words) -> None:
    import torch.distributed as dist

    from moirai.errors import PlanError
    from moirai.plan_records import PlanHandover
    from moirai.runtime.store import RunStore

    record = json.loads(json.dumps(rank_0s_record))
    record[key] = {name: value for name in record[key]} if key == "node_device" else value
    handover = PlanHandover(RunStore(dist.HashStore(), None), 1, ["cpu", "cpu"], named_hosts=True)
    handover.store.set(handover.key, json.dumps(record))
    with pytest.raises(PlanError, match="rank 0's plan") as error:
        handover.receive()
    assert words in str(error.value) and "the same moirai and torch on every rank" in str(error.value)
