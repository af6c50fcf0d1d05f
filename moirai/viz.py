"""Seeing a plan: the simulated schedule as a picture (matplotlib) or as text (rich), and the per-device summary.

Everything here reads the simulator's :class:`~moirai.planning.simulate.Timeline`, the one judge of a
plan's latency, so the picture, the text timeline and the summary table agree with every
number the placers report.

* :func:`gantt`: one lane per device and one per directed link in use; op groups are bars
  coloured by kind (the group's main aten op) or by layer (the model's top-level module), transfers
  are bars on their link's lane, the critical path is underlined in black; the title gives the
  predicted latency, the lower bound and the gap. Needs matplotlib (a dependency).
* :func:`text_gantt`: the same lanes as coloured characters for a terminal.
* :func:`summary_table`: one row per device that fits an 80-column terminal.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from rich import box
from rich.table import Table
from rich.text import Text

from moirai.errors import InfeasibleError, MoiraiError
from moirai.file_numbers import is_integer
from moirai.planning.objective import Objective, as_objective
from moirai.planning.placers import MIN_SPLIT_GAIN
from moirai.planning.plan import Plan, check_plan
from moirai.planning.problem import Problem, check_problem
from moirai.planning.simulate import Timeline, simulate
from moirai.planning.stream import simulate_stream
from moirai.progress import format_seconds
from moirai.user_files import check_output_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# The op that names a group's kind: the first of these in the group, else the group's first op.
_MAIN_OPS = (
    "convolution",
    "conv2d",
    "addmm",
    "linear",
    "bmm",
    "mm",
    "matmul",
    "scaled_dot_product",
    "embedding",
    "layer_norm",
    "batch_norm",
    "softmax",
)
# Ops that torch.export adds for its own checks and dtype or device moves: they name no kind the user knows.
_INTERNAL_OPS = ("_assert_tensor_metadata", "_assert_scalar", "to", "_to_copy", "alias", "detach", "lift_fresh_copy")
_PALETTE = "tab20"
_TRANSFER_COLOUR = "0.45"
_MAX_LEGEND_GROUPS = 11  # more kinds than this: the ones with the least time share one grey "other"
_OTHER, _TRANSFER, _CRITICAL, _CRITICAL_LABEL = "other", "transfer", "black", "critical path"
_DRIVER, _DRIVER_COLOUR, _DRIVER_HEIGHT = "the driver's messages", "0.6", 0.12
_TASK_HEIGHT, _TRANSFER_HEIGHT, _UNDERLINE_HEIGHT = 0.7, 0.5, 0.1
# A legend line in "small" type, and what the title and the axis label take besides (inches).
_LEGEND_LINE_IN, _LEGEND_MARGIN_IN = 0.2, 1.0


def predicted_latency_s(timeline: Timeline) -> float:
    """The simulated latency of a plan (the one place that reads the timeline's makespan)."""
    return timeline.makespan_s


def stop_reason(plan: Plan) -> str | None:
    """Why the placer stopped ("gap closed", "time limit", ...), when it says."""
    reason = getattr(plan.report, "stop_reason", None)
    return None if reason is None else reason.value


def best_lower_bound_s(problem: Problem, plan: Plan, objective: Objective | None = None) -> float | None:
    """The larger of the placer's proven bound and the objective's own bound (both hold for every plan that fits),
    on the objective the plan was made for (``objective``, else the one it names): latency, or the period of
    pipelined requests."""
    try:
        bound = (objective or as_objective(plan.objective)).lower_bound_s(problem)
    except InfeasibleError:
        bound = None
    candidates = [b for b in (bound, plan.lower_bound_s) if b is not None]
    return max(candidates) if candidates else None


def headline(problem: Problem, plan: Plan, timeline: Timeline, objective: Objective | None = None) -> str:
    """``predicted 1.23 ms · 812 req/s · bound 1.10 ms · gap 10.6%``: what a plan promises (one request's latency,
    and requests per second when pipelined: the objective's rate, decode steps per second for generation) and how
    far from optimal on its objective.

    A plan for another objective than latency shows its value next to its bound (``predicted 3.10 ms · period
    1.23 ms, 812 req/s · period bound 1.10 ms · gap 10.6%``). The bound holds for plans that fit memory only, so a
    plan over memory gets none. ``objective``: the plan's, where its name alone does not make it (generation's).
    """
    latency = predicted_latency_s(timeline)
    objective = objective or as_objective(plan.objective)
    value = objective.value_s(timeline)
    words = [f"{objective.latency_label} {format_seconds(latency)}"]
    rate_per_s = objective.rate_per_s(timeline)
    rate = f"{format_rate(rate_per_s)} {objective.rate_unit}" if rate_per_s > 0 else None
    if objective.value_label is not None:
        words.append(f"{objective.value_label} {format_seconds(value)}" + (f", {rate}" if rate else ""))
    elif rate:
        words.append(rate)
    bound = best_lower_bound_s(problem, plan, objective) if timeline.fits_memory else None
    if bound is not None:
        words.append(f"{objective.bound_label} {format_seconds(bound)}")
        if value > 0:
            words.append(f"gap {max(value - bound, 0.0) / value:.1%}")
    return " · ".join(words)


def unfused_gap(problem: Problem, plan: Plan, timeline: Timeline, objective: Objective | None = None) -> str | None:
    """``unfused bound 53.0 ms · gap vs unfused 18.1%``: the plan against the lower bound of its ops ungrouped
    (``report.unfused_lower_bound_s``), which also counts what coarsening may have cost. None where it would say
    nothing :func:`headline` does not: no such bound, a plan over memory, or the same gap to one decimal."""
    bound = plan.report.unfused_lower_bound_s
    value_bound = best_lower_bound_s(problem, plan, objective) if timeline.fits_memory else None
    objective = objective or as_objective(plan.objective)
    value = objective.value_s(timeline)
    if bound is None or value_bound is None or value <= 0:
        return None
    gap, unfused = (f"{max(value - b, 0.0) / value:.1%}" for b in (value_bound, bound))
    if unfused == gap:
        return None
    return f"unfused {objective.bound_label} {format_seconds(bound)} · gap vs unfused {unfused}"


def format_rate(per_s: float) -> str:
    """Three significant digits without an exponent: ``4,390``, ``57.8``, ``0.512``."""
    return f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:.3g}"


