"""Command line: ``moirai compile``, ``moirai plan``, ``moirai demo``, ``moirai placers``, ``moirai calibrate``.

``moirai compile MODULE:FACTORY --devices cpu,cpu`` imports ``MODULE`` (a module name, or a path
to a ``.py`` file), calls ``FACTORY()`` for ``(model, example_inputs)`` (or a model with an
``example_inputs`` attribute), compiles it and prints the plan; ``--check`` runs the split model
and compares its outputs with the model's. Every moirai error is one red line and a non-zero exit
code (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

import moirai
from moirai import progress, viz
from moirai.cluster.calibration import cli as calibrate_command
from moirai.errors import ClusterError, MoiraiError, PlanError, did_you_mean
from moirai.user_files import check_output_path, write_output


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        if args.command == "demo":
            return 0 if moirai.demo.run_demo(args.placer, console, args.time_limit) else 1
        if args.command == "compile":
            return _compile(args, console)
        if args.command == "plan":
            return _plan(args, console)
        if args.command == "calibrate":
            return calibrate_command.run(args, console)
        console.print("\n".join(moirai.list_placers()))
        return 0
    except (MoiraiError, OSError) as error:
        if args.debug:
            raise
        message = str(error) if isinstance(error, MoiraiError) else _os_error_message(error)
        Console(stderr=True).print(f"[red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
        return 2


def _parser() -> argparse.ArgumentParser:
    description = (__doc__ or "").replace("``", "")  # the module's reST markup, read as plain text
    parser = argparse.ArgumentParser(
        prog="moirai", description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"moirai {importlib.metadata.version('moirai')}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="plan a bundled model on a bundled cluster, run it split, check outputs")
    demo.add_argument("--placer", default="milp", help="a registered placer (`moirai placers` lists them)")
    demo.add_argument("--time-limit", type=float, default=20.0, help="seconds the milp placer may take")

    compile_ = commands.add_parser("compile", help="compile a model from a factory, print the plan")
    compile_.add_argument("factory", metavar="MODULE:FACTORY", help="FACTORY() returns (model, example_inputs)")
    where = compile_.add_mutually_exclusive_group(required=True)
    where.add_argument("--devices", help="comma-separated torch devices, e.g. cpu,cpu or cuda:0,cuda:1,cpu")
    where.add_argument("--cluster", help="a cluster file (TOML) or a preset name (see moirai.Cluster.presets())")
    compile_.add_argument("--cost", choices=("analytic", "measured"), default="analytic")
    compile_.add_argument(
        "--calibration",
        default="auto",
        metavar="auto|none|remeasure|FILE",
        help="what the links between --devices cost, as moirai.compile's calibration (default auto: this "
        "machine's cached calibration, measured once); a --cluster file keeps its own links",
    )
    compile_.add_argument("--check", action="store_true", help="run the split model, compare with the model")
    _placement_arguments(compile_, default_placer="milp")

    plan = commands.add_parser("plan", help="place a Problem given as JSON and print the plan")
    plan.add_argument("problem", help="path of a Problem JSON file (see README)")
    _placement_arguments(plan, default_placer="heft")

    commands.add_parser("placers", help="list the registered placers")
    calibrate_command.add_arguments(
        commands.add_parser("calibrate", help="measure links between local ranks, write a cluster file")
    )
    return parser


def _placement_arguments(parser: argparse.ArgumentParser, default_placer: str) -> None:
    parser.add_argument("--placer", default=default_placer, help=f"a registered placer (default {default_placer})")
    parser.add_argument("--time-limit", type=float, help="seconds the placer may take (placers with time_limit_s)")
    parser.add_argument("--objective", default="latency", help="latency or throughput (default latency)")
    parser.add_argument("--output", help="write the plan as JSON here")
    parser.add_argument("--gantt", help="draw the schedule into this picture (.png, .svg, .pdf; needs matplotlib)")
    parser.add_argument("--timeline", action="store_true", help="print the schedule as a text timeline")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def _compile(args: argparse.Namespace, console: Console) -> int:
    if args.placer not in moirai.list_placers():  # before the model is imported and traced
        placers = moirai.list_placers()
        raise MoiraiError(
            f"unknown placer {args.placer!r}{did_you_mean(args.placer, placers)}; choose one of {', '.join(placers)}"
        )
    if args.gantt:
        viz.check_picture_path(args.gantt)
    if args.output:
        check_output_path(args.output, "the plan", PlanError)  # before the model is traced and placed
    # A device list goes to compile as the API's users give it, so that both build the cluster one way.
    # `is not None`: --devices "" is a list of no devices (refused as such), not --cluster left out.
    devices = _device_list(args.devices) if args.devices is not None else _cluster(args.cluster)
    model, example_inputs = _load_factory(args.factory)
    options = _placer_options(args)
    compiled = moirai.compile(
        model,
        devices,
        example_inputs=example_inputs,
        placer=args.placer,
        cost=args.cost,
        calibration=args.calibration,
        **options,
    )
    compiled.summary(console)
    if args.timeline:
        compiled.text_gantt(console=console)
    if args.output:
        compiled.save(args.output)
        console.print(f"plan written to {args.output}", highlight=False)
    if args.gantt:
        compiled.gantt(args.gantt)
        console.print(f"schedule drawn in {args.gantt}", highlight=False)
    if args.check:
        with torch.no_grad():
            expected, actual = model(*example_inputs), compiled(*example_inputs)
        try:
            torch.testing.assert_close(actual, expected)
        except AssertionError as mismatch:
            first_line = str(mismatch).strip().splitlines()[0]
            console.print(f"[red]outputs differ[/] from the model's: {escape(first_line)}", soft_wrap=True)
            return 1
        used = len(set(compiled.node_device.values()))
        console.print(f"[green]match[/]: the split model on {used} device(s) gives the model's outputs")
    return 0


def _plan(args: argparse.Namespace, console: Console) -> int:
    if args.output:
        check_output_path(args.output, "the plan", PlanError)  # before the placer's work
    if args.gantt:
        viz.check_picture_path(args.gantt)
    problem = moirai.Problem.from_json(args.problem)
    with progress.shown():
        plan = moirai.place(problem, placer=args.placer, **_placer_options(args))
    timeline = moirai.simulate(problem, plan)
    console.print(viz.summary_table(problem, plan, timeline=timeline, title=f"{args.placer} on {args.problem}"))
    if args.timeline:
        console.print(viz.text_gantt(problem, plan, timeline=timeline))
    if args.output:
        write_output(args.output, json.dumps(plan.to_dict(), indent=1), "the plan", PlanError)
        console.print(f"plan written to {args.output}", highlight=False)
    if args.gantt:
        viz.gantt(problem, plan, args.gantt, timeline=timeline)
        console.print(f"schedule drawn in {args.gantt}", highlight=False)
    return 0


def _placer_options(args: argparse.Namespace) -> dict[str, Any]:
    """``time_limit_s`` when given, and the objective (checked before any model is traced)."""
    from moirai.planning.objective import OBJECTIVES

    if args.objective not in OBJECTIVES:
        raise MoiraiError(f"--objective {args.objective!r} is not an objective; choose one of {', '.join(OBJECTIVES)}")
    options: dict[str, Any] = {} if args.time_limit is None else {"time_limit_s": args.time_limit}
    return {**options, "objective": args.objective}


def _device_list(devices: str) -> list[str]:
    names = [name.strip() for name in devices.split(",") if name.strip()]
    if not names:
        raise ClusterError(f"--devices {devices!r}: give at least one device, e.g. --devices cpu,cpu")
    return names


def _cluster(name_or_path: str) -> moirai.Cluster:
    if name_or_path in moirai.Cluster.presets():
        return moirai.Cluster.preset(name_or_path)
    if not Path(name_or_path).exists():
        raise MoiraiError(
            f"--cluster {name_or_path!r} is neither a cluster file nor a preset; "
            f"presets are {', '.join(moirai.Cluster.presets())}"
        )
    return moirai.Cluster.from_file(name_or_path)


def _load_factory(spec: str) -> tuple[torch.nn.Module, tuple]:
    """Import ``MODULE:FACTORY``, call it, and return ``(model, example_inputs)``."""
    module_name, _, factory_name = spec.rpartition(":")
    if not module_name or not factory_name:
        raise MoiraiError(f"{spec!r} is not MODULE:FACTORY (e.g. mymodels.py:make_model or mypackage.models:make)")
    module = _import(module_name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise MoiraiError(f"{module_name} has no function {factory_name!r}")
    try:
        made = factory()
    except Exception as error:  # the user's code: report it on one line like our own errors
        raise MoiraiError(f"{spec}() raised {type(error).__name__}: {error}") from error
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, example_inputs = made
    elif isinstance(made, torch.nn.Module) and hasattr(made, "example_inputs"):
        model, example_inputs = made, made.example_inputs
    else:
        raise MoiraiError(
            f"{spec}() must return (model, example_inputs) or a model with an example_inputs attribute, "
            f"not {type(made).__name__}"
        )
    example_inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    return model.eval(), example_inputs


def _import(module_name: str) -> Any:
    """A module by name (from the current directory too), or a ``.py`` file by path."""
    try:
        if module_name.endswith(".py") or Path(module_name).is_file():
            path = Path(module_name)
            if not path.is_file():
                raise MoiraiError(f"no Python file {module_name!r}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or module_spec.loader is None:  # Python imports files named .py (or .so...) only
                raise MoiraiError(
                    f"cannot import {module_name}: it is not a Python file (.py); name the .py file that defines "
                    "the factory, or a module"
                )
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[path.stem] = module  # so that pickling the model (run_distributed) finds its classes
            module_spec.loader.exec_module(module)
            return module
        if "" not in sys.path:
            sys.path.insert(0, "")
        return importlib.import_module(module_name)
    except MoiraiError:
        raise
    except Exception as error:  # ImportError, or whatever the module raises at import
        raise MoiraiError(f"cannot import {module_name}: {type(error).__name__}: {error}") from error


def _os_error_message(error: OSError) -> str:
    if isinstance(error, FileNotFoundError) and error.filename:
        folder = Path(os.fsdecode(error.filename)).parent
        if not folder.is_dir():  # what is missing is the folder of a path to write (or read), not the file
            return f"no such folder: {folder} (for {error.filename})"
        return f"no such file: {error.filename}"
    return f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")


if __name__ == "__main__":
    sys.exit(main())
