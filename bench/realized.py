"""Predicted against realized: do split programs run as fast as the simulator says?

For every bench zoo "small" model, two Hugging Face models built from configs (DistilBERT with
dim 256 and 4 layers on 8 x 64 tokens, GPT-2 with the small config on 1 x 64 tokens) and a model
with two heavy parallel branches (two 6-layer 1024-wide MLPs on a batch of 256), and the placers
``single``, ``heft`` and ``milp``, on two logical CPU devices (``moirai.compile(model, ["cpu",
"cpu"], cost="measured")``: profiles and link calibration of this machine, cached; ``--devices cuda:0 cpu`` for a
GPU and the CPU):

* eager: the original model in this process with one thread (median of the repeats after warm-up);
* predicted: the plan's simulated latency;
* measured: the median of the calls through one persistent
  :class:`moirai.runtime.distributed.DistributedRunner` per model (two worker processes), after
  warm-up, in ``--rounds`` rounds of ``--repeats`` calls of every plan of the model in turn;
* measured / predicted, speedup over eager (eager / measured), the plan's number of transfers and
  the CPU time they take from their senders and receivers by the calibration (the schedule books
  each on its device);
* whether the split outputs equal the model's; a plan identical to an earlier placer's (say milp's
  and single's, both one device in graph order) is that placer's program, timed once for both.

One more row runs the milp plan of the two-branch model (``--torchrun-model`` picks another) the
way a deployment does: the plan is saved, and ``torchrun --nproc-per-node 2`` starts two ranks that
each load it and call ``CompiledModel.run_rank``; rank 0 times the calls.

Targets (issue "Split programs that run as fast as the plan says"): every row measured within
+-15% of predicted; milp measured <= single measured (+2%); the two-branch model >= 1.4x faster
than eager. They are printed as checks, not asserted: timings depend on the machine and its load.

Run::

    python bench/realized.py --quick            # smoke run: two models, few repeats, short solver limit
    python bench/realized.py --output realized.md  # every model; also writes the table as markdown
    python bench/realized.py --models two_branch_mlp distilbert --placers single milp
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

if __package__ in (None, ""):
    # Run as ``python bench/realized.py``: make the repository root importable, as ``python -m bench.realized`` does.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moirai  # noqa: E402
from bench.models import build, model_sizes  # noqa: E402
from bench.run import machine_description, markdown_table, write_section  # noqa: E402
from moirai.cluster.calibration import link_kind, local_calibration  # noqa: E402
from moirai.planning.simulate import simulate  # noqa: E402
from moirai.runtime.distributed import DistributedRunner  # noqa: E402

DEVICES = ("cpu", "cpu")  # the default of --devices
PLACERS = ("single", "heft", "milp")
WITHIN_PREDICTED = 0.15
MILP_NOISE = 0.02
TWO_BRANCH_SPEEDUP = 1.4
COLUMNS = (
    "model",
    "placer",
    "transfers",
    "transfer CPU ms",
    "eager ms",
    "predicted ms",
    "measured ms",
    "measured/predicted",
    "speedup vs eager",
    "outputs",
)

ModelMaker = Callable[[], tuple[nn.Module, tuple, dict[str, Any]]]


class TwoBranchMLP(nn.Module):
    """Two independent ``depth``-layer MLPs on the same input, summed: two branches a plan can run in parallel."""

    def __init__(self, width: int = 1024, depth: int = 6) -> None:
        super().__init__()

        def branch() -> nn.Sequential:
            return nn.Sequential(*(layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.ReLU())))

        self.left, self.right = branch(), branch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) + self.right(x)


def _two_branch_mlp() -> tuple[nn.Module, tuple, dict[str, Any]]:
    return TwoBranchMLP().eval(), (torch.randn(256, 1024),), {}


def _distilbert() -> tuple[nn.Module, tuple, dict[str, Any]]:
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(dim=256, n_layers=4, n_heads=4, hidden_dim=1024)
    return DistilBertModel(config).eval(), (torch.randint(0, config.vocab_size, (8, 64)),), {}


def _gpt2() -> tuple[nn.Module, tuple, dict[str, Any]]:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(use_cache=False)  # the small (124M) configuration; trace takes tensor inputs only
    return GPT2Model(config).eval(), (torch.randint(0, config.vocab_size, (1, 64)),), {}


def _zoo(name: str) -> ModelMaker:
    return lambda: build(name, "small")


MODELS: dict[str, ModelMaker] = {
    **{name: _zoo(name) for name, _ in model_sizes(paper_sizes=False)},
    "distilbert": _distilbert,
    "gpt2": _gpt2,
    "two_branch_mlp": _two_branch_mlp,
}
QUICK_MODELS = ("transformer", "two_branch_mlp")


def make_model(name: str) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """The model, with weights that depend only on its name (every torchrun rank builds the same one)."""
    torch.manual_seed(0)
    return MODELS[name]()


@dataclass
class Row:
    model: str
    placer: str
    transfers: int | None = None
    transfer_cpu_s: float | None = None
    eager_s: float | None = None
    predicted_s: float | None = None
    measured_s: float | None = None
    outputs_match: bool | None = None
    error: str = ""
    same_program_as: str = ""  # an earlier placer whose plan this one is, timed once for both

    def cells(self) -> list[str]:
        def ms(seconds: float | None) -> str:
            return "-" if seconds is None else f"{seconds * 1e3:.2f}"

        ratio = f"{self.measured_s / self.predicted_s:.2f}" if self.measured_s and self.predicted_s else "-"
        speedup = f"{self.eager_s / self.measured_s:.2f}x" if self.measured_s and self.eager_s else "-"
        outputs = self.error or {None: "-", True: "equal", False: "DIFFER"}[self.outputs_match]
        if self.same_program_as and self.same_program_as != self.placer:
            outputs += f" ({self.same_program_as}'s program)"
        transfers = "-" if self.transfers is None else str(self.transfers)
        return [
            self.model,
            self.placer,
            transfers,
            ms(self.transfer_cpu_s),
            ms(self.eager_s),
            ms(self.predicted_s),
            ms(self.measured_s),
            ratio,
            speedup,
            outputs,
        ]


def timed_s(call: Callable[[], Any], warmup: int, repeats: int, warmup_s: float = 0.0) -> list[float]:
    """Seconds of each of ``repeats`` calls after ``warmup`` calls and at least ``warmup_s`` seconds of calls."""
    started = time.perf_counter()
    calls = 0
    while calls < warmup or time.perf_counter() - started < warmup_s:
        call()
        calls += 1
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def median_time_s(call: Callable[[], Any], warmup: int, repeats: int, warmup_s: float = 0.0) -> float:
    """Median of ``repeats`` calls after ``warmup`` calls and at least ``warmup_s`` seconds of calls."""
    return statistics.median(timed_s(call, warmup, repeats, warmup_s))


def bench_model(name: str, placers: Sequence[str], args: argparse.Namespace, console: Console) -> list[Row]:
    """Eager, then every placer's plan through one persistent runner.

    Every plan is compiled before the runner starts, as a server compiles and then serves: tracing and
    the MILP's solver threads in this process (rank 0) would otherwise share its core with the calls
    that follow. Each plan is warmed up for ``--warmup-s`` seconds in the runner before it is timed:
    the first calls of a fresh runner (its allocations, gloo's connections) ran up to 1.5x slower. The
    plans are then timed round by round in turn: identical plans timed one after the other measured up
    to 13% apart. A plan identical to an earlier placer's (placement and orders) is the same program: it
    is timed once, and its row says whose program it is.
    """
    model, inputs, kwargs = make_model(name)
    with torch.no_grad():
        expected = model(*inputs, **kwargs)
        eager_s = median_time_s(lambda: model(*inputs, **kwargs), args.warmup, args.repeats, args.warmup_s)
    rows, compiled_plans = [], {}
    for placer in placers:
        row = Row(name, placer, eager_s=eager_s)
        rows.append(row)
        try:
            options = {"time_limit_s": args.time_limit} if placer == "milp" else {}
            compiled = moirai.compile(
                model,
                args.devices,
                example_inputs=inputs,
                example_kwargs=kwargs,
                placer=placer,
                cost="measured",
                **options,
            )
            row.predicted_s = compiled.plan.makespan_s
            row.transfers, row.transfer_cpu_s = plan_transfers(compiled)
            compiled_plans[placer] = compiled
        except Exception as error:  # a row that fails says why; the other rows still run
            row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
    with DistributedRunner(args.devices, timeout_s=args.call_timeout_s) as runner:
        calls: dict[str, Callable[[], Any]] = {}
        program_of: dict[tuple, str] = {}  # a plan's placement and orders -> the first placer that made it
        for row in rows:
            compiled = compiled_plans.get(row.placer)
            if compiled is None:
                continue
            plan = compiled.plan
            key = (tuple(plan.placement.tolist()), plan.order, tuple(sorted((plan.transfer_order or {}).items())))
            row.same_program_as = program_of.setdefault(key, row.placer)
            if row.same_program_as != row.placer:
                continue
            try:
                flat_inputs = compiled.traced.flatten_inputs(inputs, kwargs)
                outputs = runner.run(compiled.program, flat_inputs)
                row.outputs_match = outputs_equal(compiled.traced.unflatten_outputs(outputs), expected)
                calls[row.placer] = lambda c=compiled, f=flat_inputs: runner.run(c.program, f)
                timed_s(calls[row.placer], args.warmup, 0, args.warmup_s)
            except Exception as error:
                row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
        # Round by round, every plan in turn: a drift of the machine's speed hits all plans of the model alike.
        times: dict[str, list[float]] = {placer: [] for placer in calls}
        for _ in range(args.rounds):
            for placer, call in calls.items():
                times[placer] += timed_s(call, 1, args.repeats)
        for row in rows:
            timed = times.get(row.same_program_as or row.placer)
            if timed:
                row.measured_s = statistics.median(timed)
                if row.same_program_as != row.placer:
                    twin = next(r for r in rows if r.placer == row.same_program_as)
                    row.outputs_match = twin.outputs_match
            console.print(f"  {name} / {row.placer}: {' | '.join(row.cells()[2:])}")
    return rows


def plan_transfers(compiled: moirai.CompiledModel) -> tuple[int, float]:
    """The plan's number of transfers, and the CPU time they take from senders and receivers together
    by this machine's calibration (the sender's part is in the plan's prediction, booked on its device)."""
    torch_devices = [d.torch_device for d in compiled.cluster.devices]
    costs = local_calibration(torch_devices)
    transfers = simulate(compiled.problem, compiled.plan).transfers
    cpu_s = 0.0
    for transfer in transfers:
        cost = costs[link_kind(torch_devices[transfer.src], torch_devices[transfer.dst])]
        size = compiled.problem.tensor_bytes[transfer.tensor]
        cpu_s += cost.sender_cpu_time_s(size) + cost.receiver_cpu_time_s(size)
    return len(transfers), cpu_s


def outputs_equal(actual: Any, expected: Any) -> bool:
    try:  # a split program's outputs are where their last op ran, on cuda:N for some plans
        actual = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.cpu, actual)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    except AssertionError:
        return False
    return True


