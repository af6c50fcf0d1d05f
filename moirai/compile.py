"""``moirai.compile``: trace -> coarsen -> cost -> place -> split, and the compiled model it returns.

Example::

    cm = moirai.compile(model, ["cpu", "cpu", "cpu"], example_inputs=(x,), placer="milp", time_limit_s=30)
    cm.summary()          # plan per device
    y = cm(x)             # local runner: every part from this process
    y = cm.run_distributed(x)   # one process per device, torch.distributed send/recv
    cm.save("plan.json"); cm2 = moirai.load("plan.json", model, example_inputs=(x,))
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import json
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from moirai import progress as _progress
from moirai import viz
from moirai.cluster.calibration.across_hosts import measure_host_links
from moirai.cluster.calibration.cluster import check_calibration, local_cluster
from moirai.cluster.cost import DEFAULT_COST_MODE, build_problem, check_cost_mode, unfused_problem
from moirai.cluster.devices import Cluster
from moirai.cluster.kinds import kind_of
from moirai.environment import require_torchrun_world, torchrun_world
from moirai.errors import (
    ClusterError,
    InfeasibleError,
    InputError,
    MoiraiError,
    PlanError,
    PlanVersionWarning,
    ProblemError,
    closest_name,
    user_stacklevel,
)
from moirai.frontend.coarsen import CoarseningResult, coarsen
from moirai.frontend.graph import OpGraph, build_op_graph
from moirai.frontend.state import MutableBuffer, colocated_groups, mutable_buffers
from moirai.frontend.symbolic_shapes import dynamic_dims_to_json, dynamic_shapes_from_json
from moirai.frontend.trace import TracedModel, op_kind, trace
from moirai.plan_records import (
    LM_KEY,
    PLAN_FORMAT_VERSION,
    PlanHandover,
    check_traced_tensors,
    read_plan_file,
    traced_tensors,
    versions,
)
from moirai.planning.objective import Objective, as_objective
from moirai.planning.placers import check_options, place
from moirai.planning.placers import spec as placer_spec
from moirai.planning.plan import Plan, check_plan
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate
from moirai.runtime import distributed
from moirai.runtime.distributed import DistributedRunner, check_timeout, run_distributed, run_rank, torchrun_driver
from moirai.runtime.driver import DEFAULT_MAX_IN_FLIGHT, DEFAULT_TIMEOUT_S
from moirai.runtime.local import check_inputs, refuse_meta_weights, run_local
from moirai.runtime.server import Server
from moirai.runtime.split import SplitProgram, split_module
from moirai.runtime.written_state import kept_on_ranks, warning_at_close
from moirai.user_files import check_output_path, write_output

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)


def describe_plan(plan: Plan) -> str:
    """A plan in a few words: its placer, the devices it uses and what it predicts."""
    used = sorted(set(plan.placement.tolist()))
    names = ", ".join(plan.device_names[k] for k in used)
    groups = len(plan.placement)
    words = f"{plan.placer or 'a plan'}'s plan of {groups} op group{'s' * (groups != 1)} on {names}"
    if plan.objective_s is not None:
        value_ms = f"{plan.objective_s * 1e3:.3g} ms"
        words += {"latency": f", {value_ms} a request", "throughput": f", a request every {value_ms}"}.get(
            plan.objective, f", {plan.objective} {value_ms}"
        )
        words += " predicted"
    return words


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
    # Whether its methods that start workers report their stages (compile's or load's progress; each call may say).
    progress: bool = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's outputs for these inputs, every part run from this process. For inference: the parts run
        under ``torch.no_grad()``, so with grad mode on the outputs do not require grad, where the model's do, and
        ``backward()`` through them fails; call the model itself to train or take gradients."""
        flat_inputs = self.traced.flatten_inputs(args, kwargs)
        _check_devices_here(self.cluster, range(len(self.cluster)))
        return self.traced.unflatten_outputs(run_local(self.program, flat_inputs, self.torch_devices))

    def __repr__(self) -> str:
        """One line, not the dataclass's fields (a graph, a problem and a program: 100 kB on a small model), which a
        notebook would print for a cell that ends in the compiled model."""
        return f"<CompiledModel of {self.traced.model_name}: {describe_plan(self.plan)}; .summary() shows the plan>"

    @_progress.reports_progress
    def run_distributed(
        self, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S, progress: bool | None = None, **kwargs: Any
    ) -> Any:
        """Run with one process per device (torch.distributed send/recv); returns the outputs here. ``progress``:
        whether starting the workers reports, by default as the model was compiled (``compile(progress=...)``).

        Outputs are the model's values with its strides, and a tensor it returns twice is one tensor twice. An output
        made on another device than the first arrives as a tensor of its own: where the model returned a view of an
        input, of a buffer or of another output (``x.t()``, ``h[0]`` beside ``h``), it has the view's strides and
        values but shares no memory with them, so a write into it changes nothing else (calling the model keeps the
        views where the parts ran on one device)."""
        flat_inputs = self.traced.flatten_inputs(args, kwargs)
        _check_local_run(self.cluster, "run_distributed")
        refuse_meta_weights(self.program.parts)  # before the ranks start: each printed its own traceback first
        outputs = run_distributed(self.program, flat_inputs, self.cluster.devices, timeout_s=timeout_s)
        return self.traced.unflatten_outputs(outputs)

    @_progress.reports_progress
    def server(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        *,
        warn_state_left: bool = True,
        progress: bool | None = None,
    ) -> Server:
        """A server for many requests: ``submit(*args, **kwargs)`` -> Future, ``map(inputs)`` -> outputs in order.

        Requests are pipelined through the devices, at most ``max_in_flight`` unfinished. Outside
        torchrun it spawns one process per device but the first (this process runs device 0);
        under torchrun only rank 0 calls it, the other ranks call ``moirai.serve_rank(compiled)``.
        ``timeout_s`` bounds every wait of a request, never idle time. A result's outputs are as
        :meth:`run_distributed`'s: the model's strides, one tensor returned twice one tensor, and an output made on
        another device than the first sharing no memory with what it viewed. A buffer or input that a spawned rank
        writes in place keeps its value from request to request but is not brought back: closing warns
        (:class:`moirai.errors.StateLeftBehindWarning`) unless ``warn_state_left`` is False (state each request
        sets afresh, as the generation engine's caches). ``progress``: whether starting the workers (at the first
        request) reports, by default as the model was compiled.
        """
        timeout_s = check_timeout(timeout_s)
        if torchrun_world() is not None:  # a world of one rank is a local run
            _check_devices_here(self.cluster, [0])  # rank 0 runs device 0; each other rank checks its own
            refuse_meta_weights(self.program.parts)  # at open, not by each rank at the first request
            driver = torchrun_driver(self.program, self.cluster.devices, timeout_s, max_in_flight)

            def submit(flat: list[torch.Tensor], finish: Any) -> Any:
                check_inputs(self.program, flat)  # as the runner checks them on the other path
                return driver.submit(self.program, flat, finish, timeout_s)

            close, check_close = driver.close, driver.check_close_allowed
            worlds = None  # torchrun restarts no rank: its world is the one it started with
        else:
            _check_local_run(self.cluster, "server()")  # every device's process starts here
            refuse_meta_weights(self.program.parts)  # at open, not by each rank at the first request
            # A server that warns of state left behind keeps that state: refused after a restart would lose it.
            kept = kept_on_ranks(self.program) if warn_state_left else None
            runner = DistributedRunner(
                self.cluster.devices, timeout_s=timeout_s, max_in_flight=max_in_flight, state_on_ranks=kept
            )
            worlds = runner.worlds
            submit = lambda flat, finish: runner.submit_with(self.program, flat, finish)  # noqa: E731
            close = warning_at_close(self.program, runner.close) if warn_state_left else runner.close
            check_close = runner.check_close_allowed
        # Both submits check the flat inputs against the program (Server.submit_flat's are not flattened here).
        return Server(
            submit, self.traced.flatten_inputs, self.traced.unflatten_outputs, close, max_in_flight, check_close, worlds
        )

    @_progress.reports_progress
    def run_rank(
        self, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S, progress: bool | None = None, **kwargs: Any
    ) -> Any:
        """Run this process's part under ``torchrun`` (rank and world size from its environment).

        Rank 0 passes the inputs and gets the outputs; the other ranks may call it without
        arguments and get ``None``. Every rank must have loaded the same plan (``moirai.load``). Outside torchrun,
        or in a world of one rank, this process is the only rank: it runs the whole model as :meth:`run_distributed`
        does, where the plan's devices are all on this host (one naming another host is an :class:`InputError`: run
        it under torchrun there). ``progress`` as in :meth:`run_distributed`.
        """
        world = torchrun_world()
        if world is None:  # a local run, as compile and server() take it
            flat_inputs = self.traced.flatten_inputs(args, kwargs)
            _check_local_run(self.cluster, "run_rank")
            outputs = run_distributed(self.program, flat_inputs, self.cluster.devices, timeout_s=timeout_s)
            return self.traced.unflatten_outputs(outputs)
        rank = world.rank
        flat_inputs = self.traced.flatten_inputs(args, kwargs) if rank == 0 else None
        _check_devices_here(self.cluster, [rank])
        outputs = run_rank(self.program, rank, world.world_size, flat_inputs, self.cluster.devices, timeout_s=timeout_s)
        return None if outputs is None else self.traced.unflatten_outputs(outputs)

    def with_plan(self, plan: Plan) -> CompiledModel:
        """The same model, trace and problem split by another plan of this problem (one placed for another
        objective, or one made by hand), without tracing or profiling again."""
        check_plan(plan, "CompiledModel.with_plan's plan")
        plan.check(self.problem)
        return assemble(self.traced, self.cluster, self.graph, self.problem, plan, self.progress)

    @property
    def torch_devices(self) -> list[str]:
        return [d.torch_device for d in self.cluster.devices]

    def summary(self, console: Console | None = None, objective: Objective | None = None) -> None:
        """Print the plan as a table, one row per device (:meth:`summary_table`; it returns nothing, so that a
        notebook cell or a REPL ending in it shows the table once)."""
        (console or Console()).print(self.summary_table(objective))

    def summary_table(self, objective: Objective | None = None) -> Table:
        """The plan as a rich table, one row per device, its caption unwrapped where the console is wide enough
        (``objective``: the plan's, where its name alone does not make it)."""
        table = viz.summary_table(
            self.problem,
            self.plan,
            torch_devices=self.torch_devices,
            ops_per_task=[len(node.targets) for node in self.graph.nodes],
            title=f"moirai plan for {self.traced.model_name} ({self.plan.placer})",
            objective=objective,
        )
        if self.traced.dynamic_dims:
            dims = ", ".join(f"{dim.name} {dim.range}" for dim in self.traced.dynamic_dims)
            shapes = ", ".join(str(spec.shape) for spec in self.traced.input_specs)
            table.caption += f"\ndynamic {dims}: costs and times are those of the example inputs {shapes}"
            viz.widen_to_caption(table)
        return table

    def gantt(
        self, path: str | Path | None = None, color_by: str = "kind", plan: Plan | None = None, requests: int = 1
    ) -> Figure:
        """The simulated schedule as a matplotlib figure (saved to ``path`` when given; Jupyter shows it).

        ``color_by``: ``"kind"`` (each group's main op) or ``"layer"`` (the model's top-level module).
        ``plan``: another plan of this model's problem to draw (e.g. from ``moirai.place``), default its own.
        ``requests > 1``: that many requests pipelined through the plan, as :meth:`server` runs them,
        coloured by request (the steady state of a throughput plan).
        """
        if plan is not None:
            check_plan(plan, "CompiledModel.gantt's plan")
        groups = self._task_groups(color_by) if requests == 1 else None
        return viz.gantt(self.problem, plan or self.plan, path, groups=groups, requests=requests)

    def text_gantt(self, width: int = 60, color_by: str = "kind", console: Console | None = None) -> None:
        """Print the simulated schedule as coloured text, one row per device and link (``viz.text_gantt`` gives
        the table)."""
        table = viz.text_gantt(self.problem, self.plan, width, groups=self._task_groups(color_by))
        (console or Console()).print(table)

    def _task_groups(self, color_by: str) -> list[str]:
        if color_by == "kind":
            return [viz.kind_of_targets(node.targets) for node in self.graph.nodes]
        if color_by == "layer":
            fx_nodes = {node.name: node for node in self.traced.graph_module.graph.nodes}
            paths = [fx_nodes[node.fx_names[0]].meta.get("nn_module_stack") or {} for node in self.graph.nodes]
            return [viz.layer_of_module_path(next(reversed(p.values()))[0] if p else "") for p in paths]
        raise MoiraiError(f"color_by must be 'kind' or 'layer', not {color_by!r}")

    def save(self, path: str | Path) -> None:
        """Write what each rank needs to rebuild its part (the op -> device map and the orders) and the planned
        problem, so that :func:`load` describes the problem this plan was made for."""
        check_output_path(path, "the plan", PlanError)  # before the record is made: a large problem takes a while
        write_output(path, json.dumps(self.plan_record(), indent=1), "the plan", PlanError)

    def plan_record(self) -> dict[str, Any]:
        """What :meth:`save` writes (plain JSON values)."""
        return {
            "format": PLAN_FORMAT_VERSION,
            "model": self.traced.model_name,
            "devices": [{"name": d.name, "torch_device": d.torch_device} for d in self.cluster.devices],
            "node_device": self.node_device,
            "groups": [list(node.fx_names) for node in self.graph.nodes],
            "device_order": self.device_order,
            "plan": self.plan.to_dict(),
            "problem": self.problem.to_dict(),
            "dynamic_dims": dynamic_dims_to_json(self.traced),
            "tensors": traced_tensors(self.traced),
            "versions": versions(),
        }


