"""The throughput objective: the period of pipelined requests, its bound, the MILP's rows and the stage DP."""

from __future__ import annotations

import dataclasses
import itertools
import math

import networkx as nx
import numpy as np
import pytest
import torch
from rich.console import Console

import moirai
from moirai import viz
from moirai.errors import InfeasibleError, PlanError
from moirai.planning.bounds import lower_bounds
from moirai.planning.objective import Generation, Throughput, as_objective
from moirai.planning.placers import get_placer, list_placers, place
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.report import StopReason
from moirai.planning.simulate import simulate
from moirai.testing import EVERY_COST, link_tensors, random_layered_problem, random_problem
from tests.test_placers import MEMORY_BLIND, OPTIONS


def chain(compute_s: list[list[float]], transfer_s: float = 0.0) -> Problem:
    k = len(compute_s[0])
    return Problem.from_dict(
        {
            "devices": [{"name": f"d{d}"} for d in range(k)],
            "tasks": [{"name": f"t{i}", "compute_s": c} for i, c in enumerate(compute_s)],
            "edges": [
                {"src": f"t{i}", "dst": f"t{i + 1}", "transfer_s": (transfer_s * (1 - np.eye(k))).tolist()}
                for i in range(len(compute_s) - 1)
            ],
        }
    )


def best_period_s(problem: Problem) -> float:
    """The true best period: it depends on the placement only, so every placement that runs and fits is tried."""
    best = math.inf
    for placement in itertools.product(range(problem.num_devices), repeat=problem.num_tasks):
        try:
            timeline = simulate(problem, Plan(np.array(placement), problem.device_names))
        except PlanError:
            continue  # a task where it cannot run, or a tensor with no link
        if timeline.fits_memory:
            best = min(best, timeline.period_s)
    return best


def assert_milp_solved_the_period(problem: Problem, plan: Plan) -> None:
    """The MILP's rows price the period: its optimum is the best period, which bounds the plan's value, the served
    period (a round trip the rows do not price may make the plan the MILP found serve slower than a start plan, and
    then the start is returned)."""
    best_s = best_period_s(problem)
    assert plan.report.solver_objective_s == pytest.approx(best_s, rel=1e-6)
    assert plan.objective_s == simulate(problem, plan).served_period_s
    assert plan.objective_s >= best_s * (1 - 1e-9)
    assert plan.lower_bound_s <= best_s * (1 + 1e-6)
    if plan.report.stop_reason is StopReason.GAP_CLOSED:
        assert plan.objective_s <= plan.lower_bound_s * (1 + 1e-4)


def _edge(src: str, dst: str, transfer_s: list, send_cpu_s: list, recv_cpu_s: list) -> dict:
    return {"src": src, "dst": dst, "transfer_s": transfer_s, "send_cpu_s": send_cpu_s, "recv_cpu_s": recv_cpu_s}


# HiGHS 1.16, warm-started from the best heuristic's plan [0, 0, 1, 0, 0] (period 5.95), called it optimal with a
# bound of 1.99 and returned it; [1, 0, 1, 0, 0] has period 4.5 ([Note: HiGHS's presolve and a start]).
SENDS_AND_RECEIVES = {
    "devices": [{"name": "d0"}, {"name": "d1"}],
    "tasks": [
        {"name": "t0", "compute_s": [2.07, 2.21]},
        {"name": "t1", "compute_s": [1.74, 2.08]},
        {"name": "t2", "compute_s": [math.inf, 1.99]},
        {"name": "t3", "compute_s": [0.5, 2.44]},
        {"name": "t4", "compute_s": [1.5, 1.76]},
    ],
    "edges": [
        _edge("t0", "t1", [[0, 1.71], [0.77, 0]], [[0, 0.43], [0.3, 0]], [[0, 0.15], [0.37, 0]]),
        _edge("t1", "t3", [[0, 1.98], [1.81, 0]], [[0, 0.03], [0.08, 0]], [[0, 0.42], [0.34, 0]]),
        _edge("t3", "t4", [[0, 1.96], [1.86, 0]], [[0, 0.45], [0.37, 0]], [[0, 0.1], [0.04, 0]]),
        _edge("t2", "t4", [[0, 1.05], [1.93, 0]], [[0, 0.48], [0, 0]], [[0, 0.46], [0.14, 0]]),
    ],
}


