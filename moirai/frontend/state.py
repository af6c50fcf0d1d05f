"""State a traced model keeps between calls: buffers its ops write in place (a KV cache).

Every part of a split program holds copies of the parameters and buffers its ops read; a buffer that is written must
have one copy only, so every op that reads or writes it runs on one device for the life of the program, where its
bytes stay between calls and are never sent. :func:`mutable_buffers` finds them in a traced graph: a ``get_attr``
tensor that an op writes (its schema says so: ``index_put_``, ``index_copy_``, ``copy_``) through the tensor or a
view of it. An op reads it when it takes the buffer, a view of it, or the result of an in-place write to it.
:func:`colocated_groups` turns them into the sets of op-graph nodes that :class:`moirai.Problem` keeps on one
device (``Problem.colocated``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from moirai.frontend.writes import is_view_node, written_operands

if TYPE_CHECKING:  # the runtime's ranks import this module, and the op graph brings networkx with it
    from moirai.frontend.graph import OpGraph


@dataclass(frozen=True)
class MutableBuffer:
    """A buffer written in place, with the fx names of every op that reads or writes it."""

    name: str
    nbytes: int
    op_names: tuple[str, ...]


def mutable_buffers(graph_module: fx.GraphModule) -> tuple[MutableBuffer, ...]:
    """The buffers of ``graph_module`` that an op writes in place, in graph order."""
    found = []
    for attribute in graph_module.graph.find_nodes(op="get_attr"):
        value = getattr(graph_module, str(attribute.target), None)
        if not isinstance(value, torch.Tensor):
            continue
        ops = _ops_touching(attribute)
        if any(_writes(op, touched) for op, touched in ops):
            names = tuple(dict.fromkeys(op.name for op, _ in ops))
            found.append(MutableBuffer(attribute.name, value.numel() * value.element_size(), names))
    return tuple(found)


def written_in_place(graph: fx.Graph) -> list[fx.Node]:
    """The placeholders and ``get_attr`` nodes of ``graph`` that an op writes in place (itself or a view of it), in
    graph order: the state a part leaves behind (a buffer it updates, a flat input it writes)."""
    return [
        node
        for node in graph.nodes
        if node.op in ("placeholder", "get_attr") and any(_writes(op, touched) for op, touched in _ops_touching(node))
    ]


def colocated_groups(graph: OpGraph, buffers: Sequence[MutableBuffer]) -> tuple[tuple[int, ...], ...]:
    """The sets of ``graph``'s nodes that must share a device: those touching one buffer, sets that share a node
    merged (a layer's keys and values written by one group, say)."""
    sets: list[set[int]] = []
    for buffer in buffers:
        members = set(graph.nodes_of_fx_names([n for n in buffer.op_names if n in graph.node_of_fx_name]))
        for joined in [s for s in sets if s & members]:
            members |= joined
            sets.remove(joined)
        if members:
            sets.append(members)
    return tuple(tuple(sorted(s)) for s in sorted(sets, key=min) if len(s) > 1)


def _ops_touching(attribute: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(op, the node of the buffer it takes) for every op that takes the buffer, a view of it or an in-place
    result on it; views themselves are followed, not listed."""
    touching, seen, frontier = [], {attribute}, [attribute]
    while frontier:
        alias = frontier.pop()
        for user in alias.users:
            if user.op != "call_function":
                continue
            aliases_input = is_view_node(user) or _writes(user, alias)
            if not is_view_node(user):
                touching.append((user, alias))
            if aliases_input and user not in seen:
                seen.add(user)
                frontier.append(user)
    return touching


def _writes(op: fx.Node, value: fx.Node) -> bool:
    """Whether ``op`` writes ``value`` in place (an argument its schema marks as written, or one a block wrapped in a
    higher-order op writes: :func:`moirai.frontend.writes.written_operands`)."""
    return any(written is value for written in written_operands(op))