@_progress.reports_progress
def compile(
    model: torch.nn.Module,
    devices: Cluster | Sequence[str],
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    placer: str = "milp",
    fusion_rules: str | Path = "default",
    target_nodes: int | None = None,
    cost: str = DEFAULT_COST_MODE,
    objective: str | Objective = "latency",
    dynamic_shapes: Any = None,
    progress: bool = True,
    calibration: str | Path = "auto",
    **placer_options: Any,
) -> CompiledModel:
    """Split ``model`` across ``devices`` so that one inference finishes soonest.

    ``devices`` is a :class:`moirai.Cluster` or a list of torch device strings (a repeated
    ``"cpu"`` gives separate logical devices). ``placer`` names a registered placer
    (``moirai.list_placers()``); ``placer_options`` go to the placer (e.g.
    ``time_limit_s`` for ``milp``). ``objective`` is ``"latency"`` (one request finishes soonest) or
    ``"throughput"`` (the period of pipelined requests, :class:`moirai.planning.objective.Throughput` for a
    latency limit).
    ``cost`` is ``"analytic"`` (roofline from the device table) or ``"measured"`` (profile every
    op group on the local devices, cached on disk). ``dynamic_shapes`` (torch.export's convention,
    ``torch.export.Dim``) declares input dimensions that vary: one plan and one split program then
    serve every size in the declared ranges, with costs taken at the example inputs' shapes.
    ``progress=False`` silences the line per stage, here and in the compiled model's ``run_distributed``,
    ``server`` and ``run_rank`` (each may say otherwise with its own ``progress``).
    ``calibration`` says what the links between local devices (a list of device strings) cost:
    ``"auto"`` (the default, with either cost mode) this machine's calibration, measured the first
    time a kind of link is needed (in processes that do not import the caller's script; on a first compile
    about half a minute to a minute: a kind of link 10-20 s, the runtime's own work per request 20-40 s, on a
    loaded two-core machine) and cached, so once per machine (:func:`moirai.cluster.calibration.local_calibration`);
    ``"remeasure"`` measures it again; a path reads a calibration file; ``"none"`` skips it and keeps the detected
    defaults (each kind's local link: 50 us between CPUs, an accelerator's own where one is at an end; no CPU
    time). A :class:`moirai.Cluster` keeps the links it describes.
    """
    check_placer_options(placer_options, placer=placer)
    check_cost_mode(cost)
    handover = PlanHandover.under_torchrun(devices)
    if handover is not None and not handover.plans:
        # Another rank plans: this one takes that rank's plan, problem included.
        with handover.receiving():
            cluster, _ = rank_cluster(devices, calibration, handover)
            traced = trace(model, example_inputs, example_kwargs, dynamic_shapes)
            return from_plan_record(handover.receive(), "rank 0's plan", traced, cluster, progress)
    with handover.planning() if handover is not None else contextlib.nullcontext():
        cluster, hosts = rank_cluster(devices, calibration, handover)
        traced = trace(model, example_inputs, example_kwargs, dynamic_shapes)
        graph = build_op_graph(traced)
        coarsening = coarsen(graph, rules=fusion_rules, target_nodes=target_nodes)
        coarse = coarsening.graph
        logger.debug(
            "coarsened %s to %d op groups (fusion rules %s)", traced.model_name, len(coarse.nodes), fusion_rules
        )
        # A buffer the model writes in place (a KV cache) lives on one device with every op that touches it.
        colocated = colocated_groups(coarse, mutable_buffers(traced.graph_module))
        # A pipelining objective's devices compute at once: profiled so ([Note: steady-state profile]).
        steady_state = as_objective(objective).steady_state
        problem = build_problem(
            coarse,
            cluster,
            cost,
            traced,
            colocated=colocated,
            remote_alike=hosts is not None,
            steady_state=steady_state,
        )
        plan = place(problem, placer=placer, objective=objective, **placer_options)
        plan.report.unfused_lower_bound_s = _unfused_lower_bound_s(
            graph, coarsening, problem, cluster, traced, objective
        )
        logger.info(
            "%s placed by %s on %d of %d devices: %s %.6g s",
            traced.model_name,
            plan.placer,
            len(set(plan.placement.tolist())),
            len(cluster),
            plan.objective,
            plan.objective_s,
        )
        compiled = assemble(traced, cluster, coarse, problem, plan, progress)
    if handover is not None:
        handover.send(compiled.plan_record())
    return compiled


