"""Command line: ``moirai compile``, ``moirai plan``, ``moirai demo``, ``moirai placers``, ``moirai calibrate``.

``moirai compile MODULE:FACTORY --devices cpu,cpu`` imports ``MODULE`` (a module name, or a path
to a ``.py`` file), calls ``FACTORY()`` for ``(model, example_inputs)`` (or a model with an
``example_inputs`` attribute), compiles it and prints the plan; ``--check`` runs the split model
and compares its outputs with the model's. Every moirai error is one red line and a non-zero exit
code (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

import moirai
from moirai import progress, viz
from moirai.cluster.calibration import cli as calibrate_command
from moirai.cluster.calibration.cache import check_calibration
from moirai.cluster.cost import COST_MODES, DEFAULT_COST_MODE
from moirai.errors import ClusterError, MoiraiError, MoiraiWarning, PlacerOptionError, PlanError
from moirai.planning.placers import check_options, spec, specs
from moirai.user_files import check_output_path, same_file, write_output


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        # catch_warnings restores Python's way of showing warnings when the command ends; --quiet: no progress lines
        with warnings.catch_warnings(), progress.shown(False) if args.quiet else contextlib.nullcontext():
            if not args.debug:
                warnings.showwarning = _show_warning
            return _run(args, console)
    except (MoiraiError, OSError) as error:
        if args.debug:  # the traceback, and the exit code an error has without --debug
            traceback.print_exc()
            return 2
        message = str(error) if isinstance(error, MoiraiError) else _os_error_message(error)
        Console(stderr=True).print(f"[red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        Console(stderr=True).print("moirai: interrupted", highlight=False)
        return 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.command == "demo":
        options = _time_limit_option(args)  # the placer and its limit, before the demo's banner
        return 0 if moirai.demo.run_demo(args.placer, console, options.get("time_limit_s")) else 1
    if args.command == "compile":
        return _compile(args, console)
    if args.command == "plan":
        return _plan(args, console)
    if args.command == "calibrate":
        return calibrate_command.run(args, console)
    console.print("\n".join(moirai.list_placers()))
    return 0


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """A warning as one line on stderr, ``moirai: warning: ...``: the source line Python shows would be moirai's
    own (or a library's), which says nothing to a user of the command line."""
    kind = "" if issubclass(category, MoiraiWarning) else f"{category.__name__}: "
    text = " ".join(str(message).split())
    Console(stderr=True).print(f"moirai: warning: {escape(kind + text)}", soft_wrap=True, highlight=False)


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
    demo.add_argument(
        "--time-limit", type=float, help="seconds the placer may take (placers that take a limit; milp's default 20)"
    )

    compile_ = commands.add_parser("compile", help="compile a model from a factory, print the plan")
    compile_.add_argument(
        "factory", metavar="MODULE:FACTORY", help="FACTORY() returns (model, example_inputs[, example_kwargs])"
    )
    where = compile_.add_mutually_exclusive_group(required=True)
    where.add_argument("--devices", help="comma-separated torch devices, e.g. cpu,cpu or cuda:0,cuda:1,cpu")
    where.add_argument("--cluster", help="a cluster file (TOML) or a preset name (see moirai.Cluster.presets())")
    compile_.add_argument("--cost", choices=COST_MODES, default=DEFAULT_COST_MODE)
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
    for command in commands.choices.values():  # after the command as before it, as on every command
        command.add_argument(
            "--quiet", action="store_true", help="no progress lines on stderr (results and errors only)"
        )
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    return parser


def _placement_arguments(parser: argparse.ArgumentParser, default_placer: str) -> None:
    parser.add_argument("--placer", default=default_placer, help=f"a registered placer (default {default_placer})")
    parser.add_argument("--time-limit", type=float, help="seconds the placer may take (placers with time_limit_s)")
    parser.add_argument("--objective", default="latency", help="latency or throughput (default latency)")
    parser.add_argument("--output", help="write the plan as JSON here")
    parser.add_argument("--gantt", help="draw the schedule into this picture (.png, .svg, .pdf; needs matplotlib)")
    parser.add_argument("--timeline", action="store_true", help="print the schedule as a text timeline")


def _compile(args: argparse.Namespace, console: Console) -> int:
    options = _placer_options(args)  # before the model is imported and traced
    _check_outputs(args, _compile_inputs(args))  # before the model is traced and placed
    # A device list goes to compile as the API's users give it, so that both build the cluster one way.
    # `is not None`: --devices "" is a list of no devices (refused as such), not --cluster left out.
    devices = _device_list(args.devices) if args.devices is not None else _cluster(args.cluster)
    check_calibration(args.calibration)  # before the factory builds the model, which may take minutes
    model, example_inputs, example_kwargs = _load_factory(args.factory)
    compiled = moirai.compile(
        model,
        devices,
        example_inputs=example_inputs,
        example_kwargs=example_kwargs,
        placer=args.placer,
        cost=args.cost,
        calibration=args.calibration,
        **options,
    )
    compiled.summary(console)
    if args.timeline:
        compiled.text_gantt(console=console)
    if args.output is not None:
        compiled.save(args.output)
        console.print(f"plan written to {args.output}", highlight=False)
    if args.gantt is not None:
        compiled.gantt(args.gantt)
        console.print(f"schedule drawn in {args.gantt}", highlight=False)
    if args.check:
        with torch.no_grad():
            expected = model(*example_inputs, **example_kwargs)
            actual = compiled(*example_inputs, **example_kwargs)
        try:
            torch.testing.assert_close(actual, expected)
        except AssertionError as mismatch:
            first_line = str(mismatch).strip().splitlines()[0]
            Console(stderr=True).print(f"[red]outputs differ[/] from the model's: {escape(first_line)}", soft_wrap=True)
            return 1
        used = len(set(compiled.node_device.values()))
        console.print(f"[green]match[/]: the split model on {used} device{'s' * (used != 1)} gives the model's outputs")
    return 0


def _plan(args: argparse.Namespace, console: Console) -> int:
    options = _placer_options(args)
    _check_outputs(args, {"the problem file": args.problem})  # before the placer's work
    problem = moirai.Problem.from_json(args.problem)
    with progress.shown():
        plan = moirai.place(problem, placer=args.placer, **options)
    timeline = moirai.simulate(problem, plan)
    console.print(viz.summary_table(problem, plan, timeline=timeline, title=f"{args.placer} on {args.problem}"))
    if args.timeline:
        console.print(viz.text_gantt(problem, plan, timeline=timeline))
    if args.output is not None:
        write_output(args.output, json.dumps(plan.to_dict(), indent=1), "the plan", PlanError)
        console.print(f"plan written to {args.output}", highlight=False)
    if args.gantt is not None:
        viz.gantt(problem, plan, args.gantt, timeline=timeline)
        console.print(f"schedule drawn in {args.gantt}", highlight=False)
    return 0


def _placer_options(args: argparse.Namespace) -> dict[str, Any]:
    """``time_limit_s`` when given, and the objective, each asked of its registry (before any model is traced)."""
    from moirai.planning.objective import as_objective

    options = _time_limit_option(args)
    try:
        as_objective(args.objective)
    except MoiraiError as error:
        raise MoiraiError(f"--objective {args.objective!r}: {error}") from None
    return {**options, "objective": args.objective}


def _time_limit_option(args: argparse.Namespace) -> dict[str, Any]:
    """``{"time_limit_s": --time-limit}`` when given (and the placer takes a limit), else nothing; an unknown placer
    is the registry's error."""
    traits = spec(args.placer)
    if args.time_limit is None:
        return {}
    if not traits.takes("time_limit_s"):
        takers = ", ".join(s.name for s in specs() if s.takes("time_limit_s"))
        raise PlacerOptionError(
            f"--time-limit: placer {args.placer!r} takes no time limit; leave --time-limit out, or choose a placer "
            f"that takes one ({takers})"
        )
    options = {"time_limit_s": args.time_limit}
    try:
        check_options(traits, options)
    except PlacerOptionError:
        raise PlacerOptionError(
            f"--time-limit {args.time_limit}: give a non-negative number of seconds (0: no search, the start plan)"
        ) from None
    return options


def _check_outputs(args: argparse.Namespace, inputs: dict[str, str]) -> None:
    """Refuse, before any work, an --output or --gantt moirai cannot write, or one that names the other or a file
    the command reads (``inputs``, by what they are): writing it would replace what the user has."""
    if args.output is not None:
        check_output_path(args.output, "the plan", PlanError)
    if args.gantt is not None:
        viz.check_picture_path(args.gantt)
    if args.output is not None and args.gantt is not None and same_file(args.output, args.gantt):
        raise MoiraiError(
            f"--output {args.output!r} and --gantt {args.gantt!r} name one file: the picture would replace the plan; "
            "name two files"
        )
    for flag, path in (("--output", args.output), ("--gantt", args.gantt)):
        for what, read in inputs.items():
            if path is not None and same_file(path, read):
                raise MoiraiError(
                    f"{flag} {path!r} is {what} this command reads: writing it would replace it; name another file"
                )


def _compile_inputs(args: argparse.Namespace) -> dict[str, str]:
    """The files ``moirai compile`` reads, by what they are: the factory's .py file, the cluster file, the
    calibration file."""
    module = args.factory.rpartition(":")[0]
    factory_file = module if module and Path(module).is_file() else _module_file(module)
    inputs = {"the factory's file": factory_file} if factory_file else {}
    if args.cluster is not None and Path(args.cluster).is_file():
        inputs["the cluster file"] = args.cluster
    if args.calibration not in ("auto", "none", "remeasure") and Path(args.calibration).is_file():
        inputs["the calibration file"] = args.calibration
    return inputs


def _module_file(module_name: str) -> str | None:
    """The file a module name (``my_models``, ``pkg.models``) imports from the current directory or the path, where
    it finds one (a dotted name's packages are imported to look)."""
    if not module_name:
        return None
    if "" not in sys.path:
        sys.path.insert(0, "")  # as _import looks
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # no such module, or a name that is none: _import says so
        return None
    return found.origin if found is not None and found.has_location else None


def _device_list(devices: str) -> list[str]:
    names = [name.strip() for name in devices.split(",")]
    if not any(names):
        raise ClusterError(f"--devices {devices!r}: give at least one device, e.g. --devices cpu,cpu")
    if not all(names):
        raise ClusterError(
            f"--devices {devices!r}: device {names.index('') + 1} of the list is empty; give a name between every two "
            "commas, e.g. --devices cpu,cpu"
        )
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


def _load_factory(spec: str) -> tuple[torch.nn.Module, tuple, dict[str, Any]]:
    """Import ``MODULE:FACTORY``, call it, and return ``(model, example_inputs, example_kwargs)``: it returns the
    first two, all three (a model with keyword inputs), or a model with an ``example_inputs`` attribute."""
    module_name, _, factory_name = spec.rpartition(":")
    if not module_name or not factory_name:
        raise MoiraiError(f"{spec!r} is not MODULE:FACTORY (e.g. mymodels.py:make_model or mypackage.models:make)")
    module = _import(module_name)
    if not hasattr(module, factory_name):
        raise MoiraiError(f"{module_name} has no function {factory_name!r}")
    factory = getattr(module, factory_name)
    if not callable(factory):
        raise MoiraiError(
            f"{spec} is not callable (it is {type(factory).__name__} {repr(factory)[:40]}); name a function (or "
            "class) that returns "
            "(model, example_inputs)"
        )
    try:
        made = factory()
    except Exception as error:  # the user's code: report it on one line like our own errors
        raise MoiraiError(f"{spec}() raised {type(error).__name__}: {error}") from error
    example_kwargs: Any = {}
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], torch.nn.Module):
        model, example_inputs, *rest = made
        example_kwargs = rest[0] if rest else {}
    elif isinstance(made, torch.nn.Module) and hasattr(made, "example_inputs"):
        model, example_inputs = made, made.example_inputs
    else:
        shape = f"a tuple of {len(made)}" if isinstance(made, tuple) else type(made).__name__
        raise MoiraiError(
            f"{spec}() must return (model, example_inputs), (model, example_inputs, example_kwargs) or a model with "
            f"an example_inputs attribute, not {shape}"
        )
    if not isinstance(example_kwargs, dict):
        raise MoiraiError(
            f"{spec}() gave example_kwargs of type {type(example_kwargs).__name__}; give a dict of the model's keyword "
            "inputs, e.g. (model, (x,), {'mask': mask})"
        )
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    elif isinstance(example_inputs, (str, bytes)) or not isinstance(example_inputs, (tuple, list)):
        raise MoiraiError(
            f"{spec}() gave example inputs of type {type(example_inputs).__name__}; give a tensor or a tuple of the "
            "model's inputs, e.g. (model, (torch.randn(4, 32),))"
        )
    example_inputs = tuple(example_inputs)
    return model.eval(), example_inputs, example_kwargs


def _import(module_name: str) -> Any:
    """A module by name (from the current directory too), or a ``.py`` file by path."""
    if Path(module_name).is_dir():
        raise MoiraiError(f"cannot import {module_name}: it is a folder; name the .py file that defines the factory")
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
    except ModuleNotFoundError as error:
        parts = module_name.split(".")
        if error.name not in {".".join(parts[: i + 1]) for i in range(len(parts))}:  # one the module imports
            raise MoiraiError(f"cannot import {module_name}: {type(error).__name__}: {error}") from error
        # A path that is not there, or a mistyped module: say both, for a name such as tiny.txt or models/net
        raise MoiraiError(
            f"cannot import {module_name}: {error}, and there is no file {module_name!r}; name an existing .py file "
            "or an importable module"
        ) from error
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
