"""Random models (``fuzz_models.py``) split at random across 2-4 devices give the model's outputs bit for bit.

Each seed makes one model (a random DAG of linear, conv, attention, norms, elementwise, shape and
in-place ops with tuple/dict outputs, tied parameters, buffers and constants), traces it, puts every
op on a random device in a random topological order (``random_assignment``) and runs the split
program. ``MOIRAI_FUZZ_MODELS`` sets how many seeds the local check runs (default 500; set it
higher for a longer hunt). A failing seed is reported with the one line that rebuilds it; seeds
that once found a bug stay in ``REGRESSION_SEEDS``.
"""

from __future__ import annotations

import collections
import math
import os

import pytest
import torch
import torch.utils._pytree as pytree
from fuzz_models import FuzzModel, fuzz_case
from models_for_tests import random_assignment

import moirai
from moirai.frontend.trace import ALIGNMENT_BYTES, TracedModel, trace
from moirai.runtime import DistributedRunner, run_local
from moirai.runtime.local import _to as local_runner_to
from moirai.runtime.split import SplitProgram, split_module, with_layout

FUZZ_MODELS = int(os.environ.get("MOIRAI_FUZZ_MODELS", "500"))
BLOCK = 50
# Seeds that found a bug, with what it was; they run in every block-independent test below.
_READ_AROUND_WRITE = "an in-place write to a tensor other ops read was split from them (fixed in trace)"
REGRESSION_SEEDS: dict[int, str] = {
    63: _READ_AROUND_WRITE,
    109: _READ_AROUND_WRITE,
    233: _READ_AROUND_WRITE,
    269: _READ_AROUND_WRITE,
}
DISTRIBUTED_SEEDS = range(0, 24 * 7, 7)
COMPILE_SEEDS = range(3, 25 * 11, 11)
WORLD_SIZE = 4


def num_devices(seed: int) -> int:
    return 2 + seed % 3


def expected_outputs(model: FuzzModel, args: tuple, kwargs: dict) -> object:
    """The model's outputs, with MultiheadAttention on its decomposed path: torch.export traces that path (linears and
    ``scaled_dot_product_attention``), where eager's fused kernel rounds an ulp off it, so a split, which runs the
    traced ops, is bitwise equal to the eager model only on that path (73 of 1,500 seeds differed without it)."""
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            return model(*args, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)


def assert_bitwise(outputs: object, expected: object) -> None:
    """``outputs`` has ``expected``'s structure and every tensor equals its counterpart bit for bit."""
    leaves, spec = pytree.tree_flatten(outputs)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    assert spec == expected_spec, f"outputs {spec} where the model gives {expected_spec}"
    for index, (got, want) in enumerate(zip(leaves, expected_leaves, strict=True)):
        if isinstance(want, torch.Tensor):
            difference = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else None
            assert torch.equal(got, want), f"output {index} differs from the model's (largest difference {difference})"
        else:
            assert got == want, f"output {index} is {got!r} where the model gives {want!r}"


def random_split(seed: int) -> tuple[TracedModel, SplitProgram, list[torch.Tensor], object]:
    """The traced model of ``seed``, a random split of it, its flat inputs and the model's own outputs."""
    model, args, kwargs = fuzz_case(seed)
    expected = expected_outputs(model, args, kwargs)
    traced = trace(model, args, kwargs)
    node_device, device_order = random_assignment(traced, num_devices(seed), seed)
    program = split_module(traced, node_device, num_devices(seed), device_order)
    return traced, program, traced.flatten_inputs(args, kwargs), expected


def check_local(seed: int) -> SplitProgram:
    traced, program, flat_inputs, expected = random_split(seed)
    outputs = run_local(program, flat_inputs, ["cpu"] * program.num_devices)
    assert_bitwise(traced.unflatten_outputs(outputs), expected)
    return program


def failures_of(seeds, check) -> list[str]:
    failures = []
    for seed in seeds:
        try:
            check(seed)
        except Exception as error:  # collected, so one run reports every failing seed of the block
            first_line = (str(error).strip().splitlines() or [""])[0][:200]
            failures.append(f"seed {seed}: {type(error).__name__}: {first_line}")
    return failures


