"""Dynamic shapes: one plan and one split program for every input shape in the declared ranges."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import moirai
from moirai.errors import InputError, MoiraiError, PlanError
from moirai.frontend.graph import build_op_graph, model_output_bytes
from moirai.frontend.symbolic_shapes import shape_scalars
from moirai.frontend.trace import TensorSpec
from moirai.runtime.distributed import DistributedRunner
from moirai.runtime.local import run_local
from moirai.runtime.split import concrete_shape, split_module, symbol_values

SHAPES = [(1, 1), (3, 5), (8, 32), (4, 6), (2, 17)]


class Reshaper(torch.nn.Module):
    """Reshapes by sizes computed from the input shape, so parts need the sizes, not only the tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.mix = torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).relu()
        h = h.reshape(h.shape[0], h.shape[1] * 2, 16)
        h = self.mix(h.reshape(h.shape[0], -1, 32)) + x
        return self.head(h).flatten(1)


def _dynamic() -> tuple:
    return ({0: Dim("batch", min=1, max=8), 1: Dim("seq", min=1, max=32)},)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Reshaper().eval()


@pytest.fixture(scope="module")
def compiled(model: torch.nn.Module) -> moirai.CompiledModel:
    return moirai.compile(
        model, ["cpu", "cpu"], (torch.randn(4, 6, 16),), dynamic_shapes=_dynamic(), placer="round_robin"
    )


def test_parts_compute_shape_sizes_from_the_symbol_values(compiled: moirai.CompiledModel) -> None:
    # A part that receives the reshaped tensor but not the input must still know batch and 2*seq.
    codes = [part.graph_module.code for part in compiled.program.parts]
    assert any(".symbol_values" in code for code in codes)
    assert all("aten.sym_size" not in code for code in codes)
    assert any(t.spec.symbolic_shape is not None for t in compiled.program.transfers)
    # No op-graph edge carries a shape scalar, so the plan predicts exactly the transfers the program makes.
    scalars = {node.name for node in shape_scalars(compiled.traced)}
    assert scalars and not any(edge.tensor in scalars for edge in build_op_graph(compiled.traced).edges)
    assert len(moirai.simulate(compiled.problem, compiled.plan).transfers) == len(compiled.program.transfers)


def test_one_plan_serves_every_shape_in_range_locally(compiled: moirai.CompiledModel, model) -> None:
    for batch, seq in SHAPES:
        x = torch.randn(batch, seq, 16)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.slow
def test_one_plan_serves_every_shape_distributed(compiled: moirai.CompiledModel, model) -> None:
    with DistributedRunner(compiled.torch_devices, timeout_s=60) as runner:
        for batch, seq in SHAPES:
            x = torch.randn(batch, seq, 16)
            (y,) = runner.run(compiled.program, compiled.traced.flatten_inputs((x,), {}))
            with torch.no_grad():
                torch.testing.assert_close(y, model(x))


def test_call_outside_the_declared_range_names_the_dimension_and_range(compiled: moirai.CompiledModel) -> None:
    with pytest.raises(InputError, match=r"dimension 0 \(batch\) is 9; the plan serves batch = 1\.\.8"):
        compiled(torch.randn(9, 4, 16))
    with pytest.raises(InputError, match=r"dimension 1 \(seq\) is 33; the plan serves seq = 1\.\.32"):
        compiled(torch.randn(2, 33, 16))
    with pytest.raises(InputError, match=r"shape \(2, 4, 15\).*\(batch, seq, 16\)"):
        compiled(torch.randn(2, 4, 15))
    # Fewer dimensions than the dynamic one's axis: a PlanError that named a symbol ("'s77' ... not a dimension")
    with pytest.raises(InputError, match=r"input 0 has shape \(\) .*\(batch, seq, 16\)"):
        compiled(torch.tensor(1.0))
    with pytest.raises(InputError, match=r"input 0 has shape \(4,\) .*\(batch, seq, 16\)"):
        compiled(torch.randn(4))


class Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale


def test_a_tensor_where_a_number_was_traced_is_an_input_error() -> None:
    """A float traced as a constant, called with a tensor: comparing them was a RuntimeError (a tensor's truth)."""
    compiled = moirai.compile(Scaled(), ["cpu"], (torch.randn(3, 8), 2.0), progress=False, calibration="none")
    assert torch.equal(compiled(torch.ones(3, 8), 2.0), torch.full((3, 8), 2.0))
    with pytest.raises(
        InputError, match=r"traced with the non-tensor input 2.0 .* called with a tensor of shape \(3, 8\)"
    ):
        compiled(torch.ones(3, 8), torch.ones(3, 8))
    with pytest.raises(InputError, match=r"non-tensor input 2.0 .* called with 3.0"):
        compiled(torch.ones(3, 8), 3.0)


