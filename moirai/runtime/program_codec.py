"""A split program as bytes another rank can load without running anything the bytes say: no pickle.

Rank 0 sends every other rank its part of a program (:func:`moirai.runtime.protocol.program_for_rank`) in a load
header's payload, over gloo or shared memory and, under torchrun, between hosts. The header is authenticated with
the run's secret, but a payload is still something a socket hands a rank, and unpickling it could run any code the
bytes name. So a program travels as data:

- a JSON description: the program's wiring (transfers, outputs, input specs, dynamic dimensions), and each part's
  graph as a list of nodes whose targets are names, looked up on the receiving side in a closed vocabulary:
  ``aten``'s forward operators by schema name (``aten::add.Tensor``; see [Note: which operators a part may call]), a few
  higher-order ops whose operands are graphs, the arithmetic of :mod:`operator` and :mod:`math` and torch's
  ``sym_*`` functions (shape arithmetic), and the part's transport (:class:`moirai.runtime.split.Transport`): its
  methods and its ``symbol_values``, on the transport only;
- the raw bytes of every tensor storage the parts hold, each once (tied weights stay tied), with each tensor's dtype,
  shape, strides and offset into its storage; a rank gets them on the CPU and places its part itself. A storage of
  zeros (a KV cache no sequence has written) travels as its size, one written in part as its size and the blocks
  that are not zero, and the rank maps zero pages of its own (:mod:`moirai.runtime.zero_pages`); a meta one
  travels as its size too.

Decoding builds each part with ``fx.Graph.create_node`` and :class:`torch.fx.GraphModule`, the way the splitter
builds it. fx turns a graph into Python source, so every name of the payload that fx writes into that source (node
names, placeholders, keywords, the class name) must be a plain identifier that none of fx's own names (``self``,
``torch``, ...) shadows, and every attribute a node reads must be the tensor or graph the payload put there, not a
method of the module; anything else, or a payload that does not parse, is a :class:`moirai.DistributedError` that
names what was wrong. What remains trusted is torch's own checking of an operator's arguments. A part the vocabulary
cannot describe (a model traced by ``symbolic_trace`` that calls its own Python function or module) is a
:class:`moirai.PlanError` on rank 0, before anything is sent: such a program runs in one process (``run_local``).

Layout: 8 bytes (little-endian length of the description), the description (UTF-8 JSON), the storages in order.
"""

from __future__ import annotations

import builtins
import json
import keyword
import math
import operator
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy
import torch
import torch.fx as fx

from moirai.errors import DistributedError, PlanError
from moirai.frontend.symbolic_shapes import DynamicDim
from moirai.frontend.trace import ALIGNMENT_BYTES, TensorSpec
from moirai.runtime.split import DevicePart, OutputLocation, SplitProgram, TensorTransfer, Transport
from moirai.runtime.zero_pages import written_runs, zeros_on_demand

FORMAT_VERSION = 4  # 3: a tensor spec holds its strides; 4: and its offset past an alignment boundary and its grad
_LENGTH = struct.Struct("<Q")
_IDENTIFIER = re.compile(r"(?!__)[A-Za-z_][A-Za-z0-9_]*")  # always fullmatch: "$" would let a newline through
_OPERATOR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


