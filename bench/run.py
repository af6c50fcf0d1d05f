"""The bench runner: zoo models x clusters x objectives x placers -> simulated objective, ratio to contiguous,
speedup, gap, placement time, memory.

Per model: trace on the meta device (paper sizes) or CPU (small sizes) -> OpGraph -> coarsen with the
fusion rules (``--target-nodes`` also merges to a size; ``--no-coarsen`` keeps the original graph).
Per cluster: ``moirai.cluster.cost.build_problem`` (analytic costs).
Per objective (``latency``: one request's makespan; ``throughput``: the period of pipelined requests) and placer:
``moirai.planning.placers.place(problem, placer, objective=...)``; every value is the simulator's. A placer that
raises ``InfeasibleError`` is shown as "does not fit"; any other exception is shown as an error in its row.
``--layered`` adds a family of random layered DAGs (200-2,000 tasks, 4-14 identical devices) whose best throughput
is known, a contiguous split (:mod:`bench.known_split`); its bound column is that optimum.

Columns: the objective's value, the plan's latency, its ratio to ``contiguous``'s value (the contiguous-split DP,
the published baseline), speedup (the reference placer's value / this one's), gap to the objective's lower bound
((value - bound) / value; a throughput row's bound is the load bound, or with ``--period-bound S`` the period
program's proven bound where higher: [Note: the period bound]), placement time, the process's peak RSS while the
placer ran (sampled every 5 ms; it includes the traced model, the graph and memory earlier rows left to the
allocator) and its growth during the placer (what the placer needed beyond that). After the table, the targets: milp
at most every baseline on every row.

Run::

    python bench/run.py --quick --output quick.md      # a few minutes; also writes the tables as markdown
    python bench/run.py --quick --layered --objectives throughput   # the known-optimum family too
    python bench/run.py                                # every small model x every placer, paper sizes x fast placers
    python bench/run.py --models gpt3:13B swin --clusters moirai-intra-server --placers heft m_sct milp \\
        --time-limit 120
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import platform
import shlex
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import psutil
import torch
from rich.console import Console
from rich.table import Table

if __package__ in (None, ""):
    # Run as ``python bench/run.py``: make the repository root importable, as ``python -m bench.run`` does.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.known_split import known_split_problem  # noqa: E402
from bench.models import ZOO, build, model_sizes, size_spec  # noqa: E402
from moirai.cluster.cost import build_problem  # noqa: E402
from moirai.cluster.devices import Cluster  # noqa: E402
from moirai.errors import InfeasibleError, MoiraiError  # noqa: E402
from moirai.frontend.coarsen import coarsen  # noqa: E402
from moirai.frontend.graph import OpGraph, build_op_graph  # noqa: E402
from moirai.frontend.trace import trace  # noqa: E402
from moirai.planning.objective import as_objective  # noqa: E402
from moirai.planning.placers import get_placer, list_placers, place  # noqa: E402
from moirai.planning.plan import Plan  # noqa: E402
from moirai.planning.problem import Problem  # noqa: E402
from moirai.planning.solve.period_windows import period_lower_bound  # noqa: E402

PAPER_CLUSTERS = ("moirai-inter-server", "moirai-intra-server")
# Solver-based placers with a time limit: run on small models by default, on paper sizes only when named.
SLOW_PLACERS = ("pesto", "milp")
QUICK_MODELS = ("gpt3:small", "googlenet:small", "transformer:small", "evoformer:small", "gpt3:330M")
DEFAULT_TIME_LIMIT_S = 30.0
QUICK_TIME_LIMIT_S = 5.0
OBJECTIVES_RUN = ("latency", "throughput")
BASELINE = "contiguous"  # every row's ratio is to this placer's value
# The layered family with a known optimum: (tasks, devices), seed 0; and the placers run on it. contiguous's
# throughput DP grows fast with the member (its times: bench/RESULTS.md section 1).
LAYERED_FAMILY = ((200, 4), (500, 6), (1000, 8), (2000, 14))
LAYERED_PLACERS = ("milp", "contiguous", "pipeline", "heft", "getf", "m_sct")
RSS_SAMPLE_PERIOD_S = 0.005


@dataclass(frozen=True)
class ModelGraph:
    """A traced zoo model and the graph the placers see."""

    name: str
    size: str
    parameters: int
    original_ops: int
    graph: OpGraph
    coarsening: str
    prepare_s: float


@dataclass(frozen=True)
class Row:
    """One placer on one model and cluster.

    ``status``: "ok", "exceeds memory: ..." (a plan from a placer that ignores memory), "does not fit"
    (the placer found no plan within memory) or "error: ...".
    """

    model: str
    cluster: str
    objective: str
    placer: str
    status: str
    objective_s: float | None = None  # the simulated value of the objective the placer was asked for
    latency_s: float | None = None
    placement_s: float | None = None
    peak_rss_bytes: float | None = None
    rss_growth_bytes: float | None = None
    lower_bound_s: float | None = None
    speedup: float | None = None
    to_baseline: float | None = None  # objective_s over the BASELINE placer's on the same problem and objective

    @property
    def gap(self) -> float | None:
        if self.objective_s is None or self.lower_bound_s is None or self.objective_s == 0:
            return None
        return (self.objective_s - self.lower_bound_s) / self.objective_s


class PeakRss:
    """Peak resident memory of this process while the ``with`` block runs, sampled by a thread.

    ``growth_bytes`` is the peak minus the resident memory at entry: what the block itself needed
    beyond memory the process already held (freed memory the allocator kept is reused first).
    """

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._stop = threading.Event()
        self.start_bytes = 0
        self.peak_bytes = 0

    @property
    def growth_bytes(self) -> int:
        return self.peak_bytes - self.start_bytes

    def __enter__(self) -> PeakRss:
        self.start_bytes = self.peak_bytes = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_PERIOD_S):
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)


def parse_model_specs(specs: list[str]) -> list[tuple[str, str]]:
    """``name:size`` picks one size; a bare ``name`` picks every size of that family."""
    chosen = []
    for spec in specs:
        name, _, size = spec.partition(":")
        sizes = [size] if size else list(ZOO[name].sizes) if name in ZOO else [""]
        for one in sizes:
            size_spec(name, one)
            chosen.append((name, one))
    return chosen


def prepare_model(name: str, size: str, no_coarsen: bool, target_nodes: int | None) -> ModelGraph:
    start = time.perf_counter()
    spec = size_spec(name, size)
    model, args, kwargs = build(name, size, device="meta" if spec.paper_size else "cpu")
    graph = build_op_graph(trace(model, args, kwargs))
    original_ops = len(graph.nodes)
    coarsening = "none"
    if not no_coarsen:
        graph = coarsen(graph, rules="default", target_nodes=target_nodes).graph
        coarsening = "fusion rules" + (f" + merge to {target_nodes}" if target_nodes else "")
    parameters = sum(p.numel() for p in model.parameters())
    return ModelGraph(name, size, parameters, original_ops, graph, coarsening, time.perf_counter() - start)


def placer_options(placer: str, time_limit_s: float) -> dict[str, float]:
    """Pass the time limit to the placers that take one."""
    accepts = inspect.signature(get_placer(placer)).parameters
    return {"time_limit_s": time_limit_s} if "time_limit_s" in accepts else {}


def run_placer(
    problem: Problem,
    placer: str,
    model: str,
    cluster: str,
    objective: str,
    time_limit_s: float,
    bound_s: float | None,
) -> Row:
    try:
        with PeakRss() as rss:
            plan = place(problem, placer, objective=objective, **placer_options(placer, time_limit_s))
    except InfeasibleError:
        return Row(model, cluster, objective, placer, "does not fit", lower_bound_s=bound_s)
    except Exception as error:  # a broken placer is a row of the table, not the end of the run
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        status = f"error: {type(error).__name__}: {message[:80]}"
        return Row(model, cluster, objective, placer, status, lower_bound_s=bound_s)
    status = memory_status(problem, plan)
    return Row(
        model,
        cluster,
        objective,
        placer,
        status,
        plan.objective_s,
        plan.makespan_s,
        plan.placement_time_s,
        rss.peak_bytes,
        rss.growth_bytes,
        bound_s,
    )


def memory_status(problem: Problem, plan: Plan) -> str:
    """The status "ok", or the devices holding more than their memory (placers that ignore it, e.g. round_robin)."""
    held = np.bincount(plan.placement, weights=problem.memory_bytes, minlength=problem.num_devices)
    over = [
        f"{problem.device_names[k]} {held[k] / 1e9:.1f}/{problem.memory_capacity_bytes[k] / 1e9:.1f} GB"
        for k in np.flatnonzero(held > problem.memory_capacity_bytes)
    ]
    return "ok" if not over else "exceeds memory: " + ", ".join(over)


def objective_bound_s(problem: Problem, objective: str) -> float | None:
    """The objective's lower bound on ``problem`` (None where the model fits nowhere: every placer will say so)."""
    try:
        return as_objective(objective).lower_bound_s(problem)
    except InfeasibleError:
        return None


