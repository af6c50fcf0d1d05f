"""compile -> save -> load round-trips for models whose ops have several outputs (rotary decoders among them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import moirai
from moirai.frontend.graph import build_op_graph


class ChunkGate(torch.nn.Module):
    """A multi-output op (chunk) unpacked by getitem: one OpGraph node standing for three fx names."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.up(x).chunk(2, dim=-1)
        return self.down(value * gate.relu())


def _tiny_decoder(family: str, seed: int) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, num_key_value_heads=2),
        "mistral": lambda: transformers.MistralConfig(**common, num_key_value_heads=2),
        "qwen2": lambda: transformers.Qwen2Config(**common, num_key_value_heads=2),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**common, rotary_pct=0.5),
        "phi3": lambda: transformers.Phi3Config(**common, num_key_value_heads=2, pad_token_id=0),
    }
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(configs[family]()).eval()


def _chunk_gate(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ChunkGate().eval()


def _round_trip(build: Callable[[int], torch.nn.Module], example_inputs: tuple, example_kwargs: dict, tmp_path) -> None:
    """Plan on one instance, load the plan onto a fresh one (other weights), and compare with it."""
    compiled = moirai.compile(build(0), ["cpu", "cpu"], example_inputs, example_kwargs, placer="heft")
    path = tmp_path / "plan.json"
    compiled.save(path)
    model = build(1)
    loaded = moirai.load(path, model, example_inputs, example_kwargs)
    assert loaded.node_device == compiled.node_device
    assert [node.fx_names for node in loaded.graph.nodes] == [node.fx_names for node in compiled.graph.nodes]
    with torch.no_grad():
        torch.testing.assert_close(loaded(*example_inputs, **example_kwargs), model(*example_inputs, **example_kwargs))


def test_load_groups_a_multi_output_op_with_its_getitems_once(tmp_path) -> None:
    traced = moirai.trace(_chunk_gate(0), (torch.randn(2, 8),))
    op_nodes = build_op_graph(traced).nodes
    assert any(len(node.fx_names) > 1 for node in op_nodes), "the model must have an op unpacked by getitem"
    _round_trip(_chunk_gate, (torch.randn(2, 8),), {}, tmp_path)


# Which of these families unpack a multi-output op (the rotary halves by chunk) depends on the transformers
# release: in 5.24 GPT-NeoX and Phi-3 still do, Llama, Mistral and Qwen2 slice instead. The cause is covered by
# the test above; these check that load round-trips each family whichever way it is written.


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt_neox", "phi3"])
def test_rotary_decoder_plan_loads_and_matches_the_model(family: str, tmp_path) -> None:
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    _round_trip(
        lambda seed: _tiny_decoder(family, seed), (tokens,), {"use_cache": False, "return_dict": False}, tmp_path
    )


def _tiny_gpt2(device: str = "cpu") -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.GPT2LMHeadModel(config).eval()


def _contiguous_ops(compiled: moirai.CompiledModel) -> list[str]:
    return [name for name in compiled.node_device if name.startswith("contiguous")]


def test_a_plan_made_on_meta_weights_loads_with_the_real_ones(tmp_path) -> None:
    """The meta trace has a `contiguous` after attention that the real one does not (other strides of the meta
    attention kernel): load drops it, and the real model's outputs come out equal."""
    kwargs = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)), "use_cache": False}
    planned = moirai.compile(_tiny_gpt2("meta"), ["cpu", "cpu"], (), kwargs, placer="round_robin", calibration="none")
    assert _contiguous_ops(planned), "the meta trace must have the layout op the real one lacks"
    path = tmp_path / "plan.json"
    planned.save(path)
    model = _tiny_gpt2()
    loaded = moirai.load(path, model, (), kwargs)
    assert not _contiguous_ops(loaded)
    assert loaded.plan.placement.tolist() == planned.plan.placement.tolist()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**kwargs).logits, model(**kwargs).logits, rtol=0, atol=0)


def test_a_layout_op_the_plan_lacks_goes_with_the_op_it_copies(tmp_path) -> None:
    """The other way round: a plan made on the real weights, loaded on meta ones, places each `contiguous` with the
    op it copies, in the same group and just after it in that device's order."""
    kwargs = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)), "use_cache": False}
    planned = moirai.compile(_tiny_gpt2(), ["cpu", "cpu"], (), kwargs, placer="round_robin", calibration="none")
    path = tmp_path / "plan.json"
    planned.save(path)
    loaded = moirai.load(path, _tiny_gpt2("meta"), (), kwargs)
    nodes = {node.name: node for node in loaded.traced.graph_module.graph.nodes}
    assert _contiguous_ops(loaded), "the meta trace must have the layout op the plan lacks"
    for name in _contiguous_ops(loaded):
        producer = nodes[name].all_input_nodes[0].name
        assert loaded.node_device[name] == loaded.node_device[producer]
        order = loaded.device_order[loaded.node_device[name]]
        assert order.index(name) == order.index(producer) + 1
        assert any({name, producer} <= set(node.fx_names) for node in loaded.graph.nodes)