def reproduce_hint(failures: list[str]) -> str:
    return "\n".join(failures) + "\nrebuild one with: model, args, kwargs = fuzz_models.fuzz_case(seed)"


@pytest.mark.slow
@pytest.mark.in_process
@pytest.mark.parametrize("block", range(math.ceil(FUZZ_MODELS / BLOCK)))
def test_random_models_split_exactly_locally(block):
    seeds = range(block * BLOCK, min(FUZZ_MODELS, (block + 1) * BLOCK))
    failures = failures_of(seeds, check_local)
    assert not failures, reproduce_hint(failures)


@pytest.fixture
def one_thread():
    """The model and rank 0's part computing with one thread, as every other rank does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", sorted(REGRESSION_SEEDS))
def test_seeds_that_found_bugs(seed):
    check_local(seed)


class ReadAroundWrite(torch.nn.Module):
    """``t`` is read before and after an in-place write to it, as fuzz seed 63 first showed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = self.linear(x)
        before = t * 2
        t.add_(x)
        return before, t.relu(), t.transpose(0, 1) * 3, t.reshape(-1)


def test_in_place_write_read_on_other_devices_splits_exactly():
    model, x = ReadAroundWrite().eval(), torch.randn(3, 4)
    traced = trace(model, (x,))
    targets = [str(n.target) for n in traced.graph_module.graph.nodes if n.op == "call_function"]
    assert "aten.add_.Tensor" not in targets, "the write became data flow"
    assert "aten.view.default" not in targets, "reshapes stay reshapes: views need the traced strides"
    expected = expected_outputs(model, (x,), {})
    ops = [n.name for n in traced.graph_module.graph.nodes if n.op == "call_function"]
    for seed in range(6):
        node_device = {name: (i + seed) % 3 for i, name in enumerate(ops)}  # every op on another device
        program = split_module(traced, node_device, 3)
        outputs = run_local(program, traced.flatten_inputs((x,), {}), ["cpu"] * 3)
        torch.testing.assert_close(traced.unflatten_outputs(outputs), expected)


class TransposedAcross(torch.nn.Module):
    """A transposed (non-contiguous) tensor crosses devices; the receiver views it back (fuzz seed 63)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).transpose(1, 2)
        return y.transpose(1, 2).view(x.shape[0], -1)


def transposed_across_devices() -> tuple[TracedModel, SplitProgram, list[torch.Tensor], object]:
    model, x = TransposedAcross().eval(), torch.randn(2, 3, 4)
    traced = trace(model, (x,))
    ops = [n.name for n in traced.graph_module.graph.nodes if n.op == "call_function"]
    program = split_module(traced, {name: 0 if i < 2 else 1 for i, name in enumerate(ops)}, 2)
    return traced, program, [x], expected_outputs(model, (x,), {})


def test_received_tensor_gets_its_traced_strides_back_before_a_view():
    """The receive restores them ([Note: a received tensor keeps its traced strides]): the transfer's spec has them."""
    traced, program, flat_inputs, expected = transposed_across_devices()
    (transfer,) = program.transfers
    assert transfer.spec.stride == (18, 1, 6)
    torch.testing.assert_close(run_local(program, flat_inputs, ["cpu", "cpu"])[0], expected)


@pytest.mark.parametrize(
    "make",
    [lambda y: y.t(), lambda y: y[:, None, :].expand(4, 3, 4), lambda y: y[1::2, ::2]],
    ids=["transposed", "expanded", "sliced"],
)
def test_with_layout_lays_a_contiguous_tensor_out_as_the_original(make):
    original = make(torch.randn(4, 4))
    offset_bytes = original.data_ptr() % ALIGNMENT_BYTES
    laid_out = with_layout(original.contiguous(), original.stride(), offset_bytes)
    assert laid_out.stride() == original.stride() and laid_out.data_ptr() % ALIGNMENT_BYTES == offset_bytes
    assert torch.equal(laid_out, original)
    assert with_layout(original, original.stride(), offset_bytes) is original
    assert with_layout(original, None, offset_bytes) is original
    # The local runner's move of an output to device 0 keeps them too (.to another device lays it out contiguous).
    moved = local_runner_to(original, torch.device("meta"))
    assert moved.device.type == "meta" and moved.stride() == original.stride()
    assert local_runner_to(original, original.device) is original