def format_bytes_compact(num_bytes: float) -> str:
    """Three significant digits and a unit, at most 7 characters: ``812 GB``, ``1.20 TB``, ``16.0 MB``, ``512 B``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return (
                f"{value:.0f} {unit}"
                if value >= 100
                else f"{value:.1f} {unit}"
                if value >= 10
                else f"{value:.2f} {unit}"
            )
    return f"{num_bytes:.0f} B"


# --- what colours a task ---------------------------------------------------------------------------


def kind_of_targets(targets: Sequence[str]) -> str:
    """A group's kind: its main aten op's short name (``aten.addmm.default`` -> ``addmm``), never an internal op
    (``_assert_tensor_metadata``, ``to``): a group of those alone is ``other``."""
    names = [target.split(".")[1] if target.startswith("aten.") else target for target in targets]
    for main in _MAIN_OPS:
        for name in names:
            if name.startswith(main):
                return main
    own = [name for name in names if name not in _INTERNAL_OPS]
    return own[0] if own else (_OTHER if names else "op")


def kind_of_name(task_name: str) -> str:
    """A bare task's kind from its name: ``linear_3`` -> ``linear``, ``block2.mlp`` -> ``block.mlp``."""
    return re.sub(r"_?\d+", "", task_name) or task_name


def layer_of_module_path(module_path: str) -> str:
    """A module path's layer: up to its first index (``blocks.3.mlp.fc1`` -> ``blocks.3``), else two levels."""
    if not module_path:
        return "(model)"
    parts = module_path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2])


# --- the critical path -----------------------------------------------------------------------------


class CriticalPath(NamedTuple):
    tasks: frozenset[int]
    transfers: frozenset[int]  # indices into timeline.transfers