def _every_cost_problem(seed: int) -> Problem:
    """A fuzz review's random problem with sends, receives and the driver's messages (seeds 347 and 367 failed as
    SENDS_AND_RECEIVES did)."""
    rng = np.random.default_rng(seed)
    num_tasks, num_devices = int(rng.integers(3, 6)), int(rng.integers(2, 4))
    drawn = {
        name: scale * int(rng.integers(0, 2))
        for name, scale in (
            ("header_s", 0.5),
            ("output_s", 0.5),
            ("request_cpu_s", 0.3),
            ("output_cpu_s", 0.3),
            ("input_s", 0.4),
            ("driver_part_cpu_s", 0.3),
        )
    }
    rng.choice([2.0, 3.0, 9.0], 3)  # drawn and unused by the review's generator: kept for its seeds' problems
    capacity_bytes = float(rng.choice([2.0, 3.0, 9.0]))
    return random_problem(
        seed,
        num_tasks,
        num_devices,
        send_cpu_s=0.5,
        recv_cpu_s=0.5,
        task_memory_bytes=1.0,
        capacity_bytes=capacity_bytes,
        forbid_fraction=0.3,
        **drawn,
    )


@pytest.mark.parametrize(
    "problem",
    [Problem.from_dict(SENDS_AND_RECEIVES), _every_cost_problem(347), _every_cost_problem(367)],
    ids=["sends_and_receives", "seed347", "seed367"],
)
def test_milp_throughput_with_sends_and_receives_is_the_best_period_and_claims_no_false_gap(problem):
    plan = place(problem, "milp", objective="throughput", time_limit_s=10)
    assert_milp_solved_the_period(problem, plan)
    assert plan.report.solver_bound_s <= best_period_s(problem) * (1 + 1e-9)
    # Proved: optimal, of the served period where it meets the period's bound, else of the period it models.
    assert plan.report.stop_reason in (StopReason.GAP_CLOSED, StopReason.PART_SOLVED)


def test_period_is_the_busiest_device_or_link_per_request():
    problem = chain([[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]], transfer_s=2.5)
    timeline = simulate(problem, Plan(np.array([0, 1, 1]), problem.device_names))
    assert timeline.busy_s.tolist() == [1.0, 3.0]
    assert timeline.link_busy_s == {(0, 1): 2.5}
    assert timeline.period_s == 3.0
    split_late = simulate(problem, Plan(np.array([0, 0, 1]), problem.device_names))
    assert split_late.period_s == 3.0 and split_late.makespan_s == 6.5


def test_the_runtimes_work_per_request_counts_on_every_device_taking_part_and_always_on_the_driver():
    problem = chain([[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]]).with_costs(request_cpu_s=np.array([0.25, 0.5]))
    split = simulate(problem, Plan(np.array([0, 1, 1]), problem.device_names))
    assert split.runtime_cpu_s.tolist() == [0.25, 0.5]
    assert split.period_s == 3.5  # device 1: 3.0 of tasks and 0.5 of the runtime's work
    # A lone request waits for the driver's own work (taking it, settling its future): device 0's, whatever the plan.
    assert split.makespan_s == 4.25
    assert simulate(problem, Plan(np.array([1, 1, 1]), problem.device_names)).makespan_s == 4.25
    on_one = simulate(problem, Plan(np.array([1, 1, 1]), problem.device_names))
    assert on_one.runtime_cpu_s.tolist() == [0.25, 0.5]  # device 0 drives, though it runs nothing
    on_zero = simulate(problem, Plan(np.array([0, 0, 0]), problem.device_names))
    assert on_zero.runtime_cpu_s.tolist() == [0.25, 0.0] and on_zero.period_s == 4.25
    assert Throughput().lower_bound_s(problem.with_costs(request_cpu_s=np.array([9.0, 0.0]))) == 9.0
    # The last task's output sent from device 1 to the driver: its send on device 1, its receive on device 0.
    with_output = problem.with_costs(
        output_send_cpu_s=np.array([[0.0, 0.0], [0.0, 0.0], [0.0, 0.125]]),
        output_recv_cpu_s=np.array([[0.0, 0.0], [0.0, 0.0], [0.0, 0.375]]),
    )
    assert simulate(with_output, Plan(np.array([0, 1, 1]), problem.device_names)).runtime_cpu_s.tolist() == [
        0.625,
        0.625,
    ]
    assert simulate(with_output, Plan(np.array([0, 0, 0]), problem.device_names)).runtime_cpu_s.tolist() == [0.25, 0.0]


