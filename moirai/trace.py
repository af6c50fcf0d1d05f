"""Trace a model into a flat fx graph whose every node carries ``meta["val"]``.

Example::

    traced = trace(model, (torch.randn(8, 16),))
    flat_outputs = traced.graph_module(*traced.flatten_inputs((x,), {}))
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import re
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any

import numpy as np
import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._sympy.functions import FloorDiv, PythonMod
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.printers import PythonPrinter

from moirai.errors import InputError, PlanError, TraceError, TrainingModeWarning
from moirai.progress import stage


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor, enough to check a call and to allocate a buffer.

    ``shape`` is the shape at the example inputs. In a model traced with dynamic shapes,
    ``symbolic_shape`` holds every dimension as a Python expression over the symbols of the
    dynamic input dimensions (``"s0"``, ``"s0*s1"``, ``"16"``); :func:`concrete_shape` evaluates it.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    symbolic_shape: tuple[str, ...] | None = None


@dataclass(frozen=True)
class DynamicDim:
    """An input dimension the plan serves at every size in ``lower..upper`` (``upper`` None: unbounded).

    ``symbol`` is the name torch.export gave it (the name in :attr:`TensorSpec.symbolic_shape`),
    ``name`` the ``torch.export.Dim``'s name where known, and ``where`` the flat input and axis
    that first carries it (``"input 0 dimension 1"``).
    """

    symbol: str
    name: str
    lower: int
    upper: int | None
    where: str

    @property
    def range(self) -> str:
        return f"{self.lower}..{self.upper}" if self.upper is not None else f"{self.lower} or more"


def tensor_spec(value: torch.Tensor) -> TensorSpec:
    """The spec of a traced tensor: example shape, and symbolic shape when a dimension is symbolic."""
    shape = tuple(example_int(size) for size in value.shape)
    if all(isinstance(size, int) for size in value.shape):
        return TensorSpec(shape, value.dtype)
    return TensorSpec(shape, value.dtype, tuple(symbolic_expression(size) for size in value.shape))


def symbolic_expression(value: int | torch.SymInt | torch.SymBool | torch.SymFloat) -> str:
    """A Python expression for a traced scalar over the input dimensions' symbols (``"s0*s1"``)."""
    if isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return PythonPrinter().doprint(value.node.expr)
    return repr(value)


def evaluate_symbolic(expression: str, symbol_values: Mapping[str, int]) -> Any:
    """The value of a :func:`symbolic_expression` at the given symbol values."""
    return eval(_compiled_expression(expression), {"__builtins__": {}, **_EXPRESSION_FUNCTIONS}, dict(symbol_values))


def concrete_shape(spec: TensorSpec, symbol_values: Mapping[str, int]) -> tuple[int, ...]:
    """``spec``'s shape at the given symbol values (a receive buffer's shape)."""
    if spec.symbolic_shape is None:
        return spec.shape
    return tuple(int(evaluate_symbolic(expression, symbol_values)) for expression in spec.symbolic_shape)


def check_flat_inputs(
    specs: Sequence[TensorSpec], dynamic_dims: Sequence[DynamicDim], tensors: Sequence[Any], model_name: str
) -> dict[str, int]:
    """The value of every dynamic dimension in ``tensors``; :class:`moirai.InputError` unless they fit ``specs``."""
    if len(tensors) != len(specs):
        raise InputError(
            f"{model_name} takes {len(specs)} flat input tensors, got {len(tensors)}; "
            "flatten (args, kwargs) with TracedModel.flatten_inputs"
        )
    dims = {dim.symbol: dim for dim in dynamic_dims}
    values: dict[str, int] = {}
    for position, (value, spec) in enumerate(zip(tensors, specs, strict=True)):
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{model_name}: input {position} must be a tensor, got {type(value).__name__}")
        for axis, size in enumerate(value.shape[: len(spec.shape)]):
            dim = dims.get(spec.symbolic_shape[axis]) if spec.symbolic_shape else None
            if dim is None:
                continue
            if size < dim.lower or (dim.upper is not None and size > dim.upper):
                raise InputError(
                    f"{model_name}: input {position} dimension {axis} ({dim.name}) is {size}; the plan serves "
                    f"{dim.name} = {dim.range}: compile again with dynamic_shapes whose {dim.name} covers {size}"
                )
            if values.setdefault(dim.symbol, size) != size:
                raise InputError(
                    f"{model_name}: input {position} dimension {axis} is {size} but {dim.name} ({dim.where}) is "
                    f"{values[dim.symbol]}; the model was traced with both equal"
                )
    for position, (value, spec) in enumerate(zip(tensors, specs, strict=True)):
        expected_shape = concrete_shape(spec, values)
        if value.dtype != spec.dtype or tuple(value.shape) != expected_shape:
            shown = spec.shape if spec.symbolic_shape is None else _shape_with_dim_names(spec, dynamic_dims)
            raise InputError(
                f"{model_name}: input {position} has shape {tuple(value.shape)} and dtype {value.dtype}, "
                f"the plan was made for shape {shown} and dtype {spec.dtype}; "
                "compile again with example inputs of the shape you will serve"
                + (" (or declare the dimension dynamic: dynamic_shapes=...)" if not dynamic_dims else "")
            )
    return values


