"""Link calibration: what a transfer costs inside the runtime, its cache, and how it reaches the Problem."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import moirai
import moirai.cluster.calibration.cache as cache_module
import moirai.cluster.calibration.measure as measure_module
from moirai.cluster.calibration import (
    HostLink,
    RequestCost,
    TransferCost,
    TransferTimings,
    calibrate,
    costs_by_kind,
    local_calibration,
    local_request_cost,
    measure_request_cost_spread,
    measure_transfer_costs,
    read_calibration,
    read_host_links,
    read_request_cost,
    write_calibration,
)
from moirai.cluster.calibration.cache import calibration_cache_path, check_calibration
from moirai.cluster.calibration.cluster import local_cluster
from moirai.cluster.calibration.request_cost import MeasuredRequestCost, request_cost_of
from moirai.cluster.devices import Cluster
from moirai.errors import ClusterError, DistributedError
from moirai.planning.problem import Problem

SIZES = (1024, 65536, 1 << 20, 4 << 20)
FAKE_COST = TransferCost(
    latency_s=300e-6,
    bandwidth_bytes_per_s=0.5e9,
    sender_cpu_s=40e-6,
    sender_cpu_s_per_byte=1e-10,
    receiver_cpu_s=60e-6,
    receiver_cpu_s_per_byte=2e-10,
)
FAKE_REQUESTS = RequestCost(driver_cpu_s=120e-6, worker_cpu_s=25e-6, driver_alone_cpu_s=80e-6)
FAKE_MEASURED_REQUESTS = MeasuredRequestCost(FAKE_REQUESTS, RequestCost(driver_cpu_s=30e-6, worker_cpu_s=10e-6))


def test_fit_recovers_the_three_lines() -> None:
    sizes = np.array(SIZES, float)
    timings = TransferTimings(
        SIZES,
        tuple(FAKE_COST.delay_s(s) for s in sizes),
        tuple(FAKE_COST.sender_cpu_time_s(s) for s in sizes),
        tuple(FAKE_COST.receiver_cpu_time_s(s) for s in sizes),
    )
    fitted = timings.fit()
    for field in ("latency_s", "bandwidth_bytes_per_s", "sender_cpu_s", "receiver_cpu_s_per_byte"):
        assert getattr(fitted, field) == pytest.approx(getattr(FAKE_COST, field), rel=1e-6)


def test_fit_rejects_delays_that_do_not_grow() -> None:
    with pytest.raises(ClusterError, match="does not grow with size"):
        TransferTimings((1000, 10**6), (2e-3, 1e-3), (1e-5, 1e-5), (1e-5, 1e-5)).fit()
    with pytest.raises(ClusterError, match="two different message sizes"):
        TransferTimings((1000, 1000), (1e-3, 1e-3), (1e-5, 1e-5), (1e-5, 1e-5)).fit()


def test_costs_are_kept_per_link_kind_and_one_kind_is_averaged() -> None:
    other = TransferCost(100e-6, 1.5e9, 0.0, 3e-10, 20e-6, 0.0)
    costs = {(0, 1): FAKE_COST, (1, 0): other}
    (averaged,) = costs_by_kind(["cpu", "cpu"], costs).values()
    assert averaged.latency_s == pytest.approx(200e-6) and averaged.sender_cpu_s_per_byte == pytest.approx(2e-10)
    assert costs_by_kind(["cuda:0", "cpu"], costs) == {"cuda->cpu": FAKE_COST, "cpu->cuda": other}


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + self.a(x)


@pytest.fixture
def fake_measurement(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, ...]]:
    """Measurements are faked (no timing): each call records the devices it would have measured."""
    monkeypatch.setenv("MOIRAI_CACHE_DIR", str(tmp_path))
    measured: list[tuple[str, ...]] = []

    def measure(torch_devices, sizes_bytes=(), repeats=0, warmup=0):  # noqa: ANN001, ANN202
        measured.append(tuple(torch_devices))
        return {(0, 1): FAKE_COST, (1, 0): FAKE_COST}

    def measure_requests(link):  # noqa: ANN001, ANN202
        assert link == FAKE_COST, "the request cost is measured after the links, with the CPU link's costs"
        measured.append(("requests",))
        return FAKE_REQUESTS

    monkeypatch.setattr(measure_module, "measure_transfer_costs", measure)
    monkeypatch.setattr(cache_module, "measure_request_cost", measure_requests)
    return measured


def test_calibrated_transfer_terms_reach_the_problem(fake_measurement: list) -> None:
    compiled = moirai.compile(
        TwoLinears().eval(), ["cpu", "cpu"], example_inputs=(torch.randn(8, 64),), placer="heft", calibration="auto"
    )
    problem = compiled.problem
    expected = FAKE_COST.latency_s + problem.tensor_bytes / FAKE_COST.bandwidth_bytes_per_s
    assert problem.num_tensors > 0 and np.all(problem.tensor_bytes > 0)
    np.testing.assert_allclose(problem.transfer_s[:, 0, 1], expected, rtol=1e-12)
    np.testing.assert_allclose(problem.transfer_s[:, 1, 0], expected, rtol=1e-12)
    assert np.all(problem.transfer_s[:, 0, 0] == 0)
    # The sender's CPU time (fixed + per byte) is booked on the sending device, the receiver's on the receiving one.
    sender = FAKE_COST.sender_cpu_s + problem.tensor_bytes * FAKE_COST.sender_cpu_s_per_byte
    receiver = FAKE_COST.receiver_cpu_s + problem.tensor_bytes * FAKE_COST.receiver_cpu_s_per_byte
    for label, expected_cpu in (("send_cpu_s", sender), ("recv_cpu_s", receiver)):
        matrix = getattr(problem, label)
        np.testing.assert_allclose(matrix[:, 0, 1], expected_cpu, rtol=1e-12)
        np.testing.assert_allclose(matrix[:, 1, 0], expected_cpu, rtol=1e-12)
        assert np.all(matrix[:, 0, 0] == 0)
        assert getattr(Problem.from_dict(problem.to_dict()), label).tolist() == matrix.tolist()
    # The runtime's own work per request: the driver's alone on device 0, a worker's on the others, and the
    # driver's more for each other device taking part.
    assert problem.costs.request_cpu_s.tolist() == [FAKE_REQUESTS.driver_alone_cpu_s, FAKE_REQUESTS.worker_cpu_s]
    assert problem.costs.driver_part_cpu_s.tolist() == pytest.approx([0.0, 40e-6])
    again = Problem.from_dict(problem.to_dict())
    for label in ("request_cpu_s", "driver_part_cpu_s", "output_send_cpu_s", "output_recv_cpu_s"):
        assert getattr(again.costs, label).tolist() == getattr(problem.costs, label).tolist()
    assert fake_measurement == [("cpu", "cpu"), ("requests",)]


def test_calibration_is_measured_once_then_read_from_the_cache(fake_measurement: list, tmp_path: Path) -> None:
    assert local_calibration(["cpu", "cpu"]) == {"cpu->cpu": FAKE_COST}
    assert local_calibration(["cpu", "cpu", "cpu"]) == {"cpu->cpu": FAKE_COST}
    assert len(fake_measurement) == 1
    local_calibration(["cpu", "cpu"], "remeasure")
    assert len(fake_measurement) == 2
    (cached,) = (tmp_path / "calibration").glob("*.json")
    assert read_calibration(cached) == {"cpu->cpu": FAKE_COST}


def test_the_request_cost_is_measured_once_and_kept_when_links_are_added(fake_measurement: list, tmp_path: Path):
    assert local_request_cost() == FAKE_REQUESTS
    assert local_request_cost() == FAKE_REQUESTS
    assert fake_measurement == [("cpu", "cpu"), ("requests",)]
    local_calibration(["cpu", "cpu"], "remeasure")  # rewrites the links
    (cached,) = (tmp_path / "calibration").glob("*.json")
    assert read_request_cost(cached) == FAKE_REQUESTS
    assert fake_measurement == [("cpu", "cpu"), ("requests",), ("cpu", "cpu")]
    given = tmp_path / "links-only.json"
    write_calibration(given, {"cpu->cpu": FAKE_COST})
    assert read_request_cost(given) is None
    with pytest.raises(ClusterError, match="has no request costs"):
        local_request_cost(given)


def test_calibration_file_is_used_as_given(fake_measurement: list, tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    slow = TransferCost(1e-3, 1e8, 0.0, 0.0, 0.0, 0.0)
    write_calibration(path, {"cpu->cpu": slow})
    assert local_calibration(["cpu", "cpu"], path) == {"cpu->cpu": slow}
    assert fake_measurement == []
    with pytest.raises(ClusterError, match="has no"):
        local_calibration(["cpu", "cuda:0"], path)
    with pytest.raises(ClusterError, match=r"calibration file '.*missing.json' does not exist; pass 'auto'"):
        local_calibration(["cpu", "cpu"], tmp_path / "missing.json")
    with pytest.raises(ClusterError, match=r"calibration='.*' is a folder, not a calibration file; pass 'auto'"):
        local_calibration(["cpu", "cpu"], tmp_path)


def test_a_folder_named_as_the_calibration_is_called_a_folder(tmp_path: Path, monkeypatch) -> None:
    """A bare name (``--calibration results``) was taken for a misspelt word, not the folder it is."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    with pytest.raises(ClusterError, match=r"calibration='results' is a folder, not a calibration file"):
        check_calibration("results")
    with pytest.raises(ClusterError, match=r"calibration='' is empty; pass 'auto'"):
        check_calibration("")  # was called a folder: Path("") is "."