@_progress.reports_progress
def load(
    path: str | Path,
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    devices: Cluster | Sequence[str] | None = None,
    dynamic_shapes: Any = None,
    progress: bool = True,
    calibration: str | Path = "none",
) -> CompiledModel:
    """Rebuild a compiled model from a saved plan and the model (with real weights); ``progress`` as in compile.

    ``devices`` (default: the plan's, under the names they were planned with) become a cluster as compile's do,
    whose names the loaded problem and plan then use; the plan file holds the problem it was
    planned for, so ``calibration`` (as in compile, default ``"none"``: nothing is measured) matters only for a
    plan file too old to hold it.

    A plan compiled with dynamic shapes is traced again with the same dynamic dimensions (names and
    ranges from the plan file, applied to ``example_inputs``) unless ``dynamic_shapes`` is given.
    """
    record = read_plan_file(path)
    if LM_KEY in record:
        raise PlanError(
            f"plan file {str(path)!r} is a plan of moirai.compile_lm (CompiledLM.save wrote it): load it with "
            "moirai.load_lm(path, model), which rebuilds the generation step it splits"
        )
    # Not `devices or ...`: an empty list is refused as compile refuses it, and an array has no truth value.
    cluster = saved_cluster(record, calibration) if devices is None else local_cluster(devices, calibration)
    if len(cluster) != len(record["devices"]):
        raise PlanError(f"{path} places the model on {len(record['devices'])} devices, {len(cluster)} were given")
    if dynamic_shapes is None and record.get("dynamic_dims"):
        try:
            dynamic_shapes = dynamic_shapes_from_json(record["dynamic_dims"], model, example_inputs, example_kwargs)
        except PlanError as error:
            raise PlanError(f"{path}: 'dynamic_dims': {error}") from None
    traced = trace(model, example_inputs, example_kwargs, dynamic_shapes)
    return from_plan_record(record, path, traced, cluster, progress)


