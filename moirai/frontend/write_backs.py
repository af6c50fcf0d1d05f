"""State updated in place again after functionalization: a KV cache's write costs its rows, not the whole cache.

[Note: writes put back in place]
torch's functionalization (trace's ``run_decompositions``, for a model whose in-place writes other ops see) turns
``cache.index_put_(where, new)`` into ``updated = index_put(cache, where, new)``, which copies the whole buffer, and a
``copy_(cache, updated)`` at the end, which copies it back: every decode step of a split LLM copied every layer's
whole KV cache twice (a step of 4 sequences of an 8-layer model with 8 slots of 64 tokens spent 40% of its time so,
and the cost grows with slots times ``max_seq_len``, not with the tokens written), and held a second copy of each
layer's cache while it ran. torch's own ``fx.passes.reinplace`` leaves writes to a program's inputs and buffers
alone (its "future optimization" for a ``copy_`` at the end); inductor's does this for its own graphs.

:func:`put_writes_back_in_place` makes such an op in place again (``index_put`` -> ``index_put_``, and the few
others of :data:`IN_PLACE`) where that is sound whatever order a plan runs the ops in: the op's first operand is a
buffer or input (one ``get_attr`` or placeholder node) written back by exactly one ``copy_`` of the op's result,
and every other op that takes that tensor reads it before the write by a data edge (it is an ancestor of the op),
and is no view of it (a view's readers could run later). The write-back ``copy_`` then copies the buffer onto
itself, which torch returns from at once; it stays, so what a part writes is still found where it was
(:func:`moirai.frontend.writes.written_operands`), and readers of the result now read the buffer's value in place
(they are colocated with it, :mod:`moirai.frontend.state`).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from moirai.frontend.writes import is_view_node, written_operands

aten = torch.ops.aten

# Out-of-place ops functionalization makes of a write, and the in-place op of the same arguments.
IN_PLACE: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {
    aten.index_put.default: aten.index_put_.default,
    aten.index_copy.default: aten.index_copy_.default,
    aten.index_add.default: aten.index_add_.default,
    aten.scatter.src: aten.scatter_.src,
    aten.scatter.value: aten.scatter_.value,
    aten.scatter_add.default: aten.scatter_add_.default,
}
# The in-place writes of rows: what they read and write is their indices' and values' worth, not the tensor
# (frontend/graph.py prices them so).
ROW_WRITES = frozenset(IN_PLACE.values())


def put_writes_back_in_place(graph_module: fx.GraphModule) -> list[str]:
    """Make each out-of-place write of a buffer or input that a ``copy_`` writes back an in-place one, where sound
    ([Note: writes put back in place]); the names of the nodes made in place."""
    graph = graph_module.graph
    made = []
    for write_back in graph.find_nodes(op="call_function", target=aten.copy_.default):
        state, update = write_back.args[0], write_back.args[1]
        if _can_write_in_place(graph, state, update, write_back):
            update.target = IN_PLACE[update.target]
            made.append(update.name)
    if made:
        graph_module.recompile()
    return made


def _can_write_in_place(graph: fx.Graph, state: object, update: object, write_back: fx.Node) -> bool:
    if not (isinstance(state, fx.Node) and isinstance(update, fx.Node)):
        return False
    if update.target not in IN_PLACE or not update.args or update.args[0] is not state:
        return False
    if state.op not in ("get_attr", "placeholder") or _nodes_naming(graph, state) != 1:
        return False
    operands = pytree.tree_leaves((update.args[1:], update.kwargs))
    if not _same_layout(state, update) or any(operand is state for operand in operands):
        return False  # written from itself (an index or value of the tensor written): not in place
    if any(user is not write_back and update in written_operands(user) for user in update.users):
        return False  # the result is written again before the write-back: left as functionalization made it
    write_backs = [user for user in state.users if user.target is aten.copy_.default and user.args[0] is state]
    if write_backs != [write_back]:
        return False
    ancestors = _ancestors(update)
    return all(
        user is update or user is write_back or (user in ancestors and not is_view_node(user)) for user in state.users
    )


def _nodes_naming(graph: fx.Graph, state: fx.Node) -> int:
    """How many nodes fetch the tensor ``state`` fetches (one ``get_attr`` per attribute, else aliases to follow)."""
    if state.op == "placeholder":
        return 1
    return sum(1 for node in graph.find_nodes(op="get_attr") if node.target == state.target)


def _same_layout(state: fx.Node, update: fx.Node) -> bool:
    """Whether the op's result has the written tensor's shape and dtype, so writing in place changes no value."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq  # sympy, imported late

    before, after = state.meta.get("val"), update.meta.get("val")
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return False
    return before.dtype == after.dtype and statically_known_true(sym_eq(tuple(before.shape), tuple(after.shape)))


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    frontier = list(node.all_input_nodes)
    while frontier:
        ancestor = frontier.pop()
        if ancestor not in seen:
            seen.add(ancestor)
            frontier.extend(ancestor.all_input_nodes)
    return seen
