"""Trace a model into a flat fx graph whose every node carries ``meta["val"]``.

Example::

    traced = trace(model, (torch.randn(8, 16),))
    flat_outputs = traced.graph_module(*traced.flatten_inputs((x,), {}))

Dynamic dimensions and symbolic sizes are :mod:`moirai.frontend.symbolic_shapes`; the checks of the example
inputs and of the traced graph, and the errors tracing raises, are :mod:`moirai.frontend.trace_checks`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import math
import operator
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TextIO

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from moirai.errors import InputError, TraceError
from moirai.frontend.shared_memory import check_no_written_aliases
from moirai.frontend.symbolic_shapes import (
    DynamicDim,
    concrete_shape,
    example_int,
    exported_dynamic_dims,
    shape_with_dim_names,
    symbolic_expression,
)
from moirai.frontend.trace_checks import (
    _first_line,
    check_example_inputs,
    check_operand_dtypes,
    check_static_shapes,
    dynamic_shapes_error,
    in_place_write_error,
    inputs_do_not_fit_error,
    meta_weights_error,
    tensor_input_names,
    trace_error,
    warn_if_all_static,
    warn_if_training,
    warn_of_random_ops,
)
from moirai.frontend.write_backs import put_writes_back_in_place
from moirai.frontend.writes import is_view_node, written_bases
from moirai.progress import stage

# The alignment of every allocation on CPU (c10's) and within CUDA's caching allocator's blocks: a tensor's first
# element's offset past it is what a kernel's alignment checks see.
ALIGNMENT_BYTES = 64


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor, enough to check a call and to allocate a buffer.

    ``shape`` is the shape at the example inputs. In a model traced with dynamic shapes,
    ``symbolic_shape`` holds every dimension as a Python expression over the symbols of the
    dynamic input dimensions (``"s0"``, ``"s0*s1"``, ``"16"``); :func:`concrete_shape` evaluates it.
    ``stride`` is the traced strides of a tensor that is not contiguous and whose sizes and strides are all static;
    None for a contiguous tensor or a symbolic layout: a tensor that crosses devices gets its strides back
    ([Note: a received tensor keeps its traced strides], moirai.runtime.split). ``offset_bytes``: where its first
    element lies past an :data:`ALIGNMENT_BYTES` boundary as traced (its storage offset times its element size, modulo
    that; 0 where the offset is symbolic), which a received tensor keeps too, for the same reason. ``requires_grad``:
    whether the model's tensor requires grad even under ``no_grad`` (a view of a parameter), which changes the path
    ``matmul`` takes (set by the splitter, which sees the parameter; a trace's values never require grad).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    symbolic_shape: tuple[str, ...] | None = None
    stride: tuple[int, ...] | None = None
    offset_bytes: int = 0
    requires_grad: bool = False


def tensor_spec(value: torch.Tensor) -> TensorSpec:
    """The spec of a traced tensor: example shape, and symbolic shape when a dimension is symbolic."""
    shape = tuple(example_int(size) for size in value.shape)
    offset = value.storage_offset()
    offset_bytes = offset * value.element_size() % ALIGNMENT_BYTES if isinstance(offset, int) else 0
    if all(isinstance(size, int) for size in value.shape):
        return TensorSpec(shape, value.dtype, stride=_static_stride(value), offset_bytes=offset_bytes)
    return TensorSpec(shape, value.dtype, tuple(symbolic_expression(size) for size in value.shape), None, offset_bytes)


def _static_stride(value: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of a tensor of static shape where they are static and not contiguous; else None."""
    stride = value.stride()
    if not all(isinstance(step, int) for step in stride) or value.is_contiguous():
        return None
    return tuple(stride)


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
        if value.device.type == "meta":
            # Inputs on other devices are moved to each part's device; a meta tensor holds no values to move.
            raise InputError(
                f"{model_name}: input {position} is on the meta device, which holds shapes but no values; pass a "
                "tensor with values (on any device: each part moves its inputs to its own device)"
            )
        if value.is_nested or value.layout != torch.strided:
            # The plan computes and sends dense tensors: a nested tensor has no shape to check, and a rank cannot
            # send an MKL-DNN one (its storage is opaque), which took the whole server down with one request.
            raise InputError(
                f"{model_name}: input {position} is a {layout_name(value)} tensor; the plan was made for dense "
                "(strided) tensors: pass value.to_dense() (torch.nested.to_padded_tensor for a nested tensor)"
            )
        if value.dim() != len(spec.shape):  # before the dimensions' values: one left out would name no symbol
            raise _wrong_shape_error(model_name, position, value, spec, dynamic_dims)
        for axis, size in enumerate(value.shape):
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
            raise _wrong_shape_error(model_name, position, value, spec, dynamic_dims, expected_shape)
    return values