def test_compile_on_local_devices_uses_this_machines_calibration_by_default(fake_measurement: list) -> None:
    """A user who never heard of calibration gets this machine's links, with either cost mode; "none" opts out."""
    example = (torch.randn(8, 64),)
    for cost in ("analytic", "measured"):
        compiled = moirai.compile(TwoLinears().eval(), ["cpu", "cpu"], example_inputs=example, placer="heft", cost=cost)
        assert compiled.cluster.latency_s[0, 1] == FAKE_COST.latency_s
        assert compiled.cluster.recv_cpu_s[0, 1] == FAKE_COST.receiver_cpu_s
    assert fake_measurement == [("cpu", "cpu"), ("requests",)], "measured once, then read from the cache"
    opted_out = moirai.compile(
        TwoLinears().eval(), ["cpu", "cpu"], example_inputs=example, placer="heft", calibration="none"
    )
    np.testing.assert_array_equal(opted_out.cluster.latency_s, Cluster.from_devices(["cpu", "cpu"]).latency_s)


@pytest.mark.slow
def test_a_script_that_compiles_at_top_level_calibrates_without_a_main_guard(tmp_path: Path) -> None:
    """The calibration's ranks are fresh interpreters: they do not import the script that compiles (a spawned
    process would, and would compile, and calibrate, again). The links' ranks show it; the request cost's start the
    same way (``run_ranks``) and its own test measures it, so the cache holds one already."""
    write_calibration(calibration_cache_path(tmp_path / "cache"), {}, RequestCost(300e-6, 300e-6))
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import torch, moirai\n"
        "model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))\n"
        "compiled = moirai.compile(model.eval(), ['cpu', 'cpu'], example_inputs=(torch.randn(4, 16),), placer='heft')\n"
        "print('latency', compiled.cluster.latency_s[0, 1], 'receiver', compiled.cluster.recv_cpu_s[0, 1])\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MOIRAI_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "moirai: calibrate links" in result.stderr and "calibrate requests" not in result.stderr, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("latency ")]
    latency, receiver = (float(word) for word in line.split()[1::2])
    assert latency != Cluster.from_devices(["cpu", "cpu"]).latency_s[0, 1] and receiver > 0, "measured, not defaults"


