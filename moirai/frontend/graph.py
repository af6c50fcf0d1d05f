"""OpGraph: one node per compute op of a traced model, with the costs placement needs.

Placeholders (model inputs) and ``get_attr`` nodes (parameters, buffers, constants) are
not OpGraph nodes: an input is sent by the driver to every device whose nodes read it
(:func:`model_input_readers`), and a parameter is charged to the nodes that read it
(``param_names``). ``operator.getitem`` on a multi-output op joins its producer's node. Every
other ``call_function`` is a node. A scalar of the input shapes (``sym_size`` and arithmetic on
it, in a model traced with dynamic shapes) is a node without out-edges: every device that reads
one computes it itself (see :mod:`moirai.runtime.split`).

A coarse graph (after :mod:`moirai.frontend.coarsen`) has the same type: its nodes are groups of
ops, built with :meth:`OpGraph.merge`.

Example::

    graph = build_op_graph(trace(model, (x,)))
    graph.to_networkx()  # DiGraph over node indices, edge attribute "bytes"
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import networkx as nx
import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from moirai.errors import TraceError
from moirai.frontend.symbolic_shapes import example_int, shape_scalars
from moirai.frontend.trace import TracedModel
from moirai.frontend.write_backs import ROW_WRITES
from moirai.frontend.writes import is_view_node, writes_its_output, written_operands
from moirai.progress import stage


@dataclass(frozen=True)
class OpNode:
    """One op (or, in a coarse graph, one group of ops in topological order).

    ``output_bytes`` is the memory its outputs allocate: a view (``transpose``, ``view``,
    ``expand``...) allocates none, nor does an op that writes in place (``copy_``: its output is the tensor it
    wrote). ``bytes_moved`` is what it reads and writes: a view nothing, an embedding lookup the rows it gathers
    (not the table), a write of rows in place (a KV cache's) its indices and values and the rows it writes, a
    ``copy_`` of a tensor onto itself nothing, any other op its inputs and outputs (an in-place op's output counted
    once, as its input).
    """

    name: str
    targets: tuple[str, ...]
    fx_names: tuple[str, ...]
    flops: float
    bytes_moved: float
    output_bytes: float
    param_names: frozenset[str]
    param_bytes: float
    # Of its ops, those that compute a scalar of the input shapes (``sym_size`` and arithmetic on it): a read of
    # a tensor's metadata, made again by every device that reads the scalar, so no op a device launches.
    shape_ops: int = 0


@dataclass(frozen=True)
class OpEdge:
    """Tensor ``tensor`` (an fx node name) flows from node ``src`` to node ``dst``."""

    src: int
    dst: int
    tensor: str
    bytes: float


@dataclass(frozen=True, eq=False)
class OpGraph:
    nodes: tuple[OpNode, ...]
    edges: tuple[OpEdge, ...]
    parameter_bytes: dict[str, float] = field(default_factory=dict)

    @cached_property
    def node_of_fx_name(self) -> dict[str, int]:
        return {fx_name: i for i, node in enumerate(self.nodes) for fx_name in node.fx_names}

    def nodes_of_fx_names(self, fx_names: Sequence[str]) -> list[int]:
        """The distinct nodes standing for ``fx_names``, in order of first mention.

        A node stands for several fx names (a multi-output op and the ``getitem`` nodes that
        unpack it), so a group of fx names names such a node once per fx name.
        """
        return list(dict.fromkeys(self.node_of_fx_name[name] for name in fx_names))

    def to_networkx(self) -> nx.DiGraph:
        """DiGraph over node indices; edge attribute ``bytes`` sums the tensors on that edge."""
        g = nx.DiGraph()
        g.add_nodes_from(range(len(self.nodes)))
        for e in self.edges:
            if g.has_edge(e.src, e.dst):
                g.edges[e.src, e.dst]["bytes"] += e.bytes
            else:
                g.add_edge(e.src, e.dst, bytes=e.bytes)
        return g

    @property
    def total_flops(self) -> float:
        return float(sum(n.flops for n in self.nodes))

    @property
    def total_param_bytes(self) -> float:
        return float(sum(self.parameter_bytes.values()))

    def merge(self, groups: Sequence[Sequence[int]]) -> OpGraph:
        """A coarser graph with one node per group; every node must be in exactly one group.

        Costs add up, parameters shared inside a group count once, and an edge between
        groups carries each tensor once per consumer group. The caller keeps the result
        acyclic (merging two nodes joined by a path through a third makes a cycle).
        """
        group_of = np.full(len(self.nodes), -1)
        for g, members in enumerate(groups):
            group_of[list(members)] = g
        if np.any(group_of < 0) or sum(len(m) for m in groups) != len(self.nodes):
            raise ValueError("merge needs every node in exactly one group")
        position = {fx_name: p for p, fx_name in enumerate(self._fx_order)}
        merged = []
        for g, members in enumerate(groups):
            ops = sorted(members, key=lambda i: position[self.nodes[i].fx_names[0]])
            params = frozenset().union(*(self.nodes[i].param_names for i in ops))
            merged.append(
                OpNode(
                    name=self.nodes[ops[0]].name if len(ops) == 1 else f"group{g}_{self.nodes[ops[0]].name}",
                    targets=tuple(t for i in ops for t in self.nodes[i].targets),
                    fx_names=tuple(f for i in ops for f in self.nodes[i].fx_names),
                    flops=sum(self.nodes[i].flops for i in ops),
                    bytes_moved=sum(self.nodes[i].bytes_moved for i in ops),
                    output_bytes=sum(self.nodes[i].output_bytes for i in ops),
                    param_names=params,
                    param_bytes=sum(self.parameter_bytes.get(p, 0.0) for p in params),
                    shape_ops=sum(self.nodes[i].shape_ops for i in ops),
                )
            )
        edges: dict[tuple[int, int, str], OpEdge] = {}
        for e in self.edges:
            src, dst = int(group_of[e.src]), int(group_of[e.dst])
            if src != dst:
                edges.setdefault((src, dst, e.tensor), OpEdge(src, dst, e.tensor, e.bytes))
        return OpGraph(tuple(merged), tuple(edges.values()), self.parameter_bytes)

    @cached_property
    def _fx_order(self) -> list[str]:
        """fx names in graph order (nodes are built in graph order, so this is topological)."""
        return [f for node in self.nodes for f in node.fx_names]


@stage("op graph")
def build_op_graph(traced: TracedModel) -> OpGraph:
    """One OpNode per compute op of ``traced``, with FLOPs, bytes and parameter bytes."""
    graph_module = traced.graph_module
    scalars = shape_scalars(traced)
    parameter_bytes: dict[str, float] = {}
    for node in graph_module.graph.find_nodes(op="get_attr"):
        parameter_bytes[node.name] = _nbytes(node.meta.get("val", getattr(graph_module, str(node.target), None)))

    count_flops = _FlopCounter()
    nodes: list[OpNode] = []
    node_of: dict[str, int] = {}
    edges: dict[tuple[int, int, str], OpEdge] = {}
    for fx_node in graph_module.graph.nodes:
        if fx_node.op not in ("call_function", "call_method", "call_module"):
            continue
        inputs = fx_node.all_input_nodes
        if fx_node.target is operator.getitem and inputs and inputs[0].name in node_of:
            owner = node_of[inputs[0].name]
            node_of[fx_node.name] = owner
            nodes[owner] = replace(nodes[owner], fx_names=nodes[owner].fx_names + (fx_node.name,))
            continue
        index = len(nodes)
        params = frozenset(n.name for n in inputs if n.op == "get_attr")
        output_bytes = _nbytes(fx_node.meta.get("val"))
        shape_scalar = fx_node in scalars  # reads metadata: no bytes, no launch
        allocated_bytes = 0 if is_view_node(fx_node) or writes_its_output(fx_node) else output_bytes
        nodes.append(
            OpNode(
                name=fx_node.name,
                targets=(_target_name(fx_node),),
                fx_names=(fx_node.name,),
                flops=count_flops(fx_node),
                bytes_moved=0.0 if shape_scalar else _bytes_moved(fx_node, output_bytes),
                output_bytes=float(allocated_bytes),
                param_names=params,
                param_bytes=float(sum(parameter_bytes[p] for p in params)),
                shape_ops=int(shape_scalar),
            )
        )
        node_of[fx_node.name] = index
        for producer in inputs:
            if producer.name in node_of and node_of[producer.name] != index and producer not in scalars:
                key = (node_of[producer.name], index, producer.name)
                edges.setdefault(key, OpEdge(*key, float(_nbytes(producer.meta.get("val")))))
    if not nodes:
        raise TraceError(
            f"{traced.model_name} computes nothing: its outputs are its inputs, weights or buffers as they are, so it "
            "has no op to place on a device and nothing to split; call the model itself"
        )
    return OpGraph(tuple(nodes), tuple(edges.values()), parameter_bytes)


# Ops that gather rows of their first input (the table) by the indices of their second: they read those rows only.
_ROW_GATHERS = frozenset({"aten::embedding", "aten::index_select"})


def _bytes_moved(node: fx.Node, output_bytes: int) -> float:
    """What an op reads and writes in memory: nothing for a view (its output aliases its input, as the op's schema
    declares); for a lookup of rows (``embedding``, ``index_select``) the rows it gathers (its output's bytes), the
    indices and its output, not the whole table; else every input and its output (an in-place op's output is the
    input it writes, counted once)."""
    if is_view_node(node):
        return 0.0
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.name in _ROW_GATHERS:
        index = node.args[1] if target._schema.name == "aten::embedding" else node.args[2]
        index_bytes = _nbytes(index.meta.get("val")) if isinstance(index, fx.Node) else 0
        return float(2 * output_bytes + index_bytes)
    if target in ROW_WRITES:
        return _row_write_bytes(node)
    if target is torch.ops.aten.copy_.default and _copies_onto_itself(node):
        return 0.0
    written_in_place = writes_its_output(node)  # its output is an input it writes: counted once, as that input
    return float(
        sum(_nbytes(n.meta.get("val")) for n in node.all_input_nodes) + (0 if written_in_place else output_bytes)
    )


def _row_write_bytes(node: fx.Node) -> float:
    """A write of rows in place (``index_put_``, ``index_copy_``...): it reads its indices and values and writes as
    many elements of the tensor, not the whole tensor (a KV cache's write is its tokens' rows)."""
    written = node.args[0].meta.get("val")
    operands = [n.meta.get("val") for n in node.all_input_nodes if n is not node.args[0]]
    read = sum(_nbytes(value) for value in operands)
    values = [v for v in operands if getattr(v, "dtype", None) == getattr(written, "dtype", 0)]
    if values or not isinstance(written, torch.Tensor):
        return float(read + sum(_nbytes(value) for value in values))
    # Written with a scalar (scatter_'s value): one element for each index.
    indices = sum(_nbytes(value) // value.element_size() for value in operands if isinstance(value, torch.Tensor))
    return float(read + indices * written.element_size())


def _copies_onto_itself(node: fx.Node) -> bool:
    """A ``copy_`` of a tensor's own in-place written value into it (a write-back after a write put back in place,
    [Note: writes put back in place]): torch returns from it at once."""
    destination, source = node.args[0], node.args[1]
    return source is destination or (isinstance(source, fx.Node) and destination in written_operands(source))


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def model_output_bytes(graph: OpGraph, traced: TracedModel) -> dict[int, float]:
    """Node of ``graph`` -> bytes of the model outputs it makes (an output that is an input or a constant is
    made by no node, nor is a scalar of the input shapes: device 0 computes it, :mod:`moirai.runtime.split`)."""
    made: dict[int, float] = {}
    output = next(n for n in traced.graph_module.graph.nodes if n.op == "output")
    scalars = shape_scalars(traced)
    for value in pytree.tree_leaves(output.args[0]):
        if isinstance(value, fx.Node) and value.name in graph.node_of_fx_name and value not in scalars:
            node = graph.node_of_fx_name[value.name]
            made[node] = made.get(node, 0.0) + float(_nbytes(value.meta.get("val")))
    return made


def model_input_readers(graph: OpGraph, traced: TracedModel) -> list[tuple[float, tuple[int, ...]]]:
    """For every model input (placeholder) some node reads, its bytes and the nodes of ``graph`` that read it, as
    :mod:`moirai.runtime.split` ships it: once to every device where one of them runs (a scalar of the input shapes
    reads no input: each part computes it from the shapes it is given)."""
    scalars = {node.name for node in shape_scalars(traced)}
    inputs = []
    for placeholder in traced.graph_module.graph.find_nodes(op="placeholder"):
        readers = graph.nodes_of_fx_names(
            [user.name for user in placeholder.users if user.name in graph.node_of_fx_name and user.name not in scalars]
        )
        if readers:
            inputs.append((float(_nbytes(placeholder.meta.get("val"))), tuple(sorted(readers))))
    return inputs


def _nbytes(value: object) -> int:
    """Bytes of the tensors in ``value`` at the example shapes."""
    tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return sum(math.prod(example_int(size) for size in t.shape) * t.element_size() for t in tensors)


class _FlopCounter:
    """FLOPs of aten ops by torch's flop counter, run on meta tensors of the traced shapes.

    A model of repeated blocks calls the same op on the same shapes once per block, and running the counter costs
    about a millisecond a call, so each op and argument signature is counted once.
    """

    def __init__(self) -> None:
        self._flops_of: dict[object, float] = {}

    def __call__(self, node: fx.Node) -> float:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return 0.0
        counted = target.overloadpacket in flop_registry or torch._C._dispatch_has_kernel_for_dispatch_key(
            target.name(), "CompositeImplicitAutograd"
        )
        if not counted:
            return 0.0
        key = _signature(target, node)
        if key is None:
            return _count_flops(target, node)
        if key not in self._flops_of:
            self._flops_of[key] = _count_flops(target, node)
        return self._flops_of[key]


def _signature(target: torch._ops.OpOverload, node: fx.Node) -> tuple | None:
    """What an op's FLOPs depend on: the op, each tensor argument's shape, strides and dtype, the other arguments;
    ``None`` where an argument cannot be a key."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    described = []
    for leaf in leaves:
        value = leaf.meta.get("val") if isinstance(leaf, fx.Node) else leaf
        if isinstance(value, torch.Tensor):
            value = ("tensor", *_example_layout(value), value.dtype)
        elif isinstance(value, torch.SymInt):
            value = example_int(value)
        try:
            hash(value)
        except TypeError:
            return None
        described.append(value)
    return target, str(spec), tuple(described)


def _example_layout(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and strides of ``tensor`` at the example sizes (a symbolic size takes its example value)."""
    return tuple(example_int(size) for size in tensor.shape), tuple(example_int(size) for size in tensor.stride())


def _count_flops(target: torch._ops.OpOverload, node: fx.Node) -> float:
    def as_meta(value: object) -> object:
        if isinstance(value, fx.Node):
            value = value.meta.get("val")
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(*_example_layout(value), dtype=value.dtype, device="meta")
        return example_int(value) if isinstance(value, torch.SymInt) else value

    args, kwargs = pytree.tree_map(as_meta, (node.args, node.kwargs))
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            target(*args, **kwargs)
    except Exception:
        # Ops with no meta kernel cannot be counted; their cost falls back to bytes moved.
        return 0.0
    return float(counter.get_total_flops())