def period_bound_s(problem: Problem, time_limit_s: float) -> float:
    """The period program's proven bound on every placement's period (:func:`period_lower_bound`), from
    contiguous's plan."""
    start = place(problem, BASELINE, objective="throughput").placement
    return period_lower_bound(problem, start, time_limit_s).bound_s


def with_speedups(rows: list[Row], reference: str) -> list[Row]:
    """Each row with its speedup over ``reference`` and its ratio to BASELINE on the same problem and objective."""

    def values(placer: str) -> dict[tuple[str, str, str], float]:
        return {
            (r.model, r.cluster, r.objective): r.objective_s
            for r in rows
            if r.placer == placer and r.objective_s is not None
        }

    reference_value, baseline_value = values(reference), values(BASELINE)
    result = []
    for r in rows:
        key = (r.model, r.cluster, r.objective)
        base, baseline = reference_value.get(key), baseline_value.get(key)
        speedup = base / r.objective_s if base is not None and r.objective_s else None
        to_baseline = r.objective_s / baseline if baseline and r.objective_s is not None else None
        result.append(replace(r, speedup=speedup, to_baseline=to_baseline))
    return result


def target_lines(rows: list[Row]) -> list[str]:
    """The issue's targets, per objective: milp at most every other placer's value on every problem that fits, and
    milp's ratio to contiguous (at most 1.00 everywhere for throughput)."""
    lines = []
    for objective in sorted({r.objective for r in rows}):
        problems = sorted({(r.model, r.cluster) for r in rows if r.objective == objective})
        beaten, ratios, compared = [], [], 0
        for model, cluster in problems:
            same = [r for r in rows if (r.model, r.cluster, r.objective) == (model, cluster, objective)]
            milp = next((r for r in same if r.placer == "milp" and r.status == "ok"), None)
            if milp is None or milp.objective_s is None:
                continue
            compared += 1
            if milp.to_baseline is not None:
                ratios.append(milp.to_baseline)
            for other in same:
                if other.placer != "milp" and other.status == "ok" and other.objective_s is not None:
                    ratio = milp.objective_s / other.objective_s
                    if ratio > 1 + 1e-9:
                        beaten.append(f"{model} / {cluster}: milp {ratio:.4f}x {other.placer}'s")
        ratio_text = (
            f"milp / {BASELINE}: min {min(ratios):.3f}, median {float(np.median(ratios)):.3f}, max {max(ratios):.3f}"
            if ratios
            else f"no {BASELINE} rows"
        )
        lost = len({line.split(": milp ")[0] for line in beaten})
        lines.append(f"{objective}: milp beaten on {lost} of {compared} problems with a milp row; {ratio_text}")
        lines += [f"  beaten on {line}" for line in beaten]
        if objective == "latency":
            lines.append(_room_line([r for r in rows if r.objective == objective], problems))
        if objective == "throughput":
            lines.append(_non_contiguous_line([r for r in rows if r.objective == objective], problems))
    return lines


