"""A program on the wire is data (moirai.runtime.program_codec): it loads exactly, and a payload that names anything
outside the vocabulary of torch's operators is refused before any of it runs."""

from __future__ import annotations

import json
import operator
import re
import struct

import numpy
import pytest
import torch
from models_for_tests import MLP, ResidualBlock, contiguous_assignment

import moirai
from moirai.errors import DistributedError, PlanError
from moirai.frontend.trace import trace
from moirai.runtime import run_local
from moirai.runtime.program_codec import decode_program, encode_program
from moirai.runtime.protocol import load_bytes, program_for_rank
from moirai.runtime.split import split_module


def _split(model: torch.nn.Module, example: tuple, num_devices: int):
    torch.manual_seed(0)
    model.eval()
    traced = trace(model, example)
    program = split_module(traced, contiguous_assignment(traced, num_devices), num_devices)
    return traced, program


def _round_trip(program):
    encoded = encode_program(program)
    payload = encoded.to_bytes()
    assert len(payload) == encoded.num_bytes
    return decode_program(payload, "the test")


@pytest.mark.parametrize(
    "make", [lambda: (MLP(), (torch.randn(4, 16),)), lambda: (ResidualBlock(), (torch.randn(4, 16),))]
)
def test_a_decoded_program_gives_the_original_outputs_exactly(make) -> None:
    model, example = make()
    traced, program = _split(model, example, 3)
    flat = traced.flatten_inputs(example, {})
    expected = run_local(program, flat, ["cpu"] * 3)
    restored = _round_trip(program)
    for got, want in zip(run_local(restored, flat, ["cpu"] * 3), expected, strict=True):
        assert torch.equal(got, want)
    assert restored.transfers == program.transfers and restored.outputs == program.outputs
    assert restored.input_specs == program.input_specs
    for before, after in zip(program.parts, restored.parts, strict=True):
        assert after.input_indices == before.input_indices and after.attribute_names == before.attribute_names
        assert [n.format_node() for n in after.graph_module.graph.nodes] == [
            n.format_node() for n in before.graph_module.graph.nodes
        ]


def test_tensors_sharing_a_storage_share_it_after_loading_and_it_is_sent_once() -> None:
    traced, program = _split(MLP(), (torch.randn(4, 16),), 1)
    module = program.parts[0].graph_module
    biases = [n for n in program.parts[0].attribute_names if n.endswith("bias")]
    first, second = (_attribute(module, n) for n in biases[:2])
    assert first.shape == second.shape
    setattr(module, biases[1], torch.nn.Parameter(first.detach()))  # tied, as a model may tie two weights
    restored = _round_trip(program).parts[0].graph_module
    assert _attribute(restored, biases[0]).data_ptr() == _attribute(restored, biases[1]).data_ptr()
    storages = {_attribute(module, n).data_ptr(): _attribute(module, n).untyped_storage().nbytes()
                for n in program.parts[0].attribute_names}  # fmt: skip
    weights = sum(storages.values())
    assert weights < load_bytes(program, 0) < weights + 16384


def test_a_generation_programs_cache_buffers_load_writable_and_are_sent_with_their_part_only() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = moirai.compile_lm(
        LlamaForCausalLM(config).eval(), ["cpu", "cpu"], placer="contiguous", progress=False, max_seq_len=32,
        max_prefill=8, max_batch_size=2,
    )  # fmt: skip
    program = lm.compiled.program
    caches_seen = 0
    for rank in range(2):
        restored = _round_trip(program_for_rank(program, rank))
        mine = restored.parts[rank].graph_module
        original = program.parts[rank].graph_module
        # the KV cache and the seen-token flags: the state a step writes
        names = [name for name in program.parts[rank].attribute_names if "cache" in name or name == "seen_tokens"]
        for name in names:
            value = _attribute(mine, name)
            assert torch.equal(value, _attribute(original, name)) and value.data_ptr() != 0
            assert not value.any()  # no sequence has written it: zeros, which travel as their size
            value.fill_(1)  # a cache is written in place: the loaded one must be writable memory of its own
            assert not torch.equal(value, _attribute(original, name))
        others = [part.graph_module for part in restored.parts if part.device != rank]
        assert all(not [n for n in m.graph.nodes if n.op == "get_attr"] for m in others)
        cache_bytes = sum(_attribute(original, n).untyped_storage().nbytes() for n in names)
        sent = encode_program(program_for_rank(program, rank)).sent_storages
        assert sum(s.numel() for s in sent) == _weight_bytes(program.parts[rank]) - cache_bytes
        caches_seen += len(names)
    assert caches_seen == 5  # two layers' keys and values and the seen-token flags, wherever they are