def test_in_place_ops_nothing_else_reads_are_left_as_traced():
    """ResNet's ReLU(inplace=True): no functionalization, so fusion rules see the graph as traced."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 2)).eval()
    traced = trace(model, (torch.randn(3, 4),))
    assert "aten.relu_.default" in [str(n.target) for n in traced.graph_module.graph.nodes]


def test_generator_covers_every_op_kind_and_splits_cross_devices():
    """The fuzzer is only as good as what it draws: every step kind, every output form, real transfers."""
    kinds, forms, second_inputs = collections.Counter(), collections.Counter(), collections.Counter()
    for seed in range(60):
        model, _, _ = fuzz_case(seed)
        kinds.update(kind for kind, _, _ in model.steps)
        forms[model.output[0]] += 1
        second_inputs[model.second_input] += 1
    assert set(kinds) == set(FuzzModel.step_kinds()), f"never drawn: {set(FuzzModel.step_kinds()) - set(kinds)}"
    assert set(forms) == {"tensor", "tuple", "dict", "nested"}
    assert set(second_inputs) == {None, "positional", "keyword"}
    programs = [check_local(seed) for seed in range(8)]
    assert sum(bool(p.transfers) for p in programs) >= 6, "most random splits must send tensors between devices"
    assert any(len({t.tensor for t in p.transfers}) < len(p.transfers) for p in programs), "a tensor sent twice"


def test_a_fuzz_model_is_deterministic_per_seed():
    first, args, kwargs = fuzz_case(11)
    second, _, _ = fuzz_case(11)
    assert first.steps == second.steps
    torch.testing.assert_close(expected_outputs(first, args, kwargs), expected_outputs(second, args, kwargs))


@pytest.mark.slow
def test_random_models_compile_with_coarsening_and_placers_and_match():
    """The full pipeline (fusion rules, a placer, the simulated order) on random models and placers."""

    def check(seed: int) -> None:
        model, args, kwargs = fuzz_case(seed)
        expected = expected_outputs(model, args, kwargs)
        placer, options = [("hash", {"seed": seed}), ("round_robin", {}), ("heft", {}), ("m_etf", {})][seed % 4]
        target_nodes = [None, 2, 3][seed % 3]  # merging groups down to a size must stay cycle-free
        compiled = moirai.compile(
            model, ["cpu"] * num_devices(seed), args, kwargs, placer=placer, target_nodes=target_nodes, **options
        )
        assert_bitwise(compiled(*args, **kwargs), expected)

    failures = failures_of(COMPILE_SEEDS, check)
    assert not failures, reproduce_hint(failures)


@pytest.mark.slow
def test_random_models_split_exactly_through_one_distributed_runner(one_thread):
    """Bit for bit: each rank computes with one thread, as the model does here (``one_thread``; a 1x1 conv's kernel
    rounds otherwise with two threads than with one)."""
    with DistributedRunner(["cpu"] * WORLD_SIZE, timeout_s=120.0) as runner:

        def check(seed: int) -> None:
            traced, program, flat_inputs, expected = random_split(seed)
            outputs = runner.run(program, flat_inputs)
            assert_bitwise(traced.unflatten_outputs(outputs), expected)

        failures = failures_of(DISTRIBUTED_SEEDS, check)
        # A transfer delivers a contiguous tensor: without the traced strides back, the view fails.
        _, program, flat_inputs, expected = transposed_across_devices()
        torch.testing.assert_close(runner.run(program, flat_inputs)[0], expected)
    assert len(DISTRIBUTED_SEEDS) >= 20
    assert not failures, reproduce_hint(failures)