def critical_path(problem: Problem, timeline: Timeline) -> CriticalPath:
    """The chain of tasks and transfers, each starting as the one before ends, that ends with the last task.

    Walks back from the task that finishes last: a task waited for an incoming transfer, a
    producer on its device or the task before it on its device; a transfer waited for its
    producer or the transfer before it on its link. The first that ended when it started is taken.
    """
    tasks: set[int] = set()
    transfers: set[int] = set()
    if problem.num_tasks == 0:
        return CriticalPath(frozenset(), frozenset())
    tolerance = 1e-9 * max(predicted_latency_s(timeline), 1e-12)
    incoming: dict[tuple[int, int], int] = {(x.tensor, x.dst): q for q, x in enumerate(timeline.transfers)}
    previous_task: dict[int, int] = {}
    for sequence in timeline.device_order():
        previous_task.update(zip(sequence[1:], sequence[:-1], strict=True))
    previous_transfer: dict[int, int] = {}
    on_link: dict[tuple[int, int], list[int]] = {}
    for q, x in sorted(enumerate(timeline.transfers), key=lambda item: item[1].start):
        on_link.setdefault((x.src, x.dst), []).append(q)
    for sequence in on_link.values():
        previous_transfer.update(zip(sequence[1:], sequence[:-1], strict=True))

    def ended_at(finish: float, start: float) -> bool:
        return abs(finish - start) <= tolerance

    task: int | None = int(np.argmax(timeline.task_finish))
    while task is not None and task not in tasks:
        tasks.add(task)
        start, device = timeline.task_start[task], timeline.placement[task]
        if start <= tolerance:
            break
        waited_for: int | None = None
        for t in problem.input_tensors[task]:
            producer = int(problem.tensor_producer[t])
            q = incoming.get((t, device))
            if q is not None and ended_at(timeline.transfers[q].finish, start):
                # Follow the transfer back past link queueing to the task that produced what it carried.
                while q not in transfers:
                    transfers.add(q)
                    x = timeline.transfers[q]
                    before = previous_transfer.get(q)
                    if ended_at(timeline.task_finish[producer], x.start) or before is None:
                        break
                    if not ended_at(timeline.transfers[before].finish, x.start):
                        break
                    q = before
                    producer = int(problem.tensor_producer[timeline.transfers[q].tensor])
                waited_for = producer
                break
            if timeline.placement[producer] == device and ended_at(timeline.task_finish[producer], start):
                waited_for = producer
                break
        if waited_for is None:
            before_task = previous_task.get(task)
            if before_task is not None and ended_at(timeline.task_finish[before_task], start):
                waited_for = before_task
        task = waited_for
    return CriticalPath(frozenset(tasks), frozenset(transfers))


# --- lanes -----------------------------------------------------------------------------------------


class Lanes(NamedTuple):
    """Lane labels top to bottom: every device, then every directed link that carries a transfer."""

    labels: list[str]
    links: list[tuple[int, int]]


def lanes(problem: Problem, timeline: Timeline) -> Lanes:
    links = sorted({(x.src, x.dst) for x in timeline.transfers})
    names = problem.device_names
    return Lanes([*names, *(f"{names[a]} → {names[b]}" for a, b in links)], links)


def _time_unit(seconds: float) -> tuple[str, float]:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return unit, scale
    return "ns", 1e-9


def _groups_by_time(groups: Sequence[str], timeline: Timeline, limit: int) -> dict[str, str]:
    """Every task's colour group; beyond ``limit`` groups, those with the least total time become "other"."""
    duration = timeline.task_finish - timeline.task_start
    total: dict[str, float] = {}
    for group, seconds in zip(groups, duration.tolist(), strict=True):
        total[group] = total.get(group, 0.0) + seconds
    kept = sorted(total, key=lambda g: -total[g])[:limit] if len(total) > limit + 1 else list(total)
    return {group: group if group in kept else _OTHER for group in total}


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoiraiError("the Gantt picture needs matplotlib (moirai depends on it): pip install matplotlib") from None
    return plt


def check_picture_path(path: str | Path) -> None:
    """Raise :class:`MoiraiError` unless matplotlib is there and can write a picture of ``path``'s suffix into
    ``path``'s folder (checked before the work whose picture it is)."""
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    check_output_path(path, "the Gantt picture", MoiraiError)
    supported = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lstrip(".").lower() not in supported:
        raise MoiraiError(f"cannot draw into {str(path)!r}: name a picture file, one of .{', .'.join(supported)}")


def _driver_messages(problem: Problem, timeline: Timeline) -> list[tuple[int, float, float]]:
    """(device, start, finish) of the driver's messages a request waits for, on the device that waits: until a
    device's header and inputs have come (its tasks' earliest release), and from a task that makes a model output
    until that output is with the driver on device 0. The latency counts them; without them the picture's bars end
    before it does."""
    costs = problem.costs
    bars = []
    for k in np.unique(timeline.placement):
        on = np.flatnonzero(timeline.placement == k)
        first = float(costs.release_s[on, k].min())
        if first > 0:
            bars.append((int(k), 0.0, first))
    for i in range(problem.num_tasks):
        k = int(timeline.placement[i])
        if costs.output_s[i, k] > 0:
            bars.append((k, float(timeline.task_finish[i]), float(timeline.task_finish[i] + costs.output_s[i, k])))
    return bars