def _weight_bytes(part) -> int:
    module = part.graph_module
    storages = {_attribute(module, n).untyped_storage().data_ptr(): _attribute(module, n).untyped_storage().nbytes()
                for n in part.attribute_names}  # fmt: skip
    return sum(storages.values())


class _Counter(torch.nn.Module):
    """A buffer of zeros written in place, and one whose only nonzero byte is past the first block."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(4096))
        offset = torch.zeros(4096)
        offset[-1] = 1.0
        self.register_buffer("offset", offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum())
        return self.total[:4] + self.offset[-4:] + x


class _Rows(torch.nn.Module):
    """A 1 MiB buffer of which a call writes the first row (as a first sequence fills a cache's first slot)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rows", torch.zeros(4, 65536))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.aten.index_put_(self.rows, [torch.tensor([0])], x.view(1, -1).expand(1, 65536))
        return self.rows.sum(dim=1) + x[:4]


def test_a_buffer_written_in_part_sends_only_the_blocks_that_are_not_zero() -> None:
    from moirai.runtime.zero_pages import BLOCK_BYTES, written_runs

    example = (torch.ones(1),)
    traced, program = _split(_Rows(), example, 1)
    rows = _attribute(program.parts[0].graph_module, "rows")
    assert written_runs(rows.view(-1).view(torch.uint8)) == []
    run_local(program, traced.flatten_inputs(example, {}), ["cpu"])  # row 0 written: its first quarter
    storage = rows.view(-1).view(torch.uint8)
    assert written_runs(storage) == [(0, 65536 * 4)]
    sent = encode_program(program).sent_storages
    assert 65536 * 4 % BLOCK_BYTES == 0  # so that the written quarter is whole blocks
    assert 65536 * 4 <= sum(s.numel() for s in sent) <= 65536 * 4 + 8  # that quarter, and the row's index
    assert torch.equal(_attribute(_round_trip(program).parts[0].graph_module, "rows"), rows)


def test_a_buffer_of_zeros_travels_as_its_size_and_loads_as_zeros_and_written_state_travels_whole() -> None:
    example = (torch.ones(4),)
    traced, program = _split(_Counter(), example, 1)
    module = program.parts[0].graph_module
    weights = _weight_bytes(program.parts[0])
    assert weights == 2 * 4096 * 4 and load_bytes(program, 0) < 4096 * 4 + 16384  # the zeros are not sent
    restored = _round_trip(program)
    loaded = {n: _attribute(restored.parts[0].graph_module, n) for n in program.parts[0].attribute_names}
    for name, value in loaded.items():
        assert torch.equal(value, _attribute(module, name)) and value.dtype == torch.float32
    flat = traced.flatten_inputs(example, {})
    for _ in range(2):  # state kept between calls, where it was loaded
        assert torch.equal(run_local(restored, flat, ["cpu"])[0], run_local(program, flat, ["cpu"])[0])
    assert load_bytes(program, 0) > weights  # written now: it travels whole
    assert torch.equal(_attribute(_round_trip(program).parts[0].graph_module, "total"), _attribute(module, "total"))


def _attribute(module: torch.nn.Module, target: str) -> torch.Tensor:
    return operator.attrgetter(target)(module)


# -- payloads that name what no rank may run ------------------------------------------------------------------------


def _edited(program, edit) -> bytes:
    """The program's payload with its description changed by ``edit`` (the storages kept)."""
    encoded = encode_program(program)
    description = json.loads(encoded.description)
    edit(description)
    text = json.dumps(description).encode()
    rest = encoded.to_bytes()[8 + len(encoded.description) :]
    return struct.pack("<Q", len(text)) + text + rest


def _first_node(description, op):
    return next(n for n in description["parts"][1]["graph_module"]["nodes"] if n["op"] == op)


def _set_target(op, target):
    return lambda description: _first_node(description, op).update(target=target)


def _calls(operator_name):
    return _set_target("call_function", {"op": operator_name})


# Operators that trust their strides, lengths or indices, and so read and write the rank's memory beyond their
# tensors (three reviews found these), and out= variants.
_UNCHECKED = (
    "_reshape_alias.default segment_reduce.default _unsafe_index.Tensor max_pool2d_with_indices_backward.default "
    "_cummax_helper.default sparse_coo_tensor.indices_size _convert_indices_from_coo_to_csr.default add.out "
    "_weight_norm.default"  # a g smaller than v's first dimension: the norm is written past g's memory (a crash)
).split()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set_target("call_function", {"function": "builtins.eval"}), "calls function 'builtins.eval'"),
        (_set_target("call_function", {"function": "os.system"}), "calls function 'os.system'"),
        (_set_target("call_function", {"function": "operator.call"}), "calls function 'operator.call'"),
        (_calls("os::system.default"), "'os::system.default', which is not registered"),
        (_calls("aten::add.__class__"), "is not namespace::name.overload"),
        (_set_target("call_function", {"higher_order": "triton_kernel_wrapper_mutation"}), "may not call"),
        (_set_target("call_method", "__reduce__"), "calls method '__reduce__'"),
        (_set_target("call_method", "tofile"), "calls method 'tofile'"),
        (_set_target("placeholder", {"function": "builtins.eval"}), "is not a plain name"),
        (lambda d: _first_node(d, "call_function").update(op="call_module", target="x"), "op 'call_module'"),
        (lambda d: _first_node(d, "call_function").update(args={"pickle": "x"}), "unknown tag 'pickle'"),
        (lambda d: d.update(format=0), "format is 0"),
        # A received tensor is laid out this far past its buffer's start: within the buffer's padding only.
        (lambda d: d["transfers"][0][4].__setitem__(4, 1 << 40), "offset of 1099511627776 bytes is not"),
        (lambda d: d["transfers"][0][4].__setitem__(4, 2), "offset of 2 bytes is not a whole number of float32"),
        (lambda d: d["storages"][0].__setitem__(0, 1 << 40), "runs past the payload"),
        (lambda d: d["parts"][1]["graph_module"]["attributes"][0]["tensor"].update(offset=1 << 30), "runs past"),
        (lambda d: d["parts"][1]["graph_module"]["attributes"][0].update(target="__class__"), "dotted identifier"),
        # A module's own method under an attribute's name (GraphModule.recompile hands out fx's globals, torch's os).
        (lambda d: _rename_attribute(d, "recompile"), "'recompile' is not a dotted identifier of its own"),
        (lambda d: _first_node(d, "call_function").update(name="self"), "node name 'self'"),
        (lambda d: _first_node(d, "call_function").update(name="torch"), "node name 'torch'"),
        (_calls("aten::from_file.default"), "which opens a file by name"),
        (_calls("profiler::_record_function_enter_new.default"), "namespace 'profiler'"),
        (_calls("_c10d_functional::all_reduce.default"), "namespace '_c10d_functional'"),
        (lambda d: _first_node(d, "call_function").update(kwargs={"dict": [["class", 1]]}), "keywords ['class']"),
        (lambda d: d["storages"][0].__setitem__(0, float("inf")), "OverflowError"),
        (lambda d: d["storages"][0].__setitem__(1, "pickle"), "storage 0 travels as 'pickle'"),
        (lambda d: d["storages"].__setitem__(0, [1 << 62, "runs", []]), "cannot be mapped"),
        (lambda d: d["storages"].__setitem__(0, [64, "runs", [[0, 8], [4, 12]]]), "run [4, 12] is not within"),
        (lambda d: d["storages"].__setitem__(0, [64, "runs", [[60, 72]]]), "run [60, 72] is not within its 64"),
        (lambda d: d["storages"].__setitem__(0, [64, "runs"]), "travels as 'runs'"),
        *[(_calls(f"aten::{name}"), "may not call") for name in _UNCHECKED],
        (_calls("prims::view_of.default"), "namespace 'prims'"),
        # A module's own state under an attribute's name: its hooks run on every call.
        (lambda d: _rename_attribute(d, "_forward_pre_hooks"), "'_forward_pre_hooks' is not a dotted identifier"),
        (lambda d: _rename_attribute(d, "training"), "'training' is not a dotted identifier"),
        # fx names a call's global after the function (math_floor); a parameter of that name would stand in for it.
        (lambda d: _first_node(d, "placeholder").update(target="math_floor"), "(target 'math_floor')"),
        (lambda d: _first_node(d, "placeholder").update(target="getattr", name="getattr_1"), "(target 'getattr')"),
        (lambda d: _first_node(d, "call_function").update(args={"tuple": [{"complex": [0, {"float": "inf"}]}]}), ""),
    ],
)
def test_a_payload_naming_anything_outside_the_vocabulary_is_refused(edit, message) -> None:
    _, program = _split(MLP(), (torch.randn(4, 16),), 2)
    with pytest.raises(DistributedError, match=f"rank 1's load: .*{re.escape(message)}"):
        decode_program(_edited(program, edit), "rank 1's load")


