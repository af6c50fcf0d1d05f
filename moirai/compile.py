"""``moirai.compile``: trace -> coarsen -> cost -> place -> split, and the compiled model it returns.

Example::

    cm = moirai.compile(model, ["cpu", "cpu", "cpu"], example_inputs=(x,), placer="milp", time_limit_s=30)
    cm.summary()          # plan per device
    y = cm(x)             # local runner: every part from this process
    y = cm.run_distributed(x)   # one process per device, torch.distributed send/recv
    cm.save("plan.json"); cm2 = moirai.load("plan.json", model, example_inputs=(x,))
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.table import Table

from moirai import progress as _progress
from moirai import viz
from moirai.coarsen import coarsen
from moirai.cost import activation_peak_bytes, build_problem
from moirai.devices import Cluster
from moirai.errors import MoiraiError, PlanError
from moirai.graph import OpGraph, build_op_graph
from moirai.placers import place
from moirai.problem import Plan, Problem
from moirai.runtime import distributed
from moirai.runtime.distributed import DistributedRunner, check_timeout, run_distributed, run_rank, torchrun_driver
from moirai.runtime.local import check_inputs, run_local
from moirai.runtime.server import Server
from moirai.simulate import simulate
from moirai.split import SplitProgram, split_module
from moirai.trace import TracedModel, trace

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLAN_FORMAT_VERSION = 1


@dataclass
class CompiledModel:
    """A model split across a cluster. Call it like the original model."""

    traced: TracedModel
    cluster: Cluster
    graph: OpGraph
    problem: Problem
    plan: Plan
    node_device: dict[str, int]
    device_order: list[list[str]]
    program: SplitProgram

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat_inputs = self.traced.flatten_inputs(args, kwargs)
        return self.traced.unflatten_outputs(run_local(self.program, flat_inputs, self.torch_devices))

    @_progress.reports_progress
    def run_distributed(self, *args: Any, timeout_s: float = 120.0, progress: bool = True, **kwargs: Any) -> Any:
        """Run with one process per device (torch.distributed send/recv); returns the outputs here."""
        flat_inputs = self.traced.flatten_inputs(args, kwargs)
        outputs = run_distributed(self.program, flat_inputs, self.cluster.devices, timeout_s=timeout_s)
        return self.traced.unflatten_outputs(outputs)

    def server(self, timeout_s: float = 120.0, max_in_flight: int = 8) -> Server:
        """A server for many requests: ``submit(*args, **kwargs)`` -> Future, ``map(inputs)`` -> outputs in order.

        Requests are pipelined through the devices, at most ``max_in_flight`` unfinished. Outside
        torchrun it spawns one process per device but the first (this process runs device 0);
        under torchrun only rank 0 calls it, the other ranks call ``moirai.serve_rank(compiled)``.
        ``timeout_s`` bounds every wait of a request, never idle time.
        """
        timeout_s = check_timeout(timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            driver = torchrun_driver(self.program, self.cluster.devices, timeout_s, max_in_flight)
            submit = lambda flat, finish: driver.submit(self.program, flat, finish, timeout_s)  # noqa: E731
            close = driver.close
        else:
            runner = DistributedRunner(self.cluster.devices, timeout_s=timeout_s, max_in_flight=max_in_flight)
            submit = lambda flat, finish: runner.submit_with(self.program, flat, finish)  # noqa: E731
            close = runner.close
        return Server(submit, self._checked_flat_inputs, self.traced.unflatten_outputs, close, max_in_flight)

    def _checked_flat_inputs(self, args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        flat_inputs = self.traced.flatten_inputs(args, kwargs)
        check_inputs(self.program, flat_inputs)
        return flat_inputs

    def run_rank(self, *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> Any:
        """Run this process's part under ``torchrun`` (rank and world size from its environment).

        Rank 0 passes the inputs and gets the outputs; the other ranks may call it without
        arguments and get ``None``. Every rank must have loaded the same plan (``moirai.load``).
        """
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        flat_inputs = self.traced.flatten_inputs(args, kwargs) if rank == 0 else None
        outputs = run_rank(self.program, rank, world_size, flat_inputs, self.cluster.devices, timeout_s=timeout_s)
        return None if outputs is None else self.traced.unflatten_outputs(outputs)

    @property
    def torch_devices(self) -> list[str]:
        return [d.torch_device for d in self.cluster.devices]

    def summary(self, console: Console | None = None) -> Table:
        """Print (and return) the plan as a table that fits 80 columns: one row per device."""
        table = viz.summary_table(
            self.problem,
            self.plan,
            torch_devices=self.torch_devices,
            ops_per_task=[len(node.targets) for node in self.graph.nodes],
            reserve_bytes=activation_peak_bytes(self.graph),
            title=f"moirai plan for {self.traced.model_name} ({self.plan.placer})",
        )
        (console or Console()).print(table)
        return table

    def gantt(self, path: str | Path | None = None, color_by: str = "kind", plan: Plan | None = None) -> Figure:
        """The simulated schedule as a matplotlib figure (saved to ``path`` when given; Jupyter shows it).

        ``color_by``: ``"kind"`` (each group's main op) or ``"layer"`` (the model's top-level module).
        ``plan``: another plan of this model's problem to draw (e.g. from ``moirai.place``), default its own.
        """
        return viz.gantt(self.problem, plan or self.plan, path, groups=self._task_groups(color_by))

    def text_gantt(self, width: int = 60, color_by: str = "kind", console: Console | None = None) -> Table:
        """Print (and return) the simulated schedule as coloured text, one row per device and link."""
        table = viz.text_gantt(self.problem, self.plan, width, groups=self._task_groups(color_by))
        (console or Console()).print(table)
        return table

    def _task_groups(self, color_by: str) -> list[str]:
        if color_by == "kind":
            return [viz.kind_of_targets(node.targets) for node in self.graph.nodes]
        if color_by == "layer":
            fx_nodes = {node.name: node for node in self.traced.graph_module.graph.nodes}
            paths = [fx_nodes[node.fx_names[0]].meta.get("nn_module_stack") or {} for node in self.graph.nodes]
            return [viz.layer_of_module_path(next(reversed(p.values()))[0] if p else "") for p in paths]
        raise MoiraiError(f"color_by must be 'kind' or 'layer', not {color_by!r}")

    def save(self, path: str | Path) -> None:
        """Write what each rank needs to rebuild its part: the op -> device map and the orders."""
        record = {
            "format": PLAN_FORMAT_VERSION,
            "model": self.traced.model_name,
            "devices": [{"name": d.name, "torch_device": d.torch_device} for d in self.cluster.devices],
            "node_device": self.node_device,
            "groups": [list(node.fx_names) for node in self.graph.nodes],
            "device_order": self.device_order,
            "plan": self.plan.to_dict(),
        }
        Path(path).write_text(json.dumps(record, indent=1))


@_progress.reports_progress
def compile(
    model: torch.nn.Module,
    devices: Cluster | Sequence[str],
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    placer: str = "milp",
    fusion_rules: str | Path = "default",
    target_nodes: int | None = None,
    cost: str = "analytic",
    progress: bool = True,
    **placer_options: Any,
) -> CompiledModel:
    """Split ``model`` across ``devices`` so that one inference finishes soonest.

    ``devices`` is a :class:`moirai.Cluster` or a list of torch device strings (a repeated
    ``"cpu"`` gives separate logical devices). ``placer`` names a registered placer
    (``moirai.placers()``); ``placer_options`` go to it (e.g. ``time_limit_s`` for ``milp``).
    ``cost`` is ``"analytic"`` (roofline from the device table) or ``"measured"`` (profile every
    op group on the local devices, cached on disk). ``progress=False`` silences the line per stage.
    """
    cluster = devices if isinstance(devices, Cluster) else Cluster.from_devices(list(devices))
    traced = trace(model, example_inputs, example_kwargs)
    coarse = coarsen(build_op_graph(traced), rules=fusion_rules, target_nodes=target_nodes).graph
    problem = build_problem(coarse, cluster, cost, traced)
    plan = place(problem, placer=placer, **placer_options)
    return _assemble(traced, cluster, coarse, problem, plan)


@_progress.reports_progress
def load(
    path: str | Path,
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    devices: Cluster | Sequence[str] | None = None,
    progress: bool = True,
) -> CompiledModel:
    """Rebuild a compiled model from a saved plan and the model (with real weights); ``progress`` as in compile."""
    record = json.loads(Path(path).read_text())
    if record.get("format") != PLAN_FORMAT_VERSION:
        raise PlanError(f"{path} is not a moirai plan of format {PLAN_FORMAT_VERSION}; compile the model again")
    saved_devices = [d["torch_device"] for d in record["devices"]]
    cluster = devices if isinstance(devices, Cluster) else Cluster.from_devices(list(devices or saved_devices))
    if len(cluster) != len(saved_devices):
        raise PlanError(f"{path} places the model on {len(saved_devices)} devices, {len(cluster)} were given")
    traced = trace(model, example_inputs, example_kwargs)
    node_device = {name: int(k) for name, k in record["node_device"].items()}
    program = _split(traced, node_device, record["device_order"], len(cluster), source=str(path))
    graph = build_op_graph(traced)
    coarse = graph.merge([[graph.node_of_fx_name[name] for name in group] for group in record["groups"]])
    problem = build_problem(coarse, cluster, traced=traced)
    plan = Plan.from_dict(record["plan"])
    plan.device_names = cluster.names
    return CompiledModel(traced, cluster, coarse, problem, plan, node_device, record["device_order"], program)


def serve_rank(compiled: CompiledModel, timeout_s: float = 120.0) -> None:
    """Under torchrun, on every rank but 0: serve rank 0's ``compiled.server()`` until it closes."""
    distributed.serve_rank(compiled.program, compiled.cluster.devices, timeout_s=timeout_s)


def _assemble(traced: TracedModel, cluster: Cluster, coarse: OpGraph, problem: Problem, plan: Plan) -> CompiledModel:
    node_device = {name: int(plan.placement[i]) for i, node in enumerate(coarse.nodes) for name in node.fx_names}
    task_order = simulate(problem, plan).device_order()
    device_order = [[name for i in tasks for name in coarse.nodes[i].fx_names] for tasks in task_order]
    program = _split(traced, node_device, device_order, len(cluster), source="the plan")
    return CompiledModel(traced, cluster, coarse, problem, plan, node_device, device_order, program)


def _split(
    traced: TracedModel, node_device: dict[str, int], device_order: list[list[str]], num_devices: int, source: str
) -> SplitProgram:
    unknown = sorted(set(node_device) - {node.name for node in traced.graph_module.graph.nodes})
    if unknown:
        raise PlanError(
            f"{source} names ops {unknown[:3]} that {traced.model_name} does not have; "
            "the model or its example inputs differ from the ones planned: compile again"
        )
    return split_module(traced, node_device, num_devices, device_order)