@dataclass
class TracedModel:
    """A flat GraphModule: placeholders are the flat tensor inputs, the output is a flat tuple.

    ``in_spec`` and ``out_spec`` turn a user's ``(args, kwargs)`` into the flat inputs and the
    flat outputs back into the model's (possibly nested) output structure. Non-tensor inputs
    (``use_cache=False``, a float scale) are baked into the graph: ``constant_inputs`` maps their
    flat positions to the traced values, and a call must pass the same values.
    """

    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_specs: tuple[TensorSpec, ...]
    model_name: str
    constant_inputs: dict[int, Any]
    dynamic_dims: tuple[DynamicDim, ...] = ()

    def flatten_inputs(self, args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The flat input tensors of a call, checked against the traced example inputs."""
        expected_keys = self.in_spec.child(1).context
        if set(kwargs) == set(expected_keys):
            kwargs = {key: kwargs[key] for key in expected_keys}
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            traced_args, traced_keys = self.in_spec.child(0).num_children, sorted(expected_keys)
            if (len(args), sorted(kwargs)) != (traced_args, traced_keys):
                difference = (
                    f"{traced_args} positional input(s) and keyword(s) {traced_keys}, "
                    f"called with {len(args)} and {sorted(kwargs)}"
                )
            else:
                difference = f"inputs structured as {self.in_spec}, called with {spec}"
            raise InputError(
                f"{self.model_name} was traced with {difference}; call it with the same arguments as the example inputs"
            )
        for position, constant in self.constant_inputs.items():
            if flat[position] != constant:
                raise InputError(
                    f"{self.model_name} was traced with the non-tensor input {constant!r} at flat position "
                    f"{position}, called with {flat[position]!r}; compile again to plan for that value"
                )
        tensors = [value for position, value in enumerate(flat) if position not in self.constant_inputs]
        check_flat_inputs(self.input_specs, self.dynamic_dims, tensors, self.model_name)
        return tensors

    def unflatten_outputs(self, flat_outputs: list[Any]) -> Any:
        return pytree.tree_unflatten(list(flat_outputs), self.out_spec)


@stage("trace")
def trace(
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
) -> TracedModel:
    """Trace ``model`` with ``torch.export`` (non-strict), falling back to ``symbolic_trace``.

    ``dynamic_shapes`` declares dimensions that may vary from call to call, in torch.export's
    convention (``torch.export.Dim``): the graph then serves every size in the declared ranges.
    Weights may live on the ``meta`` device; example inputs should then be ``meta`` tensors too.
    Raises :class:`moirai.TraceError` naming the model, the failing line and what to try.
    """
    kwargs = dict(example_kwargs or {})
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    name = type(model).__name__
    dynamic_dims: tuple[DynamicDim, ...] = ()
    _check_example_inputs(model, args, kwargs, name)
    _warn_if_training(model, name)
    try:
        exported = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as export_error:
        if dynamic_shapes is not None and "tree_name" in str(export_error):
            raise TraceError(
                f"could not trace {name} with dynamic_shapes: torch.export fails when an input goes to the model "
                f"through **kwargs (here one of {sorted(kwargs)}); pass such options by a named parameter of forward "
                "or leave them out (a Hugging Face model's ModelOutput needs no return_dict=False)"
            ) from export_error
        if kwargs or dynamic_shapes is not None:
            raise _trace_error(name, export_error, args, kwargs) from export_error
        graph_module = _symbolic_trace_fallback(model, args, name, export_error)
        out_spec = pytree.tree_structure(_flat_output_marker(graph_module))
    else:
        if _has_observable_mutation(exported.graph_module.graph):
            # The splitter follows data edges; an in-place op that other ops see is not one. torch's
            # functionalization rewrites it as data flow (graphs without one are left as traced).
            exported = exported.run_decompositions({})
            _views_as_reshapes(exported.graph_module.graph)
        graph_module = exported.module()
        out_spec = exported.call_spec.out_spec
        _drop_guard_calls(graph_module)
        if dynamic_shapes is not None:
            dynamic_dims = _dynamic_dims(exported, graph_module, model, args, kwargs, dynamic_shapes)
        _check_static_shapes(graph_module, name)
    in_spec = pytree.tree_structure((args, kwargs))
    flat_inputs = pytree.tree_leaves((args, kwargs))
    constant_inputs = {i: value for i, value in enumerate(flat_inputs) if not isinstance(value, torch.Tensor)}
    graph_module = _flatten_attributes(graph_module)
    graph_module.graph.set_codegen(fx.graph.CodeGen())
    _bake_constant_inputs(graph_module, constant_inputs)
    _flatten_output(graph_module)
    graph_module.recompile()
    _check_operand_dtypes(graph_module, name, _tensor_input_names(args, kwargs))
    if dynamic_dims:
        placeholders = graph_module.graph.find_nodes(op="placeholder")
        input_specs = tuple(tensor_spec(node.meta["val"]) for node in placeholders)
    else:
        input_specs = tuple(TensorSpec(tuple(t.shape), t.dtype) for t in flat_inputs if isinstance(t, torch.Tensor))
    return TracedModel(graph_module, in_spec, out_spec, input_specs, name, constant_inputs, dynamic_dims)


def dynamic_dims_to_json(traced: TracedModel) -> dict[str, Any] | None:
    """What a plan file keeps of the dynamic dimensions: each dim's range, and every symbolic input axis."""
    if not traced.dynamic_dims:
        return None
    return {
        "dims": [
            {"symbol": dim.symbol, "name": dim.name, "min": dim.lower, "max": dim.upper} for dim in traced.dynamic_dims
        ],
        "axes": [
            [position, axis, expression]
            for position, spec in enumerate(traced.input_specs)
            for axis, expression in enumerate(spec.symbolic_shape or ())
            if not expression.isdigit()
        ],
    }


def dynamic_shapes_from_json(
    saved: dict[str, Any], model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict[str, Any] | None
) -> Any:
    """torch.export ``dynamic_shapes`` for the example inputs, rebuilt from a plan's dynamic dimensions."""
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    dims = {d["symbol"]: torch.export.Dim(d["name"], min=d["min"], max=d["max"]) for d in saved["dims"]}
    axes_of: dict[int, dict[int, Any]] = {}
    for position, axis, expression in saved["axes"]:
        if position >= len(tensors):
            raise PlanError(
                f"the plan makes dimension {axis} of flat input {position} dynamic ({expression}), but the example "
                f"inputs have {len(tensors)} tensors; give example inputs structured as those the plan was made with"
            )
        # A derived dim (2*batch) is the same arithmetic on torch.export.Dim objects.
        axes_of.setdefault(position, {})[axis] = eval(_compiled_expression(expression), {"__builtins__": {}}, dims)
    shapes = torch.export.ShapesCollection()
    for position, axes in axes_of.items():
        shapes[tensors[position]] = axes
    return shapes.dynamic_shapes(model, args, kwargs)


def shape_scalars(traced: TracedModel) -> dict[fx.Node, sympy.Expr]:
    """Ops whose value is arithmetic on the input dimensions only (``sym_size``, products of sizes).

    Only tensors cross devices: every part that reads such a scalar computes it itself from the
    call's symbol values (:mod:`moirai.split`), so no edge of the op graph carries one.
    """
    symbols = {dim.symbol for dim in traced.dynamic_dims}
    scalars = {}
    for node in traced.graph_module.graph.nodes:
        value = node.meta.get("val")
        if (
            symbols
            and node.op == "call_function"
            and isinstance(value, (torch.SymInt, torch.SymBool))
            and _is_shape_arithmetic(value.node.expr, symbols)
        ):
            scalars[node] = value.node.expr
    return scalars


# The sympy expressions of shape scalars, as Python operators (what a part computes them with).
SHAPE_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    sympy.Add: operator.add,
    sympy.Mul: operator.mul,
    FloorDiv: operator.floordiv,
    PythonMod: operator.mod,
    sympy.Mod: operator.mod,
    sympy.Eq: operator.eq,
    sympy.Ne: operator.ne,
    sympy.StrictLessThan: operator.lt,
    sympy.LessThan: operator.le,
    sympy.StrictGreaterThan: operator.gt,
    sympy.GreaterThan: operator.ge,
}


