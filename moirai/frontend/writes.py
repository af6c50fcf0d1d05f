"""What an op of a traced graph writes in place and what it views: the one answer the trace's functionalization
check, the state's colocation (:mod:`moirai.frontend.state`), the op graph's bytes, the write-backs put back in place
(:mod:`moirai.frontend.write_backs`) and the splitter's ordering of writes after reads all ask."""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
import torch.fx as fx


def is_view_node(node: fx.Node) -> bool:
    """An op whose output aliases its first input, as its schema declares (a view, or a piece of a split)."""
    target = node.target
    if target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and is_view_node(node.args[0])
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def writes_its_output(node: fx.Node) -> bool:
    """An in-place op whose output is the tensor it writes, as its schema declares (``add_``, ``copy_``,
    ``index_put_``): it allocates nothing."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and alias.is_write


def written_operands(node: fx.Node) -> list[fx.Node]:
    """The arguments ``node`` writes in place: those its op's schema marks as written (``add_``'s self, ``copy_``'s
    destination), or, for a block torch.export wraps in a higher-order op with a body module (``with torch.no_grad():``
    as ``wrap_with_set_grad_enabled``, ``torch.autocast`` as ``wrap_with_autocast``), the operands whose placeholders
    the body writes (itself or a view of them; nested blocks too): the one answer to "what does this op write" (this
    module's doc says who asks)."""
    target = node.target
    if node.op != "call_function":
        return []
    if isinstance(target, torch._ops.OpOverload):
        written = [
            node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            for i, argument in enumerate(target._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        ]
        return [value for value in written if isinstance(value, fx.Node)]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _written_by_body(node)
    return []


def _written_by_body(node: fx.Node) -> list[fx.Node]:
    """The operands of the higher-order op ``node`` that its body modules write in place. A block wrapper passes its
    arguments after its body to the body's placeholders in order; of any other higher-order op whose body writes a
    placeholder, every tensor operand counts as written (moirai cannot tell which)."""
    bodies = {value: body for value in node.all_input_nodes if (body := _body_module(value)) is not None}
    written: list[fx.Node] = []
    for body_node, body in bodies.items():
        body_writes = {base for _, base in written_bases(body.graph) if base.op == "placeholder"}
        if not body_writes:
            continue
        placeholders = body.graph.find_nodes(op="placeholder")
        passed = node.args[node.args.index(body_node) + 1 :] if body_node in node.args else ()
        if node.target in _BLOCK_WRAPPERS and len(passed) == len(placeholders):
            written += [
                value for value, placeholder in zip(passed, placeholders, strict=True) if placeholder in body_writes
            ]
        else:
            written += [value for value in node.all_input_nodes if value not in bodies]
    return [value for value in dict.fromkeys(written) if isinstance(value, fx.Node)]


def _body_module(node: fx.Node) -> fx.GraphModule | None:
    """The graph module ``node`` fetches, where it is a ``get_attr`` of one (a higher-order op's body)."""
    if node.op != "get_attr" or node.graph.owning_module is None:
        return None
    try:
        body = operator.attrgetter(str(node.target))(node.graph.owning_module)
    except AttributeError:
        return None
    return body if isinstance(body, fx.GraphModule) else None


# Higher-order ops torch.export wraps a block in (``with torch.no_grad():``, ``torch.autocast``): their arguments
# after the body module are its placeholders, in order. (getattr: a torch that lacks one has no graph that uses it.)
_BLOCK_WRAPPERS = tuple(
    op
    for op in (
        getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None),
        getattr(torch.ops.higher_order, "wrap_with_autocast", None),
    )
    if op is not None
)


def written_bases(graph: fx.Graph) -> Iterator[tuple[fx.Node, fx.Node]]:
    """Each op that writes in place (:func:`written_operands`) with each tensor it writes, followed back through
    views to the tensor they view."""
    for node in graph.nodes:
        for written in written_operands(node):
            yield node, view_base(written)


def view_base(node: fx.Node) -> fx.Node:
    """The tensor ``node`` views, followed back through views (``node`` itself if it is no view)."""
    while is_view_node(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node
