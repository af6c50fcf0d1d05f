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
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from moirai.bounds import format_bytes
from moirai.coarsen import coarsen
from moirai.cost import activation_peak_bytes, build_problem
from moirai.devices import Cluster
from moirai.errors import ClusterError, PlanError
from moirai.graph import OpGraph, build_op_graph
from moirai.placers import devices_over_memory, place
from moirai.problem import Plan, Problem
from moirai.runtime.distributed import run_distributed, run_rank
from moirai.runtime.local import run_local
from moirai.simulate import simulate
from moirai.split import SplitProgram, split_module
from moirai.trace import TracedModel, trace

PLAN_FORMAT_VERSION = 1
_PLAN_KEYS = ("format", "devices", "node_device", "groups", "device_order", "plan")


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
        _check_devices_here(self.cluster, range(len(self.cluster)))
        return self.traced.unflatten_outputs(run_local(self.program, flat_inputs, self.torch_devices))

    def run_distributed(self, *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> Any:
        """Run with one process per device (torch.distributed send/recv); returns the outputs here."""
        flat_inputs = self.traced.flatten_inputs(args, kwargs)
        _check_devices_here(self.cluster, range(len(self.cluster)))
        outputs = run_distributed(self.program, flat_inputs, self.torch_devices, timeout_s=timeout_s)
        return self.traced.unflatten_outputs(outputs)

    def run_rank(self, *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> Any:
        """Run this process's part under ``torchrun`` (rank and world size from its environment).

        Rank 0 passes the inputs and gets the outputs; the other ranks may call it without
        arguments and get ``None``. Every rank must have loaded the same plan (``moirai.load``).
        """
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        flat_inputs = self.traced.flatten_inputs(args, kwargs) if rank == 0 else None
        _check_devices_here(self.cluster, [rank] if rank < len(self.cluster) else [])
        outputs = run_rank(self.program, rank, world_size, flat_inputs, self.torch_devices, timeout_s=timeout_s)
        return None if outputs is None else self.traced.unflatten_outputs(outputs)

    @property
    def torch_devices(self) -> list[str]:
        return [d.torch_device for d in self.cluster.devices]

    def summary(self, console: Console | None = None) -> Table:
        """Print (and return) the plan as a table: one row per device."""
        timeline = simulate(self.problem, self.plan)
        reserve = activation_peak_bytes(self.graph)
        over_memory = devices_over_memory(self.problem, self.plan)
        table = Table(title=f"moirai plan for {self.traced.model_name} ({self.plan.placer})")
        for column in ("device", "torch device", "groups", "ops", "weights", "in use / memory", "busy"):
            table.add_column(column, justify="left" if column in ("device", "torch device") else "right")
        for k, device in enumerate(self.cluster.devices):
            tasks = np.flatnonzero(self.plan.placement == k)
            table.add_row(
                device.name,
                device.torch_device,
                str(len(tasks)),
                str(sum(len(self.graph.nodes[i].targets) for i in tasks)),
                format_bytes(timeline.memory_bytes[k]),
                f"{format_bytes(timeline.memory_bytes[k] + reserve)} / {format_bytes(device.memory_bytes)}",
                _format_seconds(timeline.busy_s[k]),
                style="bold red" if k in over_memory else None,
            )
        lower = self.plan.lower_bound_s
        table.caption = (
            f"predicted latency {_format_seconds(timeline.makespan)}"
            + (f", lower bound {_format_seconds(lower)}, gap {self.plan.gap:.1%}" if lower is not None else "")
            + f", {len(timeline.transfers)} transfers, placed in {self.plan.placement_time_s:.2f} s"
            + (", [bold red]OVER MEMORY on the red rows[/]" if over_memory else "")
        )
        (console or Console()).print(table)
        return table

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


def compile(
    model: torch.nn.Module,
    devices: Cluster | Sequence[str],
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    placer: str = "milp",
    fusion_rules: str | Path = "default",
    target_nodes: int | None = None,
    cost: str = "analytic",
    **placer_options: Any,
) -> CompiledModel:
    """Split ``model`` across ``devices`` so that one inference finishes soonest.

    ``devices`` is a :class:`moirai.Cluster` or a list of torch device strings (a repeated
    ``"cpu"`` gives separate logical devices). ``placer`` names a registered placer
    (``moirai.placers()``); ``placer_options`` go to it (e.g. ``time_limit_s`` for ``milp``).
    ``cost`` is ``"analytic"`` (roofline from the device table) or ``"measured"`` (profile every
    op group on the local devices, cached on disk).
    """
    cluster = devices if isinstance(devices, Cluster) else Cluster.from_devices(devices)
    traced = trace(model, example_inputs, example_kwargs)
    coarse = coarsen(build_op_graph(traced), rules=fusion_rules, target_nodes=target_nodes).graph
    problem = build_problem(coarse, cluster, cost, traced)
    plan = place(problem, placer=placer, **placer_options)
    return _assemble(traced, cluster, coarse, problem, plan)


def load(
    path: str | Path,
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    devices: Cluster | Sequence[str] | None = None,
) -> CompiledModel:
    """Rebuild a compiled model from a saved plan and the model (with real weights)."""
    record = _read_plan_file(path)
    saved_devices = [d["torch_device"] for d in record["devices"]]
    cluster = devices if isinstance(devices, Cluster) else Cluster.from_devices(devices or saved_devices)
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


def _read_plan_file(path: str | Path) -> dict[str, Any]:
    """The record ``CompiledModel.save`` wrote, or a :class:`PlanError` saying what is wrong with the file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise PlanError(f"plan file {str(path)!r} does not exist; write one with CompiledModel.save(path)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PlanError(f"cannot read plan file {str(path)!r}: {error}") from None
    if not text.strip():
        raise PlanError(f"plan file {str(path)!r} is empty; save the plan again with CompiledModel.save(path)")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(
            f"plan file {str(path)!r} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); "
            "was it cut short? Save the plan again with CompiledModel.save(path)"
        ) from None
    if not isinstance(record, dict):
        raise PlanError(
            f"plan file {str(path)!r} holds a JSON {type(record).__name__}, not a moirai plan (an object with keys "
            f"{list(_PLAN_KEYS)}); give the file CompiledModel.save wrote"
        )
    if record.get("format") != PLAN_FORMAT_VERSION:
        raise PlanError(f"{path} is not a moirai plan of format {PLAN_FORMAT_VERSION}; compile the model again")
    missing = [key for key in _PLAN_KEYS if key not in record]
    missing += [f"plan.{key}" for key in ("placement", "device_names") if key not in (record.get("plan") or {})]
    if missing:
        raise PlanError(f"plan file {str(path)!r} lacks {missing}; it is not a whole moirai plan: save it again")
    return record


def _check_devices_here(cluster: Cluster, indices: Sequence[int]) -> None:
    """Fail before running a part on a CUDA device this machine does not have (torch would assert)."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for k in indices:
        device = cluster.devices[k]
        wanted = torch.device(device.torch_device)
        if wanted.type == "cuda" and (wanted.index or 0) >= cuda_count:
            raise ClusterError(
                f"device {device.name!r} of the plan runs on {device.torch_device}, but this machine has "
                f"{cuda_count} CUDA device(s); run the plan where its devices are (CompiledModel.save, then "
                "moirai.load there), or compile for this machine's devices (moirai.Cluster.detect(), ['cpu', 'cpu'])"
            )


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


def _format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"