def saved_cluster(record: dict[str, Any], calibration: str | Path) -> Cluster:
    """The plan's own devices, made a cluster as compile makes a list of devices, under the names they were planned
    by (a cluster's own, where it was compiled on one), which its problem and summary give them."""
    saved = record["devices"]
    return local_cluster([d["torch_device"] for d in saved], calibration).renamed([d["name"] for d in saved])


def from_plan_record(
    record: dict[str, Any], source: str | Path, traced: TracedModel, cluster: Cluster, progress: bool = True
) -> CompiledModel:
    """The compiled model a plan record (:meth:`CompiledModel.plan_record`) describes, for ``traced`` on ``cluster``
    (``progress``: :attr:`CompiledModel.progress`)."""
    record = _matched_layout_ops(record, traced, source)
    node_device = {name: int(k) for name, k in record["node_device"].items()}
    _check_ops_known(traced, node_device, source=str(source))
    check_traced_tensors(record, traced, source)
    # Stages in compile's order (trace, op graph, ..., split), so that load's progress lines read as compile's.
    graph = build_op_graph(traced)
    coarse = graph.merge(_saved_groups(graph, record["groups"], source, traced.model_name, set(node_device)))
    problem = planned_problem(record, source, coarse, cluster, traced)
    # The model's buffers, not the file, say which ops share a device: a file that drops a set would split its state.
    buffers = mutable_buffers(traced.graph_module)
    _check_buffers_kept_together(buffers, node_device, source)
    problem = dataclasses.replace(problem, colocated=colocated_groups(coarse, buffers))
    plan = _saved_plan(record, source, problem)
    _check_placement_runs(plan, coarse, node_device, source)
    program = _saved_split(traced, node_device, len(cluster), record["device_order"], source)
    return CompiledModel(traced, cluster, coarse, problem, plan, node_device, record["device_order"], program, progress)


