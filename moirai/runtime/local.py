"""Run every part of a :class:`~moirai.runtime.split.SplitProgram` in this process.

Example::

    outputs = run_local(program, flat_inputs, ["cuda:0", "cuda:1", "cpu"])

One thread runs the parts node by node in a fixed order: part 0 until it must wait for a
tensor not yet sent, then part 1, and so on round the parts until all have finished. A sent
tensor is moved to its receiving device with ``.to``. Outputs are returned on
the first device. Each part is moved to its device in place (like ``Module.to``), so repeated
calls do not copy weights again. A part that writes a flat input in place writes a copy of its own, copied into the
caller's tensor once every part has run (:class:`_OwnCopies`), as every rank of a distributed run has its own.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from moirai.errors import InputError, PlanError
from moirai.frontend.trace import ALIGNMENT_BYTES, retarget_devices
from moirai.runtime.split import DevicePart, SplitProgram, TensorTransfer, symbol_values, with_layout
from moirai.runtime.written_state import written_inputs


def run_local(
    program: SplitProgram, flat_inputs: Sequence[torch.Tensor], torch_devices: Sequence[str]
) -> list[torch.Tensor]:
    """The program's flat outputs, on ``torch_devices[0]``; part ``k`` runs on ``torch_devices[k]``."""
    if len(torch_devices) != program.num_devices:
        raise InputError(
            f"the program has {program.num_devices} parts but {len(torch_devices)} torch devices were given; "
            "give one torch device per part"
        )
    values = check_inputs(program, flat_inputs)
    devices = [torch.device(d) for d in torch_devices]
    transport = _LocalTransport(program.transfers, devices, values)
    own_copies = _OwnCopies(flat_inputs)
    with torch.no_grad():
        runs = [
            _PartRun(
                place_part(part, device),
                [transport, *(own_copies.part_input(part, i, device) for i in part.input_indices)],
            )
            for part, device in zip(program.parts, devices, strict=True)
        ]
        while not all(run.finished for run in runs):
            if not any([run.advance(transport) for run in runs]):
                blocked = ", ".join(f"part {k} at {run.next_node}" for k, run in enumerate(runs) if not run.finished)
                raise PlanError(f"the parts wait for each other's tensors ({blocked}); was a part's graph edited?")
        own_copies.write_back()
    # Each place once: a tensor the model returns twice is one tensor twice, as it is from the other runners.
    gathered = {at: _to(own_copies.as_given(runs[at.device].outputs[at.index]), devices[0]) for at in program.outputs}
    return [gathered[at] for at in program.outputs]


def check_inputs(program: SplitProgram, flat_inputs: Sequence[torch.Tensor]) -> dict[str, int]:
    """The value of every dynamic dimension; :class:`moirai.InputError` unless the inputs fit the traced specs."""
    return symbol_values(program, flat_inputs)


def place_part(part: DevicePart, device: torch.device) -> fx.GraphModule:
    """The part's module with its attributes on ``device`` and its ops' device arguments set to it.

    Traced graphs record the device of tracing in ops that create tensors
    (:func:`moirai.frontend.trace.retarget_devices`); each part must create them on its own device instead. Placed
    once per device: later calls of the local runner find the part where it is.
    """
    module = part.graph_module
    if _PLACED.get(module) == device:
        return module
    if device.type != "meta":
        refuse_meta_weights([part])
    module.to(device)
    retarget_devices(module, device)
    _PLACED[module] = device
    return module


_PLACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def refuse_meta_weights(parts: Sequence[DevicePart]) -> None:
    """An :class:`InputError` where a part holds a weight or buffer on the meta device, saying how to run it."""
    for part in parts:
        module = part.graph_module
        on_meta = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if on_meta:
            raise InputError(
                f"part {part.device} holds {', '.join(on_meta[:3])} on the meta device; a program split from a "
                "model with meta weights can be inspected but not run: save its plan (.save(path)) and load that "
                "with the model of real weights (moirai.load, or moirai.load_lm for compile_lm's)"
            )