def test_place_scores_every_plan_by_its_served_period_against_the_load_bound():
    problem = random_problem(3, 12, 3)
    bound = lower_bounds(problem).load_s
    for placer in sorted(set(list_placers()) - MEMORY_BLIND):
        plan = place(problem, placer, objective="throughput", **OPTIONS.get(placer, {}))
        assert plan.objective == "throughput"
        assert plan.objective_s == simulate(problem, plan).served_period_s
        assert plan.lower_bound_s >= bound - 1e-9  # the milp placer may prove more
        assert plan.objective_s >= bound - 1e-9


@pytest.mark.parametrize(
    ("seed", "send_cpu_s", "recv_cpu_s", "request_cpu_s"),
    [(seed, 0.0, 0.0, 0.0) for seed in range(8)]
    + [(seed, 1.0, 0.0, 0.0) for seed in range(4)]
    + [(4, 0.5, 1.0, 0.0), (5, 0.0, 1.0, 0.0)]
    + [(seed, 0.0, 0.0, 4.0) for seed in range(6)]
    + [(6, 0.5, 0.5, 3.0)],
)
def test_milp_throughput_optimum_equals_the_best_period(seed, send_cpu_s, recv_cpu_s, request_cpu_s):
    """Also when sends and receives keep their devices busy, and with the runtime's own work per request on
    each device taking part and the outputs' messages to device 0: that time counts in their load per request."""
    problem = random_problem(
        seed,
        send_cpu_s=send_cpu_s,
        recv_cpu_s=recv_cpu_s,
        request_cpu_s=request_cpu_s,
        output_cpu_s=request_cpu_s,
        input_s=request_cpu_s,
        driver_part_cpu_s=request_cpu_s,
    )
    plan = place(problem, "milp", objective="throughput", time_limit_s=30)
    assert_milp_solved_the_period(problem, plan)


def test_a_latency_limit_is_met_and_an_impossible_one_is_refused_by_name():
    problem = random_problem(2)
    fastest = place(problem, "milp", time_limit_s=30)
    free = place(problem, "milp", objective="throughput", time_limit_s=30)
    limit = (fastest.makespan_s + free.makespan_s) / 2
    limited = place(problem, "milp", objective=Throughput(max_latency_s=limit), time_limit_s=30)
    assert limited.makespan_s <= limit * (1 + 1e-9)
    assert limited.objective_s >= free.objective_s - 1e-9
    with pytest.raises(InfeasibleError, match="max_latency_s"):
        place(problem, "milp", objective=Throughput(max_latency_s=0.5 * fastest.makespan_s), time_limit_s=30)


@pytest.mark.parametrize("limit_s", [-1.0, 0.0, float("nan"), -float("inf"), "1"])
def test_a_latency_limit_that_is_no_time_is_refused_by_name(limit_s):
    """Fault injected: -1 and NaN made every plan unacceptable without a word."""
    with pytest.raises(moirai.MoiraiError, match=r"Throughput\(max_latency_s=.*\): a limit is a positive number"):
        Throughput(max_latency_s=limit_s)
    with pytest.raises(moirai.MoiraiError, match=r"Generation\(max_ttft_s=.*\): a limit is a positive number"):
        Generation(max_ttft_s=limit_s)


def test_an_infinite_latency_limit_is_no_limit_and_the_milp_still_solves():
    """Fault injected: max_latency_s=inf gave the MILP a NaN bound, so the solver failed and only the heuristics
    answered (``the MILP solver failed (... non-finite upper bound (nan))``)."""
    problem = random_problem(2)
    plan = place(problem, "milp", objective=Throughput(max_latency_s=float("inf")), time_limit_s=30)
    assert plan.objective_s == pytest.approx(
        place(problem, "milp", objective="throughput", time_limit_s=30).objective_s
    )
    assert not str(plan.report.solver_status).startswith("error"), plan.report.solver_status


