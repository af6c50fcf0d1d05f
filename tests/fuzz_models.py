"""Random ``nn.Module``s for the fuzz tests: seeded random DAGs over the ops real models are made of.

``fuzz_case(seed)`` returns a model in eval mode and its example ``(args, kwargs)``. The model is one
class, :class:`FuzzModel`, whose ``forward`` runs a list of steps drawn at construction; each step
reads earlier values (inputs or step outputs, drawn at random, so a value often feeds several ops
that a random split puts on different devices) and appends its outputs. Ops: linear (a Linear reused
elsewhere, or its weight read transposed, ties parameters), conv1d, matmul, scaled-dot-product and
multi-head attention, layer and batch norm, softmax, elementwise unary and binary ops, a buffer,
constants made in ``forward``, cat/split/chunk/view/transpose/permute, in-place ops on fresh values and
on values (and views of values) other ops read, and steps whose
inner value is a 0-d, float64, int64 or bool tensor (a split may send it). The outputs are
one tensor, a tuple, a dict or a tuple holding a dict, sometimes with a model input among them.

Values stay 2-D ``(batch, features)`` or 3-D ``(batch, rows, features)`` and of moderate size, so
float32 results compare with ``torch.testing.assert_close``'s defaults.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 2
ROWS = (3, 4)
FEATURES = (4, 6, 8)
Shape = tuple[int, ...]
Step = tuple[str, tuple[int, ...], dict[str, Any]]


class FuzzModel(nn.Module):
    """A random DAG of ops; ``steps`` say which op reads which values (indices into the values so far)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.layers = nn.ModuleList()
        self.steps: list[Step] = []
        rng = random.Random(seed)
        self.second_input = rng.choice((None, "positional", "keyword"))
        rows, features = rng.choice(ROWS), rng.choice(FEATURES)
        self.input_shapes: list[Shape] = [(BATCH, rows, features)]
        if self.second_input is not None:
            self.input_shapes.append(rng.choice([(BATCH, rows, features), (BATCH, features)]))
        shapes = list(self.input_shapes)
        uses = [0] * len(shapes)
        # Values that are views of one another share a family. A family may be written in place unless it
        # holds a model input (a model must not change its inputs) or has been split: torch.export refuses
        # in-place writes to a tensor whose split pieces are read (eager PyTorch under no_grad allows them).
        family = list(range(len(shapes)))
        frozen = set(family)

        def usable(kind: str, i: int) -> bool:
            return _STEPS[kind][0](self, shapes[i]) and (kind != "mutate" or family[i] not in frozen)

        for _ in range(rng.randint(2, 10)):
            kind = rng.choice([kind for kind in _STEPS if any(usable(kind, i) for i in range(len(shapes)))])
            first = _pick(rng, [i for i in range(len(shapes)) if usable(kind, i)], len(shapes))
            inputs, attributes, out_shapes = _STEPS[kind][1](self, rng, first, shapes)
            for i in inputs:
                uses[i] += 1
            self.steps.append((kind, inputs, attributes))
            shapes += out_shapes
            uses += [0] * len(out_shapes)
            if kind in ("split", "chunk"):
                frozen.add(family[first])
            family += [family[first] if kind in _VIEWS else len(family) + j for j in range(len(out_shapes))]
        self.output = _choose_outputs(rng, shapes, uses, len(self.input_shapes))
        self.eval()

    @staticmethod
    def step_kinds() -> list[str]:
        return sorted(_STEPS)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        values = [x] if y is None else [x, y]
        for kind, inputs, attributes in self.steps:
            result = _APPLY[kind](self, [values[i] for i in inputs], attributes)
            values += list(result) if isinstance(result, (tuple, list)) else [result]
        return _structure(self.output, values)


def fuzz_case(seed: int) -> tuple[FuzzModel, tuple, dict[str, torch.Tensor]]:
    """The model of ``seed`` with random weights and running statistics, and its example inputs."""
    torch.manual_seed(seed)
    model = FuzzModel(seed)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm1d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    tensors = [torch.randn(shape) for shape in model.input_shapes]
    if model.second_input == "keyword":
        return model, (tensors[0],), {"y": tensors[1]}
    return model, tuple(tensors), {}


def _pick(rng: random.Random, candidates: list[int], count: int) -> int:
    """A candidate value index, recent values more likely (deep graphs) but any possible (fan-out)."""
    weights = [1.0 + 3.0 * (i >= count - 3) for i in candidates]
    return rng.choices(candidates, weights)[0]


def _same_shape(rng: random.Random, shapes: list[Shape], first: int) -> int:
    """Another value of ``first``'s shape (``first`` itself when there is none)."""
    return rng.choice([i for i, s in enumerate(shapes) if s == shapes[first]])