def layout_name(value: torch.Tensor) -> str:
    """``nested``, or the layout's own name (``sparse_coo``, ``_mkldnn``)."""
    return "nested" if value.is_nested else str(value.layout).removeprefix("torch.")


def _wrong_shape_error(
    model_name: str,
    position: int,
    value: torch.Tensor,
    spec: TensorSpec,
    dynamic_dims: Sequence[DynamicDim],
    expected_shape: tuple[int, ...] | None = None,
) -> InputError:
    shown = spec.shape if spec.symbolic_shape is None else shape_with_dim_names(spec, dynamic_dims)
    if tuple(value.shape) == expected_shape:  # only the dtype differs: no shape, dynamic or not, fits it
        return InputError(
            f"{model_name}: input {position} has dtype {value.dtype}, the plan was made for dtype {spec.dtype}; pass "
            f"it as .to({spec.dtype}), or compile again with example inputs of the dtype you will serve"
        )
    return InputError(
        f"{model_name}: input {position} has shape {tuple(value.shape)} and dtype {value.dtype}, "
        f"the plan was made for shape {shown} and dtype {spec.dtype}; "
        "compile again with example inputs of the shape you will serve"
        + (" (or declare the dimension dynamic: dynamic_shapes=...)" if not dynamic_dims else "")
    )


def _equal_value(value: Any, constant: Any) -> bool:
    """Whether ``value == constant`` is plainly true (a numpy bool too; an array's or a tensor's answer is not)."""
    try:
        equal = value == constant
        return isinstance(equal, (bool, np.bool_)) and bool(equal)
    except Exception:  # a type without a comparison
        return False


def _same_constant(value: Any, constant: Any) -> bool:
    """Whether a call's ``value`` is the non-tensor input the model was traced with, which the graph holds baked in.

    Equal is not enough: torch computes with a value's type, so ``2.0`` where ``2`` was traced makes float outputs
    where the graph makes int64 ones, and ``True`` for ``1`` a bool fill; so the type must be the same too (a
    ``float`` and a numpy ``float64`` as well). A float must keep its sign (``-0.0`` divides to ``-inf``), and a NaN
    is the same as a NaN, though the two do not compare equal. A tensor never is one: comparing one with a float gave
    a tensor, whose truth was a RuntimeError.
    """
    if type(value) is not type(constant) or isinstance(value, torch.Tensor):
        return False
    if isinstance(value, float):
        return _same_float(value, constant)
    if isinstance(value, complex):
        return _same_float(value.real, constant.real) and _same_float(value.imag, constant.imag)
    if isinstance(value, (tuple, list)):  # a sequence pytree keeps whole (a tuple subclass it does not know)
        return len(value) == len(constant) and all(map(_same_constant, value, constant))
    try:
        return bool(value == constant)
    except Exception:  # an array's comparison, a type without one
        return False