def test_pipeline_stages_are_contiguous_and_balance_a_chain():
    problem = chain([[1.0, 2.0]] * 6)  # device 1 half as fast: the best split gives it 2 tasks (4 s), d0 4
    plan = get_placer("pipeline")(problem)
    assert plan.placement.tolist() == [0, 0, 0, 0, 1, 1] or plan.placement.tolist() == [1, 1, 0, 0, 0, 0]
    assert simulate(problem, plan).period_s == 4.0
    order = list(problem.topological_order)
    for d in range(problem.num_devices):
        positions = [order.index(i) for i in plan.order[d]]
        assert positions == list(range(positions[0], positions[0] + len(positions))) if positions else True


def test_pipeline_stages_carry_the_runtimes_work_per_request():
    problem = chain([[1.0, 1.0]] * 6).with_costs(request_cpu_s=np.array([2.0, 0.5]))
    plan = get_placer("pipeline")(problem)
    assert sorted(np.bincount(plan.placement, minlength=2).tolist()) == [2, 4]  # 2 + 2 on the driver, 4 + 0.5
    assert simulate(problem, plan).period_s == plan.report.notes["dp_period_s"] == best_period_s(problem) == 4.5


def _pipeline_problems() -> list[Problem]:
    """Layered graphs on 2-9 devices (both the subset DP and the fixed device order) whose transfers cost their
    two ends CPU time, and small random graphs with every per-request cost (runtime work, output messages)."""
    layered = [
        random_layered_problem(20 + 5 * seed, 2 + seed % 8, seed=seed, communication_ratio=2.0, cpu_ratio=0.8)
        for seed in range(10)
    ]
    costly = [random_problem(seed, 10, 3, **EVERY_COST) for seed in range(4)]
    return layered + costly


@pytest.mark.parametrize("problem", _pipeline_problems())
def test_pipeline_dp_prices_a_plan_as_the_simulator_does_send_and_receive_cpu_included(problem: Problem):
    plan = get_placer("pipeline")(problem)
    period_s = simulate(problem, plan).period_s
    assert plan.report.notes["dp_period_s"] == pytest.approx(period_s, rel=1e-9)
    assert period_s <= plan.report.notes["cut_priced_period_s"] * (1 + 1e-9)  # never worse than PipeEdge's pick


# The simulated periods the pipeline DP reached before it priced sends and receives on devices (PipeEdge's price
# alone, commit 566b75a) on layered graphs without CPU time per transfer.
PIPEEDGE_PERIODS_S = [
    0.003888859, 0.002277848, 0.002194822, 0.002230976, 0.002208316, 0.002404709,
    0.002505119, 0.002466235, 0.007199976, 0.008546399, 0.005049087, 0.004067288,
]  # fmt: skip


@pytest.mark.parametrize("seed", range(len(PIPEEDGE_PERIODS_S)))
def test_pipeline_is_no_worse_than_before_where_transfers_cost_no_cpu(seed: int):
    n, k = 20 + 6 * seed, 2 + seed % 8
    problem = random_layered_problem(n, k, seed=seed, communication_ratio=[0.5, 2.0, 4.0][seed % 3])
    plan = get_placer("pipeline")(problem)
    assert simulate(problem, plan).period_s <= PIPEEDGE_PERIODS_S[seed] * (1 + 1e-6)


def test_unknown_objective_names_the_choices():
    with pytest.raises(Exception, match="latency.*throughput"):
        as_objective("energy")


@pytest.mark.slow
def test_compile_for_throughput_splits_correctly_and_the_summary_shows_both_figures():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(6))).eval()
    x = torch.randn(4, 32)
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="pipeline", objective="throughput")
    assert compiled.plan.objective == "throughput"
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    console = Console(record=True, width=200)
    compiled.summary(console)
    text = console.export_text()
    timeline = moirai.simulate(compiled.problem, compiled.plan)
    assert f"predicted {viz.format_seconds(timeline.makespan_s)}" in text
    period = f"period {viz.format_seconds(timeline.period_s)}, {viz.format_rate(1 / timeline.period_s)} req/s"
    assert f"{period} · period bound" in text  # the period next to its bound