@pytest.mark.slow
def test_transfers_between_two_pinned_gloo_ranks_are_measured() -> None:
    costs = measure_transfer_costs(["cpu", "cpu"], sizes_bytes=SIZES, repeats=5, warmup=2)
    assert set(costs) == {(0, 1), (1, 0)}
    for cost in costs.values():
        # Loopback gloo between two local processes: between 10 MB/s and 100 GB/s, a wake-up under 50 ms.
        assert 1e7 < cost.bandwidth_bytes_per_s < 1e11
        assert 0 <= cost.latency_s < 0.05
        # Moving a 4 MiB message takes CPU time on both ends.
        assert cost.sender_cpu_time_s(4 << 20) > 0 and cost.receiver_cpu_time_s(4 << 20) > 0


def test_every_rank_numbers_the_pairs_alike() -> None:
    # Each directed pair once, in one order for every rank: the tags of an exchange depend on its place in it.
    pairs = measure_module.directed_pairs(3)
    assert pairs == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    assert len(set(measure_module.directed_pairs(4))) == 12


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_three_and_four_ranks_measure_every_directed_pair(world_size: int) -> None:
    # Before exchanges were numbered per pair, rank 2 started pair (0, 2) at exchange 0 while rank 0 was at the
    # pair's true number, and the run hung until its timeout.
    timings = measure_module.measure_transfers(
        ["cpu"] * world_size, sizes_bytes=(1024, 65536), repeats=2, warmup=1, timeout_s=60.0
    )
    assert set(timings) == set(measure_module.directed_pairs(world_size))
    for pair_timings in timings.values():
        assert len(pair_timings.delay_s) == 2 and all(delay > 0 for delay in pair_timings.delay_s)


@pytest.mark.slow
def test_the_runtimes_work_per_request_is_measured_through_its_server_between_parts_that_compute() -> None:
    measured = measure_request_cost_spread(FAKE_COST, requests=40)
    # Python work of the driver's threads and a worker's loop: more than nothing, well under 10 ms per request.
    assert 0 < measured.cost.driver_cpu_s < 10e-3
    assert 0 <= measured.cost.worker_cpu_s < 10e-3
    spread = [measured.spread.driver_cpu_s, measured.spread.worker_cpu_s]
    assert all(math.isfinite(s) and 0 <= s < 10e-3 for s in spread), spread


def _way(first: int, rounds: list[tuple[list[float], list[float]]]) -> dict:
    return {"first": first, "rounds": [[cpu_s, half_s] for cpu_s, half_s in rounds]}


def test_the_request_cost_is_each_ranks_cpu_less_its_half_alone_and_the_booked_messages() -> None:
    link = TransferCost(
        1e-4, 1e9, sender_cpu_s=10e-6, sender_cpu_s_per_byte=0.0, receiver_cpu_s=20e-6, receiver_cpu_s_per_byte=0.0
    )
    report = {
        "activation_bytes": 8192.0,
        "input_bytes": 8192.0,
        "output_bytes": 8192.0,
        # Whole on rank 0: its CPU less both halves alone, 0.2, 0.3 and 0.25 ms; rank 1 idle.
        "alone": {
            "rounds": [([1.2e-3, 0.0], [1.0e-3, 0.0]), ([1.3e-3, 0.0], [1.0e-3, 0.0]), ([1.25e-3, 0], [1e-3, 0])]
        },
        "ways": [
            # Rank 0 first: it sends the activation (10 us), rank 1 receives it (20) and sends the output (10),
            # which rank 0 receives (20).
            _way(
                0,
                [
                    ([1.5e-3, 1.4e-3], [1.0e-3, 1.0e-3]),
                    ([1.9e-3, 1.5e-3], [1.2e-3, 1.0e-3]),
                    ([1.6e-3, 1.45e-3], [1.1e-3, 1.0e-3]),
                ],
            ),
            # Rank 1 first: the driver sends it the input (10 us, rank 1 receives it: 20), it sends the activation,
            # rank 0 receives it and makes the output (no message).
            _way(
                1,
                [
                    ([1.4e-3, 1.3e-3], [1.0e-3, 1.0e-3]),
                    ([1.4e-3, 1.3e-3], [1.0e-3, 1.0e-3]),
                    ([1.4e-3, 1.3e-3], [1.0e-3, 1.0e-3]),
                ],
            ),
        ],
    }
    measured = request_cost_of(report, link)
    # Way 0, rank 0: 1.5 - 1.0 - 0.03, 1.9 - 1.2 - 0.03, 1.6 - 1.1 - 0.03 ms: 0.47, 0.67, 0.47; rank 1: 1.4 - 1.0 -
    # 0.03, ...: 0.37, 0.47, 0.42. Way 1: rank 0 1.4 - 1.0 - 0.02 - 0.01 = 0.37, rank 1 1.3 - 1.0 - 0.01 - 0.02 = 0.27.
    assert measured.cost.driver_cpu_s == pytest.approx((0.47e-3 + 0.37e-3) / 2)
    assert measured.cost.worker_cpu_s == pytest.approx((0.42e-3 + 0.27e-3) / 2)
    assert measured.cost.driver_alone_cpu_s == pytest.approx(0.25e-3)
    assert measured.cost.driver_part_cpu_s == pytest.approx((0.47e-3 + 0.37e-3) / 2 - 0.25e-3)
    assert measured.spread.driver_cpu_s == pytest.approx((0.2e-3 + 0) / 2)
    assert measured.spread.worker_cpu_s == pytest.approx((0.1e-3 + 0) / 2)
    assert measured.spread.driver_alone_cpu_s == pytest.approx(0.1e-3)


