"""trace and OpGraph: meta["val"] everywhere, costs that add up, meta-device models, clear errors."""

import re
import subprocess
import sys
import textwrap
from typing import Any

import numpy
import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from models_for_tests import DoublesAndReturns
from torch.utils.flop_counter import FlopCounterMode

import moirai
from moirai.errors import InputError, TraceError
from moirai.frontend.graph import build_op_graph
from moirai.frontend.state import mutable_buffers
from moirai.frontend.trace import trace


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor) -> dict:
        h = torch.relu(self.first(x))
        return {"out": self.second(h) + bias, "hidden": (h,)}


class DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


def test_trace_is_flat_and_every_node_has_val() -> None:
    model = TwoLayer().eval()
    x, bias = torch.randn(4, 16), torch.randn(8)
    traced = trace(model, (x,), {"bias": bias})
    for node in traced.graph_module.graph.nodes:
        if node.op != "output":
            assert "val" in node.meta, node.name
    flat = traced.flatten_inputs((x,), {"bias": bias})
    outputs = traced.unflatten_outputs(traced.graph_module(*flat))
    expected = model(x, bias=bias)
    torch.testing.assert_close(outputs["out"], expected["out"])
    torch.testing.assert_close(outputs["hidden"][0], expected["hidden"][0])


@torch.fx.wrap
def _clamp_if_positive(x: torch.Tensor) -> torch.Tensor:
    # Data-dependent branch: export cannot trace it, symbolic_trace keeps it as one leaf call.
    return x.clamp(max=1.0) if x.sum() > 0 else x


class LeafWithBranch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _clamp_if_positive(torch.relu(x)) * 2


def test_symbolic_trace_fallback_records_val() -> None:
    x = torch.randn(3, 5)
    traced = trace(LeafWithBranch(), (x,))
    targets = [n.target for n in traced.graph_module.graph.nodes if n.op == "call_function"]
    assert _clamp_if_positive in targets  # the fallback ran, not export
    assert all("val" in n.meta for n in traced.graph_module.graph.nodes if n.op != "output")
    (output,) = traced.graph_module(*traced.flatten_inputs((x,), {}))
    torch.testing.assert_close(output, LeafWithBranch()(x))


class LinearsWithBranch(torch.nn.Module):
    """Submodules (kept whole by symbolic_trace: call_module nodes) around a call torch.export cannot trace."""

    def __init__(self, relu_in_place: bool = False, write_in_place: bool = False) -> None:
        super().__init__()
        self.first, self.second, self.third = (torch.nn.Linear(16, 16) for _ in range(3))
        self.relu = torch.nn.ReLU(inplace=relu_in_place)
        self.write_in_place = write_in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(x)
        z = self.second(y)  # reads y before the write below
        if self.write_in_place:
            y.mul_(2)
        return _clamp_if_positive(self.relu(z)) + self.third(y)


def test_the_fallback_keeps_a_models_submodules_and_its_split_is_exact(capfd) -> None:
    """_flatten_attributes moved only get_attr targets: every fallback model with a submodule was an AttributeError.
    And it is quiet: torch.export printed its partial graph twice and warned, above a fallback that then worked."""
    torch.manual_seed(0)
    model, x = LinearsWithBranch().eval(), torch.randn(4, 16)
    capfd.readouterr()
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="round_robin", progress=False)
    assert capfd.readouterr() == ("", "")
    assert len(set(compiled.plan.placement.tolist())) == 2
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))


@pytest.mark.parametrize(
    ("options", "where"), [({"write_in_place": True}, "mul_"), ({"relu_in_place": True}, "module .relu. \\(ReLU\\)")]
)
def test_the_fallback_refuses_a_graph_that_writes_a_tensor_in_place(options, where) -> None:
    """fx keeps y.mul_(2) as a call y's readers do not depend on: a plan ordering z = second(y) after it read 2y
    (a with_plan in another order gave a difference of 1.26, silently)."""
    model = LinearsWithBranch(**options).eval()
    with pytest.raises(
        moirai.TraceError, match=rf"writes a tensor in place at {where}.*Make the operation out of place"
    ):
        trace(model, (torch.randn(4, 16),))