def _is_shape_arithmetic(expr: sympy.Basic, symbols: set[str]) -> bool:
    if expr.is_Symbol:
        return str(expr) in symbols
    if expr.is_Integer or expr in (sympy.true, sympy.false):
        return True
    if isinstance(expr, sympy.Pow):
        return bool(expr.exp.is_Integer and expr.exp > 0) and _is_shape_arithmetic(expr.base, symbols)
    return type(expr) in SHAPE_OPERATORS and all(_is_shape_arithmetic(arg, symbols) for arg in expr.args)


def _shape_with_dim_names(spec: TensorSpec, dynamic_dims: Sequence[DynamicDim]) -> str:
    """``(batch, 2*seq, 16)``: a symbolic shape with the symbols named as the user named the dims."""
    names = {dim.symbol: dim.name for dim in dynamic_dims}
    words = [re.sub(r"\b[a-z]+\d+\b", lambda m: names.get(m.group(), m.group()), e) for e in spec.symbolic_shape or ()]
    return f"({', '.join(words)})"


def _dynamic_dims(
    exported: torch.export.ExportedProgram,
    graph_module: fx.GraphModule,
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    dynamic_shapes: Any,
) -> tuple[DynamicDim, ...]:
    """The dynamic input dimensions of an exported model, with their ranges and the user's Dim names."""
    ranges = {str(symbol): bounds for symbol, bounds in exported.range_constraints.items()}
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    user_names = _user_dim_names(model, args, kwargs, dynamic_shapes, tensors)
    dims: dict[str, DynamicDim] = {}
    placeholders = graph_module.graph.find_nodes(op="placeholder")
    for position, node in enumerate(placeholders):
        for axis, size in enumerate(node.meta["val"].shape):
            symbol = symbolic_expression(size)
            if not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol or symbol in dims:
                continue
            bounds = ranges[symbol]
            upper = None if bounds.upper in (int_oo, sympy.oo) else int(bounds.upper)
            name = user_names.get((position, axis), symbol)
            dims[symbol] = DynamicDim(symbol, name, int(bounds.lower), upper, f"input {position} dimension {axis}")
    for position, node in enumerate(placeholders):
        for axis, size in enumerate(node.meta["val"].shape):
            if isinstance(size, torch.SymInt) and {str(symbol) for symbol in size.node.expr.free_symbols} - set(dims):
                raise TraceError(
                    f"{type(model).__name__}: input {position} dimension {axis} is {symbolic_expression(size)}, "
                    "derived from a dimension that is no input's own dimension; moirai computes every size from "
                    "the input dimensions: declare the root Dim on an input dimension too"
                )
    return tuple(dims.values())