def test_a_rank_that_books_more_than_it_took_costs_nothing_rather_than_a_negative_time() -> None:
    link = TransferCost(1e-4, 1e9, 0.0, 0.0, 0.0, 0.0)
    report = {
        "activation_bytes": 0.0,
        "input_bytes": 0.0,
        "output_bytes": 0.0,
        "ways": [_way(0, [([1e-3, 1e-3], [1.2e-3, 0.9e-3])])],
        "alone": {"rounds": [([1e-3, 0.0], [1.1e-3, 0.0])]},
    }
    measured = request_cost_of(report, link)
    assert measured.cost.driver_cpu_s == 0.0 and measured.cost.worker_cpu_s == pytest.approx(0.1e-3)
    assert measured.cost.driver_alone_cpu_s == 0.0 and measured.cost.driver_part_cpu_s == 0.0


@pytest.mark.slow
def test_calibrate_two_gloo_ranks_writes_a_cluster_file(tmp_path: Path) -> None:
    path = tmp_path / "calibrated.toml"
    cluster = calibrate(world_size=2, sizes_bytes=SIZES, repeats=3, output=path)
    assert cluster.names == ("rank0", "rank1")
    assert [d.rank for d in cluster.devices] == [0, 1]
    assert {(link.src, link.dst) for link in cluster.links} == {("rank0", "rank1"), ("rank1", "rank0")}
    again = Cluster.from_file(path)
    np.testing.assert_allclose(again.bandwidth_bytes_per_s, cluster.bandwidth_bytes_per_s)


def test_calibrate_needs_two_ranks() -> None:
    with pytest.raises(ClusterError, match="at least two ranks"):
        calibrate(world_size=1)


def test_local_ranks_are_at_most_the_cores_however_their_number_is_given(monkeypatch, tmp_path: Path, capsys) -> None:
    """The limit lived in the CLI's --world-size alone: a --base file of 3 devices on 2 cores, and the API's
    calibrate(world_size=3), started 3 ranks; and it counted os.cpu_count(), not the cores this process may use."""
    import moirai.cluster.calibration.cli as cli_module
    from moirai.cli import main

    def measure(*args: object) -> None:
        raise AssertionError("ranks started for a world larger than the cores")

    monkeypatch.setattr(moirai.cluster.calibration.cluster, "measure_transfer_costs", measure)
    monkeypatch.setattr(cli_module, "measure_transfer_costs", measure)
    monkeypatch.setattr(moirai.cluster.calibration.cluster, "available_cores", lambda: (0, 1), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's, not this process's
    too_many = "calibration runs 3 local gloo ranks, one a core, but this machine hosts at most 2"
    with pytest.raises(ClusterError, match=too_many):
        calibrate(world_size=3)
    devices = [{"name": f"c{k}", "type": "cpu"} for k in range(3)]
    bandwidth = [[0 if a == b else 10 for b in range(3)] for a in range(3)]
    base = tmp_path / "three.toml"
    Cluster.from_dict({"devices": devices, "matrix": {"bandwidth_gbps": bandwidth}}).to_file(base)
    with pytest.raises(ClusterError, match=too_many):
        calibrate(world_size=3, base=Cluster.from_file(base))
    output = str(tmp_path / "out.toml")
    for arguments in (["--world-size", "3"], ["--base", str(base)], ["--base", str(base), "--world-size", "3"]):
        assert main(["calibrate", "--output", output, *arguments]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and too_many in error[0], error


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (["--world-size", "0"], "at least two ranks"),  # was read as "not given": 2 ranks
        (["--world-size", "1"], "at least two ranks"),
        (["--output", "nowhere/cluster.toml"], "cannot write the cluster file to 'nowhere/cluster.toml': folder"),
        (["--output", "."], "cannot write the cluster file to '.': it is a folder"),
        (["--save", "."], "cannot write the calibration to '.': it is a folder"),
    ],
)
def test_moirai_calibrate_refuses_what_it_cannot_do_before_measuring(monkeypatch, arguments, words) -> None:
    """Fault injected: arguments that failed only after ~10 s of measuring (a missing folder, naming the temporary
    file) or were taken for others (--world-size 0 for the default 2)."""
    import io

    from rich.console import Console

    import moirai.cluster.calibration.cli as cli_module
    from moirai.cli import _parser

    def measure(*args: object) -> None:
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(cli_module, "measure_transfer_costs", measure)
    monkeypatch.setattr(cli_module, "measure_request_cost_spread", measure)
    with pytest.raises(ClusterError, match=re.escape(words)):
        cli_module.run(_parser().parse_args(["calibrate", *arguments]), Console(file=io.StringIO()))