def _rename_attribute(description, name: str) -> None:
    graph = description["parts"][1]["graph_module"]
    old = graph["attributes"][0]["target"]
    graph["attributes"][0]["target"] = name
    for node in graph["nodes"]:
        if node["op"] == "get_attr" and node["target"] == old:
            node["target"] = name


def test_a_program_with_more_parts_than_the_world_has_ranks_is_refused() -> None:
    _, program = _split(MLP(), (torch.randn(4, 16),), 2)
    payload = encode_program(program).to_bytes()
    assert decode_program(payload, "rank 1's load", max_parts=2).num_devices == 2
    with pytest.raises(DistributedError, match="2 parts, more than the world's 1 ranks"):
        decode_program(payload, "rank 1's load", max_parts=1)


def test_an_attribute_named_as_a_modules_own_state_is_a_plan_error_before_it_is_sent() -> None:
    _, program = _split(MLP(), (torch.randn(4, 16),), 1)
    module = program.parts[0].graph_module
    node = next(n for n in module.graph.nodes if n.op == "get_attr")
    node.target = "training"  # as the rank would read it: the module's own flag, not the payload's tensor
    with pytest.raises(PlanError, match="reads attribute 'training', a name a module has of its own"):
        encode_program(program)


def test_an_empty_tensor_loads() -> None:
    _, program = _split(MLP(), (torch.randn(4, 16),), 1)
    name = program.parts[0].attribute_names[0]
    setattr(program.parts[0].graph_module, name, torch.nn.Parameter(torch.empty(0, 3)))
    assert _attribute(_round_trip(program).parts[0].graph_module, name).shape == (0, 3)


