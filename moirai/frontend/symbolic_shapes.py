"""Dynamic shapes: the input dimensions a plan serves at every size, and the sizes computed from them.

A model traced with ``dynamic_shapes`` (:func:`moirai.frontend.trace.trace`) has symbolic sizes: every
:class:`~moirai.frontend.trace.TensorSpec` keeps its shape as Python expressions over the symbols of the
:class:`DynamicDim` s (``"s0*s1"``), which :func:`concrete_shape` evaluates per call; shape scalars
(:func:`shape_scalars`) are recomputed on every part from the call's symbol values.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import math
import operator
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from moirai.errors import PlanError, TraceError

if TYPE_CHECKING:  # trace imports this module; these are only annotations here
    import sympy

    from moirai.frontend.trace import TensorSpec, TracedModel

# sympy is imported where a symbolic size is met, not with this module: the runtime's ranks import this module
# through moirai.frontend.trace, and would pay for sympy at every start ([Note: what a rank imports]).


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


def symbolic_expression(value: int | torch.SymInt | torch.SymBool | torch.SymFloat) -> str:
    """A Python expression for a traced scalar over the input dimensions' symbols (``"s0*s1"``)."""
    if isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        from torch.utils._sympy.printers import PythonPrinter

        return PythonPrinter().doprint(value.node.expr)
    return repr(value)


def evaluate_symbolic(expression: str, symbol_values: Mapping[str, int]) -> Any:
    """The value of a :func:`symbolic_expression` at the given symbol values; :class:`moirai.PlanError` where an
    expression accepted as arithmetic still cannot be computed (a division by zero, ``Dim`` arithmetic torch
    refuses, a value beyond :data:`_MAX_MAGNITUDE`)."""
    tree = _parsed_expression(expression)
    try:
        return _evaluate(tree, symbol_values, expression)
    except (ArithmeticError, TypeError, ValueError, RuntimeError) as error:
        raise PlanError(f"symbolic shape {expression!r:.80} cannot be evaluated ({error}); {_FORGED}") from None


def concrete_shape(spec: TensorSpec, symbol_values: Mapping[str, int]) -> tuple[int, ...]:
    """``spec``'s shape at the given symbol values (a receive buffer's shape)."""
    if spec.symbolic_shape is None:
        return spec.shape
    return tuple(int(evaluate_symbolic(expression, symbol_values)) for expression in spec.symbolic_shape)


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
        if position >= len(tensors) or axis >= tensors[position].dim():
            raise PlanError(
                f"the plan makes dimension {axis} of flat input {position} dynamic ({expression}), but the example "
                f"inputs have {len(tensors)} tensors of {[t.dim() for t in tensors][:8]} dimensions; give example "
                "inputs structured as those the plan was made with"
            )
        # A derived dim (2*batch) is the same arithmetic on torch.export.Dim objects.
        axes_of.setdefault(position, {})[axis] = evaluate_symbolic(expression, dims)
    shapes = torch.export.ShapesCollection()
    for position, axes in axes_of.items():
        shapes[tensors[position]] = axes
    return shapes.dynamic_shapes(model, args, kwargs)


def shape_scalars(traced: TracedModel) -> dict[fx.Node, sympy.Expr]:
    """Ops whose value is arithmetic on the input dimensions only (``sym_size``, products of sizes).

    Only tensors cross devices: every part that reads such a scalar computes it itself from the
    call's symbol values (:mod:`moirai.runtime.split`), so no edge of the op graph carries one.
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


@functools.cache
def shape_operators() -> dict[type, Callable[[Any, Any], Any]]:
    """The sympy expressions of shape scalars, as Python operators (what a part computes them with)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Max, Min, PythonMod

    return {
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
        # torch's own Max and Min (what torch.sym_max makes, as MPT's attention does) and sympy's
        Max: torch.sym_max,
        Min: torch.sym_min,
        sympy.Max: torch.sym_max,
        sympy.Min: torch.sym_min,
    }


def _is_shape_arithmetic(expr: sympy.Basic, symbols: set[str]) -> bool:
    import sympy

    if expr.is_Symbol:
        return str(expr) in symbols
    if expr.is_Integer or expr in (sympy.true, sympy.false):
        return True
    if isinstance(expr, sympy.Pow):
        return bool(expr.exp.is_Integer and expr.exp > 0) and _is_shape_arithmetic(expr.base, symbols)
    return type(expr) in shape_operators() and all(_is_shape_arithmetic(arg, symbols) for arg in expr.args)