def test_moirai_calibrate_leaves_the_machines_calibration_alone_unless_asked(tmp_path: Path, monkeypatch) -> None:
    import io

    from rich.console import Console

    import moirai.cluster.calibration.cli as cli_module
    from moirai.cli import _parser

    cache = tmp_path / "cache" / "calibration.json"
    cache.parent.mkdir()
    monkeypatch.setattr(cli_module, "calibration_cache_path", lambda: cache)
    monkeypatch.setattr(
        cli_module, "measure_transfer_costs", lambda devices, sizes, repeats: {(0, 1): FAKE_COST, (1, 0): FAKE_COST}
    )
    monkeypatch.setattr(cli_module, "measure_request_cost_spread", lambda link: FAKE_MEASURED_REQUESTS)
    monkeypatch.setattr(cli_module, "measure_link_kinds", lambda pair: {"cpu->cpu": FAKE_COST})
    monkeypatch.setattr(cli_module, "_transport", lambda backend: "shm")
    output = tmp_path / "cluster.toml"

    def run(*extra: str) -> str:
        console = Console(file=io.StringIO(), width=200)
        assert cli_module.run(_parser().parse_args(["calibrate", "--output", str(output), *extra]), console) == 0
        return console.file.getvalue()

    assert "not saved" in run() and not cache.exists()
    assert Cluster.from_file(output).name == "calibrated-shm", "named after what carried the messages"
    run("--update-cache")
    assert read_calibration(cache) == {"cpu->cpu": FAKE_COST}
    mine = tmp_path / "mine.json"
    run("--save", str(mine))
    assert read_request_cost(mine) == FAKE_REQUESTS


def test_moirai_calibrate_says_what_it_measures_while_it_does(tmp_path: Path, monkeypatch, capfd) -> None:
    """It printed nothing for a minute, then the table; compile's calibration shows a line per stage."""
    import io

    from rich.console import Console

    import moirai.cluster.calibration.cli as cli_module
    from moirai.cli import _parser

    monkeypatch.setattr(
        cli_module, "measure_transfer_costs", lambda devices, sizes, repeats: {(0, 1): FAKE_COST, (1, 0): FAKE_COST}
    )
    monkeypatch.setattr(cli_module, "measure_request_cost_spread", lambda link: FAKE_MEASURED_REQUESTS)
    arguments = _parser().parse_args(["calibrate", "--world-size", "2", "--output", str(tmp_path / "c.toml")])
    assert cli_module.run(arguments, Console(file=io.StringIO(), width=200)) == 0
    stages = re.findall(r"^moirai: ([a-z ]+)(?::| \S+ \S+$)", capfd.readouterr().err, re.MULTILINE)
    assert stages == ["measure transfers", "measure transfers", "measure requests", "measure requests"], stages


def test_moirai_calibrate_measures_the_links_of_a_base_file_that_has_none(tmp_path: Path, monkeypatch) -> None:
    import io

    from rich.console import Console

    import moirai.cluster.calibration.cli as cli_module
    from moirai.cli import _parser

    measured: list[list[str]] = []

    def measure(devices: list[str], sizes, repeats) -> dict:
        measured.append(devices)
        return {(a, b): FAKE_COST for a in range(len(devices)) for b in range(len(devices)) if a != b}

    monkeypatch.setattr(cli_module, "measure_transfer_costs", measure)
    monkeypatch.setattr(cli_module, "measure_request_cost_spread", lambda link: FAKE_MEASURED_REQUESTS)
    monkeypatch.setattr(cli_module, "measure_link_kinds", lambda pair: {"cpu->cpu": FAKE_COST})
    monkeypatch.setattr(moirai.cluster.calibration.cluster, "available_cores", lambda: (0, 1, 2, 3))  # 3 ranks fit
    base = tmp_path / "base.toml"
    base.write_text(
        'name = "lab"\n'
        + "".join(f'[[devices]]\nname = "cpu{r}"\ntype = "cpu"\nthreads = 1\n' for r in range(3))  # no links
    )
    with pytest.raises(ClusterError, match=r"needs \[\[links\]\] or a \[matrix\]"):
        Cluster.from_file(base)
    output = tmp_path / "cluster.toml"
    arguments = _parser().parse_args(["calibrate", "--base", str(base), "--output", str(output)])
    assert cli_module.run(arguments, Console(file=io.StringIO(), width=200)) == 0
    assert measured == [["cpu", "cpu", "cpu"]]  # as many ranks as the base has devices
    cluster = Cluster.from_file(output)
    assert cluster.name == "lab" and cluster.names == ("cpu0", "cpu1", "cpu2")
    assert len(cluster.links) == 6 and cluster.devices[0].threads == 1
    wrong = _parser().parse_args(["calibrate", "--base", str(base), "--world-size", "2", "--output", str(output)])
    with pytest.raises(ClusterError, match="3 devices.*--world-size 3"):
        cli_module.run(wrong, Console(file=io.StringIO()))


