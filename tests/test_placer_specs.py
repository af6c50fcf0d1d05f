"""A placer's traits live in its spec (``@register``): place(), list_placers(), the milp placer's start plans
and the demo's baselines read them, and the registry applies the memory precondition."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from moirai.errors import InfeasibleError
from moirai.planning import placers
from moirai.planning.placers import get_placer, list_placers, place, register, spec, specs, start_plans
from moirai.planning.plan import Plan
from moirai.planning.problem import Problem
from moirai.testing import random_problem


def two_device_chain(memory_bytes: float = 1e9) -> Problem:
    """Three tasks in a chain; device ``slow`` takes five times as long as ``fast``."""
    tasks = [{"name": f"t{i}", "compute_s": [1e-3, 5e-3], "memory_bytes": 1.0} for i in range(3)]
    edges = [{"src": f"t{i}", "dst": f"t{i + 1}", "transfer_s": [[0.0, 1e-3], [1e-3, 0.0]]} for i in range(2)]
    devices = [{"name": "fast", "memory_bytes": memory_bytes}, {"name": "slow", "memory_bytes": memory_bytes}]
    return Problem.from_dict({"devices": devices, "tasks": tasks, "edges": edges})


def on_the_last_device(problem: Problem) -> Plan:
    """Every task on the last device; it never looks at memory itself."""
    last = problem.num_devices - 1
    order = tuple(problem.topological_order if d == last else () for d in range(problem.num_devices))
    return Plan(np.full(problem.num_tasks, last), problem.device_names, order=order, placer="toy")


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry, so the toy placers registered here leave the real one as it was."""
    placers.list_placers()  # every real placer is registered before the copy
    monkeypatch.setattr(placers, "_SPECS", dict(placers._SPECS))
    return placers


def test_the_toy_placer_is_listed_with_its_traits(registry):
    register("toy", minimises=False, respects_memory=True, objectives=("latency",), start_plan=-1)(on_the_last_device)
    assert "toy" in list_placers()
    toy = spec("toy")
    assert (toy.minimises, toy.respects_memory, toy.start_plan) == (False, True, -1)
    assert toy.serves("latency") and not toy.serves("throughput")
    assert start_plans("latency")[0].name == "toy"
    assert "toy" not in [s.name for s in start_plans("throughput")]


def test_the_registry_refuses_a_model_no_placement_fits_for_a_placer_that_respects_memory(registry):
    register("toy", minimises=False, respects_memory=True)(on_the_last_device)
    too_big = two_device_chain(memory_bytes=1.0)  # 3 bytes of tasks, 2 bytes of devices
    with pytest.raises(InfeasibleError, match="needs"):
        place(too_big, "toy")
    with pytest.raises(InfeasibleError, match="needs"):
        get_placer("toy")(too_big)
    register("toy", minimises=False, respects_memory=False)(on_the_last_device)
    with pytest.warns(match="ignores memory"):
        assert place(too_big, "toy").placement.tolist() == [1, 1, 1]


def test_a_rule_based_placer_keeps_its_plan_and_one_that_minimises_never_loses_to_one_device(registry, caplog):
    problem = two_device_chain()
    register("toy", minimises=False, respects_memory=True)(on_the_last_device)
    assert place(problem, "toy").placement.tolist() == [1, 1, 1]
    register("toy", minimises=True, respects_memory=True)(on_the_last_device)
    with caplog.at_level(logging.INFO, logger="moirai.planning.placers"):
        plan = place(problem, "toy")
    assert plan.placement.tolist() == [0, 0, 0] and plan.placer == "toy"
    assert plan.report.notes["replaced_by_single_device_s"] == pytest.approx(15e-3)
    assert "replaced by the single-device plan" in caplog.text


def test_the_milp_placer_starts_from_the_toy_for_the_objectives_it_serves(registry):
    problem = two_device_chain()
    register("toy", minimises=False, respects_memory=True, objectives=("latency",), start_plan=-1)(on_the_last_device)
    latency = place(problem, "milp", time_limit_s=5.0)
    assert "toy" in latency.report.heuristics
    assert latency.report.heuristics["toy"] == pytest.approx(15e-3)
    throughput = place(problem, "milp", objective="throughput", time_limit_s=5.0)
    assert "toy" not in throughput.report.heuristics
    register("toy", minimises=False, respects_memory=True)(on_the_last_device)  # not a start plan
    assert "toy" not in place(problem, "milp", time_limit_s=5.0).report.heuristics


