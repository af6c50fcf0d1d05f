"""Under torchrun every rank builds its own program: ranks that built other plans or weights fail before any request,
and a rank that never joins (or failed before) is named, not a store timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moirai
from moirai.errors import DistributedError
from moirai.runtime.agreement import part_weights, plan_difference, program_digest, weights_difference
from moirai.runtime.blame import report_setup_failure, wait_for_ranks
from moirai.runtime.store import RunStore

SCRIPT = """
import os, sys
import torch
import moirai

rank = int(os.environ["RANK"])
mode, plan, seed = sys.argv[1], sys.argv[2 + (rank != 0)], int(sys.argv[4]) if rank else 0
torch.manual_seed(seed)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6 if rank == 0 or mode != "fails" else 5)]).eval()
x = torch.randn(2, 16)
# A rank that never comes is waited for 4 s; every other mode ends on a report, which a loaded machine may delay
timeout_s = 4 if mode == "absent" else 60
try:
    if mode == "fails":  # rank 1's model does not fit rank 0's plan: its compile fails
        compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="round_robin",
                                  calibration="none", progress=False)
    else:
        compiled = moirai.load(plan, model, example_inputs=(x,), progress=False)
    if rank == 0:
        with compiled.server(timeout_s=timeout_s) as server:
            server.submit(x).result()
    elif mode == "rank":
        compiled.run_rank(timeout_s=timeout_s)
    elif mode != "absent":
        moirai.serve_rank(compiled, timeout_s=timeout_s)
    print(f"RESULT {rank} ran", flush=True)
except moirai.errors.MoiraiError as error:
    print(f"RESULT {rank} {type(error).__name__}: {error}".replace("\\n", " "), flush=True)
"""


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> Path:
    """Two plans of one chain, split after the first op and after the second."""
    folder = tmp_path_factory.mktemp("plans")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)]).eval()
    compiled = moirai.compile(
        model, ["cpu", "cpu"], (torch.randn(2, 16),), placer="round_robin", calibration="none", progress=False
    )
    compiled.save(folder / "a.json")
    placement = compiled.plan.placement.copy()
    placement[:] = [0] * (len(placement) // 2 + 1) + [1] * (len(placement) - len(placement) // 2 - 1)
    other = compiled.with_plan(moirai.planning.plan.Plan(placement=placement, device_names=compiled.plan.device_names))
    other.save(folder / "b.json")
    (folder / "ranks.py").write_text(SCRIPT)
    return folder


def _torchrun(folder: Path, mode: str, plan_1: str, seed_1: int) -> dict[int, str]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.pop("MOIRAI_RUN_SECRET", None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "ranks.py"]
        + [mode, "a.json", plan_1, str(seed_1)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )
    lines = [line.split(" ", 2) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return {int(rank): said for _, rank, said in lines}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rank", "server"])
def test_ranks_that_loaded_other_plans_fail_before_any_request(plans: Path, mode: str) -> None:
    said = _torchrun(plans, mode, "b.json", 0)
    assert said.keys() == {0, 1}, said
    for words in said.values():  # were silently wrong outputs
        assert words.startswith("PlanError: rank 1 runs another plan than rank 0"), words


@pytest.mark.slow
def test_a_rank_with_other_weights_fails_before_any_request(plans: Path) -> None:
    said = _torchrun(plans, "server", "a.json", 1)
    assert said.keys() == {0, 1}, said
    for words in said.values():
        assert words.startswith("PlanError: rank 1's part holds other weights than rank 0's copy of it"), words


@pytest.mark.slow
def test_a_rank_that_never_joins_is_named(plans: Path) -> None:
    said = _torchrun(plans, "absent", "a.json", 0)
    # was a raw DistStoreError from init_process_group naming a store key
    assert said[0].startswith("DistributedError: rank 1 did not get to joining the process group within 4 s"), said


@pytest.mark.slow
def test_a_rank_whose_compile_failed_is_named_with_its_error(plans: Path) -> None:
    said = _torchrun(plans, "fails", "a.json", 0)
    assert said[1].startswith("PlanError"), said
    # was a raw DistStoreError from shm.connect's wait, 4 s later
    assert said[0].startswith("DistributedError: rank 1 failed before saying which host it is on"), said
    assert "PlanError" in said[0]


def _chain(seed: int, layers: int = 4) -> moirai.CompiledModel:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)]).eval()
    return moirai.compile(
        model, ["cpu", "cpu"], (torch.randn(2, 8),), placer="round_robin", calibration="none", progress=False
    )


def test_digests_tell_plans_and_weights_apart() -> None:
    same, again, reseeded = _chain(0), _chain(0), _chain(1)
    own = program_digest(same.program, 0)
    assert plan_difference(own, program_digest(again.program, 1), 1) is None
    assert weights_difference(part_weights(same.program.parts[1]), program_digest(again.program, 1).weights, 1) is None
    theirs = program_digest(reseeded.program, 1).weights
    assert "rank 1's part holds other weights" in weights_difference(part_weights(same.program.parts[1]), theirs, 1)
    longer = program_digest(_chain(0, layers=5).program, 1)
    assert "rank 1 runs another plan than rank 0" in plan_difference(own, longer, 1)


def test_meta_weights_are_compared_by_shape_alone() -> None:
    compiled = _chain(0)
    real = part_weights(compiled.program.parts[1])
    meta = {name: digest.split(":")[0] + ":" for name, digest in real.items()}
    assert weights_difference(real, meta, 1) is None


def test_waiting_for_ranks_names_one_that_failed_or_never_came() -> None:
    store = RunStore(dist.HashStore(), None)
    store.set("here/1", "1")
    report_setup_failure(store, 2, ValueError("its model is another"))
    with pytest.raises(DistributedError, match="rank 2 failed before joining.+ValueError: its model is another"):
        wait_for_ranks(store, {1: "here/1", 2: "here/2"}, "joining", timeout_s=5.0)
    with pytest.raises(DistributedError, match="rank 3 did not get to joining within 0.2 s"):
        wait_for_ranks(store, {1: "here/1", 3: "here/3"}, "joining", timeout_s=0.2)
