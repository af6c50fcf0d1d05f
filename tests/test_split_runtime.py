"""Split programs give the original model's outputs, locally and across gloo processes.

One module-scoped runner (4 worker processes) serves every distributed case; spawning costs
seconds on a small machine. The failure test spawns its own 2 processes.
"""

from __future__ import annotations

import functools
import importlib
import operator
import pickle
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from models_for_tests import (
    MLP,
    FanOut,
    KwargsDictOutput,
    ResidualBlock,
    SmallCNN,
    TiedEmbedding,
    contiguous_assignment,
    random_assignment,
)

import moirai
from moirai.errors import DistributedError, InputError, PlanError, RequestError
from moirai.frontend.trace import TensorSpec, TracedModel, trace
from moirai.runtime import DistributedRunner, run_distributed, run_local
from moirai.runtime.protocol import InputLayout
from moirai.runtime.split import SplitProgram, split_module

WORLD_SIZE = 4


def _mlp():
    return MLP(), (torch.randn(4, 16),), {}


def _cnn():
    model = SmallCNN()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(2, 3, 8, 8),), {}


def _residual():
    return ResidualBlock(), (torch.randn(4, 16),), {}


def _kwargs_dict():
    mask = (torch.rand(3, 12) > 0.3).float()
    return KwargsDictOutput(), (torch.randn(3, 8),), {"mask": mask, "scale": torch.tensor(1.5)}


def _tied():
    return TiedEmbedding(), (torch.randint(0, 50, (2, 6)),), {}


def _fan_out():
    return FanOut(), (torch.randn(4, 16),), {}


def _bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    return BertModel(config), (torch.randint(0, 99, (2, 8)),), {"attention_mask": mask}


def _swin():
    from transformers import SwinConfig, SwinModel

    config = SwinConfig(
        image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4
    )
    return SwinModel(config), (torch.randn(1, 3, 32, 32),), {}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    # use_cache goes in the config: trace takes tensor inputs only.
    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False)
    return GPT2LMHeadModel(config), (torch.randint(0, 100, (1, 8)),), {}


@dataclass(frozen=True)
class Case:
    make: Callable[[], tuple[torch.nn.Module, tuple, dict]]
    num_devices: int


CASES = {
    "mlp": Case(_mlp, 3),
    "cnn_batchnorm": Case(_cnn, 4),
    "residual": Case(_residual, 3),
    "kwargs_dict_output": Case(_kwargs_dict, 2),
    "tied_parameter": Case(_tied, 2),
    "fan_out": Case(_fan_out, 4),
    "bert": Case(_bert, 4),
    "swin": Case(_swin, 3),
    "gpt2": Case(_gpt2, 4),
}
HUGGING_FACE = {"bert", "swin", "gpt2"}


@dataclass(frozen=True)
class Prepared:
    traced: TracedModel
    node_device: dict[str, int]
    program: SplitProgram
    flat_inputs: list[torch.Tensor]
    expected: object


@functools.cache
def prepared(name: str) -> Prepared:
    case = CASES[name]
    torch.manual_seed(0)
    model, args, kwargs = case.make()
    model.eval()
    with torch.no_grad():
        expected = model(*args, **kwargs)
    traced = trace(model, args, kwargs)
    node_device = contiguous_assignment(traced, case.num_devices)
    program = split_module(traced, node_device, case.num_devices)
    return Prepared(traced, node_device, program, traced.flatten_inputs(args, kwargs), expected)


def _case_params(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in HUGGING_FACE else n for n in names]


@pytest.fixture(scope="module")
def runner():
    with DistributedRunner(["cpu"] * WORLD_SIZE, timeout_s=120.0) as shared:
        yield shared


def _assert_matches(case: Prepared, flat_outputs: list[torch.Tensor]) -> None:
    torch.testing.assert_close(flat_outputs, pytree.tree_leaves(case.expected))
    torch.testing.assert_close(case.traced.unflatten_outputs(flat_outputs), case.expected)


@pytest.mark.parametrize("name", _case_params(CASES))
def test_distributed_matches_original(name, runner):
    case = prepared(name)
    assert set(case.node_device.values()) == set(range(case.program.num_devices)), "every device gets work"
    assert case.program.transfers, "the split must cross devices"
    _assert_matches(case, runner.run(case.program, case.flat_inputs))