def _type_name(value: Any) -> str:
    """``int``, or ``numpy.int64``: a builtin's bare name, any other type's with its module (numpy's bool is named
    ``bool`` too)."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _same_float(value: float, constant: float) -> bool:
    if math.isnan(value) or math.isnan(constant):
        return math.isnan(value) and math.isnan(constant)
    return value == constant and math.copysign(1.0, value) == math.copysign(1.0, constant)


@dataclass
class TracedModel:
    """A flat GraphModule: placeholders are the flat tensor inputs, the output is a flat tuple.

    ``in_spec`` and ``out_spec`` turn a user's ``(args, kwargs)`` into the flat inputs and the
    flat outputs back into the model's (possibly nested) output structure. Non-tensor inputs
    (``use_cache=False``, a float scale) are baked into the graph: ``constant_inputs`` maps their
    flat positions to the traced values, and a call must pass the same values, of the same type (a NaN for a NaN).
    ``written_inputs`` (positions among the flat tensor inputs) and ``written_attributes`` (the graph module's
    parameters and buffers) are what the program writes in place: a call's inputs must not share memory with them.
    """

    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_specs: tuple[TensorSpec, ...]
    model_name: str
    constant_inputs: dict[int, Any]
    dynamic_dims: tuple[DynamicDim, ...] = ()
    written_inputs: tuple[int, ...] = ()
    written_attributes: tuple[str, ...] = ()

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
                traced = [
                    "Tensor" if i not in self.constant_inputs else repr(self.constant_inputs[i])
                    for i in range(self.in_spec.num_leaves)
                ]
                called = ["Tensor" if isinstance(v, torch.Tensor) else type(v).__name__ for v in flat]
                difference = (
                    f"inputs structured as {_structure(self.in_spec, traced)}, called with {_structure(spec, called)}"
                )
            raise InputError(
                f"{self.model_name} was traced with {difference}; call it with the same arguments as the example inputs"
            )
        for position, constant in self.constant_inputs.items():
            if not _same_constant(flat[position], constant):
                called = flat[position]
                remedy = "compile again to plan for that value"
                if isinstance(called, torch.Tensor):
                    shown = f"a tensor of shape {tuple(called.shape)}"
                elif type(called) is not type(constant):  # 2.0 for 2: the reprs may not tell them apart
                    shown = f"{repr(called)[:200]} (type {_type_name(called)}, traced type {_type_name(constant)})"
                    if _equal_value(called, constant):  # numpy's int64(3) for 3: the value is right, its type not
                        traced_type = _type_name(constant)
                        remedy = f"pass it as {traced_type}, the type it was traced with, or compile again for its type"
                else:
                    shown = repr(called)[:200]
                raise InputError(
                    f"{self.model_name} was traced with the non-tensor input {constant!r} at flat position "
                    f"{position}, called with {shown}; {remedy}"
                )
        tensors = [value for position, value in enumerate(flat) if position not in self.constant_inputs]
        check_flat_inputs(self.input_specs, self.dynamic_dims, tensors, self.model_name)
        self._check_no_written_aliases(args, kwargs, tensors)
        return tensors

    def _check_no_written_aliases(self, args: tuple, kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """:class:`moirai.InputError` where a call's inputs share memory with a tensor the program writes in place."""
        if not self.written_inputs and not self.written_attributes:
            return
        module = self.graph_module
        if self.written_inputs:  # a written input against every weight; else only written buffers against inputs
            weights = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        else:
            weights = {name: operator.attrgetter(name)(module) for name in self.written_attributes}
        names = tensor_input_names(args, kwargs, roots=("args", "kwargs"))
        check_no_written_aliases(tensors, names, self.written_inputs, weights, self.written_attributes, self.model_name)

    def unflatten_outputs(self, flat_outputs: list[Any]) -> Any:
        return _unflatten(list(flat_outputs), self.out_spec)


_LEAF = pytree.tree_structure(0)


def _unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    """``pytree.tree_unflatten``, but a ``torch.Size`` the model returned (``y.shape``) comes back a ``torch.Size``:
    torch's unflattens one to a tuple, since while tracing its leaves may be proxies that ``torch.Size`` refuses."""
    if spec.is_leaf():
        return leaves[0]
    children, start = [], 0
    for index in range(spec.num_children):
        child = spec.child(index)
        children.append(_unflatten(leaves[start : start + child.num_leaves], child))
        start += child.num_leaves
    if spec.type is torch.Size and all(isinstance(size, int) for size in children):
        return torch.Size(children)
    return pytree.tree_unflatten(children, pytree.TreeSpec(spec.type, spec.context, [_LEAF] * spec.num_children))


