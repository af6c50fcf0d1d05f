"""Coarsen an OpGraph: group the ops a backend fuses anyway, then optionally merge to a size.

Stage 1 is the Moirai paper's GCOF (§III-B, Algorithm 1). Fusion rules are ordered lists of op
classes (``moirai/data/fusion_rules/*.toml``, read by :mod:`moirai.frontend.fusion_rules`). Visiting ops in
topological order (the paper's depth-first traversal, made deterministic for graphs with many roots), every edge
``pred -> succ`` whose groups together spell a whole rule is fused; one that spells only part of a rule is
*bound* (tentatively merged) and either completes into a fusion later or is *unbound* at the
end. A group fuses with a consumer only over a direct or multi-input connection (the group's
outputs all go to that consumer); a multi-output connection (paper Fig. 6b) is cut only for a
rule marked ``multi_output = true``, and only when the consumer has no other producer. Either
condition leaves the edge as the only path between the two groups, so the result is a DAG
(Pesto, Corollary 3.3). A fused group starts only when all its inputs are ready, so a fusion at a join (the
consumer has another producer) makes the producer's ops wait for the other input; when that input is not
ready by the time the producer's own inputs are and the path through the fused group then outruns the
unfused graph's critical path (the critical-path bound of every plan), the edge is not fused
(:class:`_JoinCheck`). Each merge costs amortised O(log V) dictionary moves: near-linear time.

Stage 2 (``target_nodes``) merges groups until at most ``target_nodes`` remain, heaviest transfer
first, under the same cycle-safety condition and a compute cap that keeps groups balanced; the
cap is relaxed when no merge fits, and when the graph's shape admits no safe edge merge,
neighbours in a topological order are merged (always acyclic).

Example::

    result = coarsen(build_op_graph(trace(model, (x,))), rules="default", target_nodes=200)
    result.graph            # the coarse OpGraph; result.groups[g] = fine node indices of node g
    print_coarsening_table({"model": result})
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import networkx as nx
from networkx.utils import UnionFind
from rich.console import Console
from rich.table import Table

from moirai.errors import MoiraiError
from moirai.file_numbers import is_integer
from moirai.frontend.fusion_rules import (  # re-exported: callers of coarsen() name its rules from here too
    BUNDLED_RULE_SETS,
    DEFAULT_RULE_SETS,
    FusionRule,
    RuleSet,
    load_rules,
    parse_rules,
)
from moirai.frontend.graph import OpGraph
from moirai.progress import stage

__all__ = [
    "BALANCE_FACTOR",
    "BUNDLED_RULE_SETS",
    "DEFAULT_RULE_SETS",
    "FLOPS_PER_BYTE",
    "CoarseningResult",
    "Fusion",
    "GraphSize",
    "RuleSet",
    "coarsen",
    "load_rules",
    "parse_rules",
    "print_coarsening_table",
]

# Stage 2 weighs a group's compute device-independently as a roofline in FLOPs: a byte moved
# costs as much as this many FLOPs (a typical CPU/GPU ridge point is 10-100 FLOP/byte).
FLOPS_PER_BYTE = 20.0
# A merge may not make a group heavier than this multiple of the average group at the target size.
BALANCE_FACTOR = 2.0


class GraphSize(NamedTuple):
    nodes: int
    edges: int  # distinct producer -> consumer node pairs

    @classmethod
    def of(cls, graph: OpGraph) -> GraphSize:
        return cls(len(graph.nodes), len({(e.src, e.dst) for e in graph.edges}))


class Fusion(NamedTuple):
    """Fine ops (topological order) that one fusion rule grouped."""

    ops: tuple[int, ...]
    rule: str


@dataclass(frozen=True)
class CoarseningResult:
    """The coarse graph; node ``g`` of ``graph`` stands for fine nodes ``groups[g]``."""

    graph: OpGraph
    groups: tuple[tuple[int, ...], ...]
    fusions: tuple[Fusion, ...]
    rule_sources: tuple[str, ...]
    original: GraphSize
    fused: GraphSize
    coarse: GraphSize


@stage("coarsen")
def coarsen(
    graph: OpGraph,
    rules: str | Path | RuleSet | Sequence[str | Path | RuleSet] = "default",
    target_nodes: int | None = None,
) -> CoarseningResult:
    """Group ``graph``'s ops by fusion rules, then merge down to ``target_nodes`` if given.

    ``rules``: "default" (every bundled set), a bundled set's name (``BUNDLED_RULE_SETS``),
    the path of a rule file, a :class:`RuleSet`, or a sequence of these (their rules are pooled).
    ``graph``'s nodes must be in topological order, as :func:`moirai.frontend.graph.build_op_graph` makes them.
    """
    if target_nodes is not None and (not is_integer(target_nodes) or target_nodes < 1):
        raise MoiraiError(
            f"target_nodes must be at least 1, a whole number of op groups (or None for no size target), got "
            f"{target_nodes!r} ({type(target_nodes).__name__})"
        )
    if any(e.src >= e.dst for e in graph.edges):
        raise MoiraiError("coarsen needs an OpGraph whose nodes are in topological order, as build_op_graph makes them")
    rule_set = load_rules(rules)
    fusion_groups, matched_rules = _fuse(graph, _Matcher(rule_set))
    order = _topological_group_order(graph, fusion_groups)
    fusion_groups = [fusion_groups[g] for g in order]
    fusions = tuple(Fusion(tuple(fusion_groups[i]), matched_rules[g]) for i, g in enumerate(order) if matched_rules[g])
    fused = graph.merge(fusion_groups)
    groups, coarse = fusion_groups, fused
    if target_nodes is not None and len(fused.nodes) > target_nodes:
        merged = _merge_to_target(fused, target_nodes)
        merged = [merged[g] for g in _topological_group_order(fused, merged)]
        groups = [sorted(op for member in group for op in fusion_groups[member]) for group in merged]
        coarse = graph.merge(groups)
    return CoarseningResult(
        graph=coarse,
        groups=tuple(tuple(group) for group in groups),
        fusions=fusions,
        rule_sources=rule_set.sources,
        original=GraphSize.of(graph),
        fused=GraphSize.of(fused),
        coarse=GraphSize.of(coarse),
    )


def print_coarsening_table(results: Mapping[str, CoarseningResult], console: Console | None = None) -> None:
    """Nodes and edges before and after coarsening, one row per model (the paper's Table IV columns)."""
    rule_sources = dict.fromkeys(source for result in results.values() for source in result.rule_sources)
    table = Table(
        title="Graph coarsening: nodes and edges before and after",
        caption=f"fused: fusion rules ({', '.join(rule_sources)}); coarse: after the size target, if any",
    )
    for column in ("model", "ops", "edges", "fused ops", "fused edges", "coarse ops", "coarse edges"):
        table.add_column(column, justify="left" if column == "model" else "right", no_wrap=column == "model")
    for name, result in results.items():
        table.add_row(name, *(str(count) for size in (result.original, result.fused, result.coarse) for count in size))
    (console or Console()).print(table)


class _Matcher:
    """Rules as automata over op targets, for is_rule / is_sub_rule in O(1) amortised.

    Rule ``r`` with ``k`` elements is an NFA on states ``0..k``; element ``e`` consumes one op
    from state ``e`` to ``e + 1`` (and, if repeated, more at ``e + 1``); an optional element adds
    a free move ``e -> e + 1``. A group's *type* is the set of spans ``(r, start, end)`` its op
    sequence can take. Joining two groups composes their spans, so a group spells part of a
    rule iff its type is non-empty (is_sub_rule) and a whole rule iff it holds ``(r, 0, k)``.
    Types are interned as small integers; compositions are cached.
    """

    NO_MATCH = 0

    def __init__(self, rule_set: RuleSet):
        self.rules = rule_set.rules
        self._types: list[frozenset[tuple[int, int, int]]] = [frozenset()]
        self._type_ids: dict[frozenset[tuple[int, int, int]], int] = {frozenset(): self.NO_MATCH}
        self._target_types: dict[str, int] = {}
        self._joined: dict[tuple[int, int, bool], int] = {}
        self._whole_rules: dict[int, str | None] = {}

    def node_type(self, targets: Iterable[str]) -> int:
        node_type = None
        for target in targets:
            step = self._target_type(target)
            node_type = step if node_type is None else self.join(node_type, step, multi_output_only=False)
        return self.NO_MATCH if node_type is None else node_type

    def join(self, pred_type: int, succ_type: int, multi_output_only: bool) -> int:
        """The type of ``pred`` then ``succ``; only multi_output rules if the join cuts a multi-output edge."""
        key = (pred_type, succ_type, multi_output_only)
        if key not in self._joined:
            ends_from: dict[tuple[int, int], list[int]] = {}
            for rule, start, end in self._types[succ_type]:
                ends_from.setdefault((rule, start), []).append(end)
            self._joined[key] = self._intern(
                (rule, start, end)
                for rule, start, middle in self._types[pred_type]
                if not multi_output_only or self.rules[rule].multi_output
                for end in ends_from.get((rule, middle), ())
            )
        return self._joined[key]

    def whole_rule(self, group_type: int) -> str | None:
        """The first rule the group spells completely, or None."""
        if group_type not in self._whole_rules:
            spans = self._types[group_type]
            self._whole_rules[group_type] = next(
                (rule.name for r, rule in enumerate(self.rules) if (r, 0, len(rule.elements)) in spans), None
            )
        return self._whole_rules[group_type]

    def _target_type(self, target: str) -> int:
        if target not in self._target_types:
            op = target.rsplit(".", 1)[0]  # "aten.add.Tensor" -> "aten.add"
            spans = set()
            for r, rule in enumerate(self.rules):
                for e, element in enumerate(rule.elements):
                    if element.targets is None or target in element.targets or op in element.targets:
                        consumes = [(e, e + 1)] + ([(e + 1, e + 1)] if element.repeated else [])
                        for before, after in consumes:
                            spans.update(
                                (r, start, end)
                                for start in _free_moves_into(rule, before)
                                for end in _free_moves_from(rule, after)
                            )
            self._target_types[target] = self._intern(spans)
        return self._target_types[target]

    def _intern(self, spans: Iterable[tuple[int, int, int]]) -> int:
        key = frozenset(spans)
        if key not in self._type_ids:
            self._type_ids[key] = len(self._types)
            self._types.append(key)
        return self._type_ids[key]


def _free_moves_from(rule: FusionRule, state: int) -> list[int]:
    """States reachable from ``state`` by skipping optional elements."""
    reachable = [state]
    while reachable[-1] < len(rule.elements) and rule.elements[reachable[-1]].optional:
        reachable.append(reachable[-1] + 1)
    return reachable


def _free_moves_into(rule: FusionRule, state: int) -> list[int]:
    """States from which ``state`` is reachable by skipping optional elements."""
    reaching = [state]
    while reaching[-1] > 0 and rule.elements[reaching[-1] - 1].optional:
        reaching.append(reaching[-1] - 1)
    return reaching


class _Quotient:
    """A DAG under contraction: union-find over its nodes and the summed edge weights between groups.

    A contraction moves the adjacency of the group with fewer members, so every adjacency
    entry moves O(log V) times in all.
    """

    def __init__(self, node_count: int, edge_weights: Mapping[tuple[int, int], float]):
        self.groups = UnionFind(range(node_count))
        self.successors: list[dict[int, float]] = [{} for _ in range(node_count)]
        self.predecessors: list[dict[int, float]] = [{} for _ in range(node_count)]
        self._members: list[list[int]] = [[node] for node in range(node_count)]
        for (src, dst), weight in edge_weights.items():
            self.successors[src][dst] = weight
            self.predecessors[dst][src] = weight

    def group(self, node: int) -> int:
        return self.groups[node]

    def members_of(self, group: int) -> list[int]:
        """The nodes of ``group``, a group's representative (in no particular order)."""
        return self._members[group]

    def is_only_path(self, pred: int, succ: int) -> bool:
        """Whether the edge pred -> succ is provably the only path between them (Pesto, Corollary 3.3)."""
        return len(self.successors[pred]) == 1 or len(self.predecessors[succ]) == 1

    def contract(self, a: int, b: int) -> int:
        """Merge groups ``a`` and ``b``; returns the merged group. The caller keeps the graph acyclic."""
        self.groups.union(a, b)
        kept = self.groups[a]
        gone = b if kept == a else a
        for x, y in ((a, b), (b, a)):
            self.successors[x].pop(y, None)
            self.predecessors[y].pop(x, None)
        for own, other in ((self.successors, self.predecessors), (self.predecessors, self.successors)):
            for neighbour, weight in own[gone].items():
                back = other[neighbour]
                del back[gone]
                back[kept] = back.get(kept, 0.0) + weight
                own[kept][neighbour] = own[kept].get(neighbour, 0.0) + weight
            own[gone] = {}
        self._members[kept].extend(self._members[gone])  # union by size: the smaller group's list moves
        self._members[gone] = []
        return kept

    def members(self) -> list[list[int]]:
        return [sorted(group) for group in self.groups.to_sets()]


def _dependency_bytes(graph: OpGraph) -> dict[tuple[int, int], float]:
    weights: dict[tuple[int, int], float] = {}
    for e in graph.edges:
        weights[e.src, e.dst] = weights.get((e.src, e.dst), 0.0) + e.bytes
    return weights


def _work_flops(graph: OpGraph) -> list[float]:
    """Each node's compute as a device-independent roofline in FLOPs (a byte moved costs ``FLOPS_PER_BYTE``)."""
    return [max(node.flops, FLOPS_PER_BYTE * node.bytes_moved) for node in graph.nodes]


class _JoinCheck:
    """Whether fusing a group into a join lengthens the unfused graph's critical path (in roofline FLOPs).

    A fused group is one task: it starts when all its inputs are ready. Fusing ``pred`` into a consumer ``succ``
    that has another producer therefore makes ``pred``'s ops wait for that producer's output too. Measured with
    the unfused graph's longest paths into and out of the group (``ready``: longest path to a node's end;
    ``tail``: from a node's start to a sink), the path through the fused group is ``other input ready + its
    work + the longest tail after it``; longer than the unfused graph's critical path, it would raise the
    critical-path bound of every plan, and the fusion is refused. Each fusion is checked on its own against
    the unfused graph's levels (the groups fused before it do not change them).
    """

    def __init__(self, graph: OpGraph, dependencies: Iterable[tuple[int, int]]):
        node_count = len(graph.nodes)
        self.work_flops = _work_flops(graph)
        self.producers: list[list[int]] = [[] for _ in range(node_count)]
        self.consumers: list[list[int]] = [[] for _ in range(node_count)]
        for src, dst in dependencies:
            self.producers[dst].append(src)
            self.consumers[src].append(dst)
        self.ready_flops = [0.0] * node_count
        for node in range(node_count):  # nodes are in topological order
            start = max((self.ready_flops[p] for p in self.producers[node]), default=0.0)
            self.ready_flops[node] = start + self.work_flops[node]
        self.tail_flops = [0.0] * node_count
        for node in reversed(range(node_count)):
            after = max((self.tail_flops[c] for c in self.consumers[node]), default=0.0)
            self.tail_flops[node] = self.work_flops[node] + after
        self.critical_flops = max(self.ready_flops, default=0.0)

    def delays(self, quotient: _Quotient, pred: int, succ: int) -> bool:
        """Whether fusing ``pred`` into ``succ`` waits for another input of ``succ`` and so lengthens the critical
        path; False where ``succ`` has no other producer."""
        if len(quotient.predecessors[succ]) < 2:
            return False
        fused = (pred, succ)
        pred_ready = self._inputs_ready_flops(quotient, pred, fused)
        other_ready = self._inputs_ready_flops(quotient, succ, fused)
        if other_ready <= pred_ready:
            return False  # the other input is ready when pred could start: no one waits
        members = quotient.members_of(pred) + quotient.members_of(succ)
        tail = max(
            (self.tail_flops[c] for m in members for c in self.consumers[m] if quotient.group(c) not in fused),
            default=0.0,
        )
        through = other_ready + sum(self.work_flops[m] for m in members) + tail
        return through > self.critical_flops * (1 + 1e-9)  # a relative tolerance for rounding in the sums

    def _inputs_ready_flops(self, quotient: _Quotient, group: int, fused: tuple[int, int]) -> float:
        """When ``group``'s inputs from outside the fused pair are all ready, by the unfused graph's levels."""
        return max(
            (
                self.ready_flops[p]
                for m in quotient.members_of(group)
                for p in self.producers[m]
                if quotient.group(p) not in fused
            ),
            default=0.0,
        )


def _fuse(graph: OpGraph, matcher: _Matcher) -> tuple[list[list[int]], list[str | None]]:
    """Algorithm 1 (GCOF): the fusion groups and, for each, the rule that fused it (None: a lone op).

    An edge into a join is not fused where that lengthens the critical path (:class:`_JoinCheck`).
    """
    node_count = len(graph.nodes)
    dependencies = _dependency_bytes(graph)
    consumers: list[list[int]] = [[] for _ in range(node_count)]
    for src, dst in dependencies:
        consumers[src].append(dst)
    quotient = _Quotient(node_count, dependencies)  # every merge so far, bound ones included
    join_check = _JoinCheck(graph, dependencies)
    fused = UnionFind(range(node_count))  # committed fusions only: unbinding is forgetting the rest
    type_of: dict[int, int] = {}  # group -> matcher type
    parts_of: dict[int, list[int]] = {}  # group -> fused groups it binds (absent: the group itself)
    rule_of: dict[int, str] = {}  # fused group -> rule

    def group_type(group: int) -> int:
        if group not in type_of:
            type_of[group] = matcher.node_type(graph.nodes[group].targets)
        return type_of[group]

    for producer in range(node_count):  # nodes are in topological order
        for consumer in consumers[producer]:
            pred, succ = quotient.group(producer), quotient.group(consumer)
            if pred == succ:
                continue
            if len(quotient.successors[pred]) == 1:
                cuts_multi_output = False  # direct or multi-input connection
            elif len(quotient.predecessors[succ]) == 1:
                cuts_multi_output = True  # still the only path, but pred's outputs also leave the group
            else:
                continue
            joined = matcher.join(group_type(pred), group_type(succ), cuts_multi_output)
            if joined == matcher.NO_MATCH or join_check.delays(quotient, pred, succ):
                continue
            parts = parts_of.pop(pred, [pred]) + parts_of.pop(succ, [succ])
            group = quotient.contract(pred, succ)
            type_of[group] = joined
            rule = matcher.whole_rule(joined)
            if rule is None:
                parts_of[group] = parts  # bind: a partial match that may still complete
            else:
                fused.union(*parts)
                parts_of[group] = [fused[parts[0]]]
                rule_of[fused[parts[0]]] = rule
    groups = [sorted(group) for group in fused.to_sets()]
    return groups, [rule_of.get(fused[group[0]]) for group in groups]


def _topological_group_order(graph: OpGraph, groups: Sequence[Sequence[int]]) -> list[int]:
    """Group indices in a topological order of the grouped graph, ties by first op."""
    group_of = [0] * len(graph.nodes)
    for g, members in enumerate(groups):
        for member in members:
            group_of[member] = g
    quotient = nx.DiGraph()
    quotient.add_nodes_from(range(len(groups)))
    quotient.add_edges_from(
        {(group_of[e.src], group_of[e.dst]) for e in graph.edges if group_of[e.src] != group_of[e.dst]}
    )
    first_op = [min(members) for members in groups]
    return list(nx.lexicographical_topological_sort(quotient, key=first_op.__getitem__))


def _merge_to_target(graph: OpGraph, target_nodes: int) -> list[list[int]]:
    """Groups of ``graph``'s nodes, at most ``target_nodes`` of them, whose quotient is a DAG."""
    work = _work_flops(graph)
    total_work = sum(work)
    quotient = _Quotient(len(graph.nodes), _dependency_bytes(graph))
    group_count = len(graph.nodes)
    cap = BALANCE_FACTOR * total_work / target_nodes
    while group_count > target_nodes:
        group_count = _merge_heaviest_edges(quotient, work, cap, group_count, target_nodes)
        if cap > total_work:
            break
        cap *= 2
    if group_count > target_nodes:
        _merge_topological_neighbours(quotient, work, group_count, target_nodes)
    return quotient.members()


def _merge_heaviest_edges(quotient: _Quotient, work: list[float], cap: float, group_count: int, target: int) -> int:
    """Contract edges, most bytes first, that stay the only path and keep groups under ``cap``.

    Heap entries go stale when a group changes; a changed edge is pushed again, and so is the
    single edge of a group whose in- or out-degree drops to one (it may have become safe).
    """
    heap = [
        (-weight, pred, succ)
        for pred in range(len(quotient.successors))
        for succ, weight in quotient.successors[pred].items()
    ]
    heapq.heapify(heap)

    def push_edges_of(group: int) -> None:
        for succ, weight in quotient.successors[group].items():
            heapq.heappush(heap, (-weight, group, succ))
        for pred, weight in quotient.predecessors[group].items():
            heapq.heappush(heap, (-weight, pred, group))

    while heap and group_count > target:
        negative_weight, pred, succ = heapq.heappop(heap)
        if quotient.successors[pred].get(succ) != -negative_weight:
            continue  # stale: a group merged since
        if not quotient.is_only_path(pred, succ) or work[pred] + work[succ] > cap:
            continue
        neighbours = {
            *quotient.successors[pred],
            *quotient.predecessors[pred],
            *quotient.successors[succ],
            *quotient.predecessors[succ],
        } - {pred, succ}
        group = quotient.contract(pred, succ)
        work[group] = work[pred] + work[succ]
        group_count -= 1
        push_edges_of(group)
        for neighbour in neighbours:
            if len(quotient.successors[neighbour]) == 1 or len(quotient.predecessors[neighbour]) == 1:
                push_edges_of(neighbour)
    return group_count


def _merge_topological_neighbours(quotient: _Quotient, work: list[float], group_count: int, target: int) -> None:
    """Merge groups adjacent in a topological order, lightest pair first, down to ``target``.

    Two neighbours in a topological order have no path between them through a third group, and
    the order with the pair merged stays topological, so the result stays a DAG.
    """
    dag = nx.DiGraph()
    roots = {quotient.group(node) for node in range(len(quotient.successors))}
    dag.add_nodes_from(roots)
    dag.add_edges_from((pred, succ) for pred in roots for succ in quotient.successors[pred])
    order = list(nx.topological_sort(dag))
    following = dict(itertools.pairwise(order))
    preceding = {b: a for a, b in following.items()}
    heap = [(work[a] + work[b], a, b) for a, b in following.items()]
    heapq.heapify(heap)
    while group_count > target:
        combined, a, b = heapq.heappop(heap)
        if following.get(a) != b or combined != work[a] + work[b]:
            continue  # stale: a or b merged since
        before, after = preceding.pop(a, None), following.pop(b, None)
        following.pop(a)
        preceding.pop(b)
        group = quotient.contract(a, b)
        work[group] = combined
        group_count -= 1
        for left, right in ((before, group), (group, after)):
            if left is not None and right is not None:
                following[left], preceding[right] = right, left
                heapq.heappush(heap, (work[left] + work[right], left, right))