def test_op_graph_counts_flops_bytes_and_parameters() -> None:
    traced = trace(TwoLayer().eval(), (torch.randn(4, 16),), {"bias": torch.randn(8)})
    graph = build_op_graph(traced)
    linears = [n for n in graph.nodes if n.targets == ("aten.linear.default",)]
    assert [n.flops for n in linears] == [2 * 4 * 16 * 32, 2 * 4 * 32 * 8]
    assert [n.param_bytes for n in linears] == [(16 * 32 + 32) * 4, (32 * 8 + 8) * 4]
    assert graph.total_param_bytes == sum(p.numel() * 4 for p in TwoLayer().parameters())
    relu_edge = next(e for e in graph.edges if graph.nodes[e.src].targets == ("aten.relu.default",))
    assert relu_edge.bytes == 4 * 32 * 4
    assert graph.to_networkx().number_of_edges() == len(graph.edges)


class RepeatedBlocks(torch.nn.Module):
    """Three blocks of one shape, one wider, and two matmuls of different shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.wide = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        y = self.wide(x)
        return torch.mm(y, y.t()) + torch.mm(y[:, :4], y[:, :4].t().contiguous()).sum()


def test_an_op_counted_once_per_signature_counts_each_call_as_the_flop_counter_does() -> None:
    traced = trace(RepeatedBlocks().eval(), (torch.randn(8, 16),))
    graph = build_op_graph(traced)
    fx_nodes = {n.name: n for n in traced.graph_module.graph.nodes}
    for node in graph.nodes:
        fx_node = fx_nodes[node.fx_names[0]]
        args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (fx_node.args, fx_node.kwargs))
        counter = FlopCounterMode(display=False)
        with counter:
            fx_node.target(*args, **kwargs)
        assert node.flops == counter.get_total_flops(), node.name
    linears = [n.flops for n in graph.nodes if n.targets == ("aten.linear.default",)]
    assert linears == [2 * 8 * 16 * 16] * 3 + [2 * 8 * 16 * 48]
    assert sorted(n.flops for n in graph.nodes if n.targets == ("aten.mm.default",)) == [2 * 8 * 4 * 8, 2 * 8 * 48 * 8]


def test_merge_preserves_totals_and_sends_a_tensor_once_per_group() -> None:
    traced = trace(TwoLayer().eval(), (torch.randn(4, 16),), {"bias": torch.randn(8)})
    graph = build_op_graph(traced)
    merged = graph.merge([[0], list(range(1, len(graph.nodes)))])
    assert len(merged.nodes) == 2
    assert merged.total_flops == graph.total_flops
    assert sum(n.bytes_moved for n in merged.nodes) == sum(n.bytes_moved for n in graph.nodes)
    # linear -> relu is the only edge from group 0; its tensor crosses once.
    assert [(e.src, e.dst) for e in merged.edges] == [(0, 1)]


def test_untraceable_model_raises_trace_error_naming_model_and_line() -> None:
    with pytest.raises(TraceError, match=r"DataDependent.*test_trace_graph.py"):
        trace(DataDependent(), (torch.randn(3),))


def test_an_output_torch_cannot_flatten_is_a_trace_error_naming_its_class_and_the_fix() -> None:
    class Box:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    class ReturnsABox(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Box:
            return Box(x + 1)

    with pytest.raises(TraceError, match=r"output holds a .*Box, which is not a tensor.*register_pytree_node"):
        trace(ReturnsABox(), (torch.randn(3),))


def test_a_hugging_face_decoder_with_its_cache_on_is_a_trace_error_saying_use_cache_false_or_compile_lm() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 5))
    with pytest.raises(TraceError, match=r"DynamicCache \(past_key_values.*'use_cache': False.*compile_lm"):
        trace(model, (ids,))
    traced = trace(model, (ids,), {"use_cache": False})  # the fix the error names
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    assert torch.equal(
        traced.unflatten_outputs(traced.graph_module(*traced.flatten_inputs((ids,), {"use_cache": False}))).logits,
        expected,
    )


def test_wrong_input_shape_and_structure_raise_input_error() -> None:
    traced = trace(TwoLayer().eval(), (torch.randn(4, 16),), {"bias": torch.randn(8)})
    with pytest.raises(InputError, match=r"shape \(5, 16\).*\(4, 16\)"):
        traced.flatten_inputs((torch.randn(5, 16),), {"bias": torch.randn(8)})
    with pytest.raises(InputError, match=r"keyword\(s\) \['bias'\], called with 1 and \[\]"):
        traced.flatten_inputs((torch.randn(4, 16),), {})


@pytest.mark.slow
@pytest.mark.in_process
def test_meta_model_of_over_a_billion_parameters_traces_without_weight_memory() -> None:
    # A fresh interpreter so the peak RSS is this model's alone.
    script = textwrap.dedent(
        """
        import resource, torch
        from moirai.frontend.trace import trace
        from moirai.frontend.graph import build_op_graph
        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(16)])
        graph = build_op_graph(trace(model, (torch.randn(8, 8192, device="meta"),)))
        print(sum(p.numel() for p in model.parameters()), len(graph.nodes), graph.total_param_bytes,
              resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    parameters, nodes, param_bytes, peak_rss = (float(v) for v in result.stdout.split())
    assert parameters > 1.07e9 and nodes == 16
    assert param_bytes == parameters * 4  # 4.3 GB of fp32 weights are counted...
    assert peak_rss < 1.5e9  # ...but never allocated: the bound is torch's import plus the graph


class TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, q: torch.Tensor, k: torch.Tensor, extra: tuple = ()) -> torch.Tensor:
        return self.a(q) - self.b(k) + sum(extra, torch.zeros(()))