def _saved_split(
    traced: TracedModel,
    node_device: dict[str, int],
    num_devices: int,
    device_order: list[list[str]] | None,
    source: str | Path,
) -> SplitProgram:
    """The split the record's ``node_device`` and ``device_order`` describe, or a :class:`PlanError` that names the
    file and what to do, as the other load errors do (the splitter's alone names neither)."""
    try:
        return split_module(traced, node_device, num_devices, device_order)
    except PlanError as error:
        raise PlanError(
            f"{source}: 'node_device' and 'device_order' do not split {traced.model_name}: "
            f"{str(error).rstrip('.')}; {_SAVE_AGAIN}"
        ) from None


# What to do about a plan record whose fields do not hold together (each is as save writes it, the whole is not).
_SAVE_AGAIN = "the file was edited or mixed: save the plan again with CompiledModel.save(path), or compile again"


def _saved_groups(
    graph: OpGraph, groups: list[list[str]], source: str | Path, model_name: str, placed: set[str]
) -> list[list[int]]:
    """The op graph's nodes in each saved group, or a :class:`PlanError` unless the groups name every node of the
    graph exactly once (as coarsening left them); ``placed``: the ops the record's ``node_device`` names."""
    unknown = [name for group in groups for name in group if name not in graph.node_of_fx_name]
    if unknown:
        raise PlanError(
            f"{source}: 'groups' names ops {unknown[:3]} that {model_name}'s op graph does not have; the model or its "
            f"example inputs differ from the ones planned, or {_SAVE_AGAIN}"
        )
    members = [graph.nodes_of_fx_names(group) for group in groups]
    empty = [g for g, nodes in enumerate(members) if not nodes]
    counts = collections.Counter(i for nodes in members for i in nodes)
    twice = [graph.nodes[i].fx_names[0] for i, count in counts.items() if count > 1]
    absent = [node.fx_names[0] for i, node in enumerate(graph.nodes) if i not in counts]
    unplanned = [name for name in absent if name not in placed]
    if unplanned and not (empty or twice):
        # Ops the model has that no part of the file names: the model grew since the plan was made, not the file.
        raise PlanError(
            f"{source}: {model_name} has ops {unplanned[:3]} that the plan never saw (it was made for a model or "
            "example inputs without them): compile again, or load with the model the plan was saved for"
        )
    if empty or twice or absent:
        words = [f"group {empty[0]} is empty"] if empty else []
        words += [f"ops {twice[:3]} are in more than one group"] if twice else []
        words += [f"ops {absent[:3]} are in no group"] if absent else []
        raise PlanError(
            f"{source}: 'groups' must hold every op once, in groups of at least one, but {'; '.join(words)}; "
            f"{_SAVE_AGAIN}"
        )
    return members