class ScaledSum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float, y: torch.Tensor, flag: bool = True) -> torch.Tensor:
        return self.a(x) * scale + (self.b(y) if flag else 0)


def test_dynamic_shapes_beside_number_and_flag_inputs() -> None:
    """A number or a flag among the inputs (None in dynamic_shapes, as torch.export takes it) was an
    AttributeError: the dimensions were read from every input of the graph, the number's too."""
    torch.manual_seed(0)
    model = ScaledSum().eval()
    batch = torch.export.Dim("batch", min=2, max=16)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    compiled = moirai.compile(
        model,
        ["cpu", "cpu"],
        (x, 2.0),
        example_kwargs={"y": y, "flag": True},
        dynamic_shapes={"x": {0: batch}, "scale": None, "y": {0: batch}, "flag": None},
        placer="round_robin",
        progress=False,
        calibration="none",
    )
    assert [(dim.name, dim.where) for dim in compiled.traced.dynamic_dims] == [("batch", "input 0 dimension 0")]
    for rows in (3, 9):
        x, y = torch.randn(rows, 8), torch.randn(rows, 8)
        assert torch.equal(compiled(x, 2.0, y=y, flag=True), model(x, 2.0, y=y, flag=True))


def test_symbol_values_and_concrete_shapes(compiled: moirai.CompiledModel) -> None:
    batch, seq = (dim.symbol for dim in compiled.traced.dynamic_dims)
    values = symbol_values(compiled.program, [torch.randn(3, 5, 16)])
    assert values == {batch: 3, seq: 5}
    spec = TensorSpec((4, 12, 16), torch.float32, (batch, f"2*{seq}", "16"))
    assert concrete_shape(spec, values) == (3, 10, 16)
    assert concrete_shape(TensorSpec((2, 3), torch.float32), values) == (2, 3)


def test_save_and_load_keep_the_dynamic_dimensions(compiled: moirai.CompiledModel, tmp_path) -> None:
    path = tmp_path / "plan.json"
    compiled.save(path)
    torch.manual_seed(1)
    fresh = Reshaper().eval()
    loaded = moirai.load(path, fresh, (torch.randn(2, 3, 16),))  # other example shape, in range
    assert [(d.name, d.lower, d.upper) for d in loaded.traced.dynamic_dims] == [("batch", 1, 8), ("seq", 1, 32)]
    for batch, seq in SHAPES:
        x = torch.randn(batch, seq, 16)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), fresh(x))
    with pytest.raises(InputError, match="seq"):
        loaded(torch.randn(2, 40, 16))