def _add_layer(model: FuzzModel, module: nn.Module) -> int:
    model.layers.append(module)
    return len(model.layers) - 1


# --- steps: (does it apply to a value of this shape, build: -> (inputs, attributes, output shapes)) -------


def _linear(model, rng, first, shapes):
    shape = shapes[first]
    reusable = [i for i, m in enumerate(model.layers) if isinstance(m, nn.Linear) and m.in_features == shape[-1]]
    if reusable and rng.random() < 0.4:  # the same Linear at two places: tied parameters
        layer = rng.choice(reusable)
    else:
        layer = _add_layer(model, nn.Linear(shape[-1], rng.choice(FEATURES), bias=rng.random() < 0.8))
    return (first,), {"layer": layer}, [shape[:-1] + (model.layers[layer].out_features,)]


def _linear_transposed(model, rng, first, shapes):
    """``x @ W`` with the weight of a Linear used elsewhere (a tied embedding and LM head)."""
    shape = shapes[first]
    into = [i for i, m in enumerate(model.layers) if isinstance(m, nn.Linear) and m.out_features == shape[-1]]
    layer = rng.choice(into)
    return (first,), {"layer": layer}, [shape[:-1] + (model.layers[layer].in_features,)]


def _conv1d(model, rng, first, shapes):
    batch, channels, length = shapes[first]
    out = rng.choice(ROWS)
    layer = _add_layer(model, nn.Conv1d(channels, out, kernel_size=rng.choice((1, 3)), padding="same"))
    return (first,), {"layer": layer}, [(batch, out, length)]


def _matmul(model, rng, first, shapes):
    other = _same_shape(rng, shapes, first)
    batch, rows, _ = shapes[first]
    return (first, other), {}, [(batch, rows, rows)]


def _attention(model, rng, first, shapes):
    key, value = _same_shape(rng, shapes, first), _same_shape(rng, shapes, first)
    return (first, key, value), {"causal": rng.random() < 0.5}, [shapes[first]]


def _multi_head_attention(model, rng, first, shapes):
    features = shapes[first][-1]
    heads = rng.choice([h for h in (1, 2) if features % h == 0])
    layer = _add_layer(model, nn.MultiheadAttention(features, heads, batch_first=True))
    return (first, _same_shape(rng, shapes, first)), {"layer": layer}, [shapes[first]]


def _layer_norm(model, rng, first, shapes):
    return (first,), {"layer": _add_layer(model, nn.LayerNorm(shapes[first][-1]))}, [shapes[first]]


def _batch_norm(model, rng, first, shapes):
    return (first,), {"layer": _add_layer(model, nn.BatchNorm1d(shapes[first][1]))}, [shapes[first]]


def _softmax(model, rng, first, shapes):
    return (first,), {"dim": rng.choice((-1, 1))}, [shapes[first]]


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "neg": torch.neg,
    "abs": torch.abs,
    "sin": torch.sin,
    "scale": lambda t: t * 0.5 + 0.25,
    "center": lambda t: t - t.mean(dim=-1, keepdim=True),
}


def _unary(model, rng, first, shapes):
    return (first,), {"op": rng.choice(sorted(_UNARY))}, [shapes[first]]


_BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "maximum": torch.maximum,
}


def _binary(model, rng, first, shapes):
    return (first, _same_shape(rng, shapes, first)), {"op": rng.choice(sorted(_BINARY))}, [shapes[first]]


def _buffer(model, rng, first, shapes):
    name = f"buffer{len(model.steps)}"
    model.register_buffer(name, torch.randn(shapes[first][-1]))
    return (first,), {"name": name}, [shapes[first]]


def _constant(model, rng, first, shapes):
    return (first,), {"kind": rng.choice(("arange", "full", "ones_like"))}, [shapes[first]]


def _cat(model, rng, first, shapes):
    shape = shapes[first]
    others = [i for i, s in enumerate(shapes) if s[:-1] == shape[:-1]]
    parts = (first,) + tuple(rng.choice(others) for _ in range(rng.randint(1, 2)))
    return parts, {}, [shape[:-1] + (sum(shapes[i][-1] for i in parts),)]


def _split(model, rng, first, shapes):
    shape = shapes[first]
    cut = rng.randint(1, shape[-1] - 1)
    return (first,), {"sizes": (cut, shape[-1] - cut)}, [shape[:-1] + (cut,), shape[:-1] + (shape[-1] - cut,)]


