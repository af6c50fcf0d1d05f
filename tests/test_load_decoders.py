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