NON_CONTIGUOUS_TARGET = 0.98  # throughput: milp below this times contiguous where the optimum is not contiguous


def _non_contiguous_line(rows: list[Row], problems: list[tuple[str, str]]) -> str:
    """How often milp is below ``NON_CONTIGUOUS_TARGET`` times ``contiguous`` on the problems whose optimum is not
    contiguous, as far as a plan shows it (milp's plan shorter than the best contiguous split), and whose load
    bound leaves that room (below the target times ``contiguous``); the others are listed apart."""
    met, shown, no_room = [], [], []
    for model, cluster in problems:
        same = {r.placer: r for r in rows if (r.model, r.cluster) == (model, cluster) and r.status == "ok"}
        milp, contiguous = same.get("milp"), same.get(BASELINE)
        if milp is None or contiguous is None or not milp.objective_s or not contiguous.objective_s:
            continue
        ratio = milp.objective_s / contiguous.objective_s
        if ratio >= 1 - 1e-9:
            continue
        text = f"{model}/{cluster} {ratio:.4f}"
        bound_s = milp.lower_bound_s
        if bound_s is not None and bound_s >= NON_CONTIGUOUS_TARGET * contiguous.objective_s:
            no_room.append(f"{text}, bound {bound_s / contiguous.objective_s:.4f}")
            continue
        shown.append(text)
        met += [model] if ratio < NON_CONTIGUOUS_TARGET else []
    return (
        f"  milp < {NON_CONTIGUOUS_TARGET:.2f}x {BASELINE} where the optimum is not contiguous and the bound leaves "
        f"room: {len(met)} of {len(shown)}"
        + (f" ({', '.join(shown)})" if shown else "")
        + (f"; no room (the bound over {BASELINE}): {'; '.join(no_room)}" if no_room else "")
    )


