"""One answer to "is this a run of several ranks, and which rank am I?" (:func:`moirai.environment.torchrun_world`)
everywhere: compile, server(), run_rank, serve_rank, the progress lines and ``moirai calibrate`` read the same
environment alike. A world of one rank is a local run; a malformed variable is an InputError naming it."""

from __future__ import annotations

import pytest
import torch

import moirai
from moirai.cli import main
from moirai.environment import TorchrunWorld, torchrun_world
from moirai.errors import InputError
from moirai.runtime import distributed
from moirai.runtime.hosts import torchrun_layout

# What `torchrun --nproc-per-node 1` sets.
ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}


@pytest.mark.parametrize(
    ("environment", "world"),
    [
        ({}, None),
        (ONE_RANK, None),  # a world of one rank: a local run
        ({"RANK": "0", "WORLD_SIZE": "1"}, None),
        ({"RANK": "1"}, None),  # no WORLD_SIZE: no world
        ({"RANK": "", "WORLD_SIZE": "2"}, None),  # an empty variable is an unset one, as torchrun_layout reads it
        ({"RANK": "1", "WORLD_SIZE": "2"}, TorchrunWorld(1, 2)),  # a group the user set up
        ({**ONE_RANK, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}, TorchrunWorld(3, 4)),
    ],
)
def test_the_world_is_read_from_rank_and_world_size(environment: dict[str, str], world: TorchrunWorld | None) -> None:
    assert torchrun_world(environment) == world


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [("RANK", "abc", "RANK='abc' is not an integer"), ("WORLD_SIZE", "2.0", "WORLD_SIZE='2.0' is not an integer")],
)
def test_a_variable_that_is_no_integer_is_named(variable: str, value: str, words: str) -> None:
    environment = {**ONE_RANK, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", variable: value}
    with pytest.raises(InputError, match=words):
        torchrun_world(environment)
    with pytest.raises(InputError, match=words):
        torchrun_layout(environment)
    with pytest.raises(InputError, match="LOCAL_RANK='x' is not an integer"):
        torchrun_layout({**ONE_RANK, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "x"})
    with pytest.raises(InputError, match="RANK=2 and WORLD_SIZE=2 do not fit"):
        torchrun_world({"RANK": "2", "WORLD_SIZE": "2"})


@pytest.fixture(scope="module")
def model_on_two_cpus() -> tuple[torch.nn.Module, torch.Tensor, moirai.CompiledModel]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).eval()
    x = torch.randn(2, 8)
    compiled = moirai.compile(model, ["cpu", "cpu"], (x,), placer="round_robin", calibration="none", progress=False)
    return model, x, compiled


def test_a_world_of_one_rank_is_a_local_run_everywhere(monkeypatch, model_on_two_cpus) -> None:
    """Under `torchrun --nproc-per-node 1` compile planned here and run_distributed ran, but server() and run_rank
    took the world of one rank as torchrun's and refused a plan of two devices."""
    model, x, _ = model_on_two_cpus
    for variable, value in ONE_RANK.items():
        monkeypatch.setenv(variable, value)
    compiled = moirai.compile(model, ["cpu", "cpu"], (x,), placer="round_robin", calibration="none", progress=False)
    assert len(set(compiled.node_device.values())) == 2  # planned here, on both devices
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(compiled.run_rank(x, progress=False), expected)
        with compiled.server(progress=False) as server:
            torch.testing.assert_close(server.submit(x).result(timeout=60), expected)
    with pytest.raises(InputError, match="serve_rank runs under torchrun with two ranks or more"):
        moirai.serve_rank(compiled)


def test_a_rank_that_is_no_integer_is_named_by_every_entry_point(monkeypatch, model_on_two_cpus, capsys) -> None:
    model, x, compiled = model_on_two_cpus
    monkeypatch.setenv("RANK", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    named = pytest.raises(InputError, match="RANK='abc' is not an integer")
    with named:
        moirai.compile(model, ["cpu", "cpu"], (x,), placer="round_robin", calibration="none", progress=False)
    with named:
        moirai.compile(model, ["cpu", "cpu"], (x,), placer="round_robin", calibration="none")
    with named:
        compiled.server(progress=False)
    with named:
        compiled.run_rank(x, progress=False)
    with named:
        moirai.serve_rank(compiled)
    with named:
        distributed.serve_rank(compiled.program, compiled.cluster.devices)
    assert main(["calibrate", "--output", "never.json"]) == 2
    assert "RANK='abc' is not an integer" in capsys.readouterr().err


def test_a_stray_rank_does_not_stop_what_uses_no_ranks(monkeypatch, tmp_path, capsys) -> None:
    """Planning a problem file uses no ranks: a RANK left over in the shell (malformed, or outside its world) failed
    `moirai plan` in its progress lines; they report, as outside torchrun."""
    problem = tmp_path / "p.json"
    moirai.Problem.from_dict(_TINY_PROBLEM).to_json(problem)
    for rank, world_size in (("abc", "2"), ("3", "2")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world_size)
        assert main(["plan", str(problem), "--placer", "heft"]) == 0
        assert "moirai: place" in capsys.readouterr().err


_TINY_PROBLEM = {
    "devices": [{"name": "a"}, {"name": "b"}],
    "tasks": [{"name": "x", "compute_s": [1.0, 2.0]}, {"name": "y", "compute_s": [1.0, 1.0]}],
    "edges": [{"src": "x", "dst": "y", "tensor": "t", "transfer_s": [[0, 0.1], [0.1, 0]]}],
}


def test_a_plan_on_other_hosts_is_refused_by_a_local_run(monkeypatch, model_on_two_cpus) -> None:
    """run_rank outside torchrun (and server(), run_distributed) runs every device's part here: a plan of server-a
    and server-b ran both hosts' parts on this machine, silently, where it is meant for torchrun on those hosts."""
    model, x, _ = model_on_two_cpus
    for variable in ONE_RANK:
        monkeypatch.delenv(variable, raising=False)
    devices = [{"name": n, "type": "cpu", "host": h} for n, h in (("a", "server-a"), ("b", "server-b"))]
    links = [{"src": "a", "dst": "b", "bandwidth_gbps": 10, "both_directions": True}]
    cluster = moirai.Cluster.from_dict({"devices": devices, "links": links})
    compiled = moirai.compile(model, cluster, (x,), placer="round_robin", progress=False)
    elsewhere = "this plan's devices are on hosts server-a, server-b: run it under torchrun on those hosts"
    with pytest.raises(InputError, match=elsewhere):
        compiled.run_rank(x, progress=False)
    with pytest.raises(InputError, match=elsewhere):
        compiled.server(progress=False)
    with pytest.raises(InputError, match=elsewhere):
        compiled.run_distributed(x, progress=False)
    assert torch.equal(compiled(x), model(x))  # one process checks the outputs anywhere