@stage("trace", "torch.export, then decompositions to aten")
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
    if not isinstance(model, torch.nn.Module):
        raise TraceError(
            f"moirai splits a torch.nn.Module, got {type(model).__name__}: wrap the function in a module whose "
            "forward calls it"
        )
    name = type(model).__name__
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TraceError(
            f"example_kwargs={repr(example_kwargs)[:80]} ({type(example_kwargs).__name__}) is not a dict; pass "
            f"{name}.forward's keyword inputs as example_kwargs={{'name': value}}, and positional ones as "
            "example_inputs=(...)"
        )
    _refuse_keywords_as_positional(model, example_inputs, example_kwargs, name)
    kwargs = dict(example_kwargs or {})
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    dynamic_dims: tuple[DynamicDim, ...] = ()
    check_example_inputs(model, args, kwargs, name)
    args, kwargs = _unshared_inputs(args, kwargs)
    try:
        with _quiet_export():
            exported = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        if _writes_constants(exported):
            exported = _export_strict(model, args, kwargs, dynamic_shapes, name)
    except TraceError:
        raise
    except Exception as export_error:
        meta_error = meta_weights_error(model, name, args, kwargs, export_error)
        if meta_error is not None:
            raise meta_error from export_error
        if dynamic_shapes is not None and "tree_name" in str(export_error):
            raise TraceError(
                f"could not trace {name} with dynamic_shapes: torch.export fails when an input goes to the model "
                f"through **kwargs (here one of {sorted(kwargs)}); pass such options by a named parameter of forward "
                "or leave them out (a Hugging Face model's ModelOutput needs no return_dict=False)"
            ) from export_error
        dynamic_error = dynamic_shapes_error(name, export_error, args, kwargs, dynamic_shapes)
        if dynamic_error is not None:
            raise dynamic_error from export_error
        if kwargs or dynamic_shapes is not None:
            raise trace_error(name, export_error, args, kwargs) from export_error
        graph_module = _symbolic_trace_fallback(model, args, name, export_error)
        out_spec = pytree.tree_structure(_flat_output_marker(graph_module))
    else:
        if _has_observable_mutation(exported.graph_module.graph):
            # The splitter follows data edges; an in-place op that other ops see is not one. torch's
            # functionalization rewrites it as data flow (graphs without one are left as traced).
            with warnings.catch_warnings():
                # torch's own deprecated call inside the decomposition, nothing the user wrote or can change
                warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
                exported = exported.run_decompositions({})
            _views_as_reshapes(exported.graph_module.graph)
        graph_module = exported.module()
        _give_write_backs_values(graph_module)
        put_writes_back_in_place(graph_module)  # [Note: writes put back in place]
        out_spec = exported.call_spec.out_spec
        _drop_guard_calls(graph_module)
        _drop_metadata_asserts(graph_module)
        if dynamic_shapes is not None:
            dynamic_dims = exported_dynamic_dims(exported, graph_module, model, args, kwargs, dynamic_shapes)
            warn_if_all_static(name, dynamic_shapes, dynamic_dims, args, kwargs)
        check_static_shapes(graph_module, name)
    in_spec = pytree.tree_structure((args, kwargs))
    flat_inputs = pytree.tree_leaves((args, kwargs))
    constant_inputs = {i: value for i, value in enumerate(flat_inputs) if not isinstance(value, torch.Tensor)}
    graph_module = _flatten_attributes(graph_module)
    graph_module.graph.set_codegen(fx.graph.CodeGen())
    _bake_constant_inputs(graph_module, constant_inputs)
    _flatten_output(graph_module)
    graph_module = _ops_numbered_in_order(graph_module)
    check_operand_dtypes(graph_module, name, tensor_input_names(args, kwargs))
    warn_if_training(model, name, graph_module)
    warn_of_random_ops(model, name, graph_module)
    if dynamic_dims:
        placeholders = graph_module.graph.find_nodes(op="placeholder")
        input_specs = tuple(tensor_spec(node.meta["val"]) for node in placeholders)
    else:
        input_specs = tuple(TensorSpec(tuple(t.shape), t.dtype) for t in flat_inputs if isinstance(t, torch.Tensor))
    written_inputs, written_attributes = _written_state(graph_module)
    return TracedModel(
        graph_module,
        in_spec,
        out_spec,
        input_specs,
        name,
        constant_inputs,
        dynamic_dims,
        written_inputs,
        written_attributes,
    )