def gantt(
    problem: Problem,
    plan: Plan,
    path: str | Path | None = None,
    *,
    groups: Sequence[str] | None = None,
    timeline: Timeline | None = None,
    title: str | None = None,
    requests: int = 1,
    objective: Objective | None = None,
) -> Figure:
    """Draw the simulated schedule of ``plan``; save it to ``path`` (PNG, SVG, PDF by suffix) when given.

    ``groups`` names the colour of every task (default: its kind, from its name). ``requests > 1``
    draws that many requests pipelined through the plan (:mod:`moirai.planning.stream`), coloured by request,
    with the steady-state period in the title. ``objective``: the one the title judges by, where the plan's name
    alone does not make it (generation's). Returns the matplotlib Figure, which Jupyter shows inline.
    """
    check_problem(problem, "moirai.gantt's problem")
    check_plan(plan, "moirai.gantt's plan")
    if not is_integer(requests) or requests < 1:
        raise MoiraiError(
            f"requests must be a whole number, at least 1 (1: one request; more: that many pipelined), got "
            f"{requests!r} ({type(requests).__name__})"
        )
    if path is not None:
        check_picture_path(path)
    if requests > 1:
        stream = simulate_stream(problem, plan, requests)
        one_request = simulate(problem, plan)
        title = title or (
            f"{plan.placer or 'plan'}: {requests} pipelined requests · period {format_seconds(stream.period_s)} "
            f"({format_rate(1 / stream.period_s)} req/s) · "
            f"busiest device or link {format_seconds(one_request.period_s)}"
        )
        groups = [f"request {r}" for r in stream.request_of_task()]
        problem, plan, timeline = stream.problem, stream.plan, stream.timeline
    plt = _pyplot()
    from matplotlib.patches import Patch

    timeline = timeline or simulate(problem, plan)
    groups = list(groups) if groups is not None else [kind_of_name(name) for name in problem.task_names]
    if len(groups) != problem.num_tasks:
        raise MoiraiError(f"groups names {len(groups)} tasks, the problem has {problem.num_tasks}")
    colour_group = _groups_by_time(groups, timeline, _MAX_LEGEND_GROUPS)
    ordered = list(dict.fromkeys(colour_group[g] for g in groups))
    cmap = plt.get_cmap(_PALETTE)
    colour = {group: cmap(i % cmap.N) for i, group in enumerate(g for g in ordered if g != _OTHER)}
    colour[_OTHER] = "0.7"
    lane = lanes(problem, timeline)
    link_lane = {link: problem.num_devices + i for i, link in enumerate(lane.links)}
    critical = critical_path(problem, timeline)
    unit, scale = _time_unit(predicted_latency_s(timeline))

    # Tall enough for the lanes, and for the legend beside them: one line per colour, the transfers, the critical path.
    driver = _driver_messages(problem, timeline)
    legend_lines = len(ordered) + bool(timeline.transfers) + bool(driver) + 1
    height_in = max(1.2 + 0.45 * len(lane.labels), _LEGEND_MARGIN_IN + _LEGEND_LINE_IN * legend_lines)
    fig, ax = plt.subplots(figsize=(11, height_in), layout="constrained")
    plt.close(fig)  # not pyplot's to show: Jupyter shows the returned figure once, scripts save it
    for group in ordered:
        tasks = [i for i in range(problem.num_tasks) if colour_group[groups[i]] == group]
        ax.barh(
            [int(timeline.placement[i]) for i in tasks],
            [(timeline.task_finish[i] - timeline.task_start[i]) / scale for i in tasks],
            left=[timeline.task_start[i] / scale for i in tasks],
            height=_TASK_HEIGHT,
            color=colour[group],
            edgecolor="white",
            linewidth=0.3,
            label=group,
        )
    if timeline.transfers:
        ax.barh(
            [link_lane[(x.src, x.dst)] for x in timeline.transfers],
            [(x.finish - x.start) / scale for x in timeline.transfers],
            left=[x.start / scale for x in timeline.transfers],
            height=_TRANSFER_HEIGHT,
            color=_TRANSFER_COLOUR,
            edgecolor="white",
            linewidth=0.3,
            label=_TRANSFER,
        )
    if driver:
        ax.barh(  # a strip above the lane's bars: an output's message goes while later tasks run
            [lane_y - _TASK_HEIGHT / 2 - _DRIVER_HEIGHT / 2 for lane_y, _, _ in driver],
            [(finish - start) / scale for _, start, finish in driver],
            left=[start / scale for _, start, _ in driver],
            height=_DRIVER_HEIGHT,
            color=_DRIVER_COLOUR,
            linewidth=0,
            label=_DRIVER,
        )
    # The critical path underlines its tasks and transfers (outlines would hide short bars).
    on_path = [
        (int(timeline.placement[i]), _TASK_HEIGHT, timeline.task_start[i], timeline.task_finish[i])
        for i in critical.tasks
    ]
    on_path += [
        (link_lane[(x.src, x.dst)], _TRANSFER_HEIGHT, x.start, x.finish)
        for x in (timeline.transfers[q] for q in critical.transfers)
    ]
    ax.barh(
        [lane_y + height / 2 + _UNDERLINE_HEIGHT / 2 for lane_y, height, _, _ in on_path],
        [(finish - start) / scale for _, _, start, finish in on_path],
        left=[start / scale for _, _, start, _ in on_path],
        height=_UNDERLINE_HEIGHT,
        color=_CRITICAL,
        label=_CRITICAL_LABEL,
    )
    ax.set_yticks(range(len(lane.labels)), lane.labels)
    ax.set_ylim(len(lane.labels) - 0.5, -0.5)
    ax.set_xlim(0, max(predicted_latency_s(timeline) / scale, 1e-12) * 1.01)
    ax.set_xlabel(f"time ({unit})")
    if lane.links:
        ax.axhline(problem.num_devices - 0.5, color="0.8", linewidth=0.8)
    ax.grid(axis="x", color="0.92")
    ax.set_axisbelow(True)
    labels = [*ordered, *([_TRANSFER] if timeline.transfers else []), *([_DRIVER] if driver else []), _CRITICAL_LABEL]
    handles = [Patch(facecolor=colour[g]) for g in ordered]
    handles += [Patch(facecolor=_TRANSFER_COLOUR)] if timeline.transfers else []
    handles += [Patch(facecolor=_DRIVER_COLOUR)] if driver else []
    handles.append(Patch(facecolor=_CRITICAL))
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    ax.set_title(title or f"{plan.placer or 'plan'}: {headline(problem, plan, timeline, objective)}", loc="left")
    if path is not None:
        try:
            fig.savefig(path, dpi=120)
        except OSError as fault:
            raise MoiraiError(f"cannot write the Gantt picture to {str(path)!r}: {fault.strerror or fault}") from None
    return fig