_TRANSPORT_METHODS = frozenset(name for name in vars(Transport) if not name.startswith("_"))
# Names fx's generated code means for itself (the module, and the globals it imports): a node, a placeholder or a
# keyword of that name would rebind them (a nested graph's node "self" reads attributes of any value).
_RESERVED_NAMES = frozenset({"self", "torch", "device", "inf", "nan", "NoneType", "fx_pytree", "pytree"})
_PROBE = fx.GraphModule(torch.nn.Module(), fx.Graph())  # what a module has of its own: methods, hooks, state
_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
# [Note: which operators a part may call] aten's forward operators, whose arguments torch checks. Refused: other
# namespaces (prims skips checks aten makes); operators that open a file by name (a str argument named so:
# aten::from_file read /etc/passwd; einsum's int[]? path is its contraction order); and, since three reviews found
# ops that trust their sizes, strides, offsets or indices and so read and write the rank's memory beyond their
# tensors (_reshape_alias read the run's secret; segment_reduce, _cummax_helper, max_pool2d_with_indices_backward,
# _convert_indices_from_coo_to_csr, sparse_coo_tensor + to_dense and others corrupted the heap or crashed), every
# class those came from: aten's private operators (an underscore name) but the few an exported inference graph holds
# (each takes tensors whose sizes torch checks, or none: _conj, the conj-bit view Tensor.conj makes; _weight_norm,
# whose g smaller than v's first dimension crashed a process, in a checked form only: [Note: operators a part calls
# in a checked form]), backward operators, sparse, nested and
# quantized tensors, and out= variants. A graph torch.export traces for inference calls none of them (bench's zoo,
# the test models and six decoder families were scanned).
_OPERATOR_NAMESPACES = frozenset({"aten"})
_FILE_ARGUMENTS = frozenset({"filename", "path", "file"})
_PRIVATE_OPERATORS_ALLOWED = frozenset(
    (
        "_to_copy _unsafe_view _assert_tensor_metadata _assert_scalar _assert_async _functional_assert_async "
        "_functional_assert_scalar _local_scalar_dense _softmax _log_softmax _safe_softmax _reshape_copy "
        "_native_batch_norm_legit _native_batch_norm_legit_no_training _native_batch_norm_legit_functional "
        "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_efficient_attention "
        "_scaled_dot_product_flash_attention _scaled_dot_product_cudnn_attention _scaled_dot_product_attention_math "
        "_conj"
    ).split()
)
_REFUSED_WORDS = ("backward", "sparse", "nested", "dense", "quantize", "mkldnn", "_helper", "segment_reduce")
_UNCHECKED_OPERATORS = frozenset({"set_", "set", "unsafe_set", "from_file", "save"})
_TRANSPORT_ATTRIBUTE = "symbol_values"  # the one attribute a part reads off its transport (shape arithmetic)
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEMORY_FORMATS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.memory_format)}
# Higher-order ops whose operands are graphs and tensors (an exported graph's control flow and its wrappers); the
# others run what their operands name (a kernel, a script object) and are not loaded.
_HIGHER_ORDER_OPS = frozenset(
    {
        "cond",
        "while_loop",
        "map_impl",
        "wrap_with_set_grad_enabled",
        "wrap_with_autocast",
        "auto_functionalized",
        "auto_functionalized_v2",
        "with_effects",
    }
)
# Pure arithmetic, comparisons and indexing: never operator.call, attrgetter or methodcaller, which call what a
# graph hands them.
_OPERATOR_FUNCTIONS = (
    "abs add and_ eq floordiv ge getitem gt index inv invert le lshift lt mod mul ne neg not_ or_ pos pow rshift "
    "sub truediv truth xor"
).split()


def _placeholder_fits(target: Any, name: str) -> bool:
    """Whether a placeholder's target may be the parameter name fx writes for it: its node's own name, or a builtin's
    that fx gave the node a suffix for (``forward(self, input)``, node ``input_1``). No other: a parameter named as a
    global fx gives a call (``math_floor``, ``getattr``) would stand in for that function."""
    if target == name:
        return True
    suffixed = re.fullmatch(rf"{re.escape(str(target))}_\d+", name) is not None
    return suffixed and _is_plain_name(target) and target in vars(builtins) and target != "getattr"


def _name_fits(op: str, name: Any, target: Any) -> bool:
    """Whether a node's name (and a placeholder's target) may be written into fx's generated code as they are."""
    return _is_plain_name(name) and (op != "placeholder" or _placeholder_fits(target, name))


def _is_plain_name(name: Any) -> bool:
    """A name fx may write into generated code as it is: an identifier, no keyword, none of fx's own."""
    return (
        isinstance(name, str)
        and _OPERATOR_NAME.fullmatch(name) is not None
        and not keyword.iskeyword(name)
        and name not in _RESERVED_NAMES
    )


def _python_functions() -> dict[str, Callable[..., Any]]:
    """The plain Python callables a part may call, by name: shape arithmetic, ``getattr``, torch's sym functions."""
    functions: dict[str, Any] = {"builtins.getattr": builtins.getattr}
    functions |= {f"operator.{name}": getattr(operator, name) for name in _OPERATOR_FUNCTIONS}
    functions |= {f"math.{n}": getattr(math, n) for n in dir(math) if not n.startswith("_")}
    functions |= {f"torch.{n}": getattr(torch, n) for n in dir(torch) if n.startswith("sym_")}
    return {name: function for name, function in functions.items() if callable(function)}