# --- the torchrun row --------------------------------------------------------------------------


def bench_torchrun(name: str, args: argparse.Namespace, eager_s: float | None) -> Row:
    """The milp plan of ``name`` saved, loaded by two torchrun ranks, and called through ``run_rank``."""
    model, inputs, kwargs = make_model(name)
    if eager_s is None:
        with torch.no_grad():
            eager_s = median_time_s(lambda: model(*inputs, **kwargs), args.warmup, args.repeats, args.warmup_s)
    row = Row(name, "milp (torchrun)", eager_s=eager_s)
    compiled = moirai.compile(
        model,
        args.devices,
        example_inputs=inputs,
        example_kwargs=kwargs,
        placer="milp",
        cost="measured",
        time_limit_s=args.time_limit,
    )
    row.predicted_s = compiled.plan.makespan_s
    row.transfers, row.transfer_cpu_s = plan_transfers(compiled)
    with tempfile.TemporaryDirectory(prefix="moirai-realized-") as directory:
        plan_path, report_path = Path(directory, "plan.json"), Path(directory, "report.json")
        compiled.save(plan_path)
        ranks = str(len(args.devices))
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks]
        command = [
            *torchrun,
            str(Path(__file__).resolve()),
            "--serve-rank",
            str(plan_path),
            "--report",
            str(report_path),
            "--models",
            name,
            "--warmup",  # both ranks make the same number of calls: the warm-up time as a count
            str(max(args.warmup, math.ceil(args.warmup_s / row.predicted_s))),
            "--repeats",
            str(args.repeats),
            "--devices",
            *args.devices,
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.torchrun_timeout_s)
        if result.returncode != 0:
            row.error = f"torchrun failed: {(result.stderr.strip().splitlines() or ['?'])[-1][:80]}"
            return row
        report = json.loads(report_path.read_text())
    row.measured_s, row.outputs_match = report["median_s"], report["outputs_match"]
    return row