def _user_dim_names(
    model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], dynamic_shapes: Any, tensors: list[torch.Tensor]
) -> dict[tuple[int, int], str]:
    """(flat tensor input, axis) -> the ``torch.export.Dim``'s name, as torch.export matched them."""
    from torch.export import dynamic_shapes as torch_dynamic_shapes

    try:  # private torch API, used only for nicer names: without it dimensions are named by their symbols
        combined = torch_dynamic_shapes._combine_args(model, args, kwargs)
        constraints = torch_dynamic_shapes._process_dynamic_shapes(combined, dynamic_shapes)
    except Exception:
        return {}
    position_of = {id(t): position for position, t in enumerate(tensors)}
    return {
        (position_of[c.t_id], c.dim): c.name
        for c in constraints
        if c.t_id in position_of and isinstance(getattr(c, "name", None), str)
    }


_EXPRESSION_FUNCTIONS = {"max": max, "min": min, "abs": abs, "math": math, "int": int, "float": float}


@functools.lru_cache(maxsize=4096)
def _compiled_expression(expression: str) -> CodeType:
    return compile(expression, "<symbolic shape>", "eval")


def example_int(size: int | torch.SymInt) -> int:
    """A size at the example inputs (a symbolic size's hint): costs are taken at the example shapes."""
    return size if isinstance(size, int) else int(size.node.hint)