def text_gantt(
    problem: Problem,
    plan: Plan,
    width: int = 60,
    *,
    groups: Sequence[str] | None = None,
    timeline: Timeline | None = None,
) -> Table:
    """The schedule as a rich table: one row per lane, ``width`` characters of time, a colour per group.

    A character shows the task (or transfer) that covers most of its time slice; ``·`` is idle;
    the critical path is bold and underlined.
    """
    if not is_integer(width) or width < 1:
        raise MoiraiError(
            f"text_gantt's width is the characters of time per lane, a whole number of at least 1, got {width!r}"
        )
    timeline = timeline or simulate(problem, plan)
    groups = list(groups) if groups is not None else [kind_of_name(name) for name in problem.task_names]
    colour_group = _groups_by_time(groups, timeline, _MAX_LEGEND_GROUPS)
    ordered = list(dict.fromkeys(colour_group[g] for g in groups))
    styles = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]
    style = {g: styles[i % len(styles)] for i, g in enumerate(x for x in ordered if x != _OTHER)}
    style[_OTHER] = "white"
    latency = predicted_latency_s(timeline)
    critical = critical_path(problem, timeline)
    lane = lanes(problem, timeline)
    link_lane = {link: problem.num_devices + i for i, link in enumerate(lane.links)}
    # (start, finish, style, glyph, critical) of everything on each lane
    spans: list[list[tuple[float, float, str, str, bool]]] = [[] for _ in lane.labels]
    for i in range(problem.num_tasks):
        g = colour_group[groups[i]]
        spans[int(timeline.placement[i])].append(
            (timeline.task_start[i], timeline.task_finish[i], style[g], "█", i in critical.tasks)
        )
    for q, x in enumerate(timeline.transfers):
        spans[link_lane[(x.src, x.dst)]].append((x.start, x.finish, "grey62", "▬", q in critical.transfers))
    table = Table(box=box.SIMPLE_HEAD, title=f"{plan.placer or 'plan'}: {headline(problem, plan, timeline)}")
    table.add_column("lane", no_wrap=True)
    table.add_column(f"0 … {format_seconds(latency)}", no_wrap=True)
    for label, lane_spans in zip(lane.labels, spans, strict=True):
        line = Text()
        for cell in range(width):
            lo, hi = latency * cell / width, latency * (cell + 1) / width
            cover = [(min(f, hi) - max(s, lo), span) for s, f, *span in lane_spans if s < hi and f > lo]
            if not cover:
                line.append("·", style="grey37")
                continue
            _, (span_style, glyph, on_path) = max(cover, key=lambda c: c[0])
            line.append(glyph, style=f"{span_style} bold underline" if on_path else span_style)
        table.add_row(label, line)
    legend = Text("  ".join(f"█ {g}" for g in ordered))
    for g in ordered:
        start = legend.plain.index(f"█ {g}")
        legend.stylize(style[g], start, start + 1)
    table.caption = legend
    return table


