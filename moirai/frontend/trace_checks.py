"""Checks of a model's example inputs and traced graph, and the errors tracing raises.

Each check refuses, as a :class:`moirai.TraceError` naming the input, op or source line, what torch would
accept at trace time and fail on later (or accept silently with wrong results): a numpy example input,
inputs that do not bind to ``forward``, value-dependent shapes, mixed operand dtypes.
"""

from __future__ import annotations

import inspect
import re
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from moirai.errors import MoiraiWarning, RandomOpsWarning, TraceError, TrainingModeWarning, user_stacklevel
from moirai.frontend.symbolic_shapes import is_export_dim

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
# What torch.export says of an output it cannot flatten (a class that is not a registered pytree node).
_UNKNOWN_OUTPUT = re.compile(r"Found <class '([^']+)'> in output, which is not a known type")
_NORMS = {torch.ops.aten.layer_norm, torch.ops.aten.group_norm, torch.ops.aten.batch_norm, torch.ops.aten.instance_norm}


def _is_library_file(filename: str) -> bool:
    return "site-packages/torch" in filename or filename.startswith(_MOIRAI_DIRECTORY)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


_EXAMPLE_ROOTS = ("example_inputs", "example_kwargs")


def _input_path(path: tuple, roots: tuple[str, str] = _EXAMPLE_ROOTS) -> str:
    """``example_inputs[0]`` or ``example_kwargs['mask']`` for a key path into ``(args, kwargs)`` (other names of the
    two with ``roots``)."""
    return roots[path[0].idx] + pytree.keystr(path[1:])