def test_of_two_mirror_images_of_one_period_throughput_keeps_the_one_without_a_round_trip_on_rank_0():
    """Input read by the first task, output made by the last, priced alike both ways: [0, 1] and its mirror image
    [1, 0] tie in period, served period and latency. For latency the plan ending on rank 0 is kept ([Note: end on
    rank 0]); for throughput the one starting there, by the tie-break: a part 0 that waits for another device
    served 8-10% slower across two hosts."""
    from moirai.planning.costs import RequestCosts
    from moirai.planning.placers import _as_the_runtime_prefers

    problem = chain([[1.0, 1.0], [1.0, 1.0]], transfer_s=0.1)
    costs = RequestCosts.build(
        2,
        2,
        [[0]],
        input_s=[[0, 0.1]],
        input_link_s=[[0, 0.1]],
        output_s=[[0, 0], [0, 0.1]],
        output_link_s=[[0, 0], [0, 0.1]],
    )
    problem = dataclasses.replace(problem, costs=costs)
    starting, ending = (Plan(np.array(p), problem.device_names) for p in ([0, 1], [1, 0]))
    for plan in (starting, ending):
        assert simulate(problem, plan).period_s == pytest.approx(1.0)
        assert simulate(problem, plan).makespan_s == pytest.approx(2.2)
        assert simulate(problem, plan).served_period_s == pytest.approx(1.0)
    assert simulate(problem, ending).driver_hold_s == pytest.approx(2.2)
    assert _as_the_runtime_prefers(problem, starting, Throughput()).placement.tolist() == [0, 1]
    assert _as_the_runtime_prefers(problem, starting, as_objective("latency")).placement.tolist() == [1, 0]


@pytest.mark.parametrize("seed", [1, 4])
def test_milp_throughput_with_a_slow_header_finds_the_best_period_and_never_bounds_above_it(seed):
    """The MILP's horizon is a makespan every placement reaches: with device 1's header at 50 s it once left the
    header out, dropped device 1 and proved a 'bound' twice the period it returned."""
    problem = random_problem(seed, num_tasks=5, num_devices=2)
    problem = dataclasses.replace(problem, costs=problem.costs.replace(header_s=np.array([0.0, 50.0])))
    plan = place(problem, "milp", objective="throughput", time_limit_s=30)
    assert_milp_solved_the_period(problem, plan)


@pytest.mark.parametrize("seed", [1, 5])
def test_milp_throughput_is_not_stopped_by_an_absolute_gap_when_the_horizon_dwarfs_the_period(seed):
    """A tensor that should never cross, written as a huge link time, makes the horizon 1e10 times the period: in
    the model's units (horizon / 1000) the period is below HiGHS's default absolute gap, which once stopped the
    solve at its start plan and called it optimal."""
    problem = random_problem(seed, num_tasks=5, num_devices=2)
    transfer_s = problem.transfer_s.copy()
    transfer_s[0] *= 1e10
    problem = dataclasses.replace(problem, transfer_s=transfer_s)
    plan = place(problem, "milp", objective="throughput", time_limit_s=30)
    assert_milp_solved_the_period(problem, plan)


def test_milp_throughput_proves_a_period_above_its_latency_limit():
    """The runtime's work per request counts in the period, not in the latency: device 1's 5 s make the best
    period (6 s) longer than the 5 s latency limit its plan meets. The period once had the limit as upper bound,
    so the MILP found it infeasible and kept the start plan unproven."""
    problem = Problem(
        ("d0", "d1"),
        np.array([np.inf, np.inf]),
        ("a", "b"),
        np.array([[4.0, 1.0], [4.0, 1.0]]),
        np.zeros(2),
        (),
        np.zeros(0, int),
        (),
        np.zeros((0, 2, 2)),
    ).with_costs(request_cpu_s=np.array([0.0, 5.0]))
    plan = place(problem, "milp", objective=Throughput(max_latency_s=5.0), time_limit_s=30)
    assert plan.objective_s == pytest.approx(6.0)
    assert plan.lower_bound_s == pytest.approx(6.0, rel=1e-6)
    assert plan.report.stop_reason is StopReason.GAP_CLOSED