def test_the_demo_compares_against_the_start_plans_that_respect_memory(registry):
    demo = pytest.importorskip("moirai.demo")
    register("toy", minimises=True, respects_memory=True, start_plan=100)(on_the_last_device)
    register("blind_toy", minimises=True, respects_memory=False, start_plan=101)(on_the_last_device)
    assert demo.baselines()[-1] == "toy"
    assert "blind_toy" not in demo.baselines() and "round_robin" not in demo.baselines()


def test_the_demos_table_lists_the_chosen_placer_once():
    """``moirai demo --placer heft`` listed heft twice: its row, then again as a baseline at 1.00x."""
    demo = pytest.importorskip("moirai.demo")
    import rich.console

    problem = random_problem(3, 8, 2)
    console = rich.console.Console(record=True, width=100)
    demo.compare_placers(problem, place(problem, "heft"), console)
    rows = [line.split()[1] for line in console.export_text().splitlines() if line.startswith("│ ")]
    assert rows.count("heft") == 1 and set(demo.baselines()) <= set(rows), rows


def test_every_real_placer_declares_its_traits_and_memory_blind_ones_are_rule_based():
    assert {s.name for s in specs()} == set(list_placers())
    assert all(s.respects_memory or not s.minimises for s in specs())  # a placer that minimises keeps to memory


def test_moirai_adds_no_log_handler():
    assert not logging.getLogger("moirai").handlers
    for name in ("moirai.planning.placers", "moirai.planning.placers.milp", "moirai.planning.solve.search"):
        assert not logging.getLogger(name).handlers


def _linked_chain(runs_on: list[list[bool]], linked: list[tuple[int, int]]) -> Problem:
    """A chain of tasks, each on the devices ``runs_on`` allows, whose tensors cross only the ``linked`` pairs."""
    n, k = len(runs_on), len(runs_on[0])
    transfer = np.full((n - 1, k, k), np.inf)
    transfer[:, range(k), range(k)] = 0.0
    for a, b in linked:
        transfer[:, a, b] = 0.1
    return Problem(
        tuple(f"d{d}" for d in range(k)), np.full(k, 10.0), tuple(f"x{i}" for i in range(n)),
        np.where(np.array(runs_on), 1.0, np.inf), np.ones(n), tuple(f"t{i}" for i in range(n - 1)),
        np.arange(n - 1), tuple((i + 1,) for i in range(n - 1)), transfer,
    )  # fmt: skip


@pytest.mark.parametrize("name", list_placers())
def test_every_placer_names_the_tensor_no_link_can_carry_where_no_plan_exists(name):
    """x0 runs on d0 only, x2 on d2 only, and x1 anywhere, but the only links are d0->d1 and d2->d1: x1 can go
    nowhere. Every placer says so, naming the tensor, not memory (which has room) or its own search."""
    problem = _linked_chain([[True, False, False], [True, True, True], [False, False, True]], [(0, 1), (2, 1)])
    with pytest.raises(InfeasibleError, match=r"no plan exists: tensor 't\d' goes from task 'x\d'"):
        place(problem, placer=name, **({"time_limit_s": 2} if spec(name).takes("time_limit_s") else {}))


@pytest.mark.parametrize("name", list_placers())
def test_every_placers_plan_is_written_as_json_and_read_back(name):
    """m_sct's orders held numpy integers: Plan.to_dict() was no JSON, and `moirai plan --output` crashed."""
    problem = random_problem(1, 6, 2)
    plan = place(problem, placer=name, **({"time_limit_s": 1} if spec(name).takes("time_limit_s") else {}))
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.placement.tolist() == plan.placement.tolist() and back.order == plan.order
    assert back.transfer_order == plan.transfer_order


def test_links_that_leave_one_way_through_are_no_refusal():
    problem = _linked_chain([[True, False, False], [True, True, True], [False, False, True]], [(0, 1), (1, 2)])
    plan = place(problem, placer="heft")
    assert plan.placement.tolist() == [0, 1, 2]  # x1 reads from d0 and feeds d2: d1 is the one way through