def test_links_between_hosts_are_priced_by_their_hosts_and_within_a_host_by_kind(
    fake_measurement: list, tmp_path: Path
) -> None:
    # Ranks 0, 1 on host a and 2 on host b (torchrun across hosts): a link between the hosts costs what moirai
    # calibrate measured between them, a link within a host what this machine's calibration says.
    network = TransferCost(2e-3, 12.5e6, 80e-6, 3e-9, 90e-6, 4e-9)
    path = tmp_path / "hosts.json"
    write_calibration(
        path,
        {"cpu->cpu": FAKE_COST},
        FAKE_REQUESTS,
        {HostLink("a", "b", "cpu->cpu"): network, HostLink("b", "a", "cpu->cpu"): network},
    )
    assert read_host_links(path) == {HostLink("a", "b", "cpu->cpu"): network, HostLink("b", "a", "cpu->cpu"): network}
    cluster = local_cluster(["cpu", "cpu", "cpu"], path, hosts=["a", "a", "b"])
    assert [d.host for d in cluster.devices] == ["a", "a", "b"]
    assert cluster.latency_s[0, 1] == FAKE_COST.latency_s and cluster.send_cpu_s[1, 0] == FAKE_COST.sender_cpu_s
    for a, b in ((0, 2), (1, 2), (2, 0), (2, 1)):
        assert cluster.latency_s[a, b] == network.latency_s
        assert cluster.bandwidth_bytes_per_s[a, b] == network.bandwidth_bytes_per_s
        assert cluster.send_cpu_s_per_byte[a, b] == network.sender_cpu_s_per_byte
        assert cluster.recv_cpu_s[a, b] == network.receiver_cpu_s
    # Each host's two CPU devices split only their own host's cores.
    alone = Cluster.from_devices(["cpu"]).devices[0]
    assert cluster.devices[2].peak_flops == pytest.approx(alone.peak_flops)
    assert cluster.devices[0].peak_flops < alone.peak_flops or len(os.sched_getaffinity(0)) == 1
    assert fake_measurement == []
    # A calibration file is what the user asked for: a pair of hosts it lacks is an error, the cache's a warning.
    with pytest.raises(ClusterError, match=r"a -> c \(cpu->cpu\).+moirai calibrate"):
        local_cluster(["cpu", "cpu"], path, hosts=["a", "c"])
    with pytest.warns(moirai.MoiraiWarning, match=r"links a -> b \(cpu->cpu\), b -> a \(cpu->cpu\) between hosts"):
        local_cluster(["cpu", "cpu"], "auto", hosts=["a", "b"])


def test_links_between_hosts_survive_the_cache_measuring_a_new_kind(fake_measurement: list, tmp_path: Path) -> None:
    cached = cache_module.calibration_cache_path()
    network = TransferCost(2e-3, 12.5e6, 0.0, 0.0, 0.0, 0.0)
    write_calibration(cached, {}, None, {HostLink("a", "b", "cpu->cpu"): network})
    local_calibration(["cpu", "cpu"])  # measures cpu->cpu and writes the cache again
    local_request_cost()
    assert fake_measurement == [("cpu", "cpu"), ("requests",)]
    assert read_host_links(cached) == {HostLink("a", "b", "cpu->cpu"): network}


def test_the_pairs_measured_across_hosts_and_the_hosts_named() -> None:
    from moirai.cluster.calibration.across_hosts import host_pairs
    from moirai.runtime.hosts import host_labels

    # Hosts a (ranks 0, 1) and b (ranks 2, 3): first ranks both ways, then each host's first two both ways.
    assert host_pairs(["a", "a", "b", "b"]) == [(0, 2), (2, 0), (0, 1), (1, 0), (2, 3), (3, 2)]
    assert host_pairs(["a", "b", "c"]) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    # Two containers named alike on two machines are two hosts.
    same = [("node", "node/boot1/5"), ("node", "node/boot2/5"), ("other", "other/boot3/5"), ("node", "node/boot1/5")]
    assert host_labels(same) == ["node#0", "node#1", "other", "node#0"]


def test_a_link_between_hosts_takes_its_bandwidth_from_the_large_messages() -> None:
    from moirai.cluster.calibration.fit import fit_between_hosts

    # A token bucket of 64 KiB at 100 Mbit/s: messages up to the bucket pass at once, larger ones at the rate.
    sizes = tuple(1024 * 4**k for k in range(6))
    rate = 12.5e6
    delays = tuple(150e-6 + max(size - 65536, 0) / rate for size in sizes)
    cost = fit_between_hosts(TransferTimings(sizes, delays, delays, delays))
    assert cost.bandwidth_bytes_per_s == pytest.approx(rate, rel=0.1)
    assert TransferTimings(sizes, delays, delays, delays).fit().bandwidth_bytes_per_s > 1.5 * rate  # what it fixes
    assert cost.delay_s(1 << 20) == pytest.approx(delays[-1], rel=0.1)


_FAKE_RANKS = """
import sys, time

def fake_rank(rank, stop_file):
    if rank == 1:
        sys.exit("rank 1 broke before the first message")
    while True:  # rank 0 waits for its peer, as a calibration rank waits in the store
        time.sleep(0.1)
"""


def test_a_calibration_rank_that_fails_ends_the_wait_for_all_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injected: rank 1 dies at once while rank 0 would wait for it forever. The ranks are waited for
    together, so the failure is reported at once, naming rank 1, and rank 0 is not left running; before, rank 0
    was waited for first, until its timeout (300 s for a real calibration, per rank)."""
    import threading

    (tmp_path / "fake_ranks.py").write_text(_FAKE_RANKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    from fake_ranks import fake_rank  # type: ignore[import-not-found]

    errors: list[BaseException] = []

    def run() -> None:
        try:
            measure_module.run_ranks([str(tmp_path / "stop")], 2, 3600.0, entry=fake_rank)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            errors.append(error)

    waiter = threading.Thread(target=run, daemon=True)
    waiter.start()
    waiter.join(120)  # far below rank 0's 3600 s: only the failed rank can have ended the wait
    assert not waiter.is_alive(), "run_ranks still waits for rank 0 after rank 1 failed"
    assert len(errors) == 1 and isinstance(errors[0], DistributedError), errors
    assert "rank 1: rank 1 broke before the first message" in str(errors[0])
    assert "rank 0" not in str(errors[0]), "rank 0 did not fail; it was stopped"


def test_a_calibration_rank_past_its_timeout_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake_ranks_slow.py").write_text(_FAKE_RANKS.replace("if rank == 1", "if rank == 2"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    from fake_ranks_slow import fake_rank  # type: ignore[import-not-found]

    with pytest.raises(DistributedError, match=r"calibration ranks 0, 1 did not finish within 2 s"):
        measure_module.run_ranks([str(tmp_path / "stop")], 2, 2.0, entry=fake_rank)


# What another local user leaves in a shared working directory: a module named as one a rank imports.
_PLANTED_TORCH = """
from pathlib import Path
Path({marker!r}).write_text("a planted torch.py ran")
raise ImportError("planted")
"""


def test_a_calibration_rank_imports_nothing_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injected: a torch.py in the working directory. ``python -c`` put the directory first on sys.path, so
    each calibration rank ran it as this user (and failed on its ImportError); safe-path mode leaves it alone."""
    marker = tmp_path / "planted-torch-ran"
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "torch.py").write_text(_PLANTED_TORCH.format(marker=str(marker)))
    monkeypatch.chdir(shared)
    measure_module.run_ranks([], 1, 120.0, entry=torch.manual_seed)  # a rank that imports torch and returns
    assert not marker.exists(), "a calibration rank imported the torch.py of the current directory"