def _written_state(graph_module: fx.GraphModule) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The flat input positions and the attribute names whose tensors ``graph_module`` writes in place (itself or a
    view of it)."""
    written = {base for _, base in written_bases(graph_module.graph)}
    placeholders = graph_module.graph.find_nodes(op="placeholder")
    inputs = tuple(position for position, node in enumerate(placeholders) if node in written)
    attributes = tuple(dict.fromkeys(str(node.target) for node in written if node.op == "get_attr"))
    return inputs, attributes


def _give_write_backs_values(graph_module: fx.GraphModule) -> None:
    """Give ``meta["val"]`` to the ``copy_`` nodes ``exported.module()`` adds to write a mutated input or buffer back,
    which it leaves without one: the value is the written tensor's. Without it the splitter took such a node for a
    non-tensor ("flat output 0 (copy__default) is not a tensor") and the op graph for one of no bytes."""
    for node in graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default):
        written = node.args[0]
        if "val" not in node.meta and isinstance(written, fx.Node) and "val" in written.meta:
            node.meta["val"] = written.meta["val"]


def _unshared_inputs(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The example inputs with every repeat of a tensor object (``(x, x)``) replaced by a copy of its own.

    Non-strict torch.export gives the same tensor object one placeholder, so a model traced with ``(x, x)`` would
    read its first input for both on every call; copies keep each input its own (views of one tensor already do).
    """
    seen: set[int] = set()

    def own(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in seen:
            seen.add(id(value))
            return value
        with torch.no_grad():
            return value.clone().requires_grad_(value.requires_grad)

    return pytree.tree_map(own, (args, kwargs))


def _symbolic_trace_fallback(model: torch.nn.Module, args: tuple, name: str, export_error: Exception) -> fx.GraphModule:
    try:
        graph_module = fx.symbolic_trace(model)
    except Exception:
        raise trace_error(name, export_error, args, {}) from export_error
    recorder = _RecordValues(graph_module)
    try:
        with torch.no_grad():  # not inference mode: its tensors keep no version counter
            recorder.run(*args)
    except Exception as error:
        # The model ran eagerly on the example inputs and failed there: they do not fit it.
        raise inputs_do_not_fit_error(name, args, graph_module, recorder.current_node, error) from error
    if recorder.writes_in_place is not None:
        raise in_place_write_error(name, graph_module, recorder.writes_in_place, export_error) from export_error
    return graph_module


class _RecordValues(fx.Interpreter):
    """Runs the graph once and records ``meta["val"]`` (as exported graphs have) on every node, and the first node
    that writes a tensor it reads in place (its version counter, which views share, moves)."""

    current_node: fx.Node | None = None
    writes_in_place: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current_node = n
        read = [t for t in pytree.tree_leaves(self.fetch_args_kwargs_from_env(n)) if isinstance(t, torch.Tensor)]
        if n.op == "call_module":  # a module may write its own state (a running mean, a cache)
            module = self.module.get_submodule(str(n.target))
            read += [*module.parameters(), *module.buffers()]
        versions_before = [_version(t) for t in read]
        result = super().run_node(n)
        if self.writes_in_place is None and versions_before != [_version(t) for t in read]:
            self.writes_in_place = n
        n.meta["val"] = pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), result)
        return result


def _version(tensor: torch.Tensor) -> int | None:
    """How many times ``tensor`` (or a view of its storage) was written in place; None for an inference tensor."""
    return None if tensor.is_inference() else tensor._version


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


def op_kind(op_name: str) -> str:
    """The kind an op's name gives: ``contiguous_1`` -> ``contiguous``, ``sym_size_int_43`` -> ``sym_size_int``."""
    return re.sub(r"_\d+$", "", op_name)