def _saved_plan(record: dict[str, Any], source: str | Path, problem: Problem) -> Plan:
    """The record's plan, checked against the problem it was made for as the simulator checks a plan (a device of
    every task, in range, orders of every task on its device and of the tensors each link carries, that do not
    deadlock), so that what describes it (repr, summary, gantt) cannot fail later."""
    try:
        plan = Plan.from_dict(record["plan"])
    except PlanError as error:  # a report's field not of its type: PlacerReport.from_dict names it
        raise PlanError(f"{source}: 'plan': {error}; {_SAVE_AGAIN}") from None
    except (KeyError, TypeError, ValueError) as error:
        words = f"{type(error).__name__}: {error}"
        raise PlanError(f"{source}: 'plan' is not a saved plan ({words}); {_SAVE_AGAIN}") from None
    # Its devices are called what the problem calls them, the names of the devices it runs on (planned_problem):
    # those load was given may have others than the saved ones.
    plan.device_names = problem.device_names
    try:
        simulate(problem, plan)
    except PlanError as error:
        raise PlanError(f"{source}: 'plan' does not fit its problem: {error}; {_SAVE_AGAIN}") from None
    return plan


def _check_buffers_kept_together(
    buffers: Sequence[MutableBuffer], node_device: dict[str, int], source: str | Path
) -> None:
    """A :class:`PlanError` unless every op that reads or writes a buffer the model writes in place runs on one device:
    one part keeps the buffer, and another would read a stale copy of it."""
    for buffer in buffers:
        devices = {name: node_device[name] for name in buffer.op_names if name in node_device}
        if len(set(devices.values())) > 1:
            shown = ", ".join(f"{name} on device {k}" for name, k in list(devices.items())[:6])
            raise PlanError(
                f"{source}: 'node_device' puts the ops of buffer {buffer.name!r}, which the model writes in place, on "
                f"more than one device ({shown}); they must share one, as compile plans them, whatever the file's "
                f"'colocated' says: {_SAVE_AGAIN}"
            )


def _check_placement_runs(plan: Plan, coarse: OpGraph, node_device: dict[str, int], source: str | Path) -> None:
    """The plan's placement is what summary() and gantt() describe, ``node_device`` what the split runs: a
    :class:`PlanError` unless they are the same."""
    for task, node in enumerate(coarse.nodes):
        for name in node.fx_names:
            if node_device.get(name) != plan.placement[task]:
                raise PlanError(
                    f"{source}: 'node_device' puts op {name!r} on device {node_device.get(name)}, but "
                    f"'plan.placement' puts its group ({task}) on device {plan.placement[task]}; the two must agree: "
                    f"{_SAVE_AGAIN}"
                )


def planned_problem(
    record: dict[str, Any], path: str | Path, coarse: OpGraph, cluster: Cluster, traced: TracedModel
) -> Problem:
    """The problem the plan was made for, as saved, its devices called as ``cluster``'s; a plan file older than that
    gets it rebuilt (analytic costs)."""
    if "problem" not in record:
        warnings.warn(
            f"{path} does not hold the planned problem (saved by an older moirai); rebuilding it with analytic "
            "costs, so summary() and gantt() may differ from the compiled model's: save the plan again to keep them",
            PlanVersionWarning,
            stacklevel=user_stacklevel(),
        )
        return build_problem(coarse, cluster, "analytic", traced=traced)  # as the warning says, whatever the default
    saved = record["problem"]
    if not isinstance(saved, dict):
        raise PlanError(f"{path}: 'problem' must be an object (a saved Problem), got {type(saved).__name__}")
    # Sizes first: a problem of other sizes than its plan's fails its own checks with a less useful message.
    tasks, devices = (len(value) if isinstance(value := saved.get(key), list) else 0 for key in ("tasks", "devices"))
    if tasks != len(coarse.nodes) or devices != len(cluster):
        raise PlanError(
            f"{path} holds a problem of {tasks} tasks on {devices} devices, but its plan has "
            f"{len(coarse.nodes)} op groups on {len(cluster)} devices; the file was edited or mixed: save it again"
        )
    try:
        problem = Problem.from_dict(saved)
    except ProblemError as error:
        raise PlanError(
            f"{path} holds a planned problem that does not hold together ({error}); the file was edited "
            "or mixed: save it again"
        ) from None
    if not any(isinstance(d, dict) and "reserve_bytes" in d for d in saved["devices"]):
        # Saved before problems kept their reserve: the capacity is the device's memory less it, so the summary
        # would show the capacity as the device's memory. What the loading devices hold beyond it is the reserve.
        memory = np.array([d.memory_bytes for d in cluster.devices], float)
        known = np.isfinite(memory) & np.isfinite(problem.memory_capacity_bytes)
        reserve = np.where(known, np.maximum(memory - problem.memory_capacity_bytes, 0.0), 0.0)
        problem = dataclasses.replace(problem, memory_reserve_bytes=reserve)
    # Named as compile names them, by the devices it runs on: load may be given other devices (or other names of
    # them) than those planned, and summary, gantt and with_plan check that plan and problem name them alike.
    return dataclasses.replace(problem, device_names=cluster.names)