def test_the_calibration_stores_port_is_held_from_the_moment_it_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port chosen by binding and closing a socket could be taken by any process before rank 0 listened on it;
    now the caller's listener holds it, and rank 0's store takes that very socket over."""
    import socket

    from moirai.runtime.store import loopback_listener

    handed: list[int] = []
    real_run_ranks = measure_module.run_ranks

    def run_ranks_checking_the_port(settings, world_size, timeout_s, entry, store_listener=None, environment=None):  # noqa: ANN001
        port = settings[1]
        assert store_listener is not None and store_listener.getsockname() == ("127.0.0.1", port)
        with socket.socket() as intruder, pytest.raises(OSError):
            intruder.bind(("127.0.0.1", port))  # nobody else can take it while the ranks start
        handed.append(port)
        real_run_ranks(settings, world_size, timeout_s, entry, store_listener, environment)

    monkeypatch.setattr(measure_module, "run_ranks", run_ranks_checking_the_port)
    timings = measure_module.measure_transfers(["cpu", "cpu"], (1024, 4096), repeats=1, warmup=0)
    assert handed and set(timings) == {(0, 1), (1, 0)}
    with loopback_listener() as listener:
        assert listener.getsockname()[0] == "127.0.0.1"


def test_a_calibration_where_shared_memory_has_no_room_measures_gloo_as_the_runtime_would_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Docker's default 64 MB /dev/shm holds no rings for four ranks: the runtime sends through gloo there, so the
    calibration measures gloo, with a warning that says why, instead of a rank dying making its ring."""
    from moirai.errors import SharedMemoryWarning
    from moirai.runtime import shm, shm_files

    monkeypatch.setenv(shm.ENV_SWITCH, "1")
    monkeypatch.setattr(shm_files, "free_bytes", lambda directory: 1 << 20)
    with pytest.warns(SharedMemoryWarning, match=r"has 1 MB free, the calibration needs \d+ MB.*it measures gloo"):
        assert measure_module.transport_environment(4, [1024, 16 << 20]) == {shm.ENV_SWITCH: "0"}
    with pytest.warns(SharedMemoryWarning, match="the calibration needs .* it measures gloo"):
        timings = measure_module.measure_transfers(["cpu", "cpu"], (1024, 4096), repeats=1, warmup=0)
    assert set(timings) == {(0, 1), (1, 0)}
    monkeypatch.setattr(shm_files, "free_bytes", lambda directory: 1 << 40)
    assert measure_module.transport_environment(4, [1024, 16 << 20]) == {}  # room: shared memory, no warning


def test_a_link_between_hosts_is_no_faster_than_a_stream_of_its_largest_messages() -> None:
    from moirai.cluster.calibration.fit import fit_between_hosts

    # Lone messages fit at 125 MB/s; back to back they crossed at 115 MB/s (a link busy in both directions, say).
    sizes = tuple(1024 * 4**k for k in range(6))
    delays = tuple(50e-6 + size / 125e6 for size in sizes)
    lone = fit_between_hosts(TransferTimings(sizes, delays, delays, delays))
    assert lone.bandwidth_bytes_per_s == pytest.approx(125e6, rel=1e-6)
    streamed = fit_between_hosts(TransferTimings(sizes, delays, delays, delays, stream_bytes_per_s=115e6))
    assert streamed.bandwidth_bytes_per_s == pytest.approx(115e6, rel=1e-6)
    assert streamed.latency_s == pytest.approx(delays[0] - sizes[0] / 115e6)  # the smallest message's time beyond it
    faster = fit_between_hosts(TransferTimings(sizes, delays, delays, delays, stream_bytes_per_s=200e6))
    assert faster.bandwidth_bytes_per_s == pytest.approx(125e6, rel=1e-6)  # a stream never speeds a link up


