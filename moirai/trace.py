"""Trace a model into a flat fx graph whose every node carries ``meta["val"]``.

Example::

    traced = trace(model, (torch.randn(8, 16),))
    flat_outputs = traced.graph_module(*traced.flatten_inputs((x,), {}))
"""

from __future__ import annotations

import operator
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.passes.shape_prop import ShapeProp

from moirai.errors import InputError, TraceError
from moirai.progress import stage


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one flat input, enough to check a call and to allocate a buffer."""

    shape: tuple[int, ...]
    dtype: torch.dtype


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

    def flatten_inputs(self, args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The flat input tensors of a call, checked against the traced example inputs."""
        expected_keys = self.in_spec.child(1).context
        if set(kwargs) == set(expected_keys):
            kwargs = {key: kwargs[key] for key in expected_keys}
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise InputError(
                f"{self.model_name} was traced with inputs structured as {self.in_spec}, "
                f"called with {spec}; call it with the same arguments as the example inputs"
            )
        for position, constant in self.constant_inputs.items():
            if flat[position] != constant:
                raise InputError(
                    f"{self.model_name} was traced with the non-tensor input {constant!r} at flat position "
                    f"{position}, called with {flat[position]!r}; compile again to plan for that value"
                )
        tensors = [value for position, value in enumerate(flat) if position not in self.constant_inputs]
        for position, (value, expected) in enumerate(zip(tensors, self.input_specs, strict=True)):
            if not isinstance(value, torch.Tensor):
                raise InputError(f"{self.model_name}: input {position} must be a tensor, got {type(value).__name__}")
            if tuple(value.shape) != expected.shape or value.dtype != expected.dtype:
                raise InputError(
                    f"{self.model_name}: input {position} has shape {tuple(value.shape)} and dtype {value.dtype}, "
                    f"the plan was made for shape {expected.shape} and dtype {expected.dtype}; "
                    "compile again with example inputs of the shape you will serve"
                )
        return tensors

    def unflatten_outputs(self, flat_outputs: list[Any]) -> Any:
        return pytree.tree_unflatten(list(flat_outputs), self.out_spec)


@stage("trace")
def trace(
    model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict[str, Any] | None = None
) -> TracedModel:
    """Trace ``model`` with ``torch.export`` (non-strict), falling back to ``symbolic_trace``.

    Weights may live on the ``meta`` device; example inputs should then be ``meta`` tensors too.
    Raises :class:`moirai.TraceError` naming the model, the failing line and what to try.
    """
    kwargs = dict(example_kwargs or {})
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    name = type(model).__name__
    try:
        exported = torch.export.export(model, args, kwargs, strict=False)
    except Exception as export_error:
        if kwargs:
            raise _trace_error(name, export_error) from export_error
        graph_module = _symbolic_trace_fallback(model, args, name, export_error)
        out_spec = pytree.tree_structure(_flat_output_marker(graph_module))
    else:
        graph_module = exported.module()
        out_spec = exported.call_spec.out_spec
        _drop_guard_calls(graph_module)
    in_spec = pytree.tree_structure((args, kwargs))
    flat_inputs = pytree.tree_leaves((args, kwargs))
    constant_inputs = {i: value for i, value in enumerate(flat_inputs) if not isinstance(value, torch.Tensor)}
    graph_module = _flatten_attributes(graph_module)
    graph_module.graph.set_codegen(fx.graph.CodeGen())
    _bake_constant_inputs(graph_module, constant_inputs)
    _flatten_output(graph_module)
    graph_module.recompile()
    input_specs = tuple(TensorSpec(tuple(t.shape), t.dtype) for t in flat_inputs if isinstance(t, torch.Tensor))
    return TracedModel(graph_module, in_spec, out_spec, input_specs, name, constant_inputs)


def _symbolic_trace_fallback(model: torch.nn.Module, args: tuple, name: str, export_error: Exception) -> fx.GraphModule:
    try:
        graph_module = fx.symbolic_trace(model)
    except Exception:
        raise _trace_error(name, export_error) from export_error
    _ShapePropWithParams(graph_module).propagate(*args)
    return graph_module


class _ShapePropWithParams(ShapeProp):
    """ShapeProp that also records ``meta["val"]`` (as exported graphs have) on every node."""

    def run_node(self, n: fx.Node) -> Any:
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


def _trace_error(model_name: str, error: Exception) -> TraceError:
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "site-packages/torch" not in f.filename]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return TraceError(
        f"could not trace {model_name}{where}: {type(error).__name__}: {first_line}. "
        "Try: data-dependent control flow on tensor values must become torch.cond or be removed; "
        "Hugging Face decoders need use_cache=False (and return_dict=False if outputs are not tensors); "
        "example inputs must be tensors of the shape you will serve."
    )