def serve_rank(plan_path: str, report_path: str, name: str, warmup: int, repeats: int, devices: list[str]) -> None:
    """One torchrun rank: load the plan, call ``run_rank`` as often as rank 0 does; rank 0 times the calls."""
    rank = int(os.environ["RANK"])
    model, inputs, kwargs = make_model(name)
    compiled = moirai.load(plan_path, model, example_inputs=inputs, example_kwargs=kwargs, devices=devices)
    if rank != 0:
        for _ in range(1 + warmup + repeats):
            compiled.run_rank()
    else:
        with torch.no_grad():
            expected = model(*inputs, **kwargs)
        match = outputs_equal(compiled.run_rank(*inputs, **kwargs), expected)
        median_s = median_time_s(lambda: compiled.run_rank(*inputs, **kwargs), warmup, repeats)
        Path(report_path).write_text(json.dumps({"median_s": median_s, "outputs_match": match}))
    torch.distributed.destroy_process_group()


# --- checks and output --------------------------------------------------------------------------


def checks(rows: list[Row]) -> list[str]:
    """The issue's targets, each as a line saying whether this run met it."""
    lines = []
    measured = [r for r in rows if r.measured_s and r.predicted_s]
    off = [r for r in measured if abs(r.measured_s / r.predicted_s - 1) > WITHIN_PREDICTED]
    lines.append(
        f"measured within +-{WITHIN_PREDICTED:.0%} of predicted: {len(measured) - len(off)} of {len(measured)} rows"
        + (f" (not: {', '.join(f'{r.model}/{r.placer}' for r in off)})" if off else "")
    )
    by_key = {(r.model, r.placer): r for r in measured}
    for model in dict.fromkeys(r.model for r in rows):
        milp, single = by_key.get((model, "milp")), by_key.get((model, "single"))
        if milp and single:
            verdict = "yes" if milp.measured_s <= single.measured_s * (1 + MILP_NOISE) else "NO"
            lines.append(
                f"{model}: milp measured {milp.measured_s * 1e3:.2f} ms <= single {single.measured_s * 1e3:.2f} ms "
                f"(+{MILP_NOISE:.0%}): {verdict}"
            )
    two_branch = by_key.get(("two_branch_mlp", "milp"))
    if two_branch and two_branch.eager_s:
        speedup = two_branch.eager_s / two_branch.measured_s
        verdict = "yes" if speedup >= TWO_BRANCH_SPEEDUP else "NO"
        lines.append(f"two_branch_mlp milp {speedup:.2f}x faster than eager (target {TWO_BRANCH_SPEEDUP}x): {verdict}")
    return lines