def best_generation_s(decode: Problem, objective: Generation) -> float:
    """The true best value of ``objective``: every placement, device order and link order, simulated."""
    k = decode.num_devices
    topological_orders = list(nx.all_topological_sorts(decode.graph))
    best = math.inf
    for placement in itertools.product(range(k), repeat=decode.num_tasks):
        placement = np.array(placement)
        orders = {tuple(tuple(i for i in o if placement[i] == d) for d in range(k)) for o in topological_orders}
        links = link_tensors(decode, placement)
        for order in orders:
            for link_orders in itertools.product(*(itertools.permutations(ts) for ts in links.values())):
                plan = Plan(placement, decode.device_names, order, dict(zip(links, link_orders, strict=True)))
                try:
                    timeline = simulate(decode, plan)
                except PlanError:
                    continue  # link orders that contradict the device orders deadlock
                if objective.acceptable(timeline):
                    best = min(best, objective.value_s(timeline))
    return best


@pytest.mark.parametrize("seed", [11, 13])
def test_milp_for_generation_claims_no_closed_gap_for_the_decode_step_alone(seed):
    """The MILP models the decode step, not the prefill: solving it to optimality closes no gap of TTFT + n TPOT.
    It once said 'gap closed' of plans up to 18% above the optimum."""
    decode = random_problem(seed, num_tasks=4, num_devices=2)
    scale = np.random.default_rng(seed).uniform(2, 8, decode.compute_s.shape)
    objective = Generation(prefill=dataclasses.replace(decode, compute_s=decode.compute_s * scale), new_tokens=3)
    best_s = best_generation_s(decode, objective)
    plan = place(decode, "milp", objective=objective, time_limit_s=30)
    assert plan.lower_bound_s <= best_s * (1 + 1e-9)
    if plan.report.stop_reason is StopReason.GAP_CLOSED:
        assert plan.objective_s <= plan.lower_bound_s * (1 + 1e-4)
    if plan.objective_s > best_s * (1 + 1e-4):  # the case it was about: the decode step's optimum is not the best
        assert plan.report.stop_reason is StopReason.PART_SOLVED  # (a MILP that models the prefill may reach it)


def test_a_plan_over_memory_is_not_acceptable_and_ranks_after_a_slower_plan_that_fits():
    problem = dataclasses.replace(
        chain([[1.0, 1.0], [1.0, 1.0]]), memory_bytes=np.array([1.0, 1.0]), memory_capacity_bytes=np.array([2.0, 0.5])
    )
    fits, over = (simulate(problem, Plan(np.array(p), problem.device_names)) for p in ([0, 0], [0, 1]))
    assert fits.fits_memory and not over.fits_memory
    assert over.period_s < fits.period_s and over.makespan_s <= fits.makespan_s
    for objective in (Throughput(), Throughput(max_latency_s=100.0)):
        assert objective.acceptable(fits) and not objective.acceptable(over)
        assert sorted([over, fits], key=objective.rank) == [fits, over]
        assert not objective.improves(over, fits)


def _ttft_limited(seed: int) -> tuple[Problem, Generation]:
    """A decode problem and a Generation whose TTFT limit is 0.7 of the single device plan's, whose prefill is 2-6
    times its compute and 5 times its transfers: where the decode step's best plan misses the limit."""
    rng = np.random.default_rng(seed)
    num_tasks, num_devices = int(rng.integers(4, 7)), int(rng.integers(2, 4))
    decode = random_problem(seed, num_tasks=num_tasks, num_devices=num_devices, slowdown=1.5, header_s=0.3)
    spec = decode.to_dict()
    for task in spec["tasks"]:
        task["compute_s"] = [c * float(rng.uniform(2, 6)) for c in task["compute_s"]]
    for edge in spec["edges"]:
        edge["transfer_s"] = [[x * 5 for x in row] for row in edge["transfer_s"]]
    prefill, new_tokens = Problem.from_dict(spec), int(rng.choice([1, 8, 64]))
    single = simulate(decode, place(decode, "single", "latency"))
    limit_s = 0.7 * Generation(prefill=prefill, new_tokens=new_tokens).ttft_s(single)
    return decode, Generation(prefill=prefill, new_tokens=new_tokens, max_ttft_s=limit_s)