def _checked_weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``aten._weight_norm`` (``parametrizations.weight_norm``: wav2vec2's positional conv, HiFi-GAN) once its
    arguments are checked: its fused kernel reads ``g`` by ``v``'s size at ``dim`` and writes past a smaller one."""
    if not (isinstance(v, torch.Tensor) and isinstance(g, torch.Tensor) and isinstance(dim, int)):
        raise TypeError(f"_weight_norm takes two tensors and a dimension, got {type(v)}, {type(g)}, {type(dim)}")
    if g.dtype != v.dtype or g.device != v.device:
        raise ValueError(f"_weight_norm's g is {g.dtype} on {g.device}, its v {v.dtype} on {v.device}")
    if 0 <= dim < v.dim() and g.numel() != v.shape[dim]:
        raise ValueError(f"_weight_norm's g has {g.numel()} values for v's {v.shape[dim]} at dimension {dim}")
    if v.numel() == 0:  # the fused kernel divides by v's size at dim: a SIGFPE at 0 (eager torch's too)
        raise ValueError(f"_weight_norm of an empty v (shape {tuple(v.shape)}): its kernel would divide by zero")
    return torch._weight_norm(v, g, dim)


# [Note: operators a part calls in a checked form] A private operator ordinary models call but whose kernel trusts
# its arguments: the sender names the checked function in its place, the rank looks that up like the functions
# above, and it checks the arguments before it calls the operator (the values are the operator's own).
_CHECKED_OPERATORS: dict[torch._ops.OpOverload, tuple[str, Callable[..., Any]]] = {
    torch.ops.aten._weight_norm.default: ("moirai.checked._weight_norm", _checked_weight_norm),
}
_FUNCTIONS = _python_functions() | dict(_CHECKED_OPERATORS.values())
_FUNCTION_NAMES = {id(function): name for name, function in _FUNCTIONS.items()}


@dataclass(frozen=True)
class EncodedProgram:
    """A program's description and the storages it carries; :meth:`to_bytes` joins them."""

    description: bytes
    sent_storages: tuple[torch.Tensor, ...]  # one-dimensional uint8 tensors over those whose bytes are sent

    @property
    def num_bytes(self) -> int:
        return _LENGTH.size + len(self.description) + sum(s.numel() for s in self.sent_storages)

    def to_bytes(self) -> bytes:
        chunks = [_LENGTH.pack(len(self.description)), self.description]
        chunks += [memoryview(s.cpu().numpy()) for s in self.sent_storages]  # copied by the join
        return b"".join(chunks)


def encode_program(program: SplitProgram) -> EncodedProgram:
    """``program`` as data (module doc); :class:`moirai.PlanError` if a part calls what a rank cannot look up."""
    storages = _Storages()
    parts = [_encode_part(part, storages) for part in program.parts]
    travels = [_how_it_travels(s) for s in storages.tensors]
    description = {
        "format": FORMAT_VERSION,
        "parts": parts,
        "transfers": [_encode_transfer(t) for t in program.transfers],
        "outputs": [[o.device, o.index] for o in program.outputs],
        "input_specs": [_encode_spec(s) for s in program.input_specs],
        "dynamic_dims": [[d.symbol, d.name, d.lower, d.upper, d.where] for d in program.dynamic_dims],
        "storages": [[s.numel(), *how] for s, how in zip(storages.tensors, travels, strict=True)],
    }
    sent = tuple(_sent_chunks(storages.tensors, travels))
    return EncodedProgram(json.dumps(description, separators=(",", ":")).encode(), sent)


def decode_program(payload: bytes, where: str, max_parts: int | None = None) -> SplitProgram:
    """The program ``payload`` describes, its tensors on the CPU (or meta); :class:`moirai.DistributedError` naming
    ``where`` (``"rank 2's load of program 0"``) and the fault if it is malformed, names anything outside the
    vocabulary, or has more than ``max_parts`` parts (the world's size)."""
    try:
        return _decode(memoryview(payload), max_parts)
    except _Malformed as error:
        raise DistributedError(f"{where}: {error}; the program is not loaded") from None
    except Exception as error:  # noqa: BLE001 - whatever a malformed payload makes json, torch or fx raise
        raise DistributedError(
            f"{where}: the payload is not a program this version of moirai can read ({type(error).__name__}: "
            f"{error}); the program is not loaded"
        ) from None


class _Malformed(Exception):
    """A payload's fault, in words, before :func:`decode_program` names where it was."""


# -- encoding ----------------------------------------------------------------------------------------------------


class _Storages:
    """Every storage the parts hold, each once, as the uint8 tensor that goes on the wire."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index: dict[tuple[str, int], int] = {}

    def index_of(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage._cdata)
        if key not in self._index:
            self._index[key] = len(self.tensors)
            self.tensors.append(torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage).detach())
        return self._index[key]


# How a storage travels: all its bytes; its size alone (weights left on the meta device); or its size and the runs
# of it that are not zero, whose bytes alone are sent (a KV cache: none, or what a local generate wrote).
_BYTES, _META, _RUNS = "bytes", "meta", "runs"


def _how_it_travels(storage: torch.Tensor) -> list[Any]:
    if storage.is_meta:
        return [_META]
    runs = written_runs(storage)
    if runs == [(0, storage.numel())]:
        return [_BYTES]
    return [_RUNS, [list(run) for run in runs]]


def _sent_chunks(storages: list[torch.Tensor], travels: list[list[Any]]) -> Iterator[torch.Tensor]:
    for storage, how in zip(storages, travels, strict=True):
        if how[0] == _BYTES:
            yield storage
        elif how[0] == _RUNS:
            yield from (storage[start:end] for start, end in how[1])


def _encode_part(part: DevicePart, storages: _Storages) -> dict[str, Any]:
    return {
        "device": part.device,
        "graph_module": _encode_graph_module(part.graph_module, storages, f"part {part.device}", is_part=True),
        "input_indices": list(part.input_indices),
        "receives": [t.index for t in part.receives],
        "sends": [t.index for t in part.sends],
        "output_specs": [None if s is None else _encode_spec(s) for s in part.output_specs],
        "attribute_names": list(part.attribute_names),
    }


def _encode_graph_module(module: fx.GraphModule, storages: _Storages, where: str, is_part: bool) -> dict[str, Any]:
    nodes, attributes = [], []
    transport = _transport(module.graph, is_part)
    for node in module.graph.nodes:
        if node.op == "call_module":
            raise PlanError(
                f"{where} calls module {node.target!r} ({type(module.get_submodule(node.target)).__name__}), which "
                f"another rank cannot load without running Python code from the sender: {_WHAT_TO_DO}"
            )
        fault = _call_fault(node, transport)
        if fault:
            raise PlanError(f"{where}'s node {node.name} {fault}: {_WHAT_TO_DO}")
        if not _name_fits(node.op, node.name, node.target):
            raise PlanError(
                f"{where}'s node {node.name} (target {node.target!r}) has a name fx's generated code uses itself "
                f"({sorted(_RESERVED_NAMES)}), which a rank refuses to load: rename the model's input or op"
            )
        if node.op == "get_attr":
            attributes.append(_encode_attribute(module, node.target, storages, where))
        nodes.append(
            {
                "name": node.name,
                "op": node.op,
                "target": _encode_target(node, where),
                "args": _encode_value(node.args, where),
                "kwargs": _encode_value(node.kwargs, where),
            }
        )
    return {"class_name": type(module).__name__, "nodes": nodes, "attributes": attributes}


def _encode_attribute(module: fx.GraphModule, target: str, storages: _Storages, where: str) -> dict[str, Any]:
    if not _is_attribute_name(target):
        raise PlanError(
            f"{where} reads attribute {target!r}, a name a module has of its own (or not an identifier), which a "
            "rank refuses to load: rename the model's parameter or buffer"
        )
    value = operator.attrgetter(target)(module)
    if isinstance(value, fx.GraphModule):  # a higher-order op's body (torch.cond's branches)
        body = _encode_graph_module(value, storages, f"{where}'s {target}", is_part=False)
        return {"target": target, "graph_module": body}
    if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter):
        stored = value.resolve_conj().resolve_neg()  # a conj (neg) view's bit is not in its storage: send the values
        return {
            "target": target,
            "tensor": {
                "storage": storages.index_of(stored),
                "dtype": _dtype_name(stored.dtype),
                "shape": list(stored.shape),
                "stride": list(stored.stride()),
                "offset": stored.storage_offset(),
                "parameter": isinstance(value, torch.nn.Parameter),
                "requires_grad": value.requires_grad,
            },
        }
    raise PlanError(
        f"{where} reads attribute {target!r}, a {type(value).__name__}, which another rank cannot load as data: "
        f"{_WHAT_TO_DO}"
    )


def _encode_target(node: fx.Node, where: str) -> Any:
    target = node.target
    if node.op in ("placeholder", "get_attr", "output", "call_method"):  # names; a method is the transport's
        return target
    if target in _CHECKED_OPERATORS:
        return {"function": _CHECKED_OPERATORS[target][0]}
    if isinstance(target, torch._ops.OpOverload):
        fault = _operator_fault(target)
        if fault:
            raise PlanError(f"{where}'s node {node.name} calls {_operator_name(target)}, {fault}")
        return {"op": _operator_name(target)}
    if isinstance(target, torch._ops.HigherOrderOperator) and target.name() in _HIGHER_ORDER_OPS:
        return {"higher_order": target.name()}
    name = _FUNCTION_NAMES.get(id(target))
    if name is None:
        called = f"{getattr(target, '__module__', '?')}.{getattr(target, '__name__', target)}"
        raise PlanError(
            f"{where}'s node {node.name} calls {called}, which another rank cannot look up without running Python "
            f"code from the sender: {_WHAT_TO_DO}"
        )
    return {"function": name}


_WHAT_TO_DO = (
    "a rank loads graphs of torch's operators (as torch.export traces them); trace the model with torch.export, "
    "or run the program in one process (run_local)"
)


def _transport(graph: fx.Graph, is_part: bool) -> fx.Node | None:
    """A part's first placeholder, its transport (:class:`moirai.runtime.split.Transport`); a nested graph has none."""
    return next(iter(graph.find_nodes(op="placeholder")), None) if is_part else None


def _call_fault(node: fx.Node, transport: fx.Node | None) -> str | None:
    """What is wrong with ``node``'s method call or ``getattr``, if anything: a part calls only its transport's
    methods and reads only its ``symbol_values``, so that no chain of lookups reaches code a payload names."""
    if node.op == "call_method":
        if node.target in _TRANSPORT_METHODS and transport is not None and node.args[:1] == (transport,):
            return None
        return f"calls method {node.target!r} of {node.args[:1]}, where only a part's transport's methods are called"
    if node.op == "call_function" and node.target is builtins.getattr:
        if transport is not None and node.args == (transport, _TRANSPORT_ATTRIBUTE) and not node.kwargs:
            return None
        return f"reads attribute {node.args[1:2]} of {node.args[:1]}, where only the transport's symbol_values is read"
    return None


def _operator_name(op: torch._ops.OpOverload) -> str:
    return f"{op._schema.name}.{op._overloadname}"


def _encode_value(value: Any, where: str) -> Any:
    """A node argument as JSON: plain scalars as themselves, everything else tagged."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [_encode_value(v, where) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise PlanError(f"{where} has an argument dict with keys that are not strings: {list(value)}")
        return {"dict": [[k, _encode_value(v, where)] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"dtype": _dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value)}
    if isinstance(value, slice):
        return {"slice": [_encode_value(v, where) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"ellipsis": None}
    if isinstance(value, complex) and math.isfinite(value.real) and math.isfinite(value.imag):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, torch._ops.OpOverload):  # auto_functionalized's operand
        return {"op": _operator_name(value)}
    raise PlanError(f"{where} has an argument {value!r} of type {type(value).__name__}, which a rank cannot load")


def _encode_spec(spec: TensorSpec) -> list[Any]:
    symbolic = None if spec.symbolic_shape is None else list(spec.symbolic_shape)
    stride = None if spec.stride is None else list(spec.stride)
    return [list(spec.shape), _dtype_name(spec.dtype), symbolic, stride, spec.offset_bytes, spec.requires_grad]


def _encode_transfer(transfer: TensorTransfer) -> list[Any]:
    return [transfer.index, transfer.tensor, transfer.src, transfer.dst, _encode_spec(transfer.spec)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- decoding ----------------------------------------------------------------------------------------------------


def _decode(payload: memoryview, max_parts: int | None) -> SplitProgram:
    if len(payload) < _LENGTH.size:
        raise _Malformed(f"the payload has {len(payload)} bytes, fewer than its length field")
    (length,) = _LENGTH.unpack_from(payload)
    if length > len(payload) - _LENGTH.size:
        raise _Malformed(f"the payload announces a {length}-byte description but holds {len(payload)} bytes")
    description = json.loads(bytes(payload[_LENGTH.size : _LENGTH.size + length]))
    if not isinstance(description, dict) or description.get("format") != FORMAT_VERSION:
        found = description.get("format") if isinstance(description, dict) else type(description).__name__
        raise _Malformed(f"the payload's format is {found!r}, not {FORMAT_VERSION}")
    if max_parts is not None and len(description["parts"]) > max_parts:
        raise _Malformed(f"the program has {len(description['parts'])} parts, more than the world's {max_parts} ranks")
    storages = _decode_storages(payload, _LENGTH.size + length, description["storages"])
    transfers = tuple(_decode_transfer(t) for t in description["transfers"])
    by_index = {t.index: t for t in transfers}
    parts = tuple(_decode_part(p, storages, by_index) for p in description["parts"])
    return SplitProgram(
        parts=parts,
        transfers=transfers,
        outputs=tuple(OutputLocation(int(device), int(index)) for device, index in description["outputs"]),
        input_specs=tuple(_decode_spec(s) for s in description["input_specs"]),
        dynamic_dims=tuple(
            DynamicDim(str(symbol), str(name), int(lower), None if upper is None else int(upper), str(where))
            for symbol, name, lower, upper, where in description["dynamic_dims"]
        ),
    )


def _decode_storages(payload: memoryview, start: int, sizes: list[Any]) -> list[torch.Tensor]:
    storages, offset = [], start
    for size, kind, *rest in sizes:
        size, where = int(size), f"storage {len(storages)}"
        if size < 0:
            raise _Malformed(f"{where} has {size} bytes")
        if kind not in (_BYTES, _META, _RUNS) or len(rest) != (kind == _RUNS):
            raise _Malformed(f"{where} travels as {kind!r}, not as one of {[_BYTES, _META, _RUNS]}")
        if kind == _META or size == 0:  # weights left on the meta device: a size and no bytes
            storages.append(torch.empty(size, dtype=torch.uint8, device="meta" if kind == _META else "cpu"))
            continue
        if kind == _RUNS:
            storage = _zero_storage(size, where)
            pages = storage.numpy()  # the same memory: a run's bytes are written into it once, from the payload
            for run_start, run_end in _checked_runs(rest[0], size, where):
                length = run_end - run_start
                offset = _take(payload, offset, length, where)
                pages[run_start:run_end] = numpy.frombuffer(payload[offset - length : offset], numpy.uint8)
            storages.append(storage)
            continue
        offset = _take(payload, offset, size, where)
        # A copy: the tensors are written in place (a KV cache), and the payload is read-only.
        storages.append(torch.frombuffer(bytearray(payload[offset - size : offset]), dtype=torch.uint8))
    if offset != len(payload):
        raise _Malformed(f"the payload holds {len(payload) - offset} bytes beyond its storages")
    return storages


def _take(payload: memoryview, offset: int, size: int, where: str) -> int:
    """The offset past ``size`` more bytes of ``payload``; :class:`_Malformed` if it has fewer."""
    if offset + size > len(payload):
        raise _Malformed(f"{where} ({size} bytes) runs past the payload's {len(payload)} bytes")
    return offset + size


def _zero_storage(size: int, where: str) -> torch.Tensor:
    try:
        return zeros_on_demand((size,), torch.uint8)
    except (OSError, OverflowError) as error:  # a size the kernel will not map
        raise _Malformed(f"{where}, {size} bytes of zeros, cannot be mapped here: {error}") from None


def _checked_runs(runs: Any, size: int, where: str) -> list[tuple[int, int]]:
    """``runs`` as ``(start, end)`` pairs, each within the storage's ``size`` and after the one before."""
    checked: list[tuple[int, int]] = []
    for run in runs:
        run_start, run_end = (int(bound) for bound in run)
        if not (checked[-1][1] if checked else 0) <= run_start < run_end <= size:
            raise _Malformed(f"{where}'s run {[run_start, run_end]} is not within its {size} bytes after the last")
        checked.append((run_start, run_end))
    return checked


def _decode_part(part: dict[str, Any], storages: list[torch.Tensor], by_index: dict[int, TensorTransfer]) -> DevicePart:
    return DevicePart(
        device=int(part["device"]),
        graph_module=_decode_graph_module(part["graph_module"], storages, is_part=True),
        input_indices=tuple(int(i) for i in part["input_indices"]),
        receives=tuple(by_index[int(i)] for i in part["receives"]),
        sends=tuple(by_index[int(i)] for i in part["sends"]),
        output_specs=tuple(None if s is None else _decode_spec(s) for s in part["output_specs"]),
        attribute_names=tuple(str(name) for name in part["attribute_names"]),
    )


def _decode_graph_module(module: dict[str, Any], storages: list[torch.Tensor], is_part: bool) -> fx.GraphModule:
    attributes: dict[str, Any] = {}
    for attribute in module["attributes"]:
        target = str(attribute["target"])
        if not _is_attribute_name(target):
            raise _Malformed(f"attribute name {target!r} is not a dotted identifier of its own")
        if "graph_module" in attribute:
            attributes[target] = _decode_graph_module(attribute["graph_module"], storages, is_part=False)
        else:
            attributes[target] = _decode_tensor(attribute["tensor"], storages)
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for entry in module["nodes"]:
        op, name = str(entry["op"]), str(entry["name"])
        if op not in ("placeholder", "get_attr", "call_function", "call_method", "output"):
            raise _Malformed(f"node {name!r} has op {op!r}, which a loaded part may not have")
        if not _name_fits(op, name, entry["target"]):
            raise _Malformed(f"node name {name!r} (target {entry['target']!r}) is not a plain name of its own")
        if op == "get_attr" and entry["target"] not in attributes:
            raise _Malformed(f"node {name!r} reads attribute {entry['target']!r}, which the payload does not hold")
        target = _decode_target(op, entry["target"], name)
        args = _decode_value(entry["args"], nodes)
        kwargs = _decode_value(entry["kwargs"], nodes)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise _Malformed(f"node {name!r}'s arguments are not a tuple and a dict")
        # fx writes keyword names into the generated code as they are, and a placeholder's argument as its default.
        keywords_fit = all(_OPERATOR_NAME.fullmatch(key) and not keyword.iskeyword(key) for key in kwargs)
        if not keywords_fit or (op == "placeholder" and (args or kwargs)):
            raise _Malformed(f"node {name!r} has keywords {list(kwargs)} or defaults {list(args)} a part cannot have")
        if op == "output":
            graph.output(args[0])
            continue
        node = nodes[name] = graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise _Malformed(f"node name {name!r} is repeated or not an identifier")
        fault = _call_fault(node, _transport(graph, is_part))
        if fault:
            raise _Malformed(f"node {name!r} {fault}")
    graph.lint()
    class_name = str(module["class_name"])
    if not _is_plain_name(class_name) or class_name.startswith("__"):
        raise _Malformed(f"class name {class_name!r} is not an identifier")
    decoded = fx.GraphModule(attributes, graph, class_name=class_name)
    for target, value in attributes.items():  # each name reads what the payload put there, not the module's own
        if operator.attrgetter(target)(decoded) is not value:
            raise _Malformed(f"attribute {target!r} does not read the value the payload gives it")
    return decoded


def _is_attribute_name(target: str) -> bool:
    """A dotted name of identifiers, none a module's own (a method, ``training``, ``_forward_pre_hooks``)."""
    return all(_IDENTIFIER.fullmatch(atom) and not hasattr(_PROBE, atom) for atom in target.split("."))


def _decode_tensor(tensor: dict[str, Any], storages: list[torch.Tensor]) -> torch.Tensor:
    storage = storages[int(tensor["storage"])]
    dtype = _decode_dtype(tensor["dtype"])
    shape, stride = [int(s) for s in tensor["shape"]], [int(s) for s in tensor["stride"]]
    offset = int(tensor["offset"])
    itemsize = dtype.itemsize
    last = offset + sum((size - 1) * step for size, step in zip(shape, stride, strict=True)) if all(shape) else -1
    if offset < 0 or min(shape, default=0) < 0 or min(stride, default=0) < 0 or (last + 1) * itemsize > storage.numel():
        raise _Malformed(f"a {dtype} tensor of shape {shape} at offset {offset} runs past its storage")
    # On the CPU whatever the sender's device: the rank places its part on its own device (local.place_part).
    value = torch.empty(0, dtype=dtype, device=storage.device).set_(storage.untyped_storage(), offset, shape, stride)
    if tensor["parameter"]:
        return torch.nn.Parameter(value, requires_grad=bool(tensor["requires_grad"]))
    return value.requires_grad_(bool(tensor["requires_grad"]))


def _decode_target(op: str, target: Any, name: str) -> Any:
    if op in ("placeholder", "get_attr", "output"):  # checked by the caller: its own name, an attribute, "output"
        if not isinstance(target, str):
            raise _Malformed(f"node {name!r}'s target {target!r} is not a name")
        return target
    if op == "call_method":
        if target not in _TRANSPORT_METHODS:
            raise _Malformed(f"node {name!r} calls method {target!r}, where only a part's transport's are called")
        return target
    if not isinstance(target, dict) or len(target) != 1:
        raise _Malformed(f"node {name!r}'s target {target!r} is not a tagged name")
    ((kind, qualified),) = target.items()
    if kind == "op":
        return _operator(str(qualified), name)
    if kind == "higher_order":
        if qualified not in _HIGHER_ORDER_OPS:
            raise _Malformed(f"node {name!r} names higher-order op {qualified!r}, which a part may not call")
        found = getattr(torch.ops.higher_order, qualified, None)
        if not isinstance(found, torch._ops.HigherOrderOperator):
            raise _Malformed(f"node {name!r} names higher-order op {qualified!r}, which torch does not have")
        return found
    if kind == "function" and qualified in _FUNCTIONS:
        return _FUNCTIONS[qualified]
    raise _Malformed(f"node {name!r} calls {kind} {qualified!r}, which is not among the functions a part may call")


def _operator(qualified: str, name: str) -> torch._ops.OpOverload:
    """``aten::add.Tensor`` -> ``torch.ops.aten.add.Tensor``: registered operators only, nothing imported."""
    namespace, _, rest = qualified.partition("::")
    op_name, _, overload = rest.partition(".")
    # aten's operators include dunder names (aten::__and__); the lookup below is of registered schemas only.
    if not (_IDENTIFIER.fullmatch(namespace) and _OPERATOR_NAME.fullmatch(op_name) and _IDENTIFIER.fullmatch(overload)):
        raise _Malformed(f"node {name!r} names operator {qualified!r}, which is not namespace::name.overload")
    try:
        found = getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
    except (AttributeError, RuntimeError):
        found = None
    if not isinstance(found, torch._ops.OpOverload):
        raise _Malformed(f"node {name!r} names operator {qualified!r}, which is not registered on this rank")
    fault = _operator_fault(found)
    if fault:
        raise _Malformed(f"node {name!r} names operator {qualified!r}, {fault}")
    return found


def _operator_fault(op: torch._ops.OpOverload) -> str | None:
    """Why a part may not call ``op``, if it may not ([Note: which operators a part may call])."""
    if op.namespace not in _OPERATOR_NAMESPACES:
        return f"of namespace {op.namespace!r}, where a part calls {sorted(_OPERATOR_NAMESPACES)}'s operators only"
    if any(argument.name in _FILE_ARGUMENTS and _is_string(argument.type) for argument in op._schema.arguments):
        return "which opens a file by name"
    name = op._schema.name.partition("::")[2]
    private = name.startswith("_") and not name.startswith("__") and name not in _PRIVATE_OPERATORS_ALLOWED
    overload = op._overloadname
    if (
        private
        or name in _UNCHECKED_OPERATORS
        or any(word in name for word in _REFUSED_WORDS)
        or overload == "out"
        or overload.endswith("_out")
        or overload == "grad_input"
        or any(argument.name == "unsafe" for argument in op._schema.arguments)
    ):
        return "which a part may not call: some operators of its kind trust their arguments to stay within memory"
    return None


def _is_string(argument_type: Any) -> bool:
    """Whether a schema argument's type is ``str`` or ``str?``: a file's name (einsum's ``int[]? path`` is not one)."""
    if isinstance(argument_type, torch._C.OptionalType):
        argument_type = argument_type.getElementType()
    return isinstance(argument_type, torch._C.StringType)


def _decode_value(value: Any, nodes: dict[str, fx.Node]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise _Malformed(f"argument {value!r} is not a tagged value")
    ((kind, item),) = value.items()
    if kind == "node":
        if item not in nodes:
            raise _Malformed(f"an argument names node {item!r} before it is defined")
        return nodes[item]
    if kind in ("list", "tuple"):
        items = [_decode_value(v, nodes) for v in item]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {str(k): _decode_value(v, nodes) for k, v in item}
    if kind == "float" and item in ("inf", "-inf", "nan"):
        return float(item)
    if kind == "dtype":
        return _decode_dtype(item)
    if kind == "device":
        return torch.device(str(item))
    if kind == "layout" and item in _LAYOUTS:
        return _LAYOUTS[item]
    if kind == "memory_format" and item in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[item]
    if kind == "slice":
        return slice(*(_decode_value(v, nodes) for v in item))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "complex":  # fx writes complex(0, inf) as the bare name infj
        value = complex(*(float(v) for v in item))
        if not (math.isfinite(value.real) and math.isfinite(value.imag)):
            raise _Malformed(f"complex constant {value} is not finite")
        return value
    if kind == "op":
        return _operator(str(item), "an argument")
    raise _Malformed(f"argument {value!r} has an unknown tag {kind!r}")


def _decode_dtype(name: Any) -> torch.dtype:
    if name not in _DTYPES:
        raise _Malformed(f"{name!r} is not a torch dtype")
    return _DTYPES[name]


def _decode_spec(spec: list[Any]) -> TensorSpec:
    shape, dtype, symbolic, stride, offset_bytes, requires_grad = spec
    symbolic_shape = None if symbolic is None else tuple(str(s) for s in symbolic)
    strides = None if stride is None else tuple(int(s) for s in stride)
    decoded_dtype = _decode_dtype(dtype)
    offset_bytes = int(offset_bytes)
    if not 0 <= offset_bytes < ALIGNMENT_BYTES or offset_bytes % decoded_dtype.itemsize:
        raise _Malformed(
            f"a tensor spec's offset of {offset_bytes} bytes is not a whole number of "
            f"{_dtype_name(decoded_dtype)} elements below {ALIGNMENT_BYTES}"
        )
    shape = tuple(int(s) for s in shape)
    return TensorSpec(shape, decoded_dtype, symbolic_shape, strides, offset_bytes, requires_grad is True)


def _decode_transfer(transfer: list[Any]) -> TensorTransfer:
    index, tensor, src, dst, spec = transfer
    return TensorTransfer(int(index), str(tensor), int(src), int(dst), _decode_spec(spec))