def write_results(
    path: Path, command: str, devices: list[str], rows: list[Row], check_lines: list[str], elapsed_s: float
) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = "\n\n".join(
        [
            f"Command: `{command}`  \nMachine: {machine_description()}  \nDevices {devices}, "
            f"cost='measured' (profiles and the link calibration of this machine); eager: median of the repeats "
            f"after warm-up; measured: median of all calls of a plan, the model's plans timed round by round in turn "
            f"after warm-up; whole run {elapsed_s:.0f} s.",
            markdown_table(COLUMNS, [r.cells() for r in rows]),
            "\n".join(f"- {line}" for line in check_lines),
        ]
    )
    write_section(path, f"Predicted against realized latency (`bench/realized.py`), {now}", section)


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
    parser.add_argument("--placers", nargs="+", default=list(PLACERS))
    parser.add_argument("--devices", nargs="+", default=list(DEVICES), help="torch devices, e.g. cuda:0 cpu")
    parser.add_argument("--quick", action="store_true", help="smoke run: two models, 3 + 5 repeats, 5 s milp")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup-s", type=float, default=1.0, help="least seconds of warm-up calls per plan")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --repeats calls of every plan in turn")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds the milp placer may take")
    parser.add_argument("--torchrun-model", default="two_branch_mlp", help="model of the torchrun row")
    parser.add_argument("--no-torchrun", action="store_true")
    parser.add_argument("--call-timeout-s", type=float, default=120.0)
    parser.add_argument("--torchrun-timeout-s", type=float, default=600.0)
    parser.add_argument("--output", type=Path, help="also write the table as a markdown section to this file")
    parser.add_argument("--serve-rank", help=argparse.SUPPRESS)  # internal: a torchrun rank
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.models = args.models or list(QUICK_MODELS)
        args.warmup, args.repeats, args.time_limit, args.warmup_s, args.rounds = 2, 5, min(args.time_limit, 5.0), 0.0, 1
    args.models = args.models or list(MODELS)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_arguments(argv)
    # Eager runs and profiles use one thread, as each pinned worker does.
    torch.set_num_threads(1)
    if args.serve_rank:
        serve_rank(args.serve_rank, args.report, args.models[0], args.warmup, args.repeats, args.devices)
        return
    console = Console(width=max(Console().width, 170))  # the table's ten columns, also when piped
    started = time.perf_counter()
    rows: list[Row] = []
    for name in args.models:
        console.print(f"[bold]{name}[/]")
        rows += bench_model(name, args.placers, args, console)
    if not args.no_torchrun:
        eager_s = next((r.eager_s for r in rows if r.model == args.torchrun_model), None)
        rows.append(bench_torchrun(args.torchrun_model, args, eager_s))
    table = Table(title=f"predicted against realized latency on {args.devices}")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("model", "placer", "outputs") else "right")
    for row in rows:
        table.add_row(*row.cells())
    console.print(table)
    check_lines = checks(rows)
    console.print("\n".join(check_lines))
    if args.output is not None:
        command = "python bench/realized.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_results(args.output, command.strip(), args.devices, rows, check_lines, time.perf_counter() - started)


if __name__ == "__main__":
    main()