@pytest.mark.parametrize("seed", [1, 4])
def test_milp_under_a_ttft_limit_never_returns_a_plan_that_misses_it(seed):
    """The whole model holds no TTFT limit: its plan may miss it. milp once returned that plan over an acceptable
    start (seed 4: HEFT's, TTFT 32.58 s of 32.68 s, became 35.06 s), and one over the limit where no start met it
    (seed 1), with a warning to use milp."""
    decode, objective = _ttft_limited(seed)
    starts = [simulate(decode, place(decode, name)) for name in ("heft", "pieces")]
    acceptable = [timeline for timeline in starts if objective.acceptable(timeline)]
    try:
        plan = place(decode, "milp", objective, time_limit_s=8)
    except InfeasibleError as error:
        assert not acceptable
        assert "max_ttft_s" in str(error)
        return
    timeline = simulate(decode, plan)
    assert objective.acceptable(timeline)
    assert all(objective.value_s(timeline) <= objective.value_s(start) * (1 + 1e-9) for start in acceptable)


def test_the_warning_for_a_plan_over_the_limit_recommends_milp_to_other_placers_alone():
    from moirai.planning.placers import _warn_if_over_the_limit

    decode, objective = _ttft_limited(1)
    for placer in ("heft", "milp"):
        plan = Plan(np.zeros(decode.num_tasks, dtype=int), decode.device_names, placer=placer)
        with pytest.warns(moirai.MoiraiWarning) as caught:
            _warn_if_over_the_limit(plan, simulate(decode, plan), objective)
        message = str(caught[0].message)
        assert message.endswith("raise the limit")
        assert ("use placer='milp'" in message) == (placer != "milp"), message


# A chain of 2, 3 and 2 s on two like devices: [0, 1, 0] has the shortest period (4 s, device 0's two tasks) but
# device 0 waits 7 s for each request's round trip through device 1; a contiguous split serves one per 5 s.
ROUND_TRIP_CHAIN = [[2.0, 2.0], [3.0, 3.0], [2.0, 2.0]]


@pytest.mark.parametrize("placer", sorted(set(list_placers()) - MEMORY_BLIND))
def test_throughput_values_a_plan_by_its_served_period_and_no_placer_returns_the_round_trip_plan(placer):
    """The throughput objective once valued a plan by its period alone: milp returned the round trip's 4 s plan,
    which the runtime serves at 7 s, as the best; on the bench zoo its plans served 3-6x slower than contiguous's."""
    problem = chain(ROUND_TRIP_CHAIN)
    round_trip = simulate(problem, Plan(np.array([0, 1, 0]), problem.device_names))
    assert (round_trip.period_s, round_trip.served_period_s) == (4.0, 7.0)
    plan = place(problem, placer, objective="throughput", **OPTIONS.get(placer, {}))
    timeline = simulate(problem, plan)
    assert plan.objective_s == timeline.served_period_s
    assert plan.placement.tolist() not in ([0, 1, 0], [1, 0, 1])
    if placer in ("milp", "contiguous"):
        assert plan.objective_s == pytest.approx(5.0)  # the best any placement serves (a contiguous split)
    if placer == "milp":
        # The MILP priced the period: its 4 s bounds the 5 s served, and closes no gap of it.
        assert plan.report.solver_objective_s == pytest.approx(4.0, rel=1e-6)
        assert plan.lower_bound_s == pytest.approx(4.0, rel=1e-6)
        assert plan.report.stop_reason is not StopReason.GAP_CLOSED


@pytest.mark.parametrize("seed, tasks, devices", [(755221, 7, 3), (585852, 4, 3), (175025, 7, 2), (218275, 5, 2)])
def test_milp_solving_a_small_problem_whole_serves_no_slower_than_contiguous(seed, tasks, devices):
    """The whole MILP prices the period: its optimum sent work there and back, and milp returned pipeline's plan
    (4.80 s on the first problem) where contiguous's served at 3.64 s, the brute-force optimum. contiguous is a
    start of the whole solve too, and the period search goes on from the better."""
    problem = random_problem(seed, tasks, devices, **EVERY_COST)
    plan = place(problem, "milp", objective="throughput", time_limit_s=1)
    contiguous = place(problem, "contiguous", objective="throughput")
    assert plan.report.strategy == "full"
    assert plan.objective_s <= contiguous.objective_s * (1 + 1e-9)
    assert plan.objective_s == pytest.approx(Throughput().value_s(simulate(problem, plan)), rel=1e-12)