# --- the per-device summary ------------------------------------------------------------------------


def summary_table(
    problem: Problem,
    plan: Plan,
    *,
    timeline: Timeline | None = None,
    torch_devices: Sequence[str] | None = None,
    ops_per_task: Sequence[int] | None = None,
    title: str | None = None,
    objective: Objective | None = None,
) -> Table:
    """One row per device: groups (and ops), memory in use / capacity (red when over), busy time.

    The memory each device keeps free besides its tasks' (``problem.memory_reserve_bytes``, the activation peak
    a compiled model's problem was priced with) is added to its memory in use and its capacity: the capacity shown is
    the device's.
    Its columns fit an 80-column terminal for device names up to 16 characters (``format_bytes_compact``,
    ``format_seconds``); the table is as wide as its caption's longest line, up to the console's width.
    """
    timeline = timeline or simulate(problem, plan)
    latency = predicted_latency_s(timeline)
    table = Table(
        title=title or f"moirai plan ({plan.placer or 'given'})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),  # with the divider, two spaces between columns: 80 columns hold 16-character names
    )
    columns = ["device", *(["torch"] if torch_devices is not None else []), "groups"]
    columns += [*(["ops"] if ops_per_task is not None else []), "memory / capacity", "busy", "util"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("device", "torch") else "right", no_wrap=True)
    for k, name in enumerate(problem.device_names):
        tasks = np.flatnonzero(plan.placement == k)
        reserve = float(problem.memory_reserve_bytes[k])
        used = float(timeline.memory_bytes[k]) + reserve
        capacity = float(timeline.memory_capacity_bytes[k]) + reserve
        over = timeline.memory_bytes[k] > timeline.memory_capacity_bytes[k]
        memory = f"{format_bytes_compact(used)} / {format_bytes_compact(capacity) if np.isfinite(capacity) else '∞'}"
        row: list[Any] = [name, *([torch_devices[k]] if torch_devices is not None else []), str(len(tasks))]
        if ops_per_task is not None:
            row.append(str(sum(ops_per_task[i] for i in tasks)))
        busy = float(timeline.busy_s[k])
        row += [Text(memory, style="bold red" if over else ""), format_seconds(busy) if busy else "-"]
        row.append(f"{busy / latency:.0%}" if latency > 0 else "-")
        table.add_row(*row, style="bold red" if over else None)
    details = []
    reason = stop_reason(plan)
    if reason:
        details.append(f"stopped: {reason}")
    replaced_s = plan.report.notes.get("replaced_by_single_device_s")
    if replaced_s is not None:
        details.append(f"one device kept: a split ({format_seconds(replaced_s)}) gains under {MIN_SPLIT_GAIN:.0%}")
    details.append(f"{len(timeline.transfers)} transfer{'' if len(timeline.transfers) == 1 else 's'}")
    if plan.placement_time_s is not None:
        details.append(f"placed in {format_seconds(plan.placement_time_s)}")
    if not timeline.fits_memory:
        details.append("[bold red]OVER MEMORY on the red rows[/]")
    unfused = unfused_gap(problem, plan, timeline, objective)
    lines = [headline(problem, plan, timeline, objective), *([unfused] if unfused else []), " · ".join(details)]
    table.caption = "\n".join(lines)
    table.caption_justify = "left"
    return widen_to_caption(table)


def widen_to_caption(table: Table) -> Table:
    """Let ``table`` be as wide as its caption's longest line (rich caps it at the console's width), so that a
    caption wider than the columns is not wrapped to their width."""
    lines = Text.from_markup(str(table.caption or "")).plain.splitlines() or [""]
    table.min_width = max(len(line) for line in lines)
    return table
