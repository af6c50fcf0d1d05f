"""Command line: ``moirai demo``, ``moirai plan problem.json``, ``moirai placers``, ``moirai calibrate``."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

import moirai
from moirai import calibrate as calibrate_command
from moirai.errors import MoiraiError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moirai", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="plan a bundled model on a bundled cluster, run it split, check outputs")
    demo.add_argument("--placer", default="milp")
    demo.add_argument("--time-limit", type=float, default=20.0, help="seconds the milp placer may take")
    plan = commands.add_parser("plan", help="place a Problem given as JSON and print the plan")
    plan.add_argument("problem", help="path of a Problem JSON file (see README)")
    plan.add_argument("--placer", default="heft")
    plan.add_argument("--output", help="write the plan as JSON here")
    commands.add_parser("placers", help="list the registered placers")
    calibrate_command.add_arguments(
        commands.add_parser("calibrate", help="measure links between local ranks, write a cluster file")
    )
    args = parser.parse_args(argv)
    console = Console()
    try:
        if args.command == "demo":
            return 0 if moirai.demo.run_demo(args.placer, console, args.time_limit) else 1
        if args.command == "plan":
            return _plan(args, console)
        if args.command == "calibrate":
            return calibrate_command.run(args, console)
        console.print("\n".join(moirai.list_placers()))
        return 0
    except MoiraiError as error:
        console.print(f"[red]error[/]: {error}")
        return 2


def _plan(args: argparse.Namespace, console: Console) -> int:
    import json
    from pathlib import Path

    problem = moirai.Problem.from_json(args.problem)
    plan = moirai.place(problem, placer=args.placer)
    table = Table(title=f"{args.placer} on {args.problem}")
    table.add_column("device")
    table.add_column("tasks", justify="right")
    for k, name in enumerate(problem.device_names):
        table.add_row(name, str(int((plan.placement == k).sum())))
    table.caption = f"makespan {plan.makespan_s:.6g} s, lower bound {moirai.lower_bound(problem):.6g} s"
    console.print(table)
    if args.output:
        Path(args.output).write_text(json.dumps(plan.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