def test_one_tensor_given_as_two_example_inputs_traces_as_two_inputs() -> None:
    # torch.export gave the same tensor object one placeholder: the compiled model read k for q on every call.
    torch.manual_seed(0)
    model, x, y, z = TwoInputs().eval(), torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    compiled = moirai.compile(model, ["cpu", "cpu"], (x, x), placer="heft", progress=False, calibration="none")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y), model(x, y))
    cases = [  # (example args, example kwargs), (call args, call kwargs): repeats by keyword and nested too
        (((x,), {"k": x}), ((z,), {"k": y})),
        (((x, y), {"extra": (x, y, x)}), ((z, y), {"extra": (y, z, x)})),
    ]
    for example, call in cases:
        traced = trace(model, *example)
        assert len(traced.graph_module.graph.find_nodes(op="placeholder")) == len(pytree.tree_leaves(example))
        with torch.no_grad():
            (out,) = traced.graph_module(*traced.flatten_inputs(*call))
            torch.testing.assert_close(out, model(*call[0], **call[1]))
    batch = torch.export.Dim("batch", max=16)
    traced = trace(model, (x, x), dynamic_shapes=({0: batch}, {0: batch}))
    a, b = torch.randn(6, 8), torch.randn(6, 8)
    with torch.no_grad():
        torch.testing.assert_close(traced.graph_module(*traced.flatten_inputs((a, b), {}))[0], model(a, b))


class Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor, use_cache: bool = True, scale: float = 1.0) -> torch.Tensor:
        return x * scale if use_cache else x + scale


def test_non_tensor_inputs_are_baked_in_and_checked() -> None:
    x = torch.randn(3)
    traced = trace(Scaled(), (x,), {"use_cache": False, "scale": 3.0})
    assert [n.name for n in traced.graph_module.graph.find_nodes(op="placeholder")] == ["x"]
    flat = traced.flatten_inputs((x,), {"scale": 3.0, "use_cache": False})
    torch.testing.assert_close(traced.graph_module(*flat)[0], x + 3.0)
    with pytest.raises(InputError, match="non-tensor input 3.0"):
        traced.flatten_inputs((x,), {"use_cache": False, "scale": 2.0})