def shape_with_dim_names(spec: TensorSpec, dynamic_dims: Sequence[DynamicDim]) -> str:
    """``(batch, 2*seq, 16)``: a symbolic shape with the symbols named as the user named the dims."""
    names = {dim.symbol: dim.name for dim in dynamic_dims}
    words = [re.sub(r"\b[a-z]+\d+\b", lambda m: names.get(m.group(), m.group()), e) for e in spec.symbolic_shape or ()]
    return f"({', '.join(words)})"


def is_export_dim(value: Any) -> bool:
    """Whether ``value`` is a ``torch.export.Dim`` (or one derived from it, ``2*batch``), told by what it has: before
    torch 2.6 ``Dim`` is a function and each dim a type of its own, so ``isinstance(value, torch.export.Dim)`` is a
    TypeError there. ``Dim.AUTO`` and ``Dim.DYNAMIC`` are hints, not dims."""
    return (
        isinstance(getattr(value, "__name__", None), str)
        and isinstance(getattr(value, "min", None), int)
        and isinstance(getattr(value, "max", None), int)
    )


def exported_dynamic_dims(
    exported: torch.export.ExportedProgram,
    graph_module: fx.GraphModule,
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    dynamic_shapes: Any,
) -> tuple[DynamicDim, ...]:
    """The dynamic input dimensions of an exported model, with their ranges and the user's Dim names."""
    import sympy
    from torch.utils._sympy.numbers import int_oo

    ranges = {str(symbol): bounds for symbol, bounds in exported.range_constraints.items()}
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    user_names = _user_dim_names(model, args, kwargs, dynamic_shapes, tensors)
    dims: dict[str, DynamicDim] = {}
    # Tensor inputs only, counted as the user's tensors are: a number or a flag is an input of the graph too.
    placeholders = [
        node
        for node in graph_module.graph.find_nodes(op="placeholder")
        if isinstance(node.meta.get("val"), torch.Tensor)
    ]
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


# What shape expressions may call and do (PythonPrinter's output): a plan file's strings are data, never code.
_EXPRESSION_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "max": max,
    "min": min,
    "abs": abs,
    "int": int,
    "float": float,
    "math.floor": math.floor,
    "math.ceil": math.ceil,
    "math.trunc": math.trunc,
}
_BINARY_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPERATORS: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_COMPARISONS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_MAX_EXPRESSION_CHARS = 2000
_MAX_EXPONENT = 64  # a larger power of a size is no shape; it would only make the evaluation hang
# No size or shape scalar reaches torch's int64 range: a larger value is a forged expression, and refusing it keeps
# every operand small, so no operator (nested powers above all) can make the evaluation hang or fill memory.
_MAX_MAGNITUDE_BITS = 63
_MAX_MAGNITUDE = 2**_MAX_MAGNITUDE_BITS
# Shape expressions come from torch's trace; one that fails to evaluate came from an edited plan file.
_FORGED = "the plan file was edited or is not moirai's: save the plan again with moirai, or compile again"