def tensor_input_names(args: tuple, kwargs: dict[str, Any], roots: tuple[str, str] = _EXAMPLE_ROOTS) -> list[str]:
    """Where every flat tensor input came from, in flat order (the placeholders of the traced graph): of the example
    inputs, or with ``roots=("args", "kwargs")`` of a call."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    return [_input_path(path, roots) for path, value in leaves if isinstance(value, torch.Tensor)]


def _describe_tensors(args: tuple, kwargs: dict[str, Any]) -> str:
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    shown = [
        f"{_input_path(path)}: {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
        if isinstance(value, torch.Tensor)
        else f"{_input_path(path)}: {type(value).__name__}"
        for path, value in leaves
    ]
    return ", ".join(shown[:6]) + (", ..." if len(shown) > 6 else "") if shown else "none"


def check_example_inputs(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], name: str) -> None:
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


def warn_if_training(model: torch.nn.Module, name: str, graph_module: fx.GraphModule) -> None:
    """Warn where ``model`` is in training mode and that changes what it computes: a dropout or batch-norm module
    that is training, or a dropout op of the traced graph in a training module (``F.dropout(x, training=
    self.training)``, as Hugging Face's attention does, leaves no module to find). The mode is fixed at tracing, so
    the compiled program keeps it after ``model.eval()``."""
    if not any(m.training for m in model.modules()):
        return
    random_or_batch = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm)
    modules = {path: m for path, m in model.named_modules() if m.training and isinstance(m, random_or_batch)}
    training = [f"{path or name} ({type(m).__name__})" for path, m in modules.items()]
    training += [
        _describe_node(graph_module, node)
        for node in graph_module.graph.nodes
        if _training_dropout(model, node) and _innermost_module_path(node) not in modules
    ]
    if training:
        warnings.warn(
            TrainingModeWarning(
                f"{name} is in training mode: {_some(training)} will drop random activations or use batch "
                "statistics, so the split model's outputs differ from call to call and from the model in eval mode, "
                "also after model.eval() (the mode is fixed when the model is traced); call model.eval() before "
                "moirai.compile"
            ),
            stacklevel=user_stacklevel(),
        )


def warn_of_random_ops(model: torch.nn.Module, name: str, graph_module: fx.GraphModule) -> None:
    """Warn where the traced graph draws random numbers that ``model.eval()`` does not turn off (``torch.randn_like``
    noise, ``torch.rand``, ``bernoulli_``, ``multinomial``, a dropout in eval mode; a training dropout is
    :func:`warn_if_training`'s): the split program draws in the plan's order, on each part's process, so its draws
    never equal the model's under one seed, and differ by plan and by process."""
    drawing = [
        _describe_node(graph_module, node)
        for node in graph_module.graph.nodes
        if _draws_random_numbers(node) and not _training_dropout(model, node)
    ]
    if drawing:
        warnings.warn(
            RandomOpsWarning(
                f"{name}: {_some(drawing)} draw random numbers on every call, so the split model's outputs will not "
                "equal the model's, even after torch.manual_seed: its parts draw in the plan's order (another plan "
                "draws otherwise) and each in its own process (run_distributed's new processes draw the same numbers "
                "on every call); nothing to do if that randomness is meant, else take the random ops out of forward"
            ),
            stacklevel=user_stacklevel(),
        )


def _training_dropout(model: torch.nn.Module, node: fx.Node) -> bool:
    """Whether ``node`` is a dropout that draws because its module is training (what ``model.eval()`` turns off)."""
    return _draws_random_numbers(node) and _is_dropout(node) and _module_of(model, node).training


def _some(items: list[str]) -> str:
    return f"{', '.join(items[:3])}{', ...' if len(items) > 3 else ''}"


# Random ops whose randomness model.eval() turns off (the functional dropouts, and bernoulli, which they become).
_DROPOUT_OPS = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "bernoulli"}


def _is_dropout(node: fx.Node) -> bool:
    """Whether random op ``node`` is a dropout, which a module's ``self.training`` turns on, not noise a model
    draws in eval mode too (``torch.randn_like``)."""
    schema = node.target._schema
    return schema.name.split("::")[-1].rstrip("_") in _DROPOUT_OPS or any(
        a.name in ("train", "dropout_p") for a in schema.arguments
    )


def _draws_random_numbers(node: fx.Node) -> bool:
    """Whether ``node`` is an aten op whose result is random (dropout, bernoulli, rand_like, ...)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    arguments = {a.name: a.default_value for a in target._schema.arguments if a.has_default_value()}
    arguments.update({a.name: value for a, value in zip(target._schema.arguments, node.args, strict=False)})
    arguments.update(node.kwargs)
    # dropout(input, p, train), scaled_dot_product_attention(..., dropout_p=0.0): random only when they drop
    return arguments.get("train", True) is not False and arguments.get("p", arguments.get("dropout_p", 1)) != 0


def _innermost_module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def _module_of(model: torch.nn.Module, node: fx.Node) -> torch.nn.Module:
    """The innermost module whose forward made ``node`` (``model`` where the trace does not say)."""
    try:
        return model.get_submodule(_innermost_module_path(node))
    except AttributeError:
        return model


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


def inputs_do_not_fit_error(
    name: str, args: tuple, graph_module: fx.GraphModule, node: fx.Node | None, error: Exception
) -> TraceError:
    """The model ran eagerly on the example inputs and ``node`` failed there: they do not fit it."""
    return TraceError(
        f"could not trace {name}: the example inputs ({_describe_tensors(args, {})}) do not fit it; "
        f"{_describe_node(graph_module, node)} fails with {_first_line(error)}. "
        "Give example inputs of the shapes, dtypes and number the model's forward takes."
    )


def meta_weights_error(
    model: torch.nn.Module, name: str, args: tuple, kwargs: dict[str, Any], error: Exception
) -> TraceError | None:
    """A :class:`TraceError` saying to pass example inputs on the meta device, where the model's weights are there
    and an input is not (torch refuses an op across the two, and the generic message blamed the inputs' shapes);
    None otherwise."""
    on_meta = any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
    if not on_meta:
        return None
    real = [
        f"{_input_path(path)} on {value.device}"
        for path, value in pytree.tree_flatten_with_path((args, kwargs))[0]
        if isinstance(value, torch.Tensor) and value.device.type != "meta"
    ]
    if not real:
        return None
    return TraceError(
        f"could not trace {name}: its weights are on the meta device and its example inputs are not "
        f"({', '.join(real[:3])}), and torch runs no op across the two ({_first_line(error)}). Pass example inputs on "
        'the meta device too, e.g. torch.empty(shape, dtype=..., device="meta") or x.to("meta"): planning reads only '
        "their shapes and dtypes (running the split model needs the real weights)"
    )


def trace_error(model_name: str, error: Exception, args: tuple, kwargs: dict[str, Any]) -> TraceError:
    unknown_output = _UNKNOWN_OUTPUT.search(str(error))
    if unknown_output is not None:
        return _unknown_output_error(model_name, unknown_output.group(1), args, kwargs)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not _is_library_file(f.filename)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    return TraceError(
        f"could not trace {model_name}{where} with example inputs {_describe_tensors(args, kwargs)}: "
        f"{_first_line(error)}. "
        "Try: data-dependent control flow on tensor values must become torch.cond or be removed; "
        "Hugging Face decoders need use_cache=False (and return_dict=False if outputs are not tensors); "
        "example inputs must be tensors of the shape you will serve."
    )


def dynamic_shapes_error(
    model_name: str, error: Exception, args: tuple, kwargs: dict[str, Any], dynamic_shapes: Any
) -> TraceError | None:
    """A :class:`TraceError` for torch.export's refusal of ``dynamic_shapes`` (an example size outside its ``Dim``'s
    range, or a dimension the model fixes declared dynamic), naming the declared ranges; None for another error."""
    from torch._dynamo.exc import UserError, UserErrorType

    if dynamic_shapes is not None and isinstance(error, UserError) and error.error_type is UserErrorType.INVALID_INPUT:
        return TraceError(
            f"could not trace {model_name} with example inputs {_describe_tensors(args, kwargs)}: torch.export "
            f"refuses the form of the dynamic_shapes given ({_first_line(error)}). They mirror the inputs: a tuple "
            "with an entry per positional input, or a dict by forward's parameter names; for each tensor a dict "
            "{axis: torch.export.Dim(...)} (or None: static), None for an input that is no tensor"
        )
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError  # sympy: [Note: what a rank imports]

    violated = isinstance(error, UserError) and error.error_type is UserErrorType.CONSTRAINT_VIOLATION
    if not (violated or isinstance(error, ConstraintViolationError)):
        return None
    dims = [leaf for leaf in pytree.tree_leaves(dynamic_shapes) if is_export_dim(leaf)]
    declared = ", ".join(dict.fromkeys(f"{d.__name__} = {d.min}..{d.max}" for d in dims)) or "none by name"
    return TraceError(
        f"could not trace {model_name} with example inputs {_describe_tensors(args, kwargs)} and the dynamic_shapes "
        f"given (declared: {declared}): torch.export refuses them ({_first_line(error)}; its ranges show a declared "
        "lower end of 0 or 1 as 2). Give example inputs whose every dynamic dimension lies inside its declared "
        f"range{_small_sizes_words(args, kwargs)}, and declare dynamic only dimensions the model lets vary (a Linear "
        "fixes its input features, a reshape may fix others)"
    )


def warn_if_all_static(
    model_name: str, dynamic_shapes: Any, dynamic_dims: Sequence[Any], args: tuple, kwargs: dict[str, Any]
) -> None:
    """A :class:`MoiraiWarning` where ``dynamic_shapes`` declares a dimension (a Dim, ``Dim.AUTO``, ``Dim.DYNAMIC``)
    but torch.export made every one static: the plan then serves the example's shapes only, and a call of another
    size was refused with advice to declare the dimension dynamic, which the user had done."""
    if dynamic_dims or not any(leaf is not None for leaf in pytree.tree_leaves(dynamic_shapes)):
        return
    warnings.warn(
        MoiraiWarning(
            f"{model_name}: dynamic_shapes declares dimensions, but torch.export made every one static"
            f"{_small_sizes_words(args, kwargs, '')}: the plan serves the example's shapes only. Give an example of "
            "at least 2 along each dimension that should vary (Dim.AUTO lets torch.export fix a dimension the model "
            "fixes; a torch.export.Dim makes it say why)"
        ),
        stacklevel=user_stacklevel(),
    )


def _small_sizes_words(args: tuple, kwargs: dict[str, Any], lead: str = " and at least 2") -> str:
    """Where an example tensor has a dimension of size 0 or 1, which torch.export always makes static (so a Dim
    declared there, whatever its range, is violated): the words that say so, else ''."""
    small = [
        f"{_input_path(path)} dimension {axis} is {size}"
        for path, value in pytree.tree_flatten_with_path((args, kwargs))[0]
        if isinstance(value, torch.Tensor)
        for axis, size in enumerate(value.shape)
        if size in (0, 1)
    ]
    if not small:
        return ""
    return (
        f"{lead} (torch.export makes a dimension of example size 0 or 1 static, whatever its Dim says; "
        f"here {', '.join(small[:3])})"
    )


def in_place_write_error(model_name: str, graph_module: fx.GraphModule, node: fx.Node, error: Exception) -> TraceError:
    """The ``symbolic_trace`` fallback's graph writes a tensor in place at ``node``: fx keeps such a write as a call
    whose readers do not depend on it, so a plan could run them before or after it and a split read either value
    (torch.export would have made it data flow; it failed with ``error``)."""
    return TraceError(
        f"could not trace {model_name}: torch.export failed ({_first_line(error)}), and the graph of the fallback "
        f"tracer (torch.fx.symbolic_trace) writes a tensor in place at {_describe_node(graph_module, node)}, which "
        "it keeps as a call that the tensor's readers do not depend on, so a split could read the tensor before or "
        "after the write. Make the operation out of place (y = y.mul(2), not y.mul_(2); nn.ReLU() without "
        "inplace=True; torch.where, not an assignment into a slice), or make the model export"
    )


def _unknown_output_error(model_name: str, output_class: str, args: tuple, kwargs: dict[str, Any]) -> TraceError:
    """The model returns an object torch cannot flatten into tensors; a Hugging Face KV cache (returned while
    ``use_cache`` is on) has a fix of its own."""
    where = f"could not trace {model_name} with example inputs {_describe_tensors(args, kwargs)}: its output holds a "
    if output_class.startswith("transformers.cache_utils."):
        return TraceError(
            where + f"{output_class} (past_key_values: Hugging Face's KV cache, returned because use_cache is on), "
            "which a split program cannot return. Compile it with example_kwargs={'use_cache': False} (and call it "
            "with use_cache=False), or split it for generation, its KV cache kept on the devices, with "
            "moirai.compile_lm"
        )
    return TraceError(
        where + f"{output_class}, which is not a tensor or a tuple, list or dict of them: return tensors, or "
        "register the class with torch.utils._pytree.register_pytree_node"
    )


def check_static_shapes(graph_module: fx.GraphModule, name: str) -> None:
    """Refuse ops whose output shape depends on tensor values (``t[t > 0]``, ``nonzero``): plans fix every shape."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols  # sympy: [Note: what a rank imports]

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


def check_operand_dtypes(graph_module: fx.GraphModule, name: str, input_names: list[str]) -> None:
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