def test_ranks_on_two_hosts_time_a_stream_of_messages_both_ways(tmp_path: Path) -> None:
    from moirai.cluster.calibration.measure import _rank_main, run_ranks
    from moirai.runtime.store import loopback_listener

    sizes = [1024, 262144]
    with loopback_listener() as listener:
        settings = [["cpu", "cpu"], listener.getsockname()[1], sizes, 2, 1, 60.0, str(tmp_path), ["x", "y"]]
        run_ranks(settings, 2, 60.0, entry=_rank_main, store_listener=listener)
    pairs = [pair for rank in (0, 1) for pair in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    assert sorted((pair["src"], pair["dst"]) for pair in pairs) == [(0, 1), (1, 0)]
    for pair in pairs:
        assert isinstance(pair["stream_bytes_per_s"], float) and pair["stream_bytes_per_s"] > 0


def test_calibration_ranks_keep_their_cores_and_compute_on_one_thread():
    """[Note: a message's CPU on one thread]: on a 16-core machine a CPU rank gets 8 threads; calibrated with them,
    their spinning after each parallel op counts as the runtime's work and a message's CPU."""
    from moirai.runtime.resources import rank_resources

    runtime = rank_resources(["cpu", "cpu"], cores=list(range(16)))
    calibration = [measure_module.calibration_resources(r) for r in runtime]
    assert [r.threads for r in runtime] == [8, 8] and [r.threads for r in calibration] == [1, 1]
    assert [r.cores for r in calibration] == [r.cores for r in runtime]


def test_timings_that_are_noise_are_measured_once_more_then_an_error(monkeypatch, tmp_path: Path) -> None:  # noqa: ANN001
    """A fault injected as the transfer sweep's timings: a delay that does not grow with size (seen once in a bench's
    compile on this VM) is measured again with a warning; twice is the error, a ClusterError as before."""
    monkeypatch.setenv("MOIRAI_CACHE_DIR", str(tmp_path))
    noise = TransferTimings((1000, 10**6), (2e-3, 1e-3), (1e-5, 1e-5), (1e-5, 1e-5))
    answers = [noise, None]

    def measure(torch_devices, sizes_bytes=(), repeats=0, warmup=0):  # noqa: ANN001, ANN202
        timings = answers.pop(0)
        return {(0, 1): timings.fit() if timings else FAKE_COST, (1, 0): FAKE_COST}

    monkeypatch.setattr(measure_module, "measure_transfer_costs", measure)
    with pytest.warns(moirai.MoiraiWarning, match="does not grow with size.*measuring again"):
        assert local_calibration(["cpu", "cpu"]) == {"cpu->cpu": FAKE_COST}
    answers[:] = [noise, noise]
    with pytest.raises(ClusterError, match="does not grow with size"), pytest.warns(moirai.MoiraiWarning):
        local_calibration(["cpu", "cpu"], "remeasure")


def test_moirai_calibrate_sweeps_and_repeats_as_every_other_calibration(monkeypatch, tmp_path) -> None:
    """Its own sweep (range(16) cut at --max-size-mb) and repeats were written apart from measure's defaults."""
    import io

    from rich.console import Console

    import moirai.cluster.calibration.cli as cli_module
    from moirai.cli import _parser

    seen = {}

    def measure(devices, sizes, repeats):  # noqa: ANN001, ANN202
        seen.update(sizes=sizes, repeats=repeats)
        return {(0, 1): FAKE_COST, (1, 0): FAKE_COST}

    monkeypatch.setattr(cli_module, "DEFAULT_REPEATS", 7, raising=False)  # the parser's defaults are measure's
    monkeypatch.setattr(cli_module, "DEFAULT_MAX_SIZE_BYTES", 4 * 2**20, raising=False)
    monkeypatch.setattr(cli_module, "measure_transfer_costs", measure)
    monkeypatch.setattr(cli_module, "measure_request_cost_spread", lambda link: FAKE_MEASURED_REQUESTS)
    monkeypatch.setattr(cli_module, "measure_link_kinds", lambda pair: {"cpu->cpu": FAKE_COST})
    monkeypatch.setattr(cli_module, "_transport", lambda backend: "shm")
    args = _parser().parse_args(["calibrate", "--output", str(tmp_path / "cluster.toml")])
    assert cli_module.run(args, Console(file=io.StringIO())) == 0
    assert seen == {"sizes": measure_module.sizes_up_to(4 * 2**20), "repeats": 7}
    assert (
        measure_module.sizes_up_to(16 * 2**20)
        == measure_module.DEFAULT_SIZES_BYTES
        == tuple(1024 * 4**k for k in range(8))
    )


@pytest.mark.slow  # its ranks start on cores that spinning processes keep busy (10 s)
def test_a_calibration_whose_ranks_share_their_cores_with_other_processes_says_so() -> None:
    """A calibration on a busy machine measures its links slower than they are when quiet, and compile caches it for
    the machine: one process spinning on each core (injected here) is said, with what to do."""
    spin = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin, str(core)]) for core in os.sched_getaffinity(0)]
    try:
        with pytest.warns(moirai.MoiraiWarning, match=r"its ranks ran \d+% of the time .*calibration='remeasure'"):
            timings = measure_module.measure_transfers(["cpu", "cpu"], (1024, 4096), repeats=2, warmup=0)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert all(t.core_share < measure_module.BUSY_CORE_SHARE for t in timings.values()), timings


def test_a_calibration_warns_of_busy_cores_by_its_least_share_and_not_where_it_was_not_measured() -> None:
    sizes = (1024, 4096)
    quiet = TransferTimings(sizes, (1e-4, 2e-4), (1e-5, 1e-5), (1e-5, 1e-5), core_share=0.97)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measure_module.warn_if_cores_were_busy(["cpu", "cpu"], {(0, 1): quiet, (1, 0): quiet})
        unmeasured = dataclasses.replace(quiet, core_share=None)  # timings made by hand, say
        measure_module.warn_if_cores_were_busy(["cpu", "cpu"], {(0, 1): unmeasured})
    busy = dataclasses.replace(quiet, core_share=0.5)
    with pytest.warns(moirai.MoiraiWarning, match=r"between cpu, cpu: its ranks ran 50% of the time they computed"):
        measure_module.warn_if_cores_were_busy(["cpu", "cpu"], {(0, 1): quiet, (1, 0): busy})
