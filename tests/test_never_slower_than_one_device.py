"""No placer that minimises latency returns a plan predicted slower than the best single device."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import moirai
from moirai.cluster.calibration import RequestCost, TransferCost, write_calibration
from moirai.planning.objective import LATENCY
from moirai.planning.placers import MIN_SPLIT_GAIN, no_worse_than_one_device, place, specs
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import StopReason
from moirai.planning.simulate import simulate
from moirai.runtime.header import HEADER_BYTES, HEADER_WORDS
from moirai.testing import brute_force_optimum

LATENCY_PLACERS = [s.name for s in specs() if s.minimises]


def fan_out_problem(transfer_s: float, send_cpu_s: float = 0.0) -> Problem:
    """A source, four 10 ms branches and a join, on two equal devices; each crossing costs ``transfer_s`` on the
    link and ``send_cpu_s`` of its sender's time."""
    tasks = [{"name": "source", "compute_s": [1e-3, 1e-3]}]
    tasks += [{"name": f"branch{i}", "compute_s": [10e-3, 10e-3]} for i in range(4)]
    tasks += [{"name": "join", "compute_s": [1e-3, 1e-3]}]
    crossing = [[0.0, transfer_s], [transfer_s, 0.0]]
    sender = {"send_cpu_s": [[0.0, send_cpu_s], [send_cpu_s, 0.0]]}
    edges = [{"src": "source", "dst": f"branch{i}", "transfer_s": crossing, **sender} for i in range(4)]
    edges += [{"src": f"branch{i}", "dst": "join", "transfer_s": crossing, **sender} for i in range(4)]
    devices = [{"name": "a", "memory_bytes": 1e9}, {"name": "b", "memory_bytes": 1e9}]
    return Problem.from_dict({"devices": devices, "tasks": tasks, "edges": edges})


@pytest.mark.parametrize("placer", LATENCY_PLACERS)
def test_a_plan_whose_transfers_dominate_is_single_device(placer: str) -> None:
    problem = fan_out_problem(transfer_s=30e-3)
    options = {"time_limit_s": 5.0} if placer in ("milp", "pesto") else {}
    plan = place(problem, placer, **options)
    assert len(set(plan.placement.tolist())) == 1
    assert plan.makespan_s == pytest.approx(42e-3)
    assert plan.placer == placer
    # The placer's own plan, where it was worse, is remembered.
    assert plan.report.notes.get("replaced_by_single_device_s", 42e-3) > 42e-3 - 1e-12
    # On one device the tasks run in the graph's own order, the one eager runs.
    device = int(plan.placement[0])
    assert plan.order[device] == problem.topological_order and not plan.order[1 - device]


@pytest.mark.parametrize("placer", LATENCY_PLACERS)
def test_on_devices_no_plan_tells_apart_the_last_task_runs_on_the_first(placer: str) -> None:
    """Rank 0 gathers the outputs: of the mirror-image plans the model cannot tell apart, the one ending there."""
    problem = fan_out_problem(0.1e-3)  # cheap transfers: the plans split the branches over both devices
    options = {"time_limit_s": 5.0} if placer in ("milp", "pesto") else {}
    plan = place(problem, placer, **options)
    assert plan.placement[problem.topological_order[-1]] == 0
    assert plan.makespan_s == pytest.approx(simulate(problem, plan).makespan_s)


def test_transfers_that_cost_their_receiver_cpu_time_make_fewer_transfers() -> None:
    """The receiver's time counts as the sender's does: 4 ms receives make the 2/2 split (four transfers) lose
    to fewer transfers, 20 ms ones to one device."""

    def problem(recv_cpu_s: float) -> Problem:
        base = fan_out_problem(0.1e-3)
        receiver = np.zeros_like(base.transfer_s)
        receiver[:, 0, 1] = receiver[:, 1, 0] = recv_cpu_s
        return dataclasses.replace(base, recv_cpu_s=receiver)

    plans = [place(problem(seconds), "milp", time_limit_s=10.0) for seconds in (0.0, 4e-3, 20e-3)]
    transfers = [len(simulate(problem(0.0), plan).transfers) for plan in plans]
    assert transfers[0] == 4 and transfers[1] < 4 and transfers[2] == 0
    assert plans[1].makespan_s < 42e-3


def test_transfers_that_cost_their_sender_cpu_time_make_fewer_transfers() -> None:
    """With free sends the MILP splits the four branches 2/2 (four transfers); when every send keeps its sender
    busy for 4 ms, 3/1 (two transfers) is faster, and with 20 ms sends one device is."""
    free = place(fan_out_problem(0.1e-3), "milp", time_limit_s=10.0)
    costly = place(fan_out_problem(0.1e-3, send_cpu_s=4e-3), "milp", time_limit_s=10.0)
    prohibitive = place(fan_out_problem(0.1e-3, send_cpu_s=20e-3), "milp", time_limit_s=10.0)
    transfers = [len(simulate(fan_out_problem(0.1e-3), plan).transfers) for plan in (free, costly, prohibitive)]
    assert transfers == [4, 2, 0]
    # 3/1: the source sends once (1 + 4 ms), the lone branch runs on b (10 ms) and sends back (4 ms) while a runs
    # its three branches after its send (5 + 30 ms); the join follows at 35 ms.
    assert costly.makespan_s == pytest.approx(36e-3) and costly.makespan_s < 42e-3


