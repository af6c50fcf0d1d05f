"""The simulator against hand-computed timelines, and its schedules' invariants on random plans."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moirai.errors import PlanError
from moirai.planning.placers._list_scheduling import to_plan
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.planning.schedule import ScheduleBuilder
from moirai.planning.simulate import simulate


def two_devices(tasks: dict[str, list[float]], edges: list[dict], **device_options: float) -> Problem:
    devices = [{"name": "gpu0", **device_options}, {"name": "gpu1", **device_options}]
    return Problem.from_dict(
        {
            "devices": devices,
            "tasks": [{"name": name, "compute_s": times} for name, times in tasks.items()],
            "edges": edges,
        }
    )


def link(seconds: float) -> list[list[float]]:
    return [[0.0, seconds], [seconds, 0.0]]


def place(problem: Problem, devices: dict[str, int], order: dict[int, list[str]] | None = None, **options) -> Plan:
    placement = [devices[name] for name in problem.task_names]
    plan_order = None
    if order is not None:
        plan_order = tuple(tuple(problem.task_index(n) for n in order.get(d, [])) for d in range(problem.num_devices))
    return Plan(placement, problem.device_names, order=plan_order, **options)


def test_chain_on_two_devices_waits_for_the_transfer():
    problem = two_devices({"a": [1.0, 9.0], "b": [9.0, 2.0]}, [{"src": "a", "dst": "b", "transfer_s": link(0.5)}])
    timeline = simulate(problem, place(problem, {"a": 0, "b": 1}))
    assert timeline.task_start.tolist() == [0.0, 1.5]
    assert timeline.makespan_s == 3.5
    assert [(t.src, t.dst, t.start, t.finish) for t in timeline.transfers] == [(0, 1, 1.0, 1.5)]
    assert timeline.busy_s.tolist() == [1.0, 2.0]


def test_a_send_keeps_its_sender_busy_after_the_producer_and_the_transfer_starts_after_it():
    sender = {"send_cpu_s": link(0.25)}
    problem = two_devices(
        {"a": [1.0, 9.0], "b": [9.0, 2.0], "c": [1.0, 1.0]},
        [
            {"src": "a", "dst": "b", "transfer_s": link(0.5), **sender},
            {"src": "a", "dst": "c", **sender, "transfer_s": link(0.5)},
        ],
    )
    timeline = simulate(problem, place(problem, {"a": 0, "b": 1, "c": 0}))
    # a computes 1 s and posts its send to gpu1 for 0.25 s; c (on a's device) waits for that, b for the transfer.
    assert timeline.task_finish.tolist() == [1.25, 3.75, 2.25]
    assert [(t.start, t.finish) for t in timeline.transfers] == [(1.25, 1.75)]
    assert timeline.busy_s.tolist() == [2.25, 2.0]
    # On one device nothing is sent and nothing is added.
    assert simulate(problem, place(problem, {"a": 0, "b": 0, "c": 0})).makespan_s == 11.0


def test_a_receive_keeps_its_receiver_busy_once_per_tensor_and_device():
    receiver = {"recv_cpu_s": link(0.25)}
    problem = two_devices(
        {"a": [1.0, 9.0], "b": [9.0, 2.0], "c": [9.0, 1.0]},
        [
            {"src": "a", "dst": "b", "tensor": "x", "transfer_s": link(0.5), **receiver},
            {"src": "a", "dst": "c", "tensor": "x", "transfer_s": link(0.5), **receiver},
        ],
    )
    timeline = simulate(problem, place(problem, {"a": 0, "b": 1, "c": 1}))
    # The tensor crosses once; b, its first consumer on gpu1 in topological order, also receives it (0.25 s).
    assert [(t.start, t.finish) for t in timeline.transfers] == [(1.0, 1.5)]
    assert timeline.task_finish.tolist() == [1.0, 3.75, 4.75]
    assert timeline.busy_s.tolist() == [1.0, 3.25]
    # The schedule builder charges the same consumer.
    schedule = ScheduleBuilder(problem)
    schedule.book(0, 0)
    assert schedule.ready_and_busy_s(1, 1) == (1.5, 2.25)
    schedule.book(1, 1)
    assert schedule.ready_and_busy_s(2, 1) == (1.5, 1.0)
    # Booked after c, b still takes the receive from it: c (booked first, 1.5-2.75) is re-timed to 1.5-2.5.
    schedule = ScheduleBuilder(problem)
    schedule.book(0, 0)
    assert schedule.ready_and_busy_s(2, 1) == (1.5, 1.25)
    schedule.book(2, 1)
    assert schedule.book(1, 1) == 2.5
    assert schedule.finish_s == [1.0, 4.75, 2.5]
    assert simulate(problem, to_plan(schedule, "test")).task_finish.tolist() == schedule.finish_s


def test_the_schedule_builder_adds_a_send_to_its_producer_when_a_remote_consumer_asks_for_it():
    problem = two_devices(
        {"a": [1.0, 9.0], "b": [9.0, 2.0], "c": [1.0, 1.0]},
        [
            {"src": "a", "dst": "b", "transfer_s": link(0.5), "send_cpu_s": link(0.25)},
            {"src": "a", "dst": "c", "transfer_s": link(0.5)},
        ],
    )
    schedule = ScheduleBuilder(problem)
    schedule.book(0, 0)
    schedule.book(2, 0)  # c runs 1-2 on gpu0
    assert schedule.ready_and_busy_s(1, 1)[0] == 1.75  # a posts the send (1-1.25), then the link (0.5)
    assert schedule.devices[0].items == [0, 2]  # trying a device books nothing
    assert schedule.finish_s[2] == 2.0
    assert schedule.book(1, 1) == 1.75
    assert schedule.order == [[0, 2], [1]]
    # As in the simulator, a's send lengthens a itself, so c, after it on gpu0, is re-timed to 1.25-2.25.
    assert schedule.finish_s == [1.25, 3.75, 2.25]
    assert schedule.devices[0].finishes == [1.25, 2.25]
    assert simulate(problem, to_plan(schedule, "test")).task_finish.tolist() == schedule.finish_s
    assert schedule.makespan_s == 3.75


def test_a_device_starts_a_request_when_its_header_has_come():
    problem = Problem.from_dict(
        {
            "devices": [{"name": "driver"}, {"name": "worker", "header_s": 0.75}],
            "tasks": [{"name": "a", "compute_s": [1.0, 1.0]}, {"name": "b", "compute_s": [2.0, 2.0]}],
            "edges": [],
        }
    )
    timeline = simulate(problem, place(problem, {"a": 0, "b": 1}))
    assert timeline.task_start.tolist() == [0.0, 0.75]
    assert timeline.makespan_s == 2.75
    assert timeline.busy_s.tolist() == [1.0, 2.0]  # waiting for a header is not work
    assert simulate(problem, place(problem, {"a": 1, "b": 0})).task_start.tolist() == [0.75, 0.0]
    builder = ScheduleBuilder(problem)
    assert builder.ready_and_busy_s(problem.task_index("b"), 1)[0] == 0.75  # the list schedulers wait for it too
    assert Problem.from_dict(problem.to_dict()).costs.header_s.tolist() == [0.0, 0.75]


def test_a_request_is_done_when_its_outputs_are_with_the_driver():
    problem = Problem.from_dict(
        {
            "devices": [{"name": "driver"}, {"name": "worker"}],
            "tasks": [
                {"name": "a", "compute_s": [1.0, 1.0], "output_s": [0.0, 0.5]},
                {"name": "b", "compute_s": [2.0, 2.0]},
            ],
            "edges": [],
        }
    )
    assert simulate(problem, place(problem, {"a": 1, "b": 0})).makespan_s == 2.0
    late = simulate(problem, place(problem, {"a": 1, "b": 1}, order={1: ["b", "a"]}))
    assert late.task_finish.tolist() == [3.0, 2.0] and late.makespan_s == 3.5
    assert Problem.from_dict(problem.to_dict()).costs.output_s.tolist() == [[0.0, 0.5], [0.0, 0.0]]


def test_same_device_chain_sends_nothing():
    problem = two_devices({"a": [1.0, 9.0], "b": [2.0, 2.0]}, [{"src": "a", "dst": "b", "transfer_s": link(0.5)}])
    timeline = simulate(problem, place(problem, {"a": 0, "b": 0}))
    assert timeline.transfers == []
    assert timeline.makespan_s == 3.0


def contending_problem() -> Problem:
    # a (1 s) and b (2 s) on gpu0 both feed c on gpu1; a's tensor takes 3 s, b's 1 s.
    return two_devices(
        {"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [1.0, 1.0]},
        [{"src": "a", "dst": "c", "transfer_s": link(3.0)}, {"src": "b", "dst": "c", "transfer_s": link(1.0)}],
    )


def test_two_transfers_on_one_link_queue_with_contention():
    problem = contending_problem()
    plan = place(problem, {"a": 0, "b": 0, "c": 1}, order={0: ["a", "b"], 1: ["c"]})
    timeline = simulate(problem, plan)
    by_tensor = {problem.tensor_names[t.tensor]: (t.start, t.finish) for t in timeline.transfers}
    # a's tensor occupies the link 1..4; b finishes at 3 but its tensor waits for the link: 4..5.
    assert by_tensor == {"a->c": (1.0, 4.0), "b->c": (4.0, 5.0)}
    assert timeline.makespan_s == 6.0


def test_without_contention_transfers_overlap():
    problem = contending_problem()
    plan = place(problem, {"a": 0, "b": 0, "c": 1}, order={0: ["a", "b"], 1: ["c"]})
    timeline = simulate(problem, plan, contention=False)
    by_tensor = {problem.tensor_names[t.tensor]: (t.start, t.finish) for t in timeline.transfers}
    assert by_tensor == {"a->c": (1.0, 4.0), "b->c": (3.0, 4.0)}
    assert timeline.makespan_s == 5.0


def test_transfer_order_is_followed():
    problem = contending_problem()
    b_first = (problem.tensor_names.index("b->c"), problem.tensor_names.index("a->c"))
    plan = place(problem, {"a": 0, "b": 0, "c": 1}, order={0: ["a", "b"], 1: ["c"]}, transfer_order={(0, 1): b_first})
    timeline = simulate(problem, plan)
    by_tensor = {problem.tensor_names[t.tensor]: (t.start, t.finish) for t in timeline.transfers}
    assert by_tensor == {"b->c": (3.0, 4.0), "a->c": (4.0, 7.0)}
    assert timeline.makespan_s == 8.0
    assert timeline.transfer_order() == {(0, 1): b_first}


def test_transfer_order_must_list_exactly_the_transfers_of_its_link():
    problem = contending_problem()
    plan = place(problem, {"a": 0, "b": 0, "c": 1}, transfer_order={(0, 1): (0,)})
    with pytest.raises(PlanError, match="missing"):
        simulate(problem, plan)


def test_fan_out_to_two_consumers_on_one_remote_device_sends_once():
    # One tensor x of a, read by b and c, both on gpu1.
    problem = two_devices(
        {"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [3.0, 3.0]},
        [
            {"src": "a", "dst": "b", "tensor": "x", "transfer_s": link(0.5)},
            {"src": "a", "dst": "c", "tensor": "x", "transfer_s": link(0.5)},
        ],
    )
    plan = place(problem, {"a": 0, "b": 1, "c": 1}, order={0: ["a"], 1: ["b", "c"]})
    timeline = simulate(problem, plan)
    assert [(t.tensor, t.start, t.finish) for t in timeline.transfers] == [(0, 1.0, 1.5)]
    assert timeline.task_start.tolist() == [0.0, 1.5, 3.5]
    assert timeline.makespan_s == 6.5


def test_two_tensors_to_one_device_are_two_transfers():
    problem = two_devices(
        {"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [3.0, 3.0]},
        [{"src": "a", "dst": "b", "transfer_s": link(0.5)}, {"src": "a", "dst": "c", "transfer_s": link(0.5)}],
    )
    timeline = simulate(problem, place(problem, {"a": 0, "b": 1, "c": 1}, order={0: ["a"], 1: ["b", "c"]}))
    assert sorted((t.start, t.finish) for t in timeline.transfers) == [(1.0, 1.5), (1.5, 2.0)]


def test_multi_hop_route_is_one_pair_with_its_effective_time():
    # gpu0 -> gpu2 goes through gpu1: latencies add up, the bottleneck bandwidth (2 GB/s) counts.
    bandwidth = [[0.0, 10e9, 2e9], [10e9, 0.0, 2e9], [2e9, 2e9, 0.0]]
    latency = [[0.0, 0.1, 0.3], [0.1, 0.0, 0.2], [0.3, 0.2, 0.0]]
    problem = Problem.from_dict(
        {
            "devices": [{"name": f"gpu{d}"} for d in range(3)],
            "tasks": [{"name": n, "compute_s": [1.0, 1.0, 1.0]} for n in ("a", "b", "c")],
            "edges": [{"src": "a", "dst": "b", "bytes": 1e9}, {"src": "a", "dst": "c", "bytes": 1e9}],
            "links": {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency},
        }
    )
    timeline = simulate(problem, Plan([0, 1, 2], problem.device_names))
    by_destination = {t.dst: (t.start, t.finish) for t in timeline.transfers}
    assert by_destination[1] == pytest.approx((1.0, 1.0 + 0.1 + 0.1))
    # The 0 -> 2 route is its own directed pair: it overlaps the 0 -> 1 transfer.
    assert by_destination[2] == pytest.approx((1.0, 1.0 + 0.3 + 0.5))
    assert timeline.makespan_s == pytest.approx(2.8)


def test_list_scheduling_runs_the_longest_remaining_path_first():
    # r (3 s) is a sink; p (1 s) feeds q (10 s) on gpu1. Both are ready at 0 on gpu0; r has the lower index.
    problem = two_devices(
        {"r": [3.0, 3.0], "p": [1.0, 1.0], "q": [10.0, 10.0]}, [{"src": "p", "dst": "q", "transfer_s": link(0.5)}]
    )
    timeline = simulate(problem, place(problem, {"r": 0, "p": 0, "q": 1}))
    assert timeline.device_order() == ((1, 0), (2,))
    assert timeline.makespan_s == 11.5
    fifo_by_index = place(problem, {"r": 0, "p": 0, "q": 1}, order={0: ["r", "p"], 1: ["q"]})
    assert simulate(problem, fifo_by_index).makespan_s == 14.5


def test_device_order_replays_the_same_schedule():
    problem = contending_problem()
    unordered = place(problem, {"a": 0, "b": 0, "c": 1})
    first = simulate(problem, unordered)
    replay = simulate(problem, Plan(unordered.placement, problem.device_names, order=first.device_order()))
    assert replay.task_start.tolist() == first.task_start.tolist()


def test_inconsistent_orders_deadlock_is_reported():
    # a -> b crosses gpu0 -> gpu1, c -> d crosses back; each device runs its consumer first.
    problem = two_devices(
        {n: [1.0, 1.0] for n in "abcd"},
        [{"src": "a", "dst": "b", "transfer_s": link(0.1)}, {"src": "c", "dst": "d", "transfer_s": link(0.1)}],
    )
    plan = place(problem, {"a": 0, "d": 0, "b": 1, "c": 1}, order={0: ["d", "a"], 1: ["b", "c"]})
    with pytest.raises(PlanError, match="deadlock.*'gpu0' waits to run 'd'"):
        simulate(problem, plan)


def test_transfer_order_that_contradicts_the_graph_deadlock_is_reported():
    # a -> x crosses to gpu1, x -> b comes back, b -> y crosses again; the link is told to send b's tensor first.
    problem = two_devices(
        {n: [1.0, 1.0] for n in ("a", "x", "b", "y")},
        [
            {"src": "a", "dst": "x", "transfer_s": link(0.1)},
            {"src": "x", "dst": "b", "transfer_s": link(0.1)},
            {"src": "b", "dst": "y", "transfer_s": link(0.1)},
        ],
    )
    b_before_a = (problem.tensor_names.index("b->y"), problem.tensor_names.index("a->x"))
    devices = {"a": 0, "b": 0, "x": 1, "y": 1}
    plan = place(problem, devices, order={0: ["a", "b"], 1: ["x", "y"]}, transfer_order={(0, 1): b_before_a})
    with pytest.raises(PlanError, match="deadlock.*'gpu1' waits to run 'x'"):
        simulate(problem, plan)
    assert simulate(problem, plan, contention=False).makespan_s == pytest.approx(4.3)  # 4 tasks of 1 s, 3 hops of 0.1 s


def test_memory_overflow_is_simulated_and_reported():
    problem = Problem.from_dict(
        {
            "devices": [{"name": "gpu0", "memory_bytes": 10.0}, {"name": "gpu1", "memory_bytes": 10.0}],
            "tasks": [{"name": n, "compute_s": [1.0, 1.0], "memory_bytes": 6.0} for n in "ab"],
            "edges": [{"src": "a", "dst": "b", "transfer_s": link(1.0)}],
        }
    )
    crowded = simulate(problem, Plan([0, 0], problem.device_names))
    assert crowded.makespan_s == 2.0
    assert crowded.memory_bytes.tolist() == [12.0, 0.0]
    assert not crowded.fits_memory
    assert simulate(problem, Plan([0, 1], problem.device_names)).fits_memory


def test_task_on_a_device_it_cannot_run_on_is_rejected():
    problem = two_devices({"a": [1.0, float("inf")]}, [])
    with pytest.raises(PlanError, match="cannot run"):
        simulate(problem, Plan([1], problem.device_names))


@st.composite
def random_plans(draw):
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    producers, consumers = [], []
    for u in range(n - 1):
        readers = sorted({int(v) for v in rng.integers(u + 1, n, size=rng.integers(0, 3))})
        if readers:
            producers.append(u)
            consumers.append(tuple(readers))
    transfer = rng.choice([0.0, 0.5, 1.0, 2.5], size=(len(producers), k, k))
    transfer[:, np.arange(k), np.arange(k)] = 0.0
    problem = Problem(
        device_names=tuple(f"d{d}" for d in range(k)),
        memory_capacity_bytes=np.full(k, np.inf),
        task_names=tuple(f"t{i}" for i in range(n)),
        compute_s=rng.choice([0.0, 1.0, 2.0, 3.5], size=(n, k)),
        memory_bytes=np.zeros(n),
        tensor_names=tuple(f"x{t}" for t in range(len(producers))),
        tensor_producer=np.array(producers, int),
        tensor_consumers=tuple(consumers),
        transfer_s=transfer.reshape(len(producers), k, k),
    )
    placement = rng.integers(0, k, n)
    return problem, Plan(placement, problem.device_names), draw(st.booleans())


def assert_no_overlap(intervals: list[tuple[float, float]]) -> None:
    intervals = sorted(intervals)
    for (_, first_finish), (second_start, _) in zip(intervals, intervals[1:], strict=False):
        assert second_start >= first_finish - 1e-12


@settings(max_examples=150, deadline=None)
@given(random_plans())
def test_schedule_respects_precedence_and_exclusivity(case):
    problem, plan, contention = case
    timeline = simulate(problem, plan, contention=contention)
    placement = plan.placement
    assert np.allclose(
        timeline.task_finish - timeline.task_start, problem.compute_s[np.arange(problem.num_tasks), placement]
    )
    arrival = {}
    for transfer in timeline.transfers:
        producer = problem.tensor_producer[transfer.tensor]
        assert transfer.src == placement[producer] != transfer.dst
        assert transfer.start >= timeline.task_finish[producer] - 1e-12
        if not contention:
            assert transfer.start == timeline.task_finish[producer]
        assert transfer.finish - transfer.start == pytest.approx(
            problem.transfer_s[transfer.tensor, transfer.src, transfer.dst]
        )
        assert (transfer.tensor, transfer.dst) not in arrival, "a tensor is sent to a device once"
        arrival[(transfer.tensor, transfer.dst)] = transfer.finish
    needed = set()
    for t, consumers in enumerate(problem.tensor_consumers):
        producer = problem.tensor_producer[t]
        for c in consumers:
            if placement[c] == placement[producer]:
                ready = timeline.task_finish[producer]
            else:
                needed.add((t, placement[c]))
                ready = arrival[(t, placement[c])]
            assert timeline.task_start[c] >= ready - 1e-12
    assert needed == set(arrival), "exactly the tensors some remote consumer needs are sent"
    for d in range(problem.num_devices):
        assert_no_overlap([(timeline.task_start[i], timeline.task_finish[i]) for i in np.flatnonzero(placement == d)])
    if contention:
        for a in range(problem.num_devices):
            for b in range(problem.num_devices):
                assert_no_overlap([(t.start, t.finish) for t in timeline.transfers if (t.src, t.dst) == (a, b)])
    assert timeline.makespan_s == pytest.approx(max(timeline.task_finish))
    replay = simulate(problem, Plan(placement, problem.device_names, order=timeline.device_order()), contention)
    assert replay.task_start.tolist() == timeline.task_start.tolist()


def test_part_0_holds_the_driver_from_the_request_start_to_its_last_finish():
    # The driver runs part 0 right after sending a request's inputs: where no later request is queued, a plan whose
    # second stage is device 0 holds the driver for the whole request, the first stage only for its own. Neither
    # is a round trip: queued requests pipeline through both ([Note: end on rank 0]).
    problem = two_devices({"a": [1.0, 1.0], "b": [1.0, 1.0]}, [{"src": "a", "dst": "b", "transfer_s": link(0.5)}])
    first_on_driver = simulate(problem, place(problem, {"a": 0, "b": 1}))
    last_on_driver = simulate(problem, place(problem, {"a": 1, "b": 0}))
    assert first_on_driver.driver_hold_s == 0.0  # the first stage waits for nothing
    assert last_on_driver.driver_hold_s == last_on_driver.makespan_s == 2.5
    for timeline in (first_on_driver, last_on_driver):
        assert timeline.round_trip_s.tolist() == [0.0, 0.0]
        assert timeline.served_period_s == timeline.period_s == 1.0


def test_a_links_busy_time_counts_the_drivers_input_and_output_messages_with_the_transfers():
    """The driver's messages over a link (a model input to device 1, an output back) hold it as tensors do: here
    they make the link, not a device, the bottleneck of the period."""
    from dataclasses import replace

    from moirai.planning.costs import RequestCosts

    problem = two_devices({"a": [1.0, 1.0], "b": [1.0, 1.0]}, [{"src": "a", "dst": "b", "transfer_s": link(0.5)}])
    costs = RequestCosts.build(
        2, 2, [[1]], input_s=[[0.0, 3.0]], input_link_s=[[0.0, 3.0]], output_link_s=[[0.0, 0.0], [0.0, 2.0]]
    )
    problem = replace(problem, costs=costs)
    timeline = simulate(problem, place(problem, {"a": 0, "b": 1}))
    assert [(t.src, t.dst, t.finish - t.start) for t in timeline.transfers] == [(0, 1, 0.5)]
    messages_s = problem.costs.link_s(timeline.placement)
    assert messages_s[0, 1] == 3.0 and messages_s[1, 0] == 2.0
    assert timeline.link_busy_s == {(0, 1): 0.5 + 3.0, (1, 0): 2.0}
    assert timeline.busy_s.tolist() == [1.0, 1.0]
    assert timeline.period_s == 3.5


def test_an_order_that_lists_a_task_on_a_device_it_is_not_placed_on_is_refused():
    problem = two_devices({"a": [1.0, 1.0], "b": [1.0, 1.0]}, [])
    plan = Plan(np.array([0, 1]), problem.device_names, order=((0, 1), ()))
    with pytest.raises(PlanError, match="plan order lists a task on device 0 that is placed elsewhere"):
        simulate(problem, plan)


def test_a_plan_with_too_few_or_too_many_device_orders_or_fractional_devices_is_a_plan_error():
    """An order of fewer lists than devices was a raw IndexError in the simulator (through with_plan too), one of
    more lists was accepted, and a device index 1.9 was device 1."""
    from moirai.testing import random_problem

    problem = random_problem(0, num_tasks=4, num_devices=2)
    for order in (((0, 1, 2, 3),), ((0, 1, 2, 3), (), ())):
        with pytest.raises(PlanError, match=r"plan order lists \d devices, the problem has 2"):
            simulate(problem, Plan([0, 0, 0, 0], problem.device_names, order=order))
    with pytest.raises(PlanError, match=r"'placement' must be whole device indices, got \[0.0, 0.0, 0.0, 1.9\]"):
        Plan([0, 0, 0, 1.9], problem.device_names)
    assert Plan([0.0, 1.0, 0, 1], problem.device_names).placement.tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d.pop("placement"), "a plan needs 'placement'"),
        (lambda d: d.update(placement=["x"] * 4), "'placement' must be whole device indices"),
        (lambda d: d.update(transfer_order=[[0, 1]]), "'transfer_order' must be a list of [source device"),
        (lambda d: d.update(order=[[0, 1], "ab"]), "'order' must be a list of task lists"),
        (lambda d: d.update(makespan_s="fast"), "'makespan_s' must be a number"),
        (lambda d: d.update(report=[1]), "'report' must be a table"),
        (lambda d: d.update(device_names="ab"), "'device_names' must be a list of names"),
    ],
)
def test_plan_from_dict_names_the_field_that_is_wrong(edit, words):
    """Each was a raw KeyError, ValueError, IndexError or AttributeError."""
    from moirai.planning.placers import place
    from moirai.testing import random_problem

    problem = random_problem(0, num_tasks=4, num_devices=2)
    plan = place(problem, "heft")
    record = plan.to_dict()
    assert simulate(problem, Plan.from_dict(record)).makespan_s == simulate(problem, plan).makespan_s
    edit(record)
    with pytest.raises(PlanError, match=re.escape(words)):
        Plan.from_dict(record)


def test_a_tensor_listed_twice_in_a_transfer_order_is_named():
    """It said 'missing [], not sent []', naming nothing."""
    from moirai.planning.placers import place
    from moirai.testing import random_problem

    problem = random_problem(1, num_tasks=6, num_devices=2)
    plan = place(problem, "round_robin")  # a split: tensors cross
    (link, tensors), *_ = simulate(problem, plan).transfer_order().items()
    twice = Plan(plan.placement, plan.device_names, transfer_order={link: (*tensors, tensors[0])})
    with pytest.raises(PlanError, match=rf"listed twice \[{tensors[0]}\]"):
        simulate(problem, twice)
