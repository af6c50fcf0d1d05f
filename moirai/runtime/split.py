"""Split a traced model into one fx GraphModule per device, wired with explicit send/recv nodes.

Example::

    traced = trace(model, (x,))
    program = split_module(traced, node_device, num_devices=3)
    print(program.parts[1].graph_module.code)  # device 1's ops, its receives and its sends
    outputs = run_local(program, traced.flatten_inputs((x,), {}), ["cpu", "cpu", "cpu"])

Each device part is a single GraphModule ``forward(transport, *inputs) -> tuple``. Its first
argument is a transport object (see :class:`Transport`) that the runtime provides: a local
mailbox (:mod:`moirai.runtime.local`) or torch.distributed point-to-point
(:mod:`moirai.runtime.distributed`). Communication is three kinds of ``call_method`` nodes on
it, placed where they belong in the device's execution order::

    recv_linear = transport.post_recv(0)       # where the producer finishes in the global order
    ...                                        # local work that does not need the tensor
    linear = transport.wait_recv(recv_linear)  # right before the first local consumer
    send_relu_to_2 = transport.send(relu, 1)   # right after the producer

Why communication nodes inside one graph per device rather than compute segments between
communication points: a part stays one readable, printable, picklable GraphModule whose code
shows exactly when each tensor arrives and leaves; it runs as generated Python code with no
interpreter loop between segments; and posting a receive early while waiting only before the
first consumer lets a device compute whatever it can while a tensor is in flight.

The order of the nodes follows one global order of all events (ops and transfers) that every
device's order is a restriction of: the merge of the per-device orders (``device_order``, from
a simulated schedule, or fx graph order). Each transfer sits right after its producer in that
order, so every link sees its sends and receives posted in the same order on both ends. That
is what NCCL needs to match point-to-point operations without deadlock (it ignores tags), and
it makes blocking waits safe: every wait depends only on events earlier in the global order.

Placement rules:

- A tensor goes once to each device that consumes it, however many consumers it has there.
- Graph inputs (placeholders) are available to every part that reads them (``input_indices``);
  the distributed runtime ships them from rank 0.
- Parameters, buffers and constants (``get_attr`` nodes) are copied into exactly the parts whose
  ops read them. A parameter read on two devices (a tied embedding and LM head) is copied to
  both: each part gets its own ``Parameter`` object sharing the original storage, so moving one
  part to its device never moves the other's copy. The copies are not kept in sync, which is
  right for inference (the use case) and wrong for training.
- Every flat output is produced by one part (``outputs``); outputs that are graph inputs,
  attributes or shape scalars (``x.shape[0] * 2``) are served by part 0. The runtimes return all outputs on
  device 0.
- Only tensors cross devices. A node whose value is a tuple or list (``split``) must sit on the
  same device as the ``getitem`` nodes that unpack it, as :func:`moirai.frontend.graph.build_op_graph`
  groups them. A scalar of the input shapes (``sym_size``, ``batch * seq``, in a model traced
  with dynamic shapes) is computed by every part that reads it from ``transport.symbol_values``.

Weights may be on ``meta``: the split program can then be inspected but not run.
"""

from __future__ import annotations

import copy
import heapq
import numbers
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.fx as fx

from moirai.errors import PlanError
from moirai.frontend.symbolic_shapes import DynamicDim, shape_operators, shape_scalars
from moirai.frontend.symbolic_shapes import (
    concrete_shape as concrete_shape,  # part of this module's interface for the runtimes
)
from moirai.frontend.trace import ALIGNMENT_BYTES, TensorSpec, TracedModel, check_flat_inputs, tensor_spec
from moirai.frontend.writes import is_view_node, view_base, written_operands
from moirai.progress import stage

if TYPE_CHECKING:
    import sympy

_COMPUTE_OPS = ("call_function", "call_method", "call_module")


