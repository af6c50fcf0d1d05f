"""Writes that functionalization made out of place, put back in place ([Note: writes put back in place]): a step of a
split LLM writes its tokens' rows of the KV cache, not a copy of the whole cache, and no plan sees another value."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from models_for_tests import tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

import moirai
from moirai.frontend.graph import build_op_graph
from moirai.frontend.write_backs import put_writes_back_in_place
from moirai.generation.engine import SamplingParams
from moirai.generation.lm import trace_step
from moirai.generation.step import CausalLMStep, context_input

aten = torch.ops.aten


class Cache(torch.nn.Module):
    """A cache of rows written at given positions and read back (the pattern of a static KV cache)."""

    def __init__(self, reads_before: bool = False) -> None:
        super().__init__()
        self.project = torch.nn.Linear(8, 8)
        self.register_buffer("rows", torch.zeros(16, 8))
        self.reads_before = reads_before

    def forward(self, x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        # Read before the write, not on the way to it: the old value's sum, which no data edge orders before the write.
        before = self.rows.sum(0) if self.reads_before else 0
        self.rows.index_put_((where,), self.project(x))
        return self.rows.index_select(0, where).sum(0) + self.rows.mean(0) + before


class ReadsOnTheWay(Cache):
    """Reads the old value to compute what it writes: a data edge orders the read first."""

    def forward(self, x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        self.rows.index_put_((where,), self.project(x) + self.rows.index_select(0, where))
        return self.rows.sum(0)


def calls() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 8, generator=generator), torch.tensor([k, 15 - k])) for k in range(4)]


def compiled_and_reference(model_class, **options) -> tuple[moirai.CompiledModel, torch.nn.Module]:
    torch.manual_seed(0)
    model, reference = model_class(**options).eval(), model_class(**options).eval()
    reference.load_state_dict(model.state_dict())
    compiled = moirai.compile(model, ["cpu", "cpu"], calls()[0], placer="round_robin", progress=False)
    return compiled, reference


@pytest.mark.parametrize(
    ("model_class", "options", "in_place"),
    [
        # The old value read on the way to the write: torch's functionalization made it index_put and a copy_ back.
        (ReadsOnTheWay, {}, True),
        # The old value read with no data edge to the write: a plan could run the write first, so it stays.
        (Cache, {"reads_before": True}, False),
    ],
)
def test_a_write_is_made_in_place_where_only_data_edges_order_its_reads_and_every_call_equals_the_model(
    model_class, options, in_place
) -> None:
    compiled, reference = compiled_and_reference(model_class, **options)
    targets = [n.target for n in compiled.traced.graph_module.graph.nodes]
    written = aten.index_put_.default if in_place else aten.index_put.default
    left = aten.index_put.default if in_place else aten.index_put_.default
    assert written in targets and left not in targets
    with torch.no_grad():
        for x, where in calls():
            torch.testing.assert_close(compiled(x, where), reference(x, where))


def test_the_pass_leaves_a_graph_without_write_backs_as_it_is() -> None:
    graph_module = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    before = graph_module.code
    assert put_writes_back_in_place(graph_module) == [] and graph_module.code == before


class _CacheSizedWork(TorchDispatchMode):
    """Counts the ops that make or copy a tensor of at least ``numel`` elements other than in place."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.numel() >= self.numel:
            storages = [a.untyped_storage().data_ptr() for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
            made = result.untyped_storage().data_ptr() not in storages  # not a view or an in-place write
            copied = func is aten.copy_.default and storages[0] != storages[1]
            if made or copied:
                self.seen.append(func)
        return result


def test_a_decode_step_writes_its_tokens_rows_of_the_cache_and_copies_no_layers_whole_cache() -> None:
    step = CausalLMStep(tiny_llama(), slots=4, max_seq_len=64).eval()
    traced = trace_step(step, max_batch_size=4, max_prefill=8)
    layer = step.cache_shape.layers[0]
    layer_cache_numel = step.cache_shape.slots * layer.key_heads * step.cache_shape.positions * layer.key_dim
    assert traced.graph_module.key_cache_0.numel() == layer_cache_numel
    with torch.no_grad(), _CacheSizedWork(layer_cache_numel) as work:
        traced.graph_module(*_decode_inputs(context=64))  # whole slots: the gathers are as large as a cache can be
    assert work.seen == [], work.seen  # before: index_put and copy_ of each of the 4 layer caches, every step


def _decode_inputs(context: int) -> tuple[torch.Tensor, ...]:
    """A decode step of two sequences at positions 7 and 9 of slots 0 and 2, attending over ``context`` positions."""
    return (
        torch.tensor([[3], [5]]),
        torch.tensor([[7], [9]]),
        torch.tensor([0, 2]),
        torch.tensor([SamplingParams().row(0.0)] * 2),
        torch.full((2, 1), -1),
        context_input(context),
    )


class _Gathers(TorchDispatchMode):
    """The shapes of the tensors ``index_select`` makes."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is aten.index_select.default:
            self.shapes.append(tuple(result.shape))
        return result


def test_a_decode_step_gathers_only_the_positions_it_attends_over_and_equals_a_step_over_whole_slots() -> None:
    # A step over a slot's first 11 positions (of 64) gathered every slot's 64 a layer ([Note: the context a step
    # attends over]); its tokens are those of the same step over whole slots, after the same prefill.
    step = CausalLMStep(tiny_llama(), slots=4, max_seq_len=64).eval()
    traced = trace_step(step, max_batch_size=4, max_prefill=16)
    module = traced.graph_module
    prefill = (
        torch.arange(1, 11).repeat(2, 1),
        torch.arange(10).repeat(2, 1),
        torch.tensor([0, 2]),
        torch.tensor([SamplingParams().row(0.0)] * 2),
        torch.full((2, 1), -1),
        context_input(10),
    )
    tokens = {}
    with torch.no_grad():
        module(*prefill)
        prefilled = {name: tensor.clone() for name, tensor in module.named_buffers()}
        for context in (11, 64):
            for name, tensor in module.named_buffers():
                tensor.copy_(prefilled[name])
            decode = (*_decode_inputs(context)[:1], torch.tensor([[10], [10]]), *_decode_inputs(context)[2:])
            with _Gathers() as gathers:
                tokens[context] = module(*decode)
            layer = step.cache_shape.layers[0]
            assert (2, layer.key_heads, context, layer.key_dim) in gathers.shapes
            assert all(shape[2] == context for shape in gathers.shapes if len(shape) == 4), gathers.shapes
    assert all(torch.equal(short, whole) for short, whole in zip(tokens[11], tokens[64], strict=True))


def test_the_cost_model_prices_a_cache_write_by_its_rows_and_the_write_back_at_nothing() -> None:
    # Analytic costs (the default) read bytes_moved: a write of a step's rows charged the whole cache, and the
    # write-back copy_ of the cache onto itself twice the cache, though torch returns from it at once.
    step = CausalLMStep(tiny_llama(), slots=4, max_seq_len=64).eval()
    traced = trace_step(step, max_batch_size=4, max_prefill=8)
    cache_bytes = traced.graph_module.key_cache_0.numel() * 4
    graph = build_op_graph(traced)
    by_name = {node.fx_names[0]: node for node in graph.nodes if len(node.fx_names) == 1}
    fx_nodes = {n.name: n for n in traced.graph_module.graph.nodes}
    writes = [by_name[n] for n, f in fx_nodes.items() if f.target is aten.index_put_.default and n in by_name]
    write_backs = [by_name[n] for n, f in fx_nodes.items() if f.target is aten.copy_.default and n in by_name]
    assert len(writes) == len(write_backs) == 2 * 2 + 1  # keys and values of two layers, and the seen tokens
    assert all(0 < node.bytes_moved < cache_bytes / 4 for node in writes), [n.bytes_moved for n in writes]
    assert all(node.bytes_moved == 0 for node in write_backs)