class Filled(torch.nn.Module):
    def forward(self, x: torch.Tensor, fill: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return x * fill, torch.full((2,), fill)


@pytest.mark.parametrize(
    ("traced_value", "called_value"),
    [(2, 2.0), (2.0, 2), (1, True), (0.0, -0.0), (complex(1, 0), 1.0), (2, numpy.int64(2))],
)
def test_a_non_tensor_input_equal_to_the_traced_one_but_another_value_to_torch_is_refused(
    traced_value: Any, called_value: Any
) -> None:
    """2.0 == 2 and True == 1, but torch makes float and bool outputs of them where the graph holds the traced int."""
    x = torch.arange(3)
    traced = trace(Filled(), (x, traced_value))
    with pytest.raises(InputError, match=rf"non-tensor input {re.escape(repr(traced_value))} .*called with"):
        traced.flatten_inputs((x, called_value), {})
    traced.flatten_inputs((x, traced_value), {})


def test_a_non_tensor_input_traced_as_nan_accepts_nan_and_a_tuple_is_checked_item_by_item() -> None:
    x = torch.randn(3)
    traced = trace(Filled(), (x, float("nan")))
    assert len(traced.flatten_inputs((x, float("nan")), {})) == 1
    with pytest.raises(InputError, match=r"called with 1.0"):
        traced.flatten_inputs((x, 1.0), {})

    class Affine(torch.nn.Module):
        def forward(self, x: torch.Tensor, pair: tuple[Any, Any]) -> torch.Tensor:
            return x * pair[0] + pair[1]

    traced = trace(Affine(), (x, (2, 3)))
    traced.flatten_inputs((x, (2, 3)), {})
    with pytest.raises(InputError, match=r"non-tensor input 2 .*called with 2.0 \(type float, traced type int\)"):
        traced.flatten_inputs((x, (2.0, 3)), {})
    traced = trace(Filled(), (x, True))
    with pytest.raises(InputError, match=r"\(type numpy.bool, traced type bool\)"):  # numpy names its bool 'bool'
        traced.flatten_inputs((x, numpy.True_), {})
    traced = trace(Affine(), (x, (2, 3)))
    with pytest.raises(InputError, match=r"called with np.int64\(2\) .*; pass it as int, the type it was traced with"):
        traced.flatten_inputs((x, (numpy.int64(2), 3)), {})  # a value from a numpy array: right, its type not
    with pytest.raises(InputError, match=r"called with np.int64\(5\) .*; compile again to plan for that value"):
        traced.flatten_inputs((x, (numpy.int64(5), 3)), {})


def test_a_torch_size_the_model_returns_comes_back_a_torch_size() -> None:
    """torch's pytree unflattens a Size to a tuple; code that called .numel() on the model's output broke."""

    class Shapes(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            y = x * 2
            return y, y.shape, {"n": y.size(0), "size": x[0].shape}

    model, x = Shapes(), torch.randn(3, 4)
    expected = model(x)
    for dynamic_shapes in (None, ({0: torch.export.Dim("batch", max=16)},)):
        traced = trace(model, (x,), dynamic_shapes=dynamic_shapes)
        got = traced.unflatten_outputs(list(traced.graph_module(*traced.flatten_inputs((x,), {}))))
        assert type(got[1]) is torch.Size and got[1] == expected[1] and got[1].numel() == 12
        assert type(got[2]["size"]) is torch.Size and got[2] == expected[2]
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), progress=False, calibration="none")
    assert type(compiled(x)[1]) is torch.Size


def test_the_write_back_of_an_input_the_model_writes_and_returns_is_a_tensor_any_device_may_hold() -> None:
    """exported.module() adds the copy_ without a val: a plan putting it on device 1 was a PlanError calling the
    returned input 'not a tensor'."""
    model, x = DoublesAndReturns().eval(), torch.randn(3, 4)
    traced = trace(model, (x.clone(),))
    (write_back,) = traced.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
    assert write_back.meta["val"].shape == (3, 4)
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x.clone(),), progress=False, calibration="none")
    placement = [1 if "copy_" in node.name else 0 for node in compiled.graph.nodes]
    compiled = compiled.with_plan(moirai.Plan(numpy.array(placement), compiled.plan.device_names))
    called, expected_input = x.clone(), x.clone()
    with torch.no_grad():
        expected, got = model(expected_input), compiled(called)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(called, expected_input)


def test_a_view_moves_no_bytes_and_a_lookup_reads_only_the_rows_it_gathers() -> None:
    """A tied head's transpose of a 4 MB table is a view, and the lookup of 3 tokens reads 3 rows, not the table
    (bench/view_and_lookup_costs.py compares the analytic times with measured profiles)."""

    class TiedLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(1000, 1024)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.embed(ids).view(3, 1024) @ self.embed.weight.T

    ids = torch.tensor([[1, 5, 7]])
    graph = build_op_graph(trace(TiedLM(), (ids,)))
    by_target = {node.targets[0]: node for node in graph.nodes}
    row_bytes = 1024 * 4
    lookup = by_target["aten.embedding.default"]
    assert lookup.bytes_moved == 2 * 3 * row_bytes + ids.numel() * ids.element_size()
    views = [node for name, node in by_target.items() if "numpy_T" in name or "aten.view" in name]
    assert len(views) == 2 and all(node.bytes_moved == 0 and node.output_bytes == 0 for node in views)
    matmul = by_target["aten.matmul.default"]
    assert matmul.bytes_moved == (3 * 1024 + 1000 * 1024 + 3 * 1000) * 4  # what reads through the view pays for it