def rank_cluster(
    devices: Cluster | Sequence[str], calibration: str | Path, handover: PlanHandover | None
) -> tuple[Cluster, tuple[str, ...] | None]:
    """The cluster this process plans or serves with, and under a torchrun across hosts each device's host (else
    None). Every rank of such a run first takes part in measuring the links between the hosts where they are to
    be measured (:func:`measure_host_links`); a rank that does not plan measures nothing else, as the plan it
    receives carries rank 0's costs."""
    check_calibration(calibration)  # before the ranks measure links between hosts by it
    hosts = handover.hosts if handover is not None else None
    if handover is not None and hosts is not None:
        measure_host_links(
            handover.store, handover.rank, handover.torch_devices, hosts, calibration, f"{handover.key}/hosts"
        )
    plans = handover is None or handover.plans
    return local_cluster(devices, calibration if plans else "none", hosts), hosts


def _unfused_lower_bound_s(
    graph: OpGraph,
    coarsening: CoarseningResult,
    problem: Problem,
    cluster: Cluster,
    traced: TracedModel,
    objective: str | Objective,
) -> float | None:
    """The objective's lower bound with ``graph``'s ops ungrouped (:func:`moirai.cluster.cost.unfused_problem`), or
    None when coarsening grouped none of them."""
    if len(coarsening.groups) == len(graph.nodes):
        return None
    ungrouped = unfused_problem(graph, coarsening.groups, problem, cluster, traced)
    try:
        return as_objective(objective).lower_bound_s(ungrouped)
    except InfeasibleError:
        return None  # no plan fits memory; the coarsened problem's own bound is then absent too