@pytest.mark.parametrize("placer", ["heft", "milp"])
def test_a_split_that_gains_less_than_the_header_it_needs_is_not_made(placer: str) -> None:
    """The second device starts a request only once the driver's header has come (header_s): a split whose
    gain is smaller than that wait loses to one device, a larger gain still splits."""
    options = {"time_limit_s": 5.0} if placer == "milp" else {}
    base = fan_out_problem(0.1e-3)  # split 2/2: 1 + 20 + 1 ms plus transfers, against 42 ms on one device
    # The best split, 3/1, has b start its branch after the header: 35 + 10 + 1 ms, more than 42.
    late = base.with_costs(header_s=np.array([0.0, 35e-3]))
    assert len(set(place(late, placer, **options).placement.tolist())) == 1
    early = base.with_costs(header_s=np.array([0.0, 5e-3]))
    plan = place(early, placer, **options)
    assert len(set(plan.placement.tolist())) == 2 and plan.makespan_s < 42e-3
    assert plan.makespan_s == pytest.approx(simulate(early, plan).makespan_s)


@pytest.mark.parametrize("placer", LATENCY_PLACERS)
def test_a_split_predicted_only_as_fast_as_one_device_is_not_made(placer: str) -> None:
    """Two independent 1 ms tasks: one device takes 2 ms, and so does a split whose second device waits 1 ms for
    its header. On the tie the plan without transfers wins: what the model leaves out only adds to a split."""
    problem = Problem.from_dict(
        {
            "devices": [{"name": "a"}, {"name": "b", "header_s": 1e-3}],
            "tasks": [{"name": "x", "compute_s": [1e-3, 1e-3]}, {"name": "y", "compute_s": [1e-3, 1e-3]}],
            "edges": [],
        }
    )
    options = {"time_limit_s": 5.0} if placer in ("milp", "pesto") else {}
    plan = place(problem, placer, **options)
    assert plan.placement.tolist() == [0, 0] and plan.makespan_s == pytest.approx(2e-3)


def test_a_plan_on_a_slower_single_device_gives_way_to_the_faster_one() -> None:
    """A minimising placer's plan on one device is no better than one device's best: it is replaced."""
    problem = Problem.from_dict(
        {
            "devices": [{"name": "fast"}, {"name": "slow"}],
            "tasks": [{"name": "x", "compute_s": [1e-3, 3e-3]}, {"name": "y", "compute_s": [1e-3, 3e-3]}],
            "edges": [],
        }
    )
    slow = Plan([1, 1], problem.device_names, placer="heft")
    plan, timeline = no_worse_than_one_device(problem, slow, simulate(problem, slow), LATENCY)
    assert plan.placement.tolist() == [0, 0] and timeline.makespan_s == pytest.approx(2e-3)
    assert plan.report.notes["replaced_by_single_device_s"] == pytest.approx(6e-3)


@pytest.mark.parametrize("placer", ["heft", "milp"])
def test_a_split_must_gain_more_than_the_minimum_over_one_device(placer: str) -> None:
    """The second device waits for its header: a split just 0.5% faster than one device gives way to it, one
    2% faster does not."""
    options = {"time_limit_s": 5.0} if placer == "milp" else {}

    def problem(header_s: float) -> Problem:
        return Problem.from_dict(
            {
                "devices": [{"name": "a"}, {"name": "b", "header_s": header_s}],
                "tasks": [{"name": "x", "compute_s": [1e-3, 1e-3]}, {"name": "y", "compute_s": [1e-3, 1e-3]}],
                "edges": [],
            }
        )

    assert MIN_SPLIT_GAIN == 0.01
    assert len(set(place(problem(0.99e-3), placer, **options).placement.tolist())) == 1  # 1.99 ms against 2
    split = place(problem(0.96e-3), placer, **options)  # 1.96 ms against 2
    assert len(set(split.placement.tolist())) == 2 and split.makespan_s == pytest.approx(1.96e-3)


@pytest.mark.parametrize("placer", ["heft", "milp"])
def test_a_plan_ends_where_its_outputs_are_gathered(placer: str) -> None:
    """The join makes the model's output, which travels back to device 0 from elsewhere: of the mirror-image
    plans, the one ending on device 0 is faster, even when device 1 waits for its header."""
    options = {"time_limit_s": 5.0} if placer == "milp" else {}
    base = fan_out_problem(0.1e-3)
    output = np.zeros((base.num_tasks, 2))
    output[base.task_index("join"), 1] = 5e-3
    problem = base.with_costs(output_s=output, header_s=np.array([0.0, 0.05e-3]))
    plan = place(problem, placer, **options)
    assert plan.placement[problem.task_index("join")] == 0
    assert len(set(plan.placement.tolist())) == 2 and plan.makespan_s < 25e-3