@functools.lru_cache(maxsize=4096)
def _parsed_expression(expression: str) -> ast.expr:
    """``expression``'s syntax tree if it is shape arithmetic, else :class:`moirai.PlanError`."""
    if not isinstance(expression, str) or len(expression) > _MAX_EXPRESSION_CHARS:
        raise PlanError(f"a symbolic shape must be a string of at most {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError as error:
        raise PlanError(f"symbolic shape {expression!r:.80} is not an expression ({error.msg})") from None
    for node in ast.walk(tree):
        _check_node(node, expression)
    return tree


def _check_node(node: ast.AST, expression: str) -> None:
    allowed = (
        isinstance(node, ast.Name)
        or (isinstance(node, ast.Constant) and type(node.value) in (int, float, bool))
        or (isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS)
        or (isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPERATORS)
        or (isinstance(node, ast.Compare) and all(type(op) in _COMPARISONS for op in node.ops))
        or (isinstance(node, ast.Call) and _function_name(node.func) in _EXPRESSION_FUNCTIONS and not node.keywords)
        or isinstance(node, ast.Attribute | ast.Load | ast.operator | ast.unaryop | ast.cmpop)
    )
    if isinstance(node, ast.Attribute):
        allowed = _function_name(node) in _EXPRESSION_FUNCTIONS
    if not allowed:
        raise PlanError(
            f"symbolic shape {expression!r:.80} is not shape arithmetic ({type(node).__name__} is not allowed: only "
            "numbers, dimension symbols, + - * / // % **, comparisons and " + ", ".join(_EXPRESSION_FUNCTIONS) + ")"
        )


def _function_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def _evaluate(node: ast.expr, values: Mapping[str, Any], expression: str) -> Any:
    """Walk a tree :func:`_parsed_expression` accepted (values may be ints or ``torch.export.Dim`` s)."""
    if isinstance(node, ast.Constant):
        return _bounded(node.value, expression)
    if isinstance(node, ast.Name):
        if node.id not in values:
            raise PlanError(f"symbolic shape {expression!r:.80} names {node.id!r}, which is not a dimension symbol")
        return _bounded(values[node.id], expression)
    if isinstance(node, ast.UnaryOp):
        return _UNARY_OPERATORS[type(node.op)](_evaluate(node.operand, values, expression))
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, values, expression), _evaluate(node.right, values, expression)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right, expression)
        # Operands below 2**63 keep every other operator's result below 2**126: cheap to compute, then refused.
        return _bounded(_BINARY_OPERATORS[type(node.op)](left, right), expression)
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, values, expression)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _evaluate(comparator, values, expression)
            if not _COMPARISONS[type(op)](left, right):
                return False
            left = right
        return True
    if not isinstance(node, ast.Call):  # a function named but not called
        raise PlanError(f"symbolic shape {expression!r:.80} is not shape arithmetic")
    function = _EXPRESSION_FUNCTIONS[_function_name(node.func) or ""]
    return _bounded(function(*(_evaluate(argument, values, expression) for argument in node.args)), expression)


def _check_power(base: Any, exponent: Any, expression: str) -> None:
    """Refuse a power before computing it where its result would pass :data:`_MAX_MAGNITUDE`: ``base ** exponent``
    is at least ``2 ** ((base.bit_length() - 1) * exponent)``, and below it the result has fewer than 127 bits."""
    if not (isinstance(exponent, int) and abs(exponent) <= _MAX_EXPONENT):
        raise PlanError(f"symbolic shape {expression!r:.80} raises to a power other than an integer up to 64")
    if isinstance(base, int) and exponent > 0 and (abs(base).bit_length() - 1) * exponent >= _MAX_MAGNITUDE_BITS:
        raise PlanError(
            f"symbolic shape {expression!r:.80} computes {base}**{exponent}, at least 2**{_MAX_MAGNITUDE_BITS}: no "
            f"size is that large; {_FORGED}"
        )


def _bounded(value: Any, expression: str) -> Any:
    """``value``, unless it is a number of magnitude 2**63 or more, or not finite (nan fails the comparison): no
    size is."""
    if isinstance(value, (int, float)) and not abs(value) < _MAX_MAGNITUDE:
        raise PlanError(
            f"symbolic shape {expression!r:.80} has a value of magnitude 2**{_MAX_MAGNITUDE_BITS} or more: no size "
            f"is that large; {_FORGED}"
        )
    return value


# Symbol name -> size, while costs are taken at sizes other than the example inputs' (sizes_at).
_SIZES_AT: contextvars.ContextVar[Mapping[str, int] | None] = contextvars.ContextVar("moirai_sizes_at", default=None)


@contextlib.contextmanager
def sizes_at(symbol_values: Mapping[str, int]) -> Iterator[None]:
    """Within the block, :func:`example_int` gives every symbolic size at ``symbol_values`` (symbol name -> size)
    instead of at the example inputs: the op graph of one trace priced at another call's shapes (a generation
    step's prefill and decode)."""
    token = _SIZES_AT.set(dict(symbol_values))
    try:
        yield
    finally:
        _SIZES_AT.reset(token)


def example_int(size: int | torch.SymInt) -> int:
    """A size at the example inputs (a symbolic size's hint): costs are taken at the example shapes, or at the
    sizes :func:`sizes_at` sets."""
    if isinstance(size, int):
        return size
    overrides = _SIZES_AT.get()
    if overrides:
        expr = size.node.expr
        value = expr.xreplace({s: overrides[s.name] for s in expr.free_symbols if s.name in overrides})
        if isinstance(value, int) or value.is_number:
            return int(value)
    return int(size.node.hint)
