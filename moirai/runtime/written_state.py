"""State that a part other than part 0 writes in place, brought back to the driver after a one-off distributed run.

The local runner runs every part in this process, on the program's own tensors: a buffer a part writes in place (a
counter, a cache) keeps its value for the next call, and a flat input it writes is the caller's tensor. A spawned
world's ranks run copies: rank 0 runs part 0 on the program's tensors, but every other rank loads its part's
buffers and receives its inputs as copies, which ``run_distributed`` loses with its ranks when it returns. So
``run_distributed`` runs :func:`returning_state`'s program instead, whose parts but 0 also return a copy of each
buffer and flat input they write, as flat outputs after the model's, and :func:`write_back` copies them into the
program's buffers and the caller's inputs: the next call, local or distributed, starts where eager would.

A server (``compiled.server()``) keeps each rank's state from one request to the next, but does not bring it back:
what ranks other than 0 wrote ends with their processes when it closes, which :func:`warning_at_close` says.

Example::

    returning, states = returning_state(program)
    outputs = runner.run(returning, flat_inputs)
    outputs = write_back(program, states, outputs, flat_inputs)  # the model's outputs
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from moirai.errors import StateLeftBehindWarning, user_stacklevel
from moirai.frontend.state import written_in_place
from moirai.frontend.trace import TensorSpec, tensor_spec
from moirai.runtime.split import DevicePart, OutputLocation, PartTracer, SplitProgram

__all__ = [
    "WrittenState",
    "kept_on_ranks",
    "returning_state",
    "warning_at_close",
    "write_back",
    "written_inputs",
    "written_states",
]


@dataclass(frozen=True)
class WrittenState:
    """Part ``device`` writes its buffer ``attribute`` or flat input ``input_index`` (one of the two is set)."""

    device: int
    attribute: str | None = None
    input_index: int | None = None

    def __str__(self) -> str:
        written = f"buffer {self.attribute}" if self.attribute is not None else f"flat input {self.input_index}"
        return f"{written} on device {self.device}"


def written_states(program: SplitProgram) -> tuple[WrittenState, ...]:
    """Every buffer and flat input that a part other than part 0 writes in place, part by part."""
    return tuple(state for part in program.parts[1:] for state in _part_states(part)[1])


def written_inputs(part: DevicePart) -> frozenset[int]:
    """The flat inputs ``part`` writes in place (their indices), found once per part graph."""
    module = part.graph_module
    cached = _WRITTEN_INPUTS.get(module)
    if cached is None or cached[0] is not module.code:
        indices = frozenset(state.input_index for state in _part_states(part)[1] if state.input_index is not None)
        cached = _WRITTEN_INPUTS[module] = (module.code, indices)
    return cached[1]


_WRITTEN_INPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def returning_state(program: SplitProgram) -> tuple[SplitProgram, tuple[WrittenState, ...]]:
    """``program`` whose parts but 0 also return a copy of each buffer and flat input they write, as flat outputs
    after the model's, and what each of those outputs is; ``program`` itself where no such part writes any."""
    parts, outputs, states = [program.parts[0]], list(program.outputs), []
    for part in program.parts[1:]:
        written, part_states = _part_states(part)
        if written:
            first = len(part.output_specs)
            outputs += [OutputLocation(part.device, first + j) for j in range(len(written))]
            states += part_states
            part = _part_returning(part, written, [_spec(program, part, state) for state in part_states])
        parts.append(part)
    if not states:
        return program, ()
    return dataclasses.replace(program, parts=tuple(parts), outputs=tuple(outputs)), tuple(states)


def write_back(
    program: SplitProgram,
    states: Sequence[WrittenState],
    flat_outputs: Sequence[torch.Tensor],
    flat_inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """Copy the returned state (the last ``len(states)`` flat outputs) into ``program``'s buffers and the caller's
    ``flat_inputs``; the model's flat outputs."""
    model_outputs = len(flat_outputs) - len(states)
    with torch.no_grad():
        for state, value in zip(states, flat_outputs[model_outputs:], strict=True):
            if state.attribute is not None:
                target = operator.attrgetter(state.attribute)(program.parts[state.device].graph_module)
            else:
                target = flat_inputs[state.input_index]
            target.copy_(value)
    return list(flat_outputs[:model_outputs])


def kept_on_ranks(program: SplitProgram) -> str | None:
    """The buffers parts other than part 0 write in place, named (None: none): a server's ranks keep them from one
    request to the next (an input written in place is given anew with every request)."""
    kept = [state for state in written_states(program) if state.attribute is not None]
    if not kept:
        return None
    return ", ".join(map(str, kept[:3])) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")


def warning_at_close(program: SplitProgram, close: Callable[[], None]) -> Callable[[], None]:
    """``close``, followed by a :class:`moirai.errors.StateLeftBehindWarning` where ranks other than 0 write state
    in place (``close`` itself where none does)."""
    states = written_states(program)
    if not states:
        return close

    def close_and_warn() -> None:
        close()
        named = ", ".join(map(str, states[:3])) + (f" and {len(states) - 3} more" if len(states) > 3 else "")
        warnings.warn(
            StateLeftBehindWarning(
                f"the closed server's ranks other than 0 wrote {named} in place; that state ended with their "
                "processes, so later calls of the compiled model (local or run_distributed) start from its values "
                "before the server (but for rank 0's own). Run requests that must see each other's state in one "
                "server, or with compiled(...) or compiled.run_distributed(...), which keep it"
            ),
            stacklevel=user_stacklevel(),
        )

    return close_and_warn


def _part_states(part: DevicePart) -> tuple[list[fx.Node], list[WrittenState]]:
    """The nodes of ``part`` that it writes in place and what each is."""
    placeholders = [node for node in part.graph_module.graph.find_nodes(op="placeholder")][1:]  # after the transport
    input_of = {node: index for node, index in zip(placeholders, part.input_indices, strict=True)}
    written = written_in_place(part.graph_module.graph)
    states = [
        WrittenState(part.device, input_index=input_of[node])
        if node.op == "placeholder"
        else WrittenState(part.device, attribute=str(node.target))
        for node in written
    ]
    return written, states


def _spec(program: SplitProgram, part: DevicePart, state: WrittenState) -> TensorSpec:
    if state.input_index is not None:
        return program.input_specs[state.input_index]
    return tensor_spec(operator.attrgetter(state.attribute)(part.graph_module))


def _part_returning(part: DevicePart, written: Sequence[fx.Node], specs: Sequence[TensorSpec]) -> DevicePart:
    """``part`` also returning a copy of each of ``written`` after its run (a copy: the rank's next request may
    write the tensor while its send is still in flight); the same tensors, so the load carries their values now."""
    graph = fx.Graph()
    values: dict[fx.Node, fx.Node] = {}
    returned = graph.graph_copy(part.graph_module.graph, values)
    copies = [graph.call_function(torch.ops.aten.clone.default, (values[node],)) for node in written]
    graph.output((*returned, *copies))
    module = fx.GraphModule(part.graph_module, graph, class_name=type(part.graph_module).__name__)
    module._tracer_cls = PartTracer
    return dataclasses.replace(part, graph_module=module, output_specs=(*part.output_specs, *specs))