def test_an_op_that_writes_in_place_allocates_nothing_and_moves_its_inputs() -> None:
    """Before: the write-back ``copy_`` of a cache buffer (given the written tensor's value so a plan may move it)
    counted as a new tensor of the buffer's size, so a generation plan's memory held every KV cache twice and a
    cluster it fits was called too small."""

    class Cache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(64, 256))

        def forward(self, position: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
            before = self.cache.sum(0)  # read before the write: functionalized, the write a copy_ back at the end
            self.cache.index_copy_(0, position, row)
            return self.cache.sum(0) - before

    graph = build_op_graph(trace(Cache(), (torch.tensor([3]), torch.ones(1, 256))))
    writes = [node for node in graph.nodes if node.targets[0].endswith("copy_.default")]
    assert writes, [node.targets for node in graph.nodes]
    cache_bytes, row_bytes = 64 * 256 * 4, 256 * 4
    assert all(node.output_bytes == 0 for node in writes)
    copies = [node for node in writes if node.targets[0] == "aten.copy_.default"]
    assert copies, [node.targets for node in graph.nodes]
    assert all(node.bytes_moved <= 2 * cache_bytes + row_bytes for node in copies)  # inputs, not inputs + output


class _StateBehindAReference(torch.nn.Module):
    """Writes in place through a second reference to its state, as Hugging Face's StaticCache export wrapper does."""

    def __init__(self, registered: bool) -> None:
        super().__init__()
        state = torch.zeros(4)
        if registered:
            self.register_buffer("state", state)
        self.holder = [state]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.holder[0].add_(x)
        return x * 2 + self.holder[0]


def test_state_written_through_another_reference_to_a_buffer_is_the_buffer() -> None:
    traced = trace(_StateBehindAReference(registered=True), (torch.ones(4),))
    # non-strict export alone takes it for a constant (lifted_tensor_0), which a split would copy into every part
    assert [buffer.name for buffer in mutable_buffers(traced.graph_module)] == ["state"]
    flat = traced.flatten_inputs((torch.ones(4),), {})
    assert torch.equal(traced.graph_module(*flat)[0], torch.full((4,), 3.0))
    assert torch.equal(traced.graph_module(*flat)[0], torch.full((4,), 4.0))  # the write was kept


def test_state_written_outside_every_buffer_is_a_trace_error_pointing_at_compile_lm() -> None:
    with pytest.raises(TraceError, match="not its registered buffers.*compile_lm"):
        trace(_StateBehindAReference(registered=False), (torch.ones(4),))


def test_retargeting_devices_reaches_the_graphs_nested_in_a_module():
    """torch 2.11's export keeps a Llama's rotary embedding as the body of ``wrap_with_autocast``, a graph nested in
    the traced one whose ``arange``/``_assert_tensor_metadata`` name the device of tracing: a part run on a GPU
    failed with 'Tensor device mismatch' until the nested graphs were retargeted too."""
    from moirai.frontend.trace import devices_mentioned, retarget_devices

    class Ramp(torch.nn.Module):
        def forward(self, x):
            return x + torch.arange(x.shape[-1], dtype=x.dtype, device=torch.device("cpu"))

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ramp = fx.symbolic_trace(Ramp())

        def forward(self, x):
            return self.ramp(x) * 2

    class KeepGraphModules(fx.Tracer):
        def is_leaf_module(self, module, name):
            return isinstance(module, fx.GraphModule) or super().is_leaf_module(module, name)

    outer = Outer()
    module = fx.GraphModule(outer, KeepGraphModules().trace(outer))
    assert devices_mentioned(module) == {torch.device("cpu")}
    retarget_devices(module, torch.device("meta"))
    assert devices_mentioned(module) == {torch.device("meta")}
    assert module(torch.ones(2, 3, device="meta")).device.type == "meta"


def test_meta_weights_with_real_example_inputs_say_to_pass_meta_inputs() -> None:
    """The message said the inputs did not fit and to give other shapes, though the shapes were right."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    for dynamic_shapes in (None, ({0: batch},)):  # the fallback tracer's error, and torch.export's alone
        with pytest.raises(
            TraceError, match=r"weights are on the meta device .*\(example_inputs\[0\] on cpu\)"
        ) as error:
            trace(model, (torch.randn(4, 16),), dynamic_shapes=dynamic_shapes)
        assert 'device="meta"' in str(error.value) and "of the shapes" not in str(error.value)
    graph = build_op_graph(trace(model, (torch.randn(4, 16).to("meta"),)))  # as the message says
    assert graph.total_param_bytes == (16 * 32 + 32 + 32 * 8 + 8) * 4