ROOM_TARGET = 0.90  # latency: milp at most this times the best other placer, where the lower bound allows it


def _room_line(rows: list[Row], problems: list[tuple[str, str]]) -> str:
    """How often milp is at most ``ROOM_TARGET`` times the best other placer, on the problems whose lower bound
    leaves that room (bound at most ``ROOM_TARGET`` times the best other's value)."""
    met, room = [], []
    for model, cluster in problems:
        same = [r for r in rows if (r.model, r.cluster) == (model, cluster) and r.status == "ok" and r.objective_s]
        milp = next((r for r in same if r.placer == "milp"), None)
        others = [r.objective_s for r in same if r.placer != "milp"]
        if milp is None or not others or milp.lower_bound_s is None:
            continue
        best = min(others)
        if milp.lower_bound_s <= ROOM_TARGET * best:
            room.append(f"{model}/{cluster} {milp.objective_s / best:.3f}")
            met += [model] if milp.objective_s <= ROOM_TARGET * best else []
    return f"  milp <= {ROOM_TARGET:.2f}x the best other where the bound leaves room: {len(met)} of {len(room)}" + (
        f" ({', '.join(room)})" if room else ""
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


MODEL_COLUMNS = ("model", "params", "graph ops", "placed nodes", "Table IV / Fig. 4 ops", "coarsening", "prepare s")
RESULT_COLUMNS = (
    "model",
    "cluster",
    "objective",
    "placer",
    "value ms",
    "latency ms",
    f"/ {BASELINE}",
    "speedup",
    "gap to bound",
    "place s",
    "peak RSS MB",
    "RSS growth MB",
    "status",
)


def model_cells(m: ModelGraph) -> list[str]:
    paper = size_spec(m.name, m.size).paper_ops
    paper_text = "-" if paper is None else f"{paper.original} / {paper.coarsened or '-'}"
    return [
        f"{m.name}:{m.size}",
        f"{m.parameters / 1e6:.1f}M",
        str(m.original_ops),
        str(len(m.graph.nodes)),
        paper_text,
        m.coarsening,
        f"{m.prepare_s:.1f}",
    ]


def result_cells(r: Row) -> list[str]:
    speedup = "-" if r.speedup is None else f"{r.speedup:.2f}x"
    return [
        r.model,
        r.cluster,
        r.objective,
        r.placer,
        _ms(r.objective_s),
        _ms(r.latency_s),
        _fmt(r.to_baseline, ".4f"),
        speedup,
        _fmt(r.gap, ".1%"),
        _fmt(r.placement_s, ".3f"),
        _fmt(None if r.peak_rss_bytes is None else r.peak_rss_bytes / 2**20, ".0f"),
        _fmt(None if r.rss_growth_bytes is None else r.rss_growth_bytes / 2**20, ".0f"),
        r.status,
    ]


def rich_table(title: str, columns: tuple[str, ...], rows: list[list[str]], group_by: int = 0) -> Table:
    """A table with a rule under every group of rows sharing their first ``group_by`` cells."""
    table = Table(title=title)
    for column in columns:
        left = ("model", "cluster", "objective", "placer", "status")
        table.add_column(column, justify="left" if column in left else "right")
    for row, following in zip(rows, [*rows[1:], None][: len(rows)], strict=True):  # no rows: an empty table
        table.add_row(*row, end_section=following is None or following[:group_by] != row[:group_by])
    return table


def markdown_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gb = psutil.virtual_memory().total / 2**30
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return (
        f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {memory_gb:.0f} GiB RAM, "
        + (f"{', '.join(gpus)}, " if gpus else "")
        + f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def write_results(
    path: Path,
    command: str,
    reference: str,
    time_limit_s: float,
    models: list[ModelGraph],
    rows: list[Row],
    elapsed_s: float,
) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = "\n\n".join(
        [
            f"Command: `{command}`  \nMachine: {machine_description()}  \n"
            f"Reference placer for speedup: `{reference}`; ratios to `{BASELINE}`; solver time limit "
            f"{time_limit_s:g} s; costs: analytic (moirai.cluster.cost); values: moirai.planning.simulate with link "
            f"contention; whole run {elapsed_s:.0f} s.",
            markdown_table(MODEL_COLUMNS, [model_cells(m) for m in models]),
            markdown_table(RESULT_COLUMNS, [result_cells(r) for r in rows]),
            "Targets:\n\n" + "\n".join(f"- {line}" for line in target_lines(rows)),
        ]
    )
    write_section(path, f"Every placer on the zoo models (`bench/run.py`), {now}", section)


def write_section(path: Path, title: str, body: str) -> None:
    """Write ``## title`` and ``body`` to ``path``, replacing it: bench/RESULTS.md is edited by hand from these."""
    path.write_text(f"## {title}\n\n{body}\n")


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few minutes' subset: small models and GPT-3 330M")
    parser.add_argument(
        "--objectives", nargs="+", default=list(OBJECTIVES_RUN), choices=OBJECTIVES_RUN, help="default: both"
    )
    parser.add_argument(
        "--layered",
        action="store_true",
        help=f"also the random layered family with a known optimum: (tasks, devices) in {LAYERED_FAMILY}, "
        f"placers {', '.join(LAYERED_PLACERS)} unless --placers names others",
    )
    parser.add_argument("--layered-max-tasks", type=int, default=2000, help="the family's members up to this size")
    parser.add_argument("--no-zoo", action="store_true", help="no zoo models (with --layered: the family alone)")
    parser.add_argument(
        "--models",
        nargs="+",
        metavar="NAME[:SIZE]",
        help=f"zoo models (default: every size); families: {', '.join(ZOO)}",
    )
    parser.add_argument(
        "--clusters",
        nargs="+",
        default=list(PAPER_CLUSTERS),
        help=f"cluster presets; available: {', '.join(Cluster.presets())}",
    )
    parser.add_argument(
        "--placers",
        nargs="+",
        help=f"default: every registered placer ({', '.join(list_placers())}); "
        f"{', '.join(SLOW_PLACERS)} only on small models unless named",
    )
    parser.add_argument("--reference", default="m_sct", help="placer the speedup is measured against")
    parser.add_argument(
        "--time-limit",
        type=float,
        help=f"seconds for solver placers (pesto, milp, getf); default "
        f"{DEFAULT_TIME_LIMIT_S:g}, {QUICK_TIME_LIMIT_S:g} with --quick",
    )
    parser.add_argument(
        "--period-bound",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="throughput rows' bound: also the period program over every task (a MILP of this many seconds a "
        "problem, from contiguous's plan; 0: the load bound alone)",
    )
    parser.add_argument("--target-nodes", type=int, help="after fusion, merge the graph down to this many nodes")
    parser.add_argument("--no-coarsen", action="store_true", help="place the original graph")
    parser.add_argument("--output", type=Path, help="also write the tables as a markdown section to this file")
    options = parser.parse_args(argv)
    if options.quick:
        options.models = options.models or list(QUICK_MODELS)
    if options.time_limit is None:
        options.time_limit = QUICK_TIME_LIMIT_S if options.quick else DEFAULT_TIME_LIMIT_S
    try:
        options.models = (
            [] if options.no_zoo else parse_model_specs(options.models) if options.models else model_sizes()
        )
        options.clusters = {name: Cluster.preset(name) for name in options.clusters}
        for placer in [*(options.placers or []), options.reference]:
            get_placer(placer)
    except (KeyError, MoiraiError) as error:
        parser.error(str(error).strip("'\""))
    return options


def placers_for(model: ModelGraph, chosen: list[str] | None) -> list[str]:
    if chosen:
        return chosen
    paper_size = size_spec(model.name, model.size).paper_size
    return [p for p in list_placers() if not (paper_size and p in SLOW_PLACERS)]


def layered_rows(
    chosen: list[str] | None,
    objectives: list[str],
    time_limit_s: float,
    max_tasks: int,
    console: Console,
    started: float,
) -> list[Row]:
    """Every placer on the layered family; a throughput row's bound is the family's known optimum."""
    rows = []
    for num_tasks, num_devices in LAYERED_FAMILY:
        for seed in (0,) if num_tasks <= max_tasks else ():
            family = known_split_problem(num_tasks, num_devices, seed)
            model, cluster = f"layered{num_tasks}-s{seed}", f"{num_devices} identical"
            for objective in objectives:
                bound_s = (
                    family.optimum_s if objective == "throughput" else objective_bound_s(family.problem, objective)
                )
                for placer in chosen or LAYERED_PLACERS:
                    with console.status(f"{model} on {cluster}, {objective}: {placer}"):
                        rows.append(
                            run_placer(family.problem, placer, model, cluster, objective, time_limit_s, bound_s)
                        )
            console.print(f"{model} on {cluster} done ({time.perf_counter() - started:.0f} s)")
    return rows


def main(argv: list[str] | None = None) -> None:
    options = parse_arguments(argv)
    console = Console(width=None if sys.stdout.isatty() else 160, emoji=False)
    started = time.perf_counter()
    clusters: dict[str, Cluster] = options.clusters
    models: list[ModelGraph] = []
    rows: list[Row] = []
    for name, size in options.models:
        with console.status(f"tracing and coarsening {name}:{size}"):
            model = prepare_model(name, size, options.no_coarsen, options.target_nodes)
        models.append(model)
        for cluster_name, cluster in clusters.items():
            problem = build_problem(model.graph, cluster)
            for objective in options.objectives:
                bound_s = objective_bound_s(problem, objective)
                if objective == "throughput" and options.period_bound > 0 and bound_s is not None:
                    with console.status(f"{name}:{size} on {cluster_name}: the period bound"):
                        bound_s = max(bound_s, period_bound_s(problem, options.period_bound))
                for placer in placers_for(model, options.placers):
                    with console.status(f"{name}:{size} on {cluster_name}, {objective}: {placer}"):
                        rows.append(
                            run_placer(
                                problem, placer, f"{name}:{size}", cluster_name, objective, options.time_limit, bound_s
                            )
                        )
        console.print(
            f"{name}:{size}: {model.original_ops} ops -> {len(model.graph.nodes)} nodes, "
            f"{len(clusters)} clusters done ({time.perf_counter() - started:.0f} s)"
        )
    if options.layered:
        rows += layered_rows(
            options.placers, options.objectives, options.time_limit, options.layered_max_tasks, console, started
        )
    rows = with_speedups(rows, options.reference)
    console.print(rich_table("Models", MODEL_COLUMNS, [model_cells(m) for m in models]))
    console.print(
        rich_table(
            f"Placers (speedup vs {options.reference}, value / {BASELINE}'s)",
            RESULT_COLUMNS,
            [result_cells(r) for r in rows],
            group_by=3,
        )
    )
    console.print("Targets:\n" + "\n".join(target_lines(rows)))
    if options.output is not None:
        command = " ".join(["python bench/run.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])])
        write_results(
            options.output, command, options.reference, options.time_limit, models, rows, time.perf_counter() - started
        )
        console.print(f"wrote {options.output}")


if __name__ == "__main__":
    main()