def serve_rank(compiled: CompiledModel, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Under torchrun, on every rank but 0: serve rank 0's ``compiled.server()`` until it closes."""
    _check_devices_here(compiled.cluster, [require_torchrun_world("serve_rank").rank])
    distributed.serve_rank(compiled.program, compiled.cluster.devices, timeout_s=timeout_s)


def check_placer_options(
    placer_options: dict[str, Any], caller: Callable[..., Any] | None = None, placer: str | None = None
) -> None:
    """A misspelt parameter of ``caller`` (compile's ``dynamic_shape=``) would reach the placer as an option; name it
    here, and an unknown ``placer`` or an option it does not take, before the trace and the costs take their time."""
    caller = caller or compile
    own = [name for name in inspect.signature(caller).parameters if name != "placer_options"]
    name = f"moirai.{getattr(caller, '__name__', 'compile')}"
    for option in placer_options:
        close = closest_name(option, own, cutoff=0.8)
        if close is not None:
            raise MoiraiError(
                f"{name} has no parameter {option!r}; did you mean {close!r}? Keywords other than "
                f"its own ({', '.join(own)}) go to the placer as its options"
            )
    if placer is not None:
        check_options(placer_spec(placer), placer_options)


def _check_devices_here(cluster: Cluster, indices: Sequence[int]) -> None:
    """Fail before running a part on a device this machine does not have (torch would assert). An index past the
    plan's devices (a torchrun rank it has no part for) is left to the runtime, which names the mismatch.

    The device's host is not asked (:attr:`Device.on_this_host`): under torchrun a rank runs its own device, whose
    host is a name in the plan (a cluster file's, or ``name#1`` from :func:`moirai.runtime.hosts.rank_hosts`) that
    need not be this machine's hostname; torchrun's layout is checked against the plan's hosts by the runtime."""
    for k in indices:
        if k >= len(cluster):
            continue
        device = cluster.devices[k]
        wanted = torch.device(device.torch_device)
        kind = kind_of(wanted)
        if not kind.available(wanted):
            raise ClusterError(
                f"device {device.name!r} of the plan runs on {device.torch_device}, but this machine has "
                f"{kind.count()} {kind.name.upper()} device(s); run the plan where its devices are "
                "(CompiledModel.save, then moirai.load there), or compile for this machine's devices "
                "(moirai.Cluster.detect(), ['cpu', 'cpu'])"
            )


def _check_local_run(cluster: Cluster, call: str) -> None:
    """``run_distributed``, and ``run_rank`` or ``server()`` outside torchrun (or in a world of one rank), start every
    device's process on this machine: a plan whose devices name other hosts (a cluster file's ``host``) is meant for
    torchrun on them, and run here it would silently stand in for them (its measured times would not be the plan's).
    Then every device as :func:`_check_devices_here` checks it. Calling the model runs its parts in one process, to
    check its outputs anywhere: that is not asked."""
    if not all(d.on_this_host for d in cluster.devices):
        hosts = ", ".join(dict.fromkeys(d.host for d in cluster.devices))
        raise InputError(
            f"this plan's devices are on hosts {hosts}: run it under torchrun on those hosts, one rank per device "
            f"(host i with --node-rank i); {call} would run every host's part on this machine"
        )
    _check_devices_here(cluster, range(len(cluster)))


def assemble(
    traced: TracedModel, cluster: Cluster, coarse: OpGraph, problem: Problem, plan: Plan, progress: bool = True
) -> CompiledModel:
    """The compiled model of ``plan`` (``progress``: :attr:`CompiledModel.progress`)."""
    node_device = {name: int(plan.placement[i]) for i, node in enumerate(coarse.nodes) for name in node.fx_names}
    task_order = simulate(problem, plan).device_order()
    device_order = [[name for i in tasks for name in coarse.nodes[i].fx_names] for tasks in task_order]
    program = split_module(traced, node_device, len(cluster), device_order)
    return CompiledModel(traced, cluster, coarse, problem, plan, node_device, device_order, program, progress)


def _check_ops_known(traced: TracedModel, node_device: dict[str, int], source: str) -> None:
    """A plan names the traced model's ops; one it does not have means another model or other inputs."""
    unknown = sorted(set(node_device) - {node.name for node in traced.graph_module.graph.nodes})
    if unknown:
        raise PlanError(
            f"{source} names ops {unknown[:3]} that {traced.model_name} does not have; "
            "the model or its example inputs differ from the ones planned: compile again"
        )


# Ops that only copy their one input or lay it out anew, which one trace of a model may have where another has none: a
# model on `meta` weights traces a `contiguous` after attention that the real one does not (the meta kernel of
# scaled_dot_product_attention gives other strides than the CPU one), and torch names such ops by a counter per name.
_LAYOUT_TARGETS = {
    torch.ops.aten.contiguous.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
}
_LAYOUT_NAMES = frozenset(str(target.overloadpacket.__name__) for target in _LAYOUT_TARGETS)


def _matched_layout_ops(record: dict[str, Any], traced: TracedModel, source: str | Path) -> dict[str, Any]:
    """``record`` with its layout ops matched to ``traced``'s, where the two traces differ in them (a plan made on
    ``meta`` weights, loaded with the real ones): every op of such a kind in the file is dropped, and every one in the
    trace goes with the op whose value it copies (its device, group and place in that device's order), or, where it
    reads an input or a weight, with the op that reads it. Any other difference is left to the checks that follow."""
    traced_ops = [node for node in traced.graph_module.graph.nodes if _is_op_node(node)]
    here = {node.name for node in traced_ops}
    planned = set(record["node_device"])
    kinds = {op_kind(name) for name in here ^ planned} & _LAYOUT_NAMES
    moved = [node for node in traced_ops if op_kind(node.name) in kinds and node.target in _LAYOUT_TARGETS]
    dropped = {name for name in planned if op_kind(name) in kinds}
    if not moved and not dropped:
        return record
    # Every op of a differing kind moves, not just the unmatched ones: the names after the first difference shift.
    node_device = {name: k for name, k in record["node_device"].items() if name not in dropped}
    groups = [[name for name in group if name not in dropped] for group in record["groups"]]
    if any(group and not kept for group, kept in zip(record["groups"], groups, strict=True)):
        raise PlanError(
            f"{source}: an op group of only {sorted(kinds)} ops has no counterpart in {traced.model_name}'s trace, "
            "which lays out tensors differently from the one planned (meta weights, another device); compile the "
            "model again as it is loaded"
        )
    orders = record["device_order"]
    orders = None if orders is None else [[name for name in order if name not in dropped] for order in orders]
    group_of = {name: g for g, group in enumerate(groups) for name in group}
    before: dict[str, list[str]] = collections.defaultdict(list)
    after: dict[str, list[str]] = collections.defaultdict(list)
    # Graph order meets the op a layout op copies first; reverse order the op that reads one copying an input.
    for node in moved:
        if producers := [p.name for p in node.all_input_nodes if p.name in node_device]:
            _join(node.name, producers[0], after, node_device, group_of, groups)
    for node in reversed(moved):
        if node.name not in node_device:
            readers = [user.name for user in node.users if user.name in node_device]
            if not readers:
                raise PlanError(
                    f"{source}: {traced.model_name}'s trace has {node.name}, which copies a tensor no op of the plan "
                    "makes or reads, so it has no place in the plan; compile the model again as it is loaded"
                )
            _join(node.name, readers[0], before, node_device, group_of, groups)
    if orders is not None:
        orders = [[placed for name in order for placed in _with_moved(name, before, after)] for order in orders]
    return {**record, "node_device": node_device, "groups": groups, "device_order": orders}


def _is_op_node(node: torch.fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module")


def _join(
    name: str,
    anchor: str,
    beside: dict[str, list[str]],
    node_device: dict[str, int],
    group_of: dict[str, int],
    groups: list[list[str]],
) -> None:
    """Put op ``name`` on ``anchor``'s device, in its group, and next to it in that device's order (``beside``: the ops
    run just before or just after ``anchor``)."""
    node_device[name] = node_device[anchor]
    group_of[name] = group_of[anchor]
    groups[group_of[anchor]].append(name)
    beside[anchor].append(name)


def _with_moved(name: str, before: dict[str, list[str]], after: dict[str, list[str]]) -> list[str]:
    """``name`` in a device's order, with the layout ops placed before and after it (and theirs)."""
    placed = [op for early in before.get(name, []) for op in _with_moved(early, before, after)]
    placed.append(name)
    return placed + [op for late in after.get(name, []) for op in _with_moved(late, before, after)]