class Transport(Protocol):
    """What a part's communication nodes call; the runtime supplies the implementation.

    ``symbol_values`` are this call's dynamic dimensions (:func:`symbol_values`; empty for a
    static program): receive buffers and a part's shape arithmetic are sized from them.
    """

    symbol_values: Mapping[str, int]

    def send(self, tensor: torch.Tensor, transfer_index: int) -> None: ...

    def post_recv(self, transfer_index: int) -> Any: ...

    def wait_recv(self, pending: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class TensorTransfer:
    """Tensor ``tensor`` (an fx node name) goes from device ``src`` to device ``dst``.

    ``index`` is the transfer's position in :attr:`SplitProgram.transfers`, the global posting
    order; the distributed runtime also uses it as the message tag.
    """

    index: int
    tensor: str
    src: int
    dst: int
    spec: TensorSpec


@dataclass(frozen=True)
class OutputLocation:
    """Flat output lives at position ``index`` of the tuple returned by part ``device``."""

    device: int
    index: int


@dataclass(frozen=True, eq=False)
class DevicePart:
    """One device's share: ``graph_module(transport, *[flat_inputs[i] for i in input_indices])``."""

    device: int
    graph_module: fx.GraphModule
    input_indices: tuple[int, ...]
    receives: tuple[TensorTransfer, ...]
    sends: tuple[TensorTransfer, ...]
    output_specs: tuple[TensorSpec | None, ...]
    attribute_names: tuple[str, ...]

    @property
    def idle(self) -> bool:
        """Nothing to do for a request: no inputs, ops, messages or outputs (a device the plan leaves unused)."""
        busy = self.input_indices or self.receives or self.sends or self.output_specs
        return not busy and not any(node.op in _COMPUTE_OPS for node in self.graph_module.graph.nodes)


class PartTracer(fx.Tracer):
    """Traces a part's code again where a pickle of it is loaded (a GraphModule pickles its code, not its graph; a
    user may pickle a program, while ranks load parts as data, moirai.runtime.program_codec), with its
    buffers as ``get_attr`` nodes: the default tracer reads them as plain tensors, so an op on buffers alone (an
    in-place count, ``calls.add_(1)``) would run once while unpickling and be folded into a constant."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.proxy_buffer_attributes = True


@dataclass(frozen=True, eq=False)
class SplitProgram:
    """Every device's part plus what connects them."""

    parts: tuple[DevicePart, ...]
    transfers: tuple[TensorTransfer, ...]
    outputs: tuple[OutputLocation, ...]
    input_specs: tuple[TensorSpec, ...]
    dynamic_dims: tuple[DynamicDim, ...] = ()

    @property
    def num_devices(self) -> int:
        return len(self.parts)

    @property
    def working_ranks(self) -> tuple[int, ...]:
        """Ranks other than 0 whose part has work: a driver sends requests to these only."""
        return tuple(part.device for part in self.parts[1:] if not part.idle)


def symbol_values(program: SplitProgram, flat_inputs: Sequence[torch.Tensor]) -> dict[str, int]:
    """The value of every dynamic dimension at these flat inputs (driver side); InputError unless they fit."""
    return check_flat_inputs(program.input_specs, program.dynamic_dims, flat_inputs, "the program")


@stage("split")
def split_module(
    traced: TracedModel,
    node_device: Mapping[str, int],
    num_devices: int,
    device_order: Sequence[Sequence[str]] | None = None,
) -> SplitProgram:
    """One :class:`DevicePart` per device from a device index for every op of ``traced``.

    ``node_device`` maps every ``call_function``/``call_method``/``call_module`` node name
    (``getitem`` included) to a device in ``range(num_devices)``. ``device_order[k]`` optionally
    lists device ``k``'s node names in execution order; the orders must be jointly consistent
    with the data dependencies (as a simulated schedule's are). Default: fx graph order.
    Raises :class:`moirai.PlanError` when the assignment or the orders do not fit the graph.
    """
    graph = traced.graph_module.graph
    ops = [node for node in graph.nodes if node.op in _COMPUTE_OPS]
    _check_assignment(ops, node_device, num_devices, traced.model_name)
    sequences = [
        _writes_after_reads(sequence) for sequence in _device_sequences(ops, node_device, num_devices, device_order)
    ]
    # [Note: a view of written state crosses as a copy] A view of a buffer or input that its device later writes in
    # place, sent to another device, is sent as a copy made when it is made: the local runner's transfer to the same
    # device is the tensor itself, and a posted gloo send reads its bytes until it completes, so the other device
    # could read the written value.
    sent_as_copies = set().union(*(_views_of_written(sequence) for sequence in sequences))
    scalars = shape_scalars(traced)
    global_order = _merge_orders(sequences, node_device, {node: i for i, node in enumerate(graph.nodes)}, scalars)
    transfers = _transfers([node for node in global_order if node not in scalars], node_device)
    (output_node,) = graph.find_nodes(op="output")
    output_values = output_node.args[0]
    # A shape scalar's value is computed where it is read, so part 0 computes and returns it (as it does a constant).
    output_device = [node_device[v.name] if _is_op(v) and v not in scalars else 0 for v in output_values]
    builders = [_PartBuilder(k, traced.graph_module, scalars) for k in range(num_devices)]
    placeholders = graph.find_nodes(op="placeholder")
    for builder in builders:
        builder.add_inputs_and_attributes(
            placeholders,
            [node for node in sequences[builder.device] if node not in scalars],
            [v for v, d in zip(output_values, output_device, strict=True) if d == builder.device],
        )
    transfers_after: dict[str, list[TensorTransfer]] = {}
    for transfer in transfers:
        transfers_after.setdefault(transfer.tensor, []).append(transfer)
    for node in global_order:
        if node not in scalars:
            builders[node_device[node.name]].add_op(node)
        for transfer in transfers_after.get(node.name, ()):
            builders[transfer.src].add_send(transfer, transfer.tensor in sent_as_copies)
            builders[transfer.dst].add_recv(transfer)
    locations = [
        OutputLocation(device, builders[device].add_output_value(value, position))
        for position, (value, device) in enumerate(zip(output_values, output_device, strict=True))
    ]
    parts = tuple(builder.part(transfers) for builder in builders)
    return SplitProgram(parts, tuple(transfers), tuple(locations), traced.input_specs, traced.dynamic_dims)


def _is_op(value: object) -> bool:
    return isinstance(value, fx.Node) and value.op in _COMPUTE_OPS


def _check_assignment(ops: list[fx.Node], node_device: Mapping[str, int], num_devices: int, model_name: str) -> None:
    if num_devices < 1:
        raise PlanError(f"num_devices must be at least 1, got {num_devices}")
    missing = [node.name for node in ops if node.name not in node_device]
    if missing:
        raise PlanError(
            f"{model_name}: {len(missing)} op(s) have no device, e.g. {', '.join(missing[:5])}; "
            "node_device must map every call_function/call_method/call_module node (getitem included) to a device"
        )
    known = {node.name for node in ops}
    unknown = sorted(set(node_device) - known)
    if unknown:
        raise PlanError(
            f"{model_name}: node_device names {', '.join(unknown[:5])}, which are not ops of the traced graph; "
            "was the plan made for another trace of the model?"
        )
    for name, device in node_device.items():
        if isinstance(device, bool) or not isinstance(device, numbers.Integral) or not 0 <= device < num_devices:
            raise PlanError(
                f"{model_name}: op {name} is assigned to device {device!r}, but devices are 0..{num_devices - 1}"
            )


def _device_sequences(
    ops: list[fx.Node],
    node_device: Mapping[str, int],
    num_devices: int,
    device_order: Sequence[Sequence[str]] | None,
) -> list[list[fx.Node]]:
    by_device: list[list[fx.Node]] = [[] for _ in range(num_devices)]
    for node in ops:
        by_device[node_device[node.name]].append(node)
    if device_order is None:
        return by_device
    if len(device_order) != num_devices:
        raise PlanError(f"device_order has {len(device_order)} entries, expected one per device ({num_devices})")
    sequences = []
    for device, (names, nodes) in enumerate(zip(device_order, by_device, strict=True)):
        node_of = {node.name: node for node in nodes}
        if len(names) != len(node_of) or set(names) != set(node_of):
            extra = sorted(set(names) - set(node_of))[:5]
            absent = sorted(set(node_of) - set(names))[:5]
            raise PlanError(
                f"device_order[{device}] must list each op assigned to device {device} exactly once "
                f"(not on that device: {extra or 'none'}; missing: {absent or 'none'}; "
                f"{len(names)} names for {len(node_of)} ops)"
            )
        sequences.append([node_of[name] for name in names])
    return sequences


def _writes_after_reads(sequence: list[fx.Node]) -> list[fx.Node]:
    """One device's ops with each in-place write after every op of the device that reads the tensor it writes as it
    was before the write (a view made of it included): the device's order, stably sorted by its data edges and those.

    A functionalized graph ends with a ``copy_`` of each updated buffer's or input's new value into it, and its
    readers of the old value (``y - self.average`` before ``self.average.mul_(0.9)``) have no data edge to it: a
    plan's order may put the write first (an op waiting for another device's tensor runs after it), and the reader
    would see the new value. A write whose result an op reads, here or on another device, stays where it is. One
    sort rather than one move per write: a write that also reads (``self.prev.copy_(self.cur)``) may have to come
    after another write's readers and before a third write.
    """
    on_device = set(sequence)
    before: dict[fx.Node, set[fx.Node]] = {}
    for writer in sequence:
        written = written_operands(writer)
        if not written or any(user.op != "output" for user in writer.users):
            continue  # an op reads what it wrote: data edges order it, on this device or through another
        readers = {reader for operand in written for reader, _ in _aliases_of(operand, writer)} & on_device
        if readers:
            before[writer] = readers
    if not before:
        return list(sequence)
    position = {node: index for index, node in enumerate(sequence)}
    # The data edges the device's order already keeps (a shape scalar it reads is computed where it is read, so may
    # come later in the order), and the reads before each write.
    waits_for = {
        node: {p for p in node.all_input_nodes if p in on_device and position[p] < position[node]}
        | before.get(node, set())
        for node in sequence
    }
    users: dict[fx.Node, list[fx.Node]] = {node: [] for node in sequence}
    for node, predecessors in waits_for.items():
        for predecessor in predecessors:
            users[predecessor].append(node)
    remaining = {node: len(predecessors) for node, predecessors in waits_for.items()}
    ready = [position[node] for node in sequence if remaining[node] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        node = sequence[heapq.heappop(ready)]
        order.append(node)
        for user in users[node]:
            remaining[user] -= 1
            if remaining[user] == 0:
                heapq.heappush(ready, position[user])
    if len(order) != len(sequence):  # writes that each read what the other writes: the device's order as given
        return list(sequence)
    return order


def _aliases_of(written: fx.Node, writer: fx.Node) -> Iterator[tuple[fx.Node, bool]]:
    """Each op other than ``writer`` that reads the tensor ``written`` views (itself, or any view of it, the views
    included: one may be sent to another device), not through an in-place op's result (which holds the written
    value); with whether it is a view itself."""
    base = view_base(written)
    seen, frontier = {base}, [base]
    while frontier:
        alias = frontier.pop()
        for user in alias.users:
            if user is writer or user in seen or any(target is alias for target in written_operands(user)):
                continue
            seen.add(user)
            view = is_view_node(user)
            if view:
                frontier.append(user)
            yield user, view


def _views_of_written(sequence: list[fx.Node]) -> set[str]:
    """The views, made on this device, of a tensor an op of the device writes in place: one sent to another device
    is sent as a copy ([Note: a view of written state crosses as a copy])."""
    views = set()
    for writer in sequence:
        for operand in written_operands(writer):
            views |= {user.name for user, view in _aliases_of(operand, writer) if view}
    return views


def _merge_orders(
    sequences: list[list[fx.Node]],
    node_device: Mapping[str, int],
    position: Mapping[fx.Node, int],
    scalars: Mapping[fx.Node, Any],
) -> list[fx.Node]:
    """One global order of all ops that every device's sequence is a restriction of.

    Among the devices whose next op has all its inputs computed, the op earliest in the fx
    graph goes first; when no device can proceed the per-device orders contradict the data
    dependencies.
    """
    heads = [0] * len(sequences)
    done: set[fx.Node] = set()
    merged: list[fx.Node] = []

    def ready(node: fx.Node) -> bool:
        return all(p in done for p in node.all_input_nodes if _is_op(p) and p not in scalars)

    total = sum(len(s) for s in sequences)
    while len(merged) < total:
        candidates = [s[h] for s, h in zip(sequences, heads, strict=True) if h < len(s) and ready(s[h])]
        if not candidates:
            blocked = [
                f"device {k} runs {s[h].name} next, which needs "
                + ", ".join(
                    f"{p.name} (device {node_device[p.name]})"
                    for p in s[h].all_input_nodes
                    if _is_op(p) and p not in done and p not in scalars
                )
                for k, (s, h) in enumerate(zip(sequences, heads, strict=True))
                if h < len(s)
            ]
            raise PlanError(
                "device_order contradicts the data dependencies: "
                + "; ".join(blocked)
                + ". Each device's order must run an op after every op it reads, in a schedule all devices share."
            )
        node = min(candidates, key=position.__getitem__)
        heads[node_device[node.name]] += 1
        done.add(node)
        merged.append(node)
    return merged


def _transfers(global_order: list[fx.Node], node_device: Mapping[str, int]) -> list[TensorTransfer]:
    """One transfer per (tensor, remote consuming device), in the global order of their producers."""
    transfers: list[TensorTransfer] = []
    for node in global_order:
        src = node_device[node.name]
        remote = sorted({node_device[user.name] for user in node.users if _is_op(user)} - {src})
        if not remote:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            consumers = sorted(user.name for user in node.users if _is_op(user) and node_device[user.name] != src)
            raise PlanError(
                f"{node.name} (device {src}) produces a {type(value).__name__}, not a tensor, and is read by "
                f"{', '.join(consumers)} on device(s) {remote}; only tensors can cross devices: put the ops that "
                f"unpack it (getitem) on device {src}"
            )
        spec = _spec_of(node)
        transfers += [TensorTransfer(len(transfers) + i, node.name, src, dst, spec) for i, dst in enumerate(remote)]
    return transfers


class _PartBuilder:
    """Builds one device's graph node by node, in the global order."""

    def __init__(self, device: int, source: fx.GraphModule, scalars: Mapping[fx.Node, sympy.Expr]) -> None:
        self.device = device
        self.source = source
        self.scalars = scalars
        self.symbol_nodes: dict[str, fx.Node] = {}
        self.graph = fx.Graph()
        self.transport = self.graph.placeholder("transport")
        self.env: dict[str, fx.Node] = {}
        self.pending_receives: dict[str, fx.Node] = {}
        self.input_indices: list[int] = []
        self.attributes: dict[str, torch.Tensor | torch.nn.Module] = {}
        self.output_values: list[fx.Node] = []
        self.output_index: dict[fx.Node, int] = {}  # where a node this part returns is in its outputs

    def add_inputs_and_attributes(
        self, placeholders: list[fx.Node], ops: Sequence[fx.Node], outputs: Iterable[object]
    ) -> None:
        """Placeholders for the flat inputs, get_attr nodes and submodules this part reads."""
        read = {n for op in ops for n in op.all_input_nodes}
        read |= {v for v in outputs if isinstance(v, fx.Node)}
        for index, placeholder in enumerate(placeholders):
            if placeholder in read:
                self.input_indices.append(index)
                self.env[placeholder.name] = self.graph.node_copy(placeholder)
        for node in sorted((n for n in read if n.op == "get_attr"), key=lambda n: n.name):
            self.attributes[node.target] = _detached_copy(_fetch_attribute(self.source, node.target))
            self.env[node.name] = self.graph.node_copy(node)
        for op in ops:
            if op.op == "call_module":
                # symbolic_trace graphs call leaf modules; a copy keeps parts independent like tensors above.
                self.attributes[op.target] = copy.deepcopy(self.source.get_submodule(op.target))

    def add_op(self, node: fx.Node) -> None:
        """Copy ``node``, first waiting for any received input not yet waited for."""
        for producer in node.all_input_nodes:
            pending = self.pending_receives.pop(producer.name, None)
            if pending is not None:
                wait = self.graph.create_node("call_method", "wait_recv", (self.transport, pending), name=producer.name)
                wait.meta["val"] = producer.meta.get("val")  # strides included: [Note: a received tensor keeps ...]
                self.env[producer.name] = wait
        self.env[node.name] = self.graph.node_copy(node, self.local_value)

    def local_value(self, node: fx.Node) -> Any:
        """This part's value for ``node``; a shape scalar is computed here on first use."""
        if node.name not in self.env and node in self.scalars:
            self.env[node.name] = self._emit_shape_arithmetic(self.scalars[node])
        return self.env[node.name]

    def _emit_shape_arithmetic(self, expr: sympy.Basic) -> Any:
        import sympy  # where a program has symbolic sizes only ([Note: what a rank imports])

        if expr.is_Integer:
            return int(expr)
        if expr in (sympy.true, sympy.false):
            return bool(expr)
        if expr.is_Symbol:
            name = str(expr)
            if name not in self.symbol_nodes:
                if not self.symbol_nodes:
                    values = self.graph.create_node("call_function", getattr, (self.transport, "symbol_values"))
                    self.symbol_nodes[""] = values
                getter = (self.symbol_nodes[""], name)
                self.symbol_nodes[name] = self.graph.create_node("call_function", operator.getitem, getter, name=name)
            return self.symbol_nodes[name]
        if isinstance(expr, sympy.Pow):
            return self.graph.create_node(
                "call_function", operator.pow, (self._emit_shape_arithmetic(expr.base), int(expr.exp))
            )
        function = shape_operators()[type(expr)]
        result, *rest = (self._emit_shape_arithmetic(arg) for arg in expr.args)
        for operand in rest:  # Add, Mul, Max and Min take any number of terms
            result = self.graph.create_node("call_function", function, (result, operand))
        return result

    def add_send(self, transfer: TensorTransfer, as_copy: bool) -> None:
        """Send the tensor; ``as_copy`` sends a copy of it ([Note: a view of written state crosses as a copy])."""
        value = self.env[transfer.tensor]
        if as_copy:
            snapshot = self.graph.call_function(torch.ops.aten.clone.default, (value,))
            snapshot.meta["val"] = value.meta.get("val")
            value = snapshot
        args = (self.transport, value, transfer.index)
        self.graph.create_node("call_method", "send", args, name=f"send_{transfer.tensor}_to_{transfer.dst}")

    def add_recv(self, transfer: TensorTransfer) -> None:
        args = (self.transport, transfer.index)
        post = self.graph.create_node("call_method", "post_recv", args, name=f"recv_{transfer.tensor}")
        self.pending_receives[transfer.tensor] = post

    def add_output_value(self, value: object, position: int) -> int:
        """Return ``value`` from this part; the runtimes gather non-tensor outputs from part 0 only.

        A node the model returns twice is returned once, and both flat outputs name that place: the runtimes gather
        it once and give the caller one tensor twice, as the model did.
        """
        if self.device != 0 and not isinstance(_spec_of(value), TensorSpec):
            raise PlanError(
                f"flat output {position} ({value}) is not a tensor but is produced on device {self.device}; "
                "only tensors cross devices: put its producer on device 0"
            )
        if not isinstance(value, fx.Node):
            self.output_values.append(value)
            return len(self.output_values) - 1
        if value not in self.output_index:
            self.output_index[value] = len(self.output_values)
            self.output_values.append(self.local_value(value))
        return self.output_index[value]

    def part(self, transfers: Sequence[TensorTransfer]) -> DevicePart:
        self.graph.output(tuple(self.output_values))
        self.graph.lint()
        graph_module = fx.GraphModule(self.attributes, self.graph, class_name=f"Device{self.device}Part")
        graph_module._tracer_cls = PartTracer  # how unpickling a part traces its code again (see there)
        return DevicePart(
            device=self.device,
            graph_module=graph_module,
            input_indices=tuple(self.input_indices),
            receives=tuple(t for t in transfers if t.dst == self.device),
            sends=tuple(t for t in transfers if t.src == self.device),
            output_specs=tuple(_spec_of(v) for v in self.output_values),
            attribute_names=tuple(self.attributes),
        )


# [Note: a received tensor keeps its traced strides] A message carries a tensor's bytes contiguous, so a tensor that was
# not (a transpose, a slice, an expand) arrived contiguous: an op on it could round differently from the model (a
# linear on a transposed input takes another kernel, 1 ulp off) and a view traced on the strided original could fail
# or read other elements (fuzz seed 63). So every receive of a tensor whose traced layout is static gives it its traced
# strides back (TensorSpec.stride; the transfers between parts and the outputs rank 0 gathers, in
# moirai.runtime.protocol), and the local runner, whose ``.to`` keeps a tensor on its own device as it is, gives one
# moved to another device the strides it had. The same holds for where the first element lies: every allocation starts
# on a 64-byte boundary, and a kernel may vectorise differently where its input does not (on an AMD EPYC, a linear on
# rows 1, 3 and 5 of another linear's output, 24 bytes past the boundary, rounds 1 ulp off the same rows received at
# 0), so a received tensor is placed as far past the boundary as it was traced (TensorSpec.offset_bytes). Done by the
# transports rather than by nodes in the part's graph, so that the local runner copies nothing it passes as it is; a
# contiguous tensor at a boundary, nearly all, costs nothing. A layout with a symbolic size or stride crosses
# contiguous. A flat input's layout is the caller's, not the trace's: the request's header carries it where it is not a
# new tensor's (moirai.runtime.protocol.InputLayout; rows 4 bytes past the boundary were 1 ulp off too). And a view of
# a parameter requires grad in the model, also under no_grad, which ``matmul`` asks (it folds a batch into one ``mm``
# only then: a linear on a received slice of MultiheadAttention's ``in_proj_weight`` was 1 ulp off), so a received
# tensor requires grad where the model's did (TensorSpec.requires_grad; a flat input's, InputLayout's).
def with_layout(
    tensor: torch.Tensor, stride: tuple[int, ...] | None, offset_bytes: int = 0, requires_grad: bool = False
) -> torch.Tensor:
    """``tensor``'s values laid out with ``stride`` (a spec's, or the sent tensor's; None: ``tensor``'s own) and their
    first element ``offset_bytes`` past an alignment boundary, requiring grad if ``requires_grad`` (a leaf: no graph
    is recorded), or ``tensor`` itself where it is so already ([Note: a received tensor keeps its traced strides]).

    A dimension of stride 0 (``expand``) holds one element in memory, written once; a layout whose elements overlap
    otherwise (``as_strided``) cannot be written into and stays as received.
    """
    laid_out = _laid_out(tensor, tensor.stride() if stride is None else stride, offset_bytes)
    if requires_grad and not laid_out.requires_grad:
        laid_out = laid_out.detach().requires_grad_(True)
    return laid_out


def _laid_out(tensor: torch.Tensor, stride: tuple[int, ...], offset_bytes: int) -> torch.Tensor:
    if tensor.stride() == stride and tensor.data_ptr() % ALIGNMENT_BYTES == offset_bytes or tensor.numel() == 0:
        return tensor
    offset = offset_bytes // tensor.element_size()
    extent = 1 + sum((size - 1) * step for size, step in zip(tensor.shape, stride, strict=True))
    laid_out = tensor.new_empty(offset + extent).as_strided(tensor.shape, stride, offset)
    target, source = laid_out, tensor
    for dim, step in enumerate(stride):
        if step == 0:
            target, source = (
                target.narrow(dim, 0, min(1, tensor.shape[dim])),
                source.narrow(dim, 0, min(1, tensor.shape[dim])),
            )
    if _overlaps(target.shape, target.stride()):
        return tensor
    target.copy_(source)
    return laid_out


def _overlaps(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two elements of a layout share memory: each dimension's stride, smallest first, must step past the
    extent of those before it."""
    extent = 1
    for step, size in sorted((step, size) for step, size in zip(stride, shape, strict=True) if size > 1):
        if step < extent:
            return True
        extent = step * (size - 1) + extent
    return False


def _spec_of(value: object) -> TensorSpec | None:
    """The spec of a node's tensor, which requires grad where the model's does ([Note: a received tensor keeps its
    traced strides]): a view of a parameter that requires grad, which a trace's value does not say."""
    meta = value.meta.get("val") if isinstance(value, fx.Node) else value
    if not isinstance(meta, torch.Tensor):
        return None
    spec = tensor_spec(meta)
    base = view_base(value) if isinstance(value, fx.Node) else None
    if base is not None and base.op == "get_attr" and isinstance(base.target, str):
        attribute = _fetch_attribute(base.graph.owning_module, base.target)
        if isinstance(attribute, torch.Tensor) and attribute.requires_grad:
            return replace(spec, requires_grad=True)
    return spec


def _fetch_attribute(module: torch.nn.Module, target: str) -> torch.Tensor | torch.nn.Module:
    value: Any = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _detached_copy(value: torch.Tensor | torch.nn.Module) -> torch.Tensor | torch.nn.Module:
    """A new tensor object on the same storage, so each part can be moved on its own.

    Submodules read by ``get_attr`` (the branches of ``torch.cond``) are deep copies.
    """
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(value.detach(), requires_grad=value.requires_grad)
    if isinstance(value, torch.Tensor):
        return value.detach()
    return copy.deepcopy(value)