class _OwnCopies:
    """The inputs of one call as each part takes them: a part that writes a flat input in place writes a copy of its
    own, which :meth:`write_back` copies into the caller's tensor once every part has run.

    The parts run interleaved in one process, and ``.to`` a tensor's own device is the tensor itself: a write into
    the caller's tensor (functionalization's ``copy_`` into an input, the write's last step in the traced graph) could
    run before another part's read of the input as the call gave it (``x.clamp_(min=0)`` after two towers read
    ``x``). Each rank of a distributed run has its own copy anyway; this gives the local runner the same.
    """

    def __init__(self, flat_inputs: Sequence[torch.Tensor]) -> None:
        self._flat_inputs = flat_inputs
        self._copies: dict[int, tuple[int, torch.Tensor]] = {}  # id of a copy -> (flat input index, the copy)

    def part_input(self, part: DevicePart, index: int, device: torch.device) -> torch.Tensor:
        value = self._flat_inputs[index].to(device)
        if index not in written_inputs(part):
            return value
        if value is self._flat_inputs[index]:
            value = value.clone()
        self._copies[id(value)] = (index, value)
        return value

    def write_back(self) -> None:
        """Copy what the parts wrote into their copies into the caller's tensors."""
        for index, copy in self._copies.values():
            self._flat_inputs[index].copy_(copy)

    def as_given(self, output: object) -> object:
        """``output``, or the caller's tensor where ``output`` is a part's copy of it (an in-place write returns its
        input: eager's output is the caller's tensor)."""
        index, _ = self._copies.get(id(output), (None, None))
        return output if index is None else self._flat_inputs[index]


class _PartRun:
    """One part run node by node; it pauses at a wait for a tensor that has not been sent yet.

    A plain loop over the nodes rather than :class:`torch.fx.Interpreter`, whose per-node bookkeeping cost more
    than the ops of a small part; values are freed after their last use, as the part's generated code frees them.
    """

    def __init__(self, module: fx.GraphModule, args: list) -> None:
        self._module = module
        self._env: dict[fx.Node, Any] = {}
        self._args = iter(args)
        self._nodes, self._frees = _steps(module)
        self._position = 0
        self.outputs: tuple = ()

    @property
    def finished(self) -> bool:
        return self._position == len(self._nodes)

    @property
    def next_node(self) -> str:
        return self._nodes[self._position].format_node()

    def advance(self, transport: _LocalTransport) -> bool:
        """Run until blocked or finished; whether any node ran."""
        start, env = self._position, self._env
        while not self.finished:
            node = self._nodes[self._position]
            if node.target == "wait_recv" and not transport.delivered(env[node.args[1]]):
                break
            if node.op == "placeholder":
                value = next(self._args)
            elif node.op == "get_attr":
                value = operator.attrgetter(node.target)(self._module)
            else:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                if node.op == "call_function":
                    value = node.target(*args, **kwargs)
                elif node.op == "call_method":
                    value = getattr(args[0], node.target)(*args[1:], **kwargs)
                elif node.op == "call_module":
                    value = self._module.get_submodule(node.target)(*args, **kwargs)
                else:  # output
                    value = self.outputs = args[0]
            env[node] = value
            for finished in self._frees[self._position]:
                del env[finished]
            self._position += 1
        return self._position > start


def _steps(module: fx.GraphModule) -> tuple[list[fx.Node], list[tuple[fx.Node, ...]]]:
    """The module's nodes and, per node, the values whose last use it is (computed again after a recompile, which
    an edit of the graph needs for the distributed runtime's generated code too)."""
    cached = _STEPS.get(module)
    if cached is None or cached[0] is not module.code:
        nodes = list(module.graph.nodes)
        last_use: dict[fx.Node, int] = {}
        for position, node in enumerate(nodes):
            for used in node.all_input_nodes:
                last_use[used] = position
        frees: list[list[fx.Node]] = [[] for _ in nodes]
        for used, position in last_use.items():
            frees[position].append(used)
        cached = _STEPS[module] = (module.code, nodes, [tuple(f) for f in frees])
    return cached[1], cached[2]


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _LocalTransport:
    """Sends are moved to the receiving device at once and kept until waited for."""

    def __init__(
        self, transfers: Sequence[TensorTransfer], devices: Sequence[torch.device], symbol_values: Mapping[str, int]
    ) -> None:
        self._transfers = transfers
        self._devices = devices
        self.symbol_values = symbol_values
        self._delivered: dict[int, torch.Tensor] = {}

    def send(self, tensor: torch.Tensor, transfer_index: int) -> None:
        self._delivered[transfer_index] = _to(tensor, self._devices[self._transfers[transfer_index].dst])

    def post_recv(self, transfer_index: int) -> int:
        return transfer_index

    def wait_recv(self, pending: int) -> torch.Tensor:
        return self._delivered.pop(pending)

    def delivered(self, pending: int) -> bool:
        return pending in self._delivered


def _to(value: object, device: torch.device) -> object:
    """``value`` on ``device``: a tensor already there as it is (``.to`` copies nothing), one moved there with its
    strides, alignment and need of grad, as a message's keeps them ([Note: a received tensor keeps its traced strides],
    split.py)."""
    if not isinstance(value, torch.Tensor):
        return value
    moved = value.to(device)
    if moved is value:
        return value
    return with_layout(moved, value.stride(), value.data_ptr() % ALIGNMENT_BYTES, value.requires_grad)