def _ops_numbered_in_order(graph_module: fx.GraphModule) -> fx.GraphModule:
    """The module with its ops renamed ``add``, ``add_1``, ``add_2``... in graph order, kind by kind.

    [Note: op names numbered in order]
    A saved plan names its ops, and a load finds them by name in a fresh trace. torch.export numbers an op's name by
    every op of its kind it ever made, symbolic size arithmetic it later dropped included, so a trace that differs
    in one op numbers every later op of other kinds differently: a step traced on ``meta`` weights has a ``clone``
    after attention that the real weights' trace has not, and its later ``add``s were ``add_285`` where the real
    trace's were ``add_280``, so a plan made on ``meta`` named ops the real model's trace did not have. Numbered in
    order, the two traces' names differ only in the layout ops themselves, which a load matches
    (moirai/compile.py's ``_matched_layout_ops``).
    """
    graph = fx.Graph()
    graph.set_codegen(graph_module.graph._codegen)
    counts: dict[str, int] = {}
    values: dict[fx.Node, fx.Node] = {}
    for node in graph_module.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            kind = op_kind(node.name)
            number = counts.get(kind, 0)
            counts[kind] = number + 1
            name = kind if number == 0 else f"{kind}_{number}"
            args = fx.node.map_arg(node.args, values.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
            copy = graph.create_node(node.op, node.target, args, kwargs, name, node.type)
            copy.meta = dict(node.meta)
        else:
            copy = graph.node_copy(node, values.__getitem__)
        values[node] = copy
    return fx.GraphModule(graph_module, graph, class_name=type(graph_module).__name__)


def _flatten_attributes(graph_module: fx.GraphModule) -> fx.GraphModule:
    """The module with every attribute and submodule its graph reads at top level, named after its node.

    Generated code fetches a nested target through every module on its path, one slow
    ``nn.Module.__getattr__`` each: inception_v4 made 6,180 such calls per run, a third of its time. The modules the
    ``symbolic_trace`` fallback calls (``call_module``, a Linear kept whole) move too: left out, every model with a
    submodule failed here with an AttributeError.
    """
    root = torch.nn.Module()
    for node in graph_module.graph.find_nodes(op="call_module"):
        root.add_module(node.name, graph_module.get_submodule(str(node.target)))
        node.target = node.name
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


def _drop_metadata_asserts(graph_module: fx.GraphModule) -> None:
    """Exported graphs assert the dtype and device of each tensor a ``.to`` converts, which the trace already fixed;
    each assert is an op call on every run (a Llama layer has seven)."""
    metadata_assert = torch.ops.aten._assert_tensor_metadata.default
    for node in graph_module.graph.find_nodes(op="call_function", target=metadata_assert):
        if not node.users:
            graph_module.graph.erase_node(node)


def retarget_devices(module: fx.GraphModule, device: torch.device) -> None:
    """Set every device argument of ``module``'s ops to ``device``, also in the graphs nested in it.

    Traced graphs record the device of tracing in ops that create or check tensors (``arange(device=cpu)``,
    ``_to_copy``, ``_assert_tensor_metadata``), also inside the bodies of higher-order ops (a Llama's rotary
    embedding runs under ``wrap_with_autocast``); code that runs the graph on another device must create them there.
    """
    for graph_module in _graph_modules(module):
        stale = [node for node in graph_module.graph.nodes if _devices_of(node) - {device}]
        for node in stale:
            node.args, node.kwargs = pytree.tree_map_only(torch.device, lambda _: device, (node.args, node.kwargs))
        if stale:
            graph_module.recompile()


def devices_mentioned(module: fx.GraphModule) -> set[torch.device]:
    """The devices that ``module``'s ops name in their arguments, also in the graphs nested in it."""
    nodes = (node for graph_module in _graph_modules(module) for node in graph_module.graph.nodes)
    return {device for node in nodes for device in _devices_of(node)}


def _graph_modules(module: fx.GraphModule) -> Iterator[fx.GraphModule]:
    return (m for m in module.modules() if isinstance(m, fx.GraphModule))


def _devices_of(node: fx.Node) -> set[torch.device]:
    return {leaf for leaf in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(leaf, torch.device)}


def _has_observable_mutation(graph: fx.Graph) -> bool:
    """Whether an in-place op writes a tensor (or a view of it) that another op also reads, or a block wrapped in a
    higher-order op (``with torch.no_grad():``) writes in place at all.

    ``relu_`` on a value nothing else reads (ResNet's ``ReLU(inplace=True)``) is harmless to a split;
    ``t.add_(u)`` where another op reads ``t`` (before or after) makes an order the data edges do not show. A
    wrapped block's results may alias what it writes, where :func:`is_view_node` cannot follow them; functionalizing
    inlines the block and makes its writes data flow like any other.
    """
    for node, base in written_bases(graph):
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return True
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


def _writes_constants(exported: torch.export.ExportedProgram) -> bool:
    """Whether the program writes a tensor it took as a constant: state the model holds outside its registered
    buffers (Hugging Face's ``StaticCache`` behind an export wrapper's buffers), which non-strict export cannot
    see as the buffer it aliases, so each call's writes would be lost."""
    constants = {
        spec.arg.name
        for spec in exported.graph_signature.input_specs
        if spec.kind == torch.export.graph_signature.InputKind.CONSTANT_TENSOR
    }
    return any(base.op == "placeholder" and base.name in constants for _, base in written_bases(exported.graph))


class _Leaf(NamedTuple):
    name: str

    def __repr__(self) -> str:
        return self.name


def _structure(spec: pytree.TreeSpec, leaf_names: Sequence[str]) -> str:
    """``args (Tensor, (Tensor,))`` (and ``kwargs {...}``): a call's input structure as Python writes it."""
    args, kwargs = pytree.tree_unflatten([_Leaf(name) for name in leaf_names], spec)
    return f"args {tuple(args)!r}" + (f" and kwargs {dict(kwargs)!r}" if kwargs else "")


# Loggers torch.export writes to on its way to an error that :func:`trace` explains or falls back from: an op that
# fails on fake tensors (a wrong input shape) logs its whole traceback; a branch on a tensor's value warns.
_EXPORT_FAILURE_LOGS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """torch.export without what it tells stderr of a failure that :func:`trace` then explains or falls back from:
    the logs of ``_EXPORT_FAILURE_LOGS``, and the partial graph torch.export prints before it raises (twice for a
    model that branches on a tensor: a screen of code above a fallback that then succeeded)."""
    logs = [logging.getLogger(name) for name in _EXPORT_FAILURE_LOGS]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    stderr = sys.stderr
    sys.stderr = _WithoutPrintsOf(stderr, _TORCH_EXPORT_TRACE)
    try:
        yield
    finally:
        if isinstance(sys.stderr, _WithoutPrintsOf):  # unless the caller replaced it meanwhile
            sys.stderr = stderr
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)