def test_cheap_transfers_still_split() -> None:
    plan = place(fan_out_problem(transfer_s=0.1e-3), "heft")
    assert len(set(plan.placement.tolist())) == 2 and plan.makespan_s < 42e-3
    assert "replaced_by_single_device_s" not in plan.report.notes


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        self.right = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) + self.right(x)


def test_expensive_calibrated_links_give_a_single_device_plan(tmp_path: Path) -> None:
    path = tmp_path / "slow-links.json"
    write_calibration(path, {"cpu->cpu": TransferCost(50e-3, 1e6, 0.0, 0.0, 0.0, 0.0)}, RequestCost(0.0, 0.0))
    model = TwoBranches().eval()
    x = torch.randn(16, 64)
    compiled = moirai.compile(
        model, ["cpu", "cpu"], example_inputs=(x,), placer="milp", calibration=path, time_limit_s=5.0
    )
    assert len(set(compiled.plan.placement.tolist())) == 1
    assert np.all(compiled.problem.transfer_s[:, 0, 1] >= 50e-3)
    # The driver's header to the second device is one message of the link: its latency plus the header's bytes (the
    # calibration gives no CPU times); the model's output (16 x 64 floats), made by the last task, travels back.
    assert compiled.problem.costs.header_s.tolist() == pytest.approx([0.0, 50e-3 + HEADER_BYTES / 1e6])
    last = compiled.problem.topological_order[-1]
    assert compiled.problem.costs.output_s[last].tolist() == pytest.approx([0.0, 50e-3 + 16 * 64 * 4 / 1e6])
    assert not compiled.problem.costs.output_s[compiled.problem.topological_order[0]].any()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


def test_the_driver_messages_cost_what_the_calibration_says_a_message_costs(tmp_path: Path) -> None:
    """The header's wait is its delay and its receiver's time; an output's way back adds the sender's time."""
    path = tmp_path / "links.json"
    write_calibration(path, {"cpu->cpu": TransferCost(1e-3, 1e9, 2e-4, 0.0, 3e-4, 0.0)}, RequestCost(1e-4, 2e-5))
    x = torch.randn(16, 64)
    problem = moirai.compile(TwoBranches().eval(), ["cpu", "cpu"], (x,), placer="heft", calibration=path).problem
    assert problem.costs.header_s.tolist() == pytest.approx([0.0, 1e-3 + HEADER_BYTES / 1e9 + 3e-4])
    assert problem.costs.request_cpu_s.tolist() == [1e-4, 2e-5]
    last = problem.topological_order[-1]
    assert problem.costs.output_s[last].tolist() == pytest.approx([0.0, 2e-4 + 1e-3 + 16 * 64 * 4 / 1e9 + 3e-4])
    # For the period, the same message's CPU times: the sender's on the maker's device, the receiver's on device 0.
    assert problem.costs.output_send_cpu_s[last].tolist() == pytest.approx([0.0, 2e-4])
    assert problem.costs.output_recv_cpu_s[last].tolist() == pytest.approx([0.0, 3e-4])
    assert HEADER_BYTES == 8 * HEADER_WORDS  # the runtime's header: that many int64


def _two_tasks_with_an_output(output_s: float) -> Problem:
    """Two independent tasks, 10x faster on device 1; ``b``'s output takes ``output_s`` back to device 0."""
    return Problem.from_dict(
        {
            "devices": [{"name": "d0"}, {"name": "d1"}],
            "tasks": [{"name": "a", "compute_s": [10.0, 1.0]}, {"name": "b", "compute_s": [10.0, 1.0]}],
            "request_costs": {"output_s": [[0, 0], [0, output_s]]},
        }
    )


def test_a_one_device_plan_keeps_its_own_order_where_the_traced_one_is_slower() -> None:
    """On device 1, b first sends its output on its way while a runs (6 s); the traced order a, b took 7 s and was
    kept as 'gap closed'."""
    problem = _two_tasks_with_an_output(5.0)
    plan = place(problem, "milp", time_limit_s=5)
    assert plan.objective_s == pytest.approx(brute_force_optimum(problem)) == 6.0
    assert plan.order == ((), (1, 0))
    assert plan.report.stop_reason is StopReason.GAP_CLOSED


def test_a_one_device_plan_runs_in_the_traced_order_where_the_model_cannot_tell() -> None:
    plan = place(_two_tasks_with_an_output(0.0), "milp", time_limit_s=5)
    assert plan.order == ((), (0, 1)) and plan.objective_s == 2.0
