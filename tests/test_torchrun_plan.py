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