def _chunk(model, rng, first, shapes):
    shape = shapes[first]
    dim = rng.choice([d for d in range(1, len(shape)) if shape[d] % 2 == 0])
    half = shape[:dim] + (shape[dim] // 2,) + shape[dim + 1 :]
    return (first,), {"dim": dim}, [half, half]


def _view(model, rng, first, shapes):
    shape = shapes[first]
    if len(shape) == 3:
        return (first,), {"shape": (shape[0], shape[1] * shape[2])}, [(shape[0], shape[1] * shape[2])]
    rows = rng.choice([r for r in ROWS if shape[1] % r == 0])
    return (first,), {"shape": (shape[0], rows, shape[1] // rows)}, [(shape[0], rows, shape[1] // rows)]


def _transpose(model, rng, first, shapes):
    batch, rows, features = shapes[first]
    return (first,), {}, [(batch, features, rows)]


def _permute(model, rng, first, shapes):
    order = rng.choice(((0, 2, 1), (1, 0, 2), (2, 1, 0)))
    return (first,), {"order": order}, [tuple(shapes[first][d] for d in order)]


def _in_place(model, rng, first, shapes):
    other = _same_shape(rng, shapes, first)
    return (first, other), {"op": rng.choice(("add_", "mul_", "relu_", "clamp_"))}, [shapes[first]]


def _any(model: FuzzModel, shape: Shape) -> bool:
    return True


def _argmax_embedding(model, rng, first, shapes):
    """An int64 index tensor (the argmax) between two ops, which a split may send across devices."""
    width = rng.choice(FEATURES)
    layer = _add_layer(model, nn.Embedding(shapes[first][-1], width))
    return (first,), {"layer": layer}, [shapes[first][:-1] + (width,)]


def _where(model, rng, first, shapes):
    """A bool mask between two ops."""
    return (first, _same_shape(rng, shapes, first)), {}, [shapes[first]]


def _scalar_scale(model, rng, first, shapes):
    """A 0-d tensor (the mean) between two ops."""
    return (first,), {}, [shapes[first]]


def _float64_round_trip(model, rng, first, shapes):
    """A float64 tensor between two ops."""
    return (first,), {}, [shapes[first]]


def _mutate(model, rng, first, shapes):
    """An in-place op on a value other ops read too (before and after): the mutation must be seen in order."""
    return (first, _same_shape(rng, shapes, first)), {"op": rng.choice(("add_", "mul_", "clamp_"))}, [shapes[first]]


# Steps whose outputs are views of their first input.
_VIEWS = {"view", "transpose", "permute", "split", "chunk", "mutate"}


def _is_3d(model: FuzzModel, shape: Shape) -> bool:
    return len(shape) == 3


def _linear_into(model: FuzzModel, shape: Shape) -> bool:
    return any(isinstance(m, nn.Linear) and m.out_features == shape[-1] for m in model.layers)


def _viewable(model: FuzzModel, shape: Shape) -> bool:
    return len(shape) == 3 or any(shape[1] % r == 0 for r in ROWS)


# What a step applies to (the model so far, a value's shape) and how it is drawn.
_STEPS: dict[str, tuple[Callable[[FuzzModel, Shape], bool], Callable]] = {
    "linear": (_any, _linear),
    "linear_transposed": (_linear_into, _linear_transposed),
    "conv1d": (_is_3d, _conv1d),
    "matmul": (_is_3d, _matmul),
    "attention": (_is_3d, _attention),
    "multi_head_attention": (_is_3d, _multi_head_attention),
    "layer_norm": (_any, _layer_norm),
    "batch_norm": (_any, _batch_norm),
    "softmax": (_any, _softmax),
    "unary": (_any, _unary),
    "binary": (_any, _binary),
    "buffer": (_any, _buffer),
    "constant": (_any, _constant),
    "cat": (_any, _cat),
    "split": (lambda model, s: s[-1] >= 2, _split),
    "chunk": (lambda model, s: any(d % 2 == 0 for d in s[1:]), _chunk),
    "view": (_viewable, _view),
    "transpose": (_is_3d, _transpose),
    "permute": (_is_3d, _permute),
    "in_place": (_any, _in_place),
    "argmax_embedding": (_any, _argmax_embedding),
    "where": (_any, _where),
    "scalar_scale": (_any, _scalar_scale),
    "float64_round_trip": (_any, _float64_round_trip),
    "mutate": (_any, _mutate),
}


# --- what each step computes ---------------------------------------------------------------------------


def _apply_constant(t: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "arange":
        return t + torch.arange(t.shape[-1], dtype=t.dtype, device=t.device) * 0.1
    if kind == "full":
        return t * torch.full(t.shape, 0.5, dtype=t.dtype, device=t.device)
    return t - torch.ones_like(t)


def _apply_in_place(t: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
    result = t * 1.0  # a fresh tensor: in-place ops on it leave t (read elsewhere) alone
    if op == "add_":
        result.add_(other)
    elif op == "mul_":
        result.mul_(other)
    elif op == "relu_":
        result.relu_()
    else:
        result.clamp_(-1.0, 1.0)
    return result


def _apply_mutation(t: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
    if op == "add_":
        return t.add_(other)
    if op == "mul_":
        return t.mul_(other)
    return t.clamp_(-1.0, 1.0)


_APPLY: dict[str, Callable[[FuzzModel, list[torch.Tensor], dict[str, Any]], Any]] = {
    "linear": lambda m, v, a: m.layers[a["layer"]](v[0]),
    "linear_transposed": lambda m, v, a: v[0] @ m.layers[a["layer"]].weight,
    "conv1d": lambda m, v, a: m.layers[a["layer"]](v[0]),
    "matmul": lambda m, v, a: v[0] @ v[1].transpose(1, 2) * 0.5,
    "attention": lambda m, v, a: F.scaled_dot_product_attention(v[0], v[1], v[2], is_causal=a["causal"]),
    "multi_head_attention": lambda m, v, a: m.layers[a["layer"]](v[0], v[1], v[1], need_weights=False)[0],
    "layer_norm": lambda m, v, a: m.layers[a["layer"]](v[0]),
    "batch_norm": lambda m, v, a: m.layers[a["layer"]](v[0]),
    "softmax": lambda m, v, a: torch.softmax(v[0], dim=a["dim"]),
    "unary": lambda m, v, a: _UNARY[a["op"]](v[0]),
    "binary": lambda m, v, a: _BINARY[a["op"]](v[0], v[1]),
    "buffer": lambda m, v, a: v[0] * getattr(m, a["name"]) + 0.1,
    "constant": lambda m, v, a: _apply_constant(v[0], a["kind"]),
    "cat": lambda m, v, a: torch.cat(v, dim=-1),
    "split": lambda m, v, a: v[0].split(a["sizes"], dim=-1),
    "chunk": lambda m, v, a: v[0].chunk(2, dim=a["dim"]),
    "view": lambda m, v, a: v[0].reshape(a["shape"]),
    "transpose": lambda m, v, a: v[0].transpose(1, 2),
    "permute": lambda m, v, a: v[0].permute(*a["order"]),
    "in_place": lambda m, v, a: _apply_in_place(v[0], v[1], a["op"]),
    "argmax_embedding": lambda m, v, a: m.layers[a["layer"]](v[0].argmax(dim=-1)),
    "where": lambda m, v, a: torch.where(v[0] > 0, v[0], v[1]),
    "scalar_scale": lambda m, v, a: v[0] * v[0].mean(),
    "float64_round_trip": lambda m, v, a: (v[0].double() * 1.5).float(),
    "mutate": lambda m, v, a: _apply_mutation(v[0], v[1], a["op"]),
}


# --- outputs -------------------------------------------------------------------------------------------


def _choose_outputs(rng: random.Random, shapes: list[Shape], uses: list[int], num_inputs: int) -> Any:
    """Every unused step output (so no op is dead code) and sometimes more, in a random structure."""
    unused = [i for i in range(num_inputs, len(shapes)) if uses[i] == 0]
    extra = rng.sample(range(len(shapes)), k=min(len(shapes), rng.randint(0, 2)))
    chosen = list(dict.fromkeys(unused + extra)) or [len(shapes) - 1]
    if rng.random() < 0.1:
        chosen.append(chosen[0])  # one tensor returned twice
    form = rng.choice(("tensor", "tuple", "dict", "nested")) if len(chosen) > 1 else rng.choice(("tensor", "tuple"))
    if form == "tensor":
        return ("tensor", chosen[0]) if len(chosen) == 1 else ("tuple", tuple(chosen))
    if form == "tuple":
        return ("tuple", tuple(chosen))
    if form == "dict":
        return ("dict", {f"out{j}": i for j, i in enumerate(chosen)})
    return ("nested", (chosen[0], {f"out{j}": i for j, i in enumerate(chosen[1:])}))


def _structure(output: tuple[str, Any], values: list[torch.Tensor]) -> Any:
    form, indices = output
    if form == "tensor":
        return values[indices]
    if form == "tuple":
        return tuple(values[i] for i in indices)
    if form == "dict":
        return {key: values[i] for key, i in indices.items()}
    first, rest = indices
    return values[first], {key: values[i] for key, i in rest.items()}