def test_a_getattr_other_than_the_transports_symbol_values_is_refused() -> None:
    _, program = _split(MLP(), (torch.randn(4, 16),), 2)

    def reads_class(description):
        nodes = description["parts"][1]["graph_module"]["nodes"]
        transport = nodes[0]["name"]
        position = next(i for i, n in enumerate(nodes) if n["op"] == "call_function")
        nodes.insert(position, {
            "name": "sneaky", "op": "call_function", "target": {"function": "builtins.getattr"},
            "args": {"tuple": [{"node": transport}, "__class__"]}, "kwargs": {"dict": []},
        })  # fmt: skip

    with pytest.raises(DistributedError, match="reads attribute .*__class__.* only the transport's symbol_values"):
        decode_program(_edited(program, reads_class), "rank 1's load")


def _injected(tmp_path, edit) -> tuple[bytes, object]:
    """A payload whose ``edit`` tries to make fx's generated code touch a file; and that file."""
    _, program = _split(MLP(), (torch.randn(4, 16),), 2)
    marker = tmp_path / "ran"
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    return _edited(program, lambda d: edit(d, code)), marker


@pytest.mark.parametrize(
    "edit",
    [
        lambda d, code: _first_node(d, "placeholder").update(target=f"x={code}"),
        lambda d, code: _first_node(d, "placeholder").update(target="x\n"),
        lambda d, code: _first_node(d, "placeholder").update(args={"tuple": [{"node": "x"}]}),
        lambda d, code: _first_node(d, "call_function").update(kwargs={"dict": [[f"x={code}, y", 1]]}),
        lambda d, code: _first_node(d, "call_function").update(name=f"y = {code}; z"),
        lambda d, code: d["parts"][1]["graph_module"].update(class_name=f"A({code})"),
    ],
)
def test_nothing_in_a_payload_reaches_the_code_fx_generates(tmp_path, edit) -> None:
    payload, marker = _injected(tmp_path, edit)
    with pytest.raises(DistributedError, match="rank 1's load: "):
        decode_program(payload, "rank 1's load")
    assert not marker.exists()


@pytest.mark.parametrize("payload", [b"", b"\x00" * 3, struct.pack("<Q", 99) + b"{}", struct.pack("<Q", 2) + b"[]"])
def test_a_truncated_or_foreign_payload_is_a_distributed_error(payload) -> None:
    with pytest.raises(DistributedError, match="rank 1's load: .*the program is not loaded"):
        decode_program(payload, "rank 1's load")