def _symbolic_trace_fallback(model: torch.nn.Module, args: tuple, name: str, export_error: Exception) -> fx.GraphModule:
    try:
        graph_module = fx.symbolic_trace(model)
    except Exception:
        raise _trace_error(name, export_error, args, {}) from export_error
    recorder = _RecordValues(graph_module)
    try:
        recorder.run(*args)
    except Exception as error:
        # The model ran eagerly on the example inputs and failed there: they do not fit it.
        raise TraceError(
            f"could not trace {name}: the example inputs ({_describe_tensors(args, {})}) do not fit it; "
            f"{_describe_node(graph_module, recorder.current_node)} fails with {_first_line(error)}. "
            "Give example inputs of the shapes, dtypes and number the model's forward takes."
        ) from error
    return graph_module


class _RecordValues(fx.Interpreter):
    """Runs the graph once and records ``meta["val"]`` (as exported graphs have) on every node."""

    current_node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current_node = n
        result = super().run_node(n)
        n.meta["val"] = pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), result)
        return result


def _flat_output_marker(graph_module: fx.GraphModule) -> Any:
    """A placeholder structure mirroring the graph's output argument, used to get its TreeSpec."""
    (output_node,) = graph_module.graph.find_nodes(op="output")
    return pytree.tree_map(lambda _: 0, output_node.args[0])


def _bake_constant_inputs(graph_module: fx.GraphModule, constant_inputs: dict[int, Any]) -> None:
    """Replace the placeholders of non-tensor inputs by their traced values."""
    placeholders = graph_module.graph.find_nodes(op="placeholder")
    substitute = {placeholders[position]: value for position, value in constant_inputs.items()}
    for node in substitute:
        for user in list(node.users):
            user.args, user.kwargs = fx.node.map_arg((user.args, user.kwargs), lambda n: substitute.get(n, n))
        graph_module.graph.erase_node(node)


def _flatten_output(graph_module: fx.GraphModule) -> None:
    (output_node,) = graph_module.graph.find_nodes(op="output")
    output_node.args = (tuple(pytree.tree_leaves(output_node.args[0])),)


def _flatten_attributes(graph_module: fx.GraphModule) -> fx.GraphModule:
    """The module with every attribute its graph reads at top level, named after its get_attr node.

    Generated code fetches a nested target through every module on its path, one slow
    ``nn.Module.__getattr__`` each: inception_v4 made 6,180 such calls per run, a third of its time.
    """
    root = torch.nn.Module()
    for node in graph_module.graph.find_nodes(op="get_attr"):
        value = operator.attrgetter(str(node.target))(graph_module)
        if isinstance(value, torch.nn.Parameter):
            root.register_parameter(node.name, value)
        elif isinstance(value, torch.Tensor):
            root.register_buffer(node.name, value)
        else:
            setattr(root, node.name, value)
        node.target = node.name
    return fx.GraphModule(root, graph_module.graph, class_name=type(graph_module).__name__)