_TORCH_EXPORT_TRACE = os.path.join("torch", "export", "_trace.py")


class _WithoutPrintsOf(io.TextIOBase):
    """``stream``, but for what code in the file ``source`` (a path's tail) writes to it directly (its ``print``
    calls): every other writer, another thread's included, writes through."""

    def __init__(self, stream: TextIO, source: str) -> None:
        self._stream, self._source = stream, source

    def write(self, text: str) -> int:
        if sys._getframe(1).f_code.co_filename.endswith(self._source):
            return len(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._stream.encoding

    def __getattr__(self, name: str) -> Any:  # what else a writer asks the stream (pytest's, a notebook's)
        return getattr(self._stream, name)


def _refuse_keywords_as_positional(
    model: torch.nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None, name: str
) -> None:
    """A dict given as ``example_inputs`` whose keys are all names of ``forward``'s parameters is keyword inputs
    given in the wrong place (a dict the model takes as its one input is ``example_inputs=(inputs,)``)."""
    if not isinstance(example_inputs, dict) or not example_inputs:
        return
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if all(isinstance(key, str) and key in parameters for key in example_inputs):
        raise TraceError(
            f"example_inputs is a dict of {name}.forward's arguments {sorted(example_inputs)}: pass keyword inputs "
            "as example_kwargs={...} (and call the compiled model with them as keywords), or their values as "
            "example_inputs=(...) in forward's order"
        )


def _export_strict(
    model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], dynamic_shapes: Any, name: str
) -> torch.export.ExportedProgram:
    """Export again with TorchDynamo (strict), which follows a tensor to the registered buffer it aliases."""
    try:
        exported = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=True)
    except Exception as error:
        raise TraceError(
            f"could not trace {name}: its forward writes in place tensors that are not its registered buffers (a "
            "cache object holding its own references, say), which torch.export cannot carry between calls, and "
            f"strict export failed too ({_first_line(error)}). Register such state as buffers and write them "
            "through the module; for a Hugging Face causal LM, moirai.compile_lm(model, devices) splits it with "
            "its KV cache and generates"
        ) from error
    if _writes_constants(exported):
        raise TraceError(
            f"could not trace {name}: its forward writes in place tensors that are not its registered buffers, so "
            "their writes would be lost between calls. Register such state as buffers; for a Hugging Face causal "
            "LM, moirai.compile_lm(model, devices) splits it with its KV cache and generates"
        )
    return exported


def _views_as_reshapes(graph: fx.Graph) -> None:
    """Functionalization writes ``reshape`` as ``view``, which needs the strides seen at trace time; the
    kernels of a run (an attention's output layout) or a transfer may give others. In a functional graph
    a reshape computes the same values."""
    for node in graph.nodes:
        if node.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            node.target = torch.ops.aten.reshape.default