@torch.fx.wrap
def _users_own_function(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(max=1.0) if x.sum() > 0 else x  # data-dependent: export fails, symbolic_trace keeps the call


class _CallsItsOwnFunction(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _users_own_function(torch.relu(x)) * 2


def test_a_program_calling_the_users_own_function_runs_locally_and_is_a_plan_error_across_ranks() -> None:
    example = (torch.randn(3, 5),)
    traced, program = _split(_CallsItsOwnFunction(), example, 2)
    flat = traced.flatten_inputs(example, {})
    torch.testing.assert_close(run_local(program, flat, ["cpu", "cpu"])[0], _CallsItsOwnFunction()(*example))
    with pytest.raises(PlanError, match="calls torch.relu.*trace the model with torch.export.*run_local"):
        encode_program(program)


class _EinsumAndConj(torch.nn.Module):
    """Ordinary ops a rank refused: einsum (its int[]? path read as a file's name) and conj (aten._conj, private), with
    a buffer that is a conj view (its bit is not in its storage's bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("phase", torch.randn(4, dtype=torch.complex64).conj())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attention = torch.einsum("bij,bkj->bik", x, x).softmax(-1)
        spectrum = torch.fft.fft(torch.einsum("bik,bkj->bij", attention, x))
        conj = spectrum.conj()
        return (spectrum * conj).real, conj, conj * self.phase


def test_einsum_conj_and_a_conj_buffer_load_on_a_rank_and_give_the_models_outputs() -> None:
    model, example = _EinsumAndConj(), (torch.randn(2, 3, 4),)
    traced, program = _split(model, example, 2)
    called = {str(n.target) for part in program.parts for n in part.graph_module.graph.nodes}
    assert {"aten.einsum.default", "aten._conj.default"} <= called
    with torch.no_grad():
        expected = model(*example)
    got = run_local(_round_trip(program), traced.flatten_inputs(example, {}), ["cpu", "cpu"])
    for value, want in zip(got, expected, strict=True):
        torch.testing.assert_close(value, want)


def test_a_weight_normed_model_loads_on_a_rank_in_a_checked_form_and_gives_the_models_outputs() -> None:
    """Before: ``parametrizations.weight_norm`` (wav2vec2's positional conv, HiFi-GAN) traced to aten._weight_norm,
    which a rank refuses (a g smaller than v crashed a process), so such a model ran locally but never distributed.
    It travels as [Note: operators a part calls in a checked form]: the operator's own values, its arguments checked."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        weight_norm(torch.nn.Linear(8, 16)), torch.nn.ReLU(), weight_norm(torch.nn.Conv1d(16, 4, 3), dim=1)
    )
    example = (torch.randn(16, 8),)
    traced, program = _split(model, example, 2)
    called = {str(n.target) for part in program.parts for n in part.graph_module.graph.nodes}
    assert "aten._weight_norm.default" in called
    with torch.no_grad():
        expected = model(*example)
    (got,) = run_local(_round_trip(program), traced.flatten_inputs(example, {}), ["cpu", "cpu"])
    assert torch.equal(got, expected)


def test_the_checked_weight_norm_refuses_a_g_its_kernel_would_write_past() -> None:
    from moirai.runtime.program_codec import _checked_weight_norm

    v = torch.randn(64, 8)
    with pytest.raises(ValueError, match="g has 1 values for v's 64 at dimension 0"):
        _checked_weight_norm(v, torch.ones(1, 1), 0)
    with pytest.raises(ValueError, match="g is torch.float64"):
        _checked_weight_norm(v, torch.ones(64, 1, dtype=torch.float64), 0)
    g = torch.rand(64, 1)
    assert torch.equal(_checked_weight_norm(v, g, 0), torch._weight_norm(v, g, 0))
    for v, g, dim in ((torch.ones(3, 0), torch.ones(0), 1), (torch.ones(0, 3), torch.ones(0, 1), 0)):
        with pytest.raises(ValueError, match="empty v"):  # torch's fused kernel divides by v's size at dim: SIGFPE
            _checked_weight_norm(v, g, dim)


@pytest.mark.slow
def test_einsum_and_conj_placed_off_device_0_run_distributed_with_conj_tensors_crossing() -> None:
    model, example = _EinsumAndConj().eval(), (torch.randn(2, 3, 4),)
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=example, progress=False, calibration="none")
    # Every group on device 1 but the last: the conj output and the conj operand of the last group cross devices.
    placement = [1] * (len(compiled.graph.nodes) - 1) + [0]
    compiled = compiled.with_plan(moirai.Plan(numpy.array(placement), compiled.plan.device_names))
    with torch.no_grad():
        expected, got = model(*example), compiled.run_distributed(*example, progress=False)
    for value, want in zip(got, expected, strict=True):
        torch.testing.assert_close(value, want)