@pytest.mark.parametrize("name", _case_params(CASES))
def test_local_matches_original(name):
    case = prepared(name)
    _assert_matches(case, run_local(case.program, case.flat_inputs, ["cpu"] * case.program.num_devices))


@pytest.mark.parametrize("name", _case_params(CASES))
def test_parts_hold_only_the_attributes_their_ops_read(name):
    case = prepared(name)
    graph = case.traced.graph_module.graph
    (output,) = graph.find_nodes(op="output")
    for part in case.program.parts:
        read = {
            source.target
            for node in graph.nodes
            if case.node_device.get(node.name) == part.device
            for source in node.all_input_nodes
            if source.op == "get_attr"
        }
        if part.device == 0:
            read |= {v.target for v in output.args[0] if v.op == "get_attr"}
        module = part.graph_module
        held = {name for name, _ in module.named_parameters(remove_duplicate=False)}
        held |= {name for name, _ in module.named_buffers(remove_duplicate=False)}
        assert held == read
        assert set(part.attribute_names) == read


@pytest.mark.parametrize("name", ["tied_parameter", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_tied_parameter_is_copied_to_both_devices(name):
    program = prepared(name).program
    tied = {"tied_parameter": "embedding_weight", "gpt2": "lm_head_weight"}[name]
    holders = [part.device for part in program.parts if tied in part.attribute_names]
    assert holders == [0, program.num_devices - 1]
    first, last = (program.parts[d].graph_module.get_parameter(tied) for d in holders)
    assert first is not last and first.data_ptr() == last.data_ptr()


def test_tensor_read_twice_on_a_remote_device_is_sent_once():
    case = prepared("fan_out")
    program = case.program
    trunk = next(n.name for n in case.traced.graph_module.graph.nodes if n.target == torch.ops.aten.sigmoid.default)
    assert case.node_device[trunk] == 0
    readers_on_1 = [
        user
        for user in case.traced.graph_module.graph.nodes
        if case.node_device.get(user.name) == 1 and any(a.name == trunk for a in user.all_input_nodes)
    ]
    assert len(readers_on_1) == 2
    assert sorted(t.dst for t in program.transfers if t.tensor == trunk) == [1, 2, 3]
    sends = [n for n in program.parts[0].graph_module.graph.nodes if n.op == "call_method" and n.target == "send"]
    assert [n.args[1].name for n in sends].count(trunk) == 3
    waits = [n for n in program.parts[1].graph_module.graph.nodes if n.target == "wait_recv"]
    assert [n.name for n in waits].count(trunk) == 1


def test_receive_is_posted_early_and_waited_for_just_before_use():
    graph = prepared("residual").program.parts[2].graph_module.graph
    names = [n.name for n in graph.nodes]
    consumer = next(n for n in graph.nodes if n.target == torch.ops.aten.add.Tensor)
    skip_wait = next(a for a in consumer.args if a.target == "wait_recv" and a.name != consumer.args[0].name)
    assert names.index(skip_wait.args[1].name) < names.index(consumer.args[0].args[1].name), "skip posted first"
    assert names.index(skip_wait.name) == names.index(consumer.name) - 1


def test_device_order_is_followed_and_checked():
    case = prepared("fan_out")
    ops = [n.name for n in case.traced.graph_module.graph.nodes if n.op == "call_function"]
    node_device = {name: 0 if position < 2 else 1 for position, name in enumerate(ops)}
    right_branch_first = [ops[:2], ops[4:6] + ops[2:4] + ops[6:]]
    program = split_module(case.traced, node_device, 2, right_branch_first)
    part_ops = [n.name for n in program.parts[1].graph_module.graph.nodes if n.op == "call_function"]
    assert part_ops == right_branch_first[1]
    torch.testing.assert_close(run_local(program, case.flat_inputs, ["cpu", "cpu"]), [case.expected])
    with pytest.raises(PlanError, match="contradicts the data dependencies"):
        split_module(case.traced, node_device, 2, [ops[:2], ops[2:][::-1]])
    with pytest.raises(PlanError, match="exactly once"):
        split_module(case.traced, node_device, 2, [ops[:2], ops[3:]])


@pytest.mark.parametrize("name", ["cnn_batchnorm", "kwargs_dict_output", "fan_out"])
def test_random_placements_and_orders_match_locally(name):
    case = prepared(name)
    for seed in range(10):
        node_device, device_order = random_assignment(case.traced, 3, seed)
        program = split_module(case.traced, node_device, 3, device_order)
        assert len({(t.tensor, t.dst) for t in program.transfers}) == len(program.transfers), "each tensor once"
        _assert_matches(case, run_local(program, case.flat_inputs, ["cpu"] * 3))


def test_random_placement_with_many_round_trips_runs_distributed(runner):
    case = prepared("cnn_batchnorm")
    node_device, device_order = random_assignment(case.traced, WORLD_SIZE, seed=8)
    program = split_module(case.traced, node_device, WORLD_SIZE, device_order)
    links = {(t.src, t.dst) for t in program.transfers}
    assert len(links) >= 6, "messages go both ways on several links"
    _assert_matches(case, runner.run(program, case.flat_inputs))


def test_driver_tells_only_the_ranks_with_work(runner):
    """A device the plan leaves unused gets no request: its part is idle, and the runner still answers."""
    case = prepared("mlp")
    everything_on_0 = dict.fromkeys(case.node_device, 0)
    program = split_module(case.traced, everything_on_0, WORLD_SIZE)
    assert [part.idle for part in program.parts] == [False] + [True] * (WORLD_SIZE - 1)
    assert program.working_ranks == ()
    assert case.program.working_ranks == tuple(range(1, case.program.num_devices))
    for _ in range(3):
        _assert_matches(case, runner.run(program, case.flat_inputs))
    _assert_matches(case, runner.run(case.program, case.flat_inputs))  # the idle ranks still serve the next plan


def test_program_survives_pickling():
    case = prepared("residual")
    restored = pickle.loads(pickle.dumps(case.program))
    _assert_matches(case, run_local(restored, case.flat_inputs, ["cpu"] * 3))


def test_op_without_device_is_a_plan_error():
    case = prepared("mlp")
    partial = dict(case.node_device)
    missing = next(iter(partial))
    del partial[missing]
    with pytest.raises(PlanError, match=f"no device.*{missing}"):
        split_module(case.traced, partial, 3)


def test_unknown_device_and_unknown_op_are_plan_errors():
    case = prepared("mlp")
    with pytest.raises(PlanError, match="devices are 0..2"):
        split_module(case.traced, {**case.node_device, next(iter(case.node_device)): 5}, 3)
    with pytest.raises(PlanError, match="not ops of the traced graph"):
        split_module(case.traced, {**case.node_device, "no_such_op": 0}, 3)


def test_multi_output_op_split_from_its_getitems_is_a_plan_error():
    case = prepared("kwargs_dict_output")
    graph = case.traced.graph_module.graph
    split_node = next(n for n in graph.nodes if n.target == torch.ops.aten.split.Tensor)
    moved = {**case.node_device, split_node.name: 0, **{u.name: 1 for u in split_node.users}}
    with pytest.raises(PlanError, match="only tensors can cross devices"):
        split_module(case.traced, moved, 2)


def test_meta_weights_split_for_inspection_but_do_not_run():
    with torch.device("meta"):
        model = MLP()
    traced = trace(model, (torch.empty(4, 16, device="meta"),))
    program = split_module(traced, contiguous_assignment(traced, 2), 2)
    assert all(p.is_meta for part in program.parts for p in part.graph_module.parameters())
    with pytest.raises(InputError, match="meta device"):
        run_local(program, [torch.randn(4, 16)], ["cpu", "cpu"])


def test_run_distributed_of_meta_weights_is_refused_before_a_rank_starts(monkeypatch):
    """Each rank printed its own traceback before the driver's InputError."""
    with torch.device("meta"):
        model = MLP()
    compiled = moirai.compile(
        model, ["cpu", "cpu"], (torch.empty(4, 16, device="meta"),), placer="round_robin", calibration="none"
    )
    compile_module = importlib.import_module("moirai.compile")  # the module, not moirai.compile the function
    monkeypatch.setattr(compile_module, "run_distributed", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(InputError, match="on the meta device; a program split from a model with meta weights"):
        compiled.run_distributed(torch.randn(4, 16))


def test_local_runner_follows_a_part_edited_and_recompiled_between_calls():
    # The local runner keeps each part's node list between calls; an edit takes effect with the recompile the
    # distributed runtime's generated code needs too.
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(4, 16)
    traced = trace(model, (x,))
    program = split_module(traced, contiguous_assignment(traced, 2), 2)
    with torch.no_grad():
        torch.testing.assert_close(run_local(program, [x], ["cpu", "cpu"]), [model(x)])
        for part in program.parts:  # relu(h) becomes -relu(h): a node more in the graph
            graph = part.graph_module.graph
            for relu in graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default):
                with graph.inserting_after(relu):
                    negated = graph.call_function(torch.ops.aten.neg.default, (relu,))
                relu.replace_all_uses_with(negated, delete_user_cb=lambda user, negated=negated: user is not negated)
            part.graph_module.recompile()
        first, _, second, _, last = model.layers
        expected = last(-torch.relu(second(-torch.relu(first(x)))))
        torch.testing.assert_close(run_local(program, [x], ["cpu", "cpu"]), [expected])


def test_wrong_input_shape_is_an_input_error():
    case = prepared("mlp")
    with pytest.raises(InputError, match="shape"):
        run_local(case.program, [torch.randn(5, 16)], ["cpu"] * 3)


def test_failing_rank_fails_the_call_with_its_rank_and_error():
    case = prepared("mlp")
    program = split_module(case.traced, contiguous_assignment(case.traced, 2), 2)
    module = program.parts[1].graph_module
    first_op = next(n for n in module.graph.nodes if n.op == "call_function" and n.target != operator.getitem)
    with module.graph.inserting_before(first_op):
        # A matrix product of an activation with itself, whose shapes do not fit: the part loads, and fails when run.
        operand = first_op.args[0]
        injected = module.graph.call_function(torch.ops.aten.mm.default, (operand, operand))
        injected.name = "injected_failure_for_the_test"
    module.recompile()
    started = time.monotonic()
    # An op that raises fails its own request (the ranks serve on), naming the rank, the op and the cause.
    expected = r"request 0 failed on rank 1 \(cpu\) at op injected_failure_for_the_test(.|\n)*cannot be multiplied"
    with pytest.raises(RequestError, match=expected):
        run_distributed(program, case.flat_inputs, ["cpu", "cpu"], timeout_s=30.0)
    assert time.monotonic() - started < 60.0


def test_missing_message_times_out_instead_of_hanging(runner):
    """Last on purpose: a failure stops the shared workers (a later call would start new ones)."""
    case = prepared("mlp")
    program = split_module(case.traced, case.node_device, 3)
    module = program.parts[0].graph_module
    send = next(n for n in module.graph.nodes if n.target == "send")
    never_sent = send.args[1].name
    module.graph.erase_node(send)
    module.recompile()
    started = time.monotonic()
    with pytest.raises(DistributedError, match="failed during request") as failure:
        runner.run(program, case.flat_inputs, timeout_s=3.0)
    assert time.monotonic() - started < 3.0 + 10.0
    # torch's message may span lines (gloo appends where it was raised): match across them.
    message = str(failure.value)
    assert re.search(f"rank 1: receiving tensor {never_sent} from rank 0 failed .*Timed out", message, re.DOTALL)


class _TransposedIntoLinear(torch.nn.Module):
    """``x.t() * 2`` has strides (1, 2): a linear on it rounds differently than on a contiguous copy."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.t() * 2)


class _StridedIntoLinear(torch.nn.Module):
    """A linear whose input is ``layout``'s view of another linear's output: transposed, expanded, sliced, or its
    rows from the second on (contiguous, its first element 24 bytes past the alignment of every allocation)."""

    LAYOUTS = {
        "transposed": lambda y: y.t(),
        "expanded": lambda y: y[:, None, :].expand(6, 3, 6),
        "sliced": lambda y: y[1::2, :],
        "offset": lambda y: y[1:, :],
    }

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.first, self.second, self.layout = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), layout

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        strided = self.LAYOUTS[self.layout](self.first(x))
        return self.second(strided), strided


def _split_after_the_last_strided_op(traced: TracedModel) -> SplitProgram:
    """Device 0 up to the last op whose value is not contiguous or starts past its storage's start, device 1 after:
    that tensor crosses."""
    ops = [node for node in traced.graph_module.graph.nodes if node.op == "call_function"]
    last = max(
        i for i, node in enumerate(ops) if not node.meta["val"].is_contiguous() or node.meta["val"].storage_offset()
    )
    return split_module(traced, {node.name: int(i > last) for i, node in enumerate(ops)}, 2)


STRIDED_MODELS = {
    "transposed_into_linear": lambda: (_TransposedIntoLinear(), torch.randn(4, 2)),
    **{
        layout: functools.partial(lambda lay: (_StridedIntoLinear(lay), torch.randn(6, 6)), layout)
        for layout in _StridedIntoLinear.LAYOUTS
    },
}


@pytest.mark.parametrize("name", STRIDED_MODELS)
def test_a_strided_tensor_crosses_devices_with_its_strides_bitwise(name, runner):
    """[Note: a received tensor keeps its traced strides]: it arrived contiguous, and the linear after it was 1 ulp
    off the model's; and at the start of its buffer, where a linear on an AMD EPYC was 1 ulp off a tensor that
    starts 24 bytes further."""
    torch.manual_seed(0)
    model, x = STRIDED_MODELS[name]()
    model.eval()
    traced = trace(model, (x,))
    program = _split_after_the_last_strided_op(traced)
    (transfer,) = {t.tensor: t for t in program.transfers}.values()
    assert transfer.spec.stride is not None or transfer.spec.offset_bytes, "a tensor laid out unlike a new one crosses"
    for seed in range(4):
        torch.manual_seed(seed)
        x = torch.randn(x.shape)
        with torch.no_grad():
            expected = pytree.tree_leaves(model(x))
        for outputs in (runner.run(program, [x]), run_local(program, [x], ["cpu", "cpu"])):
            assert all(torch.equal(got, want) for got, want in zip(outputs, expected, strict=True))


class _ParameterSliceIntoLinear(torch.nn.Module):
    """A linear whose weight is a slice of a parameter (MultiheadAttention's ``in_proj_weight``, split three ways)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(24, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.transpose(0, 1), self.weight[8:16])


def test_a_slice_of_a_parameter_crosses_devices_requiring_grad_as_in_the_model_bitwise(runner):
    """Under no_grad a view of a parameter still requires grad, and ``matmul`` folds a batch into one ``mm`` only
    then: received without it, the linear took ``bmm`` and was 1 ulp off (TensorSpec.requires_grad)."""
    torch.manual_seed(0)
    model = _ParameterSliceIntoLinear().eval()
    traced = trace(model, (torch.randn(2, 3, 8),))
    ops = [node.name for node in traced.graph_module.graph.nodes if node.op == "call_function"]
    program = split_module(traced, {name: int("slice" not in name) for name in ops}, 2)
    (transfer,) = program.transfers
    assert transfer.spec.requires_grad
    for seed in range(4):
        torch.manual_seed(seed)
        x = torch.randn(2, 3, 8)
        with torch.no_grad():
            expected = model(x)
        for (output,) in (runner.run(program, [x]), run_local(program, [x], ["cpu", "cpu"])):
            assert torch.equal(output, expected)


@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(31)[1:].view(5, 6), lambda: torch.randn(6, 5).t(), lambda: torch.randn(5, 6)],
    ids=["4 bytes past the boundary", "transposed", "new"],
)
def test_a_flat_input_read_off_rank_0_keeps_the_callers_layout_bitwise(make, runner):
    """The header carries the caller's layout of a flat input another rank reads (protocol.InputLayout): a linear on
    rows that start 4 bytes past the alignment boundary was 1 ulp off the same rows received into a new buffer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6)).eval()
    traced = trace(model, (torch.randn(5, 6),))
    program = split_module(traced, {n.name: 1 for n in traced.graph_module.graph.nodes if n.op == "call_function"}, 2)
    for seed in range(4):
        torch.manual_seed(seed)
        x = make()
        with torch.no_grad():
            expected = model(x)
        assert torch.equal(runner.run(program, [x])[0], expected)


@pytest.mark.parametrize(
    "value", [[[6], 0, False], [[6, -1], 0, False], [None, 2, False], [None, 64, False], [None, 0], "x"]
)
def test_a_flat_inputs_layout_that_does_not_fit_its_spec_is_refused(value):
    spec = TensorSpec((5, 6), torch.float32)
    with pytest.raises(DistributedError, match="is not a layout of a 2-d torch.float32 tensor"):
        InputLayout.from_wire(value, spec, "rank 1")
    assert InputLayout.from_wire([[1, 5], 8, True], spec, "rank 1") == InputLayout((1, 5), 8, True)


@pytest.mark.slow
def test_run_distributed_and_server_give_a_strided_tensor_its_strides_bitwise():
    """The user's entry points, which start ranks of their own, on a plan that sends ``x.t() * 2`` across."""
    torch.manual_seed(0)
    model, x = _TransposedIntoLinear().eval(), torch.randn(4, 2)
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="hash", calibration="none")
    problem = compiled.problem
    placement = np.zeros(problem.num_tasks, dtype=int)
    placement[problem.topological_order[-1]] = 1  # the linear's task on device 1, what feeds it on device 0
    split = compiled.with_plan(moirai.Plan(placement, problem.device_names))
    assert [t.spec.stride for t in split.program.transfers] == [(1, 2)]
    inputs = [torch.randn(4, 2) for _ in range(3)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    assert all(torch.equal(split.run_distributed(x), want) for x, want in zip(inputs, expected, strict=True))
    with split.server(timeout_s=60.0) as server:
        results = [server.submit(x).result(60.0) for x in inputs]
    assert all(torch.equal(got, want) for got, want in zip(results, expected, strict=True))


class _OddOutputs(torch.nn.Module):
    """Returns one tensor twice and tensors of other layouts than contiguous, all made on the last device."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.linear(x) * 2
        return h, h.t(), h, h[::2, 1:], h[None].expand(3, 4, 4), x.t() + 0


def _odd_outputs() -> tuple[torch.nn.Module, SplitProgram, torch.Tensor]:
    torch.manual_seed(0)
    model, x = _OddOutputs().eval(), torch.randn(4, 4)
    traced = trace(model, (x,))
    ops = [node.name for node in traced.graph_module.graph.nodes if node.op == "call_function"]
    linear = max(i for i, name in enumerate(ops) if "addmm" in name or "linear" in name)
    return model, split_module(traced, {name: int(i > linear) for i, name in enumerate(ops)}, 2), x


def _assert_outputs_as_the_model_returns_them(outputs: tuple, expected: tuple) -> None:
    assert outputs[0] is outputs[2], "one tensor returned twice is one tensor"
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got, want) and got.stride() == want.stride()


def test_outputs_gathered_keep_their_identity_and_strides(runner):
    """A tensor returned twice came back as two copies, and every output from another rank came back contiguous
    (an expand materialised)."""
    model, program, x = _odd_outputs()
    assert {at.device for at in program.outputs} == {1}
    assert program.outputs[0] == program.outputs[2], "returned once by its part, gathered once"
    with torch.no_grad():
        expected = model(x)
    for outputs in (runner.run(program, [x]), run_local(program, [x], ["cpu", "cpu"])):
        _assert_outputs_as_the_model_returns_them(tuple(outputs), expected)


def test_the_layout_of_a_tensor_at_an_address_no_new_tensor_can_have_starts_at_the_boundary():
    buffer = bytearray(4 * 7)
    odd = next(
        t for at in range(4) if (t := torch.frombuffer(buffer, dtype=torch.float32, offset=at, count=6)).data_ptr() % 4
    )
    assert InputLayout.of(odd).offset_bytes == 0
    assert InputLayout.of(torch.randn(31)[3:]) == InputLayout(None, 12, False)