def _drop_guard_calls(graph_module: fx.GraphModule) -> None:
    """Exported modules check inputs in a pre-hook and a guard call; moirai checks flat inputs itself."""
    graph_module._forward_pre_hooks.clear()
    for node in list(graph_module.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph_module.graph.erase_node(node)
    if hasattr(graph_module, "_guards_fn"):
        delattr(graph_module, "_guards_fn")


def _trace_error(model_name: str, error: Exception, args: tuple, kwargs: dict[str, Any]) -> TraceError:
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not _is_library_file(f.filename)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    return TraceError(
        f"could not trace {model_name}{where} with example inputs {_describe_tensors(args, kwargs)}: "
        f"{_first_line(error)}. "
        "Try: data-dependent control flow on tensor values must become torch.cond or be removed; "
        "Hugging Face decoders need use_cache=False (and return_dict=False if outputs are not tensors); "
        "example inputs must be tensors of the shape you will serve."
    )


# --- checks of the example inputs and of the traced graph -------------------------------------------

_MOIRAI_DIRECTORY = str(Path(__file__).parent)
# Ops whose first three tensor operands (input, weight, bias; q, k, v) must share one dtype. Fake
# tensors do not check it, so an int64 input into a Linear traces and then fails on every call.
_SAME_DTYPE_OPS = {
    getattr(torch.ops.aten, name)
    for name in (
        "linear mm addmm bmm baddbmm matmul mv addmv dot conv1d conv2d conv3d convolution _convolution "
        "conv_transpose1d conv_transpose2d conv_transpose3d scaled_dot_product_attention "
        "layer_norm group_norm batch_norm instance_norm"
    ).split()
}
_NORMS = {torch.ops.aten.layer_norm, torch.ops.aten.group_norm, torch.ops.aten.batch_norm, torch.ops.aten.instance_norm}


def _is_library_file(filename: str) -> bool:
    return "site-packages/torch" in filename or filename.startswith(_MOIRAI_DIRECTORY)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _input_path(path: tuple) -> str:
    """``example_inputs[0]`` or ``example_kwargs['mask']`` for a key path into ``(args, kwargs)``."""
    root = "example_inputs" if path[0].idx == 0 else "example_kwargs"
    return root + pytree.keystr(path[1:])


def _tensor_input_names(args: tuple, kwargs: dict[str, Any]) -> list[str]:
    """Where every flat tensor input came from, in flat order (the placeholders of the traced graph)."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    return [_input_path(path) for path, value in leaves if isinstance(value, torch.Tensor)]


def _describe_tensors(args: tuple, kwargs: dict[str, Any]) -> str:
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    shown = [
        f"{_input_path(path)}: {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
        if isinstance(value, torch.Tensor)
        else f"{_input_path(path)}: {type(value).__name__}"
        for path, value in leaves
    ]
    return ", ".join(shown[:6]) + (", ..." if len(shown) > 6 else "") if shown else "none"


def _check_example_inputs(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], name: str) -> None:
    """Catch the inputs torch would reject only deep inside tracing: arrays, and a wrong number of them."""
    for path, value in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(value, (np.ndarray, np.generic)):
            raise TraceError(
                f"{name}: example input {_input_path(path)} is a numpy {type(value).__name__}; "
                "moirai traces torch tensors: pass torch.from_numpy(array) (or torch.as_tensor)"
            )
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward without a Python signature: let tracing judge
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TraceError(
            f"the example inputs do not fit {name}.forward{signature}: {error} "
            f"(given {len(args)} positional and keyword(s) {sorted(kwargs)}); pass example_inputs=(...) with one "
            "value per positional argument and example_kwargs={...} for the keyword ones"
        ) from None


def _warn_if_training(model: torch.nn.Module, name: str) -> None:
    random_or_batch = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm)
    training = [
        f"{path or name} ({type(m).__name__})"
        for path, m in model.named_modules()
        if m.training and isinstance(m, random_or_batch)
    ]
    if training:
        warnings.warn(
            TrainingModeWarning(
                f"{name} is in training mode: {', '.join(training[:3])}{', ...' if len(training) > 3 else ''} "
                "will drop random activations or use batch statistics, so the split model's outputs differ from "
                "call to call and from the model in eval mode; call model.eval() before moirai.compile"
            ),
            stacklevel=3,
        )


def _source_line(node: fx.Node) -> str:
    """``file.py:12 (code)`` of the user's line that made ``node``, from the trace's stack, or ``""``."""
    lines = [line.strip() for line in str(node.meta.get("stack_trace") or "").strip().splitlines()]
    places = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not places:
        return ""
    place = lines[places[-1]].split(",")
    file, line_number = place[0].removeprefix("File ").strip('"'), place[1].strip().removeprefix("line ")
    code = lines[places[-1] + 1] if places[-1] + 1 < len(lines) else ""
    return f"{Path(file).name}:{line_number} ({code})"


def _describe_node(graph_module: fx.GraphModule, node: fx.Node | None) -> str:
    if node is None:
        return "the model"
    if node.op == "call_module":
        return f"module {node.target!r} ({type(graph_module.get_submodule(str(node.target))).__name__})"
    stack = node.meta.get("nn_module_stack")
    module = ""
    if stack and list(stack.values())[-1][0]:
        path, kind = list(stack.values())[-1]
        module = f" in module {path!r} ({getattr(kind, '__name__', str(kind).rsplit('.', 1)[-1])})"
    source = _source_line(node)
    label = node.name if node.name == _target_label(node) else f"{node.name} ({_target_label(node)})"
    return label + module + (f" at {source}" if source else "")


def _target_label(node: fx.Node) -> str:
    target = node.target
    return str(target.overloadpacket.__name__) if isinstance(target, torch._ops.OpOverload) else str(target)


def is_view_node(node: fx.Node) -> bool:
    """An op whose output aliases its first input, as its schema declares (a view, or a piece of a split)."""
    target = node.target
    if target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and is_view_node(node.args[0])
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _has_observable_mutation(graph: fx.Graph) -> bool:
    """Whether an in-place op writes a tensor (or a view of it) that another op also reads.

    ``relu_`` on a value nothing else reads (ResNet's ``ReLU(inplace=True)``) is harmless to a split;
    ``t.add_(u)`` where another op reads ``t`` (before or after) makes an order the data edges do not show.
    """
    for node in graph.nodes:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        written = [
            node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            for i, argument in enumerate(target._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        ]
        for value in written:
            if not isinstance(value, fx.Node):
                continue
            base = value
            while is_view_node(base) and isinstance(base.args[0], fx.Node):
                base = base.args[0]
            aliases, frontier = {base}, [base]
            while frontier:
                for user in frontier.pop().users:
                    if user is node or user in aliases:
                        continue
                    if not is_view_node(user):
                        return True  # a reader of the written tensor other than the in-place op
                    aliases.add(user)
                    frontier.append(user)
    return False


def _views_as_reshapes(graph: fx.Graph) -> None:
    """Functionalization writes ``reshape`` as ``view``, which needs the strides seen at trace time; the
    kernels of a run (an attention's output layout) or a transfer may give others. In a functional graph
    a reshape computes the same values."""
    for node in graph.nodes:
        if node.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            node.target = torch.ops.aten.reshape.default


def _check_static_shapes(graph_module: fx.GraphModule, name: str) -> None:
    """Refuse ops whose output shape depends on tensor values (``t[t > 0]``, ``nonzero``): plans fix every shape."""
    for node in graph_module.graph.nodes:
        tensors = [t for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
        if node.op == "call_function" and any(free_unbacked_symbols(t) for t in tensors):
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise TraceError(
                f"{name}: {_describe_node(graph_module, node)} makes a tensor whose shape {shapes} depends on the "
                "values of a tensor, not only on the input shapes; moirai plans programs whose every shape is known "
                "at compile time: replace boolean-mask indexing (t[t > 0]), nonzero or unique by shape-preserving "
                "ops such as torch.where(t > 0, t, 0)"
            )


def _check_operand_dtypes(graph_module: fx.GraphModule, name: str, input_names: list[str]) -> None:
    """Refuse matmuls, convolutions and norms whose operands' dtypes differ (as eager PyTorch would)."""
    placeholders = graph_module.graph.find_nodes(op="placeholder")
    for node in graph_module.graph.nodes:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket not in _SAME_DTYPE_OPS:
            continue
        operands = [a for a in node.args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        operands = operands[:1] if target.overloadpacket in _NORMS else operands[:3]
        dtypes = [a.meta["val"].dtype for a in operands]
        if len(set(dtypes)) <= 1 and all(d.is_floating_point or d.is_complex for d in dtypes):
            continue
        inputs = [
            f"example input {input_names[placeholders.index(a)]} is {a.meta['val'].dtype}"
            for a in operands
            if a in placeholders and placeholders.index(a) < len(input_names)
        ]
        raise TraceError(
            f"{name}: {_describe_node(graph_module, node)} gets operands of dtypes "
            f"{', '.join(str(d) for d in dtypes)}{' (' + '; '.join(inputs) + ')' if inputs else ''}; it needs one "
            "floating-point dtype: give example inputs of the dtype the model computes in (e.g. x.float()), or "
            "cast them inside the model"
        )