def test_a_static_plan_loaded_with_dynamic_shapes_is_a_plan_error(tmp_path) -> None:
    """A plan serves the sizes it was planned for: loaded with dynamic_shapes it served every batch without a word."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).eval()
    x = torch.randn(4, 16)
    static = moirai.compile(model, ["cpu", "cpu"], (x,), placer="round_robin", progress=False, calibration="none")
    path = tmp_path / "plan.json"
    static.save(path)
    with pytest.raises(
        PlanError, match=r"one size .*input 0 axis 0 \(planned 4, here .*again with these dynamic_shapes"
    ):
        moirai.load(path, model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=8)},), progress=False)


class PairedInputs(torch.nn.Module):
    """Two inputs sharing the batch dimension, one of them twice as long (a derived Dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        halves = pairs.reshape(x.shape[0], 2, 16).sum(1)
        return self.proj(x) * mask.unsqueeze(-1) + halves


def test_shared_and_derived_dims_are_checked_and_survive_save_and_load(tmp_path) -> None:
    torch.manual_seed(0)
    model = PairedInputs().eval()
    batch = Dim("batch", min=2, max=16)
    dynamic = ({0: batch}, {0: batch}, {0: 2 * batch})
    example = (torch.randn(4, 16), torch.rand(4), torch.randn(8, 16))
    compiled = moirai.compile(model, ["cpu", "cpu"], example, dynamic_shapes=dynamic, placer="round_robin")
    path = tmp_path / "plan.json"
    compiled.save(path)
    loaded = moirai.load(path, model, example)
    for split in (compiled, loaded):
        for rows in (2, 7, 16):
            inputs = (torch.randn(rows, 16), torch.rand(rows), torch.randn(2 * rows, 16))
            with torch.no_grad():
                torch.testing.assert_close(split(*inputs), model(*inputs))
        with pytest.raises(InputError, match=r"input 1 dimension 0 is 5 but batch \(input 0 dimension 0\) is 6"):
            split(torch.randn(6, 16), torch.rand(5), torch.randn(12, 16))
        with pytest.raises(InputError, match=r"input 2 has shape \(11, 16\).*\(2\*batch, 16\)"):
            split(torch.randn(6, 16), torch.rand(6), torch.randn(11, 16))


class ShapeOutputs(torch.nn.Module):
    """Returns, beside a tensor, scalars of the input shape: an int computed from it, the size itself, 0-d tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.b(torch.relu(self.a(x)))
        return h, x.shape[0] * 2, x.shape[0], torch.tensor(x.shape[0]) * 2, h.new_full((), h.shape[0] * 3)


@pytest.fixture(scope="module")
def shape_outputs() -> tuple[torch.nn.Module, moirai.CompiledModel]:
    torch.manual_seed(0)
    model = ShapeOutputs().eval()
    dynamic = ({0: Dim("batch", min=2, max=1024)},)
    compiled = moirai.compile(
        model,
        ["cpu", "cpu"],
        (torch.randn(8, 16),),
        dynamic_shapes=dynamic,
        placer="round_robin",
        progress=False,
        calibration="none",
    )
    return model, compiled


def test_shape_scalar_outputs_come_from_part_0_wherever_their_ops_are_placed(shape_outputs) -> None:
    # Placed on device 1, `x.shape[0] * 2` was a PlanError the user could not act on ("put its producer on device 0").
    model, compiled = shape_outputs
    traced = compiled.traced
    ops = [node.name for node in traced.graph_module.graph.nodes if node.op == "call_function"]
    scalars = {node.name for node in shape_scalars(traced)}
    everything_on_1 = split_module(traced, dict.fromkeys(ops, 1), 2)
    assert 1 in {compiled.plan_record()["node_device"][name] for name in scalars}  # where the PlanError was
    for program in (compiled.program, everything_on_1):
        assert all(program.outputs[i].device == 0 for i in (1, 2))
        for rows in (3, 17):
            x = torch.randn(rows, 16)
            outputs = traced.unflatten_outputs(run_local(program, traced.flatten_inputs((x,), {}), ["cpu", "cpu"]))
            with torch.no_grad():
                torch.testing.assert_close(outputs, model(x))
                torch.testing.assert_close(compiled(x), model(x))
            assert type(outputs[1]) is type(outputs[2]) is int
    # No model output message is priced for the scalars: device 0 computes them.
    graph = build_op_graph(traced)
    assert not {name for node in model_output_bytes(graph, traced) for name in graph.nodes[node].fx_names} & scalars


@pytest.mark.slow
def test_shape_scalar_outputs_distributed_and_through_the_server(shape_outputs) -> None:
    model, compiled = shape_outputs
    requests = [torch.randn(rows, 16) for rows in (3, 17)]
    with DistributedRunner(compiled.torch_devices, timeout_s=60) as runner:
        for x in requests:
            flat = runner.run(compiled.program, compiled.traced.flatten_inputs((x,), {}))
            with torch.no_grad():
                torch.testing.assert_close(compiled.traced.unflatten_outputs(flat), model(x))
    with compiled.server(timeout_s=60) as server:
        for x in requests:
            with torch.no_grad():
                torch.testing.assert_close(server.submit(x).result(), model(x))


def test_summary_says_costs_are_those_of_the_example_shape(compiled: moirai.CompiledModel) -> None:
    from rich.console import Console

    console = Console(record=True, width=200)
    compiled.summary(console)
    text = " ".join(console.export_text().split())
    assert "dynamic batch 1..8, seq 1..32: costs and times are those of the example inputs (4, 6, 16)" in text


def test_misspelt_compile_parameter_is_named_not_passed_to_the_placer(model) -> None:
    with pytest.raises(MoiraiError, match="no parameter 'dynamic_shape'; did you mean 'dynamic_shapes'"):
        moirai.compile(model, ["cpu"], (torch.randn(4, 6, 16),), dynamic_shape=_dynamic(), placer="heft")


class ThroughKwargs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **kwargs: bool) -> torch.Tensor:
        return self.proj(x) * (2 if kwargs.get("double") else 1)


def test_dynamic_shapes_with_an_input_through_var_kwargs_is_a_trace_error_saying_what_to_do() -> None:
    # torch.export cannot map dynamic_shapes onto **kwargs inputs (an AssertionError deep inside it).
    dynamic = {"x": {0: Dim("batch")}, "kwargs": {"double": None}}
    with pytest.raises(moirai.TraceError, match=r"\*\*kwargs \(here one of \['double'\]\)"):
        moirai.compile(ThroughKwargs(), ["cpu"], (torch.randn(3, 4),), {"double": True}, dynamic_shapes=dynamic)


@pytest.mark.slow
def test_hf_decoder_with_dynamic_batch_and_sequence() -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 64, (4, 16))
    dynamic = ({0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=64)},)
    compiled = moirai.compile(model, ["cpu", "cpu"], (tokens,), dynamic_shapes=dynamic, placer="round_robin")
    assert {node.device for node in compiled.program.parts} == {0, 1}
    for batch, seq in [(1, 2), (3, 7), (8, 64), (4, 16)]:
        x = torch.randint(0, 64, (batch, seq))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x).logits, model(x).logits)
    with pytest.raises(InputError, match=r"\(seq\) is 65; the plan serves seq = 2\.\.64"):
        compiled(torch.randint(0, 64, (2, 65)))
    with DistributedRunner(compiled.torch_devices, timeout_s=60) as runner:
        for batch, seq in [(2, 5), (6, 33)]:
            x = torch.randint(0, 64, (batch, seq))
            flat_outputs = runner.run(compiled.program, compiled.traced.flatten_inputs((x,), {}))
            with torch.no_grad():
                torch.testing.assert_close(compiled.traced.unflatten_outputs(flat_outputs).logits, model(x).logits)


@pytest.mark.slow
def test_hf_gpt2_with_attention_mask_sharing_batch_and_sequence() -> None:
    import transformers

    config = transformers.GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=64)
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    example = (torch.randint(0, 100, (4, 16)),)
    mask = {"attention_mask": torch.ones(4, 16, dtype=torch.long)}
    compiled = moirai.compile(model, ["cpu"] * 3, example, mask, dynamic_shapes=dynamic, placer="heft", progress=False)
    for rows, length in [(1, 2), (5, 40), (8, 64)]:
        tokens = torch.randint(0, 100, (rows, length))
        attention_mask = torch.ones(rows, length, dtype=torch.long)
        attention_mask[0, : length // 2] = 0
        with torch.no_grad():
            expected = model(tokens, attention_mask=attention_mask).logits
            torch.testing.assert_close(compiled(tokens, attention_mask=attention_mask).logits, expected)
    with pytest.raises(InputError, match=r"input 1 dimension 1 is 9 but seq \(input 0 dimension 1\) is 8"):
        compiled(torch.randint(0, 100, (2, 8)), attention_mask=torch.ones(2, 9, dtype=torch.long))


def _mixed_requests(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 9, (count,), generator=generator).tolist()
    lengths = torch.randint(1, 33, (count,), generator=generator).tolist()
    return [torch.randn(b, s, 16, generator=generator) for b, s in zip(sizes, lengths, strict=True)]


def test_fifty_requests_of_mixed_shapes_equal_eager_locally(compiled: moirai.CompiledModel, model) -> None:
    with torch.no_grad():
        for x in _mixed_requests(50):
            torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.slow
def test_fifty_pipelined_requests_of_mixed_shapes_equal_eager_through_the_server(
    compiled: moirai.CompiledModel, model
) -> None:
    requests = _mixed_requests(50)
    with compiled.server(timeout_s=60, max_in_flight=8) as server:
        futures = [server.submit(x) for x in requests[:25]]
        outputs = [f.result() for f in futures] + list(server.map(requests[25:]))
    assert len({tuple(x.shape) for x in requests}) > 20
    with torch.no_grad():
        for x, y in zip(requests, outputs, strict=True):
            torch.testing.assert_close(y, model(x))


class _Sum(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def test_dynamic_shapes_of_the_wrong_form_are_told_their_form_not_control_flow_advice() -> None:
    batch = torch.export.Dim("batch", min=2, max=16)
    with pytest.raises(moirai.TraceError, match="refuses the form of the dynamic_shapes given") as error:
        moirai.compile(_Sum(), ["cpu"], (torch.randn(4, 8), torch.randn(4, 8)), dynamic_shapes=({0: batch},))
    assert "They mirror the inputs" in str(error.value) and "torch.cond" not in str(error.value)


def test_an_example_of_size_one_along_a_dynamic_dimension_is_named() -> None:
    """torch.export makes an example size of 0 or 1 static: the error said to give examples inside the declared
    range, which 1 in 1..8 was; with Dim.AUTO the plan came out static without a word."""
    model = torch.nn.Linear(8, 8).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    with pytest.raises(moirai.TraceError, match=r"at least 2 .*here example_inputs\[0\] dimension 0 is 1"):
        moirai.compile(model, ["cpu"], (torch.randn(1, 8),), dynamic_shapes=({0: batch},), calibration="none")
    with pytest.warns(moirai.MoiraiWarning, match=r"made every one static .*example_inputs\[0\] dimension 0 is 1"):
        compiled = moirai.compile(
            model, ["cpu"], (torch.randn(1, 8),), dynamic_shapes=({0: torch.export.Dim.AUTO},), calibration="none"
        )
    assert compiled.traced.dynamic_dims == ()
