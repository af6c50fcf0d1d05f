"""Model families from configs with random weights generate across the split exactly as their own ``generate``:
Llama, Qwen2, Mistral, Gemma, Phi-3, GPT-2, Gemma2 and Gemma3 (text), greedy, 32 new tokens for two rows (one
left-padded), on 2 and 3 logical CPU devices, local and distributed, and MPT, DeepSeek-V3, Qwen3, GPT-NeoX, OPT,
Falcon and Mixtral locally; sliding windows (per kind of layer where they differ) are masked as the config says;
ALiBi from a 2D mask is refused. Hugging Face's own export wrapper over a ``StaticCache`` compiles with plain
``moirai.compile`` and runs stepwise."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import moirai
from moirai.errors import InputError
from moirai.frontend.state import mutable_buffers
from moirai.frontend.trace import TracedModel
from moirai.frontend.write_backs import IN_PLACE
from moirai.generation.step import AttentionSpan, attention_mask, check_positions, embedding_rows, layer_spans
from moirai.planning.plan import Plan

transformers = pytest.importorskip("transformers")
lm_module = importlib.import_module("moirai.generation.lm")

NEW_TOKENS = 32
PROMPT_TOKENS = 11  # over max_prefill, so prompts go in two chunks
WINDOW = 4  # under the prompt, so a sliding layer's mask differs from a full one's from the first token on
# Untied heads: with a tied head these random models mostly repeat their last token (Gemma's embedding is scaled by
# sqrt(hidden)), and the tokens would not depend on attention, masks or caches at all.
COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "eos_token_id": None,  # every row runs its 32 tokens, on both sides
}


@dataclass(frozen=True)
class Family:
    model_class: str
    make_config: Callable[[], object]
    windowed: bool = False  # the config has sliding-window layers


def _config(name: str, **options: object) -> Callable[[], object]:
    return lambda: getattr(transformers, name)(**options)


FAMILIES = {
    "llama": Family("LlamaForCausalLM", _config("LlamaConfig", **COMMON)),
    # sliding layers from layer 1 on: a full and a sliding layer, one mask each
    "qwen2": Family(
        "Qwen2ForCausalLM",
        _config("Qwen2Config", **COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        windowed=True,
    ),
    "mistral": Family("MistralForCausalLM", _config("MistralConfig", **COMMON, sliding_window=WINDOW), windowed=True),
    # head_dim 32 is not hidden / heads; the embedding is scaled by sqrt(hidden)
    "gemma": Family("GemmaForCausalLM", _config("GemmaConfig", **COMMON, head_dim=32)),
    # fused qkv and gate-up projections
    "phi3": Family(
        "Phi3ForCausalLM", _config("Phi3Config", **COMMON, sliding_window=WINDOW, pad_token_id=0), windowed=True
    ),
    # Conv1D projections, learned positions, its own attention and cache call
    "gpt2": Family(
        "GPT2LMHeadModel",
        _config(
            "GPT2Config",
            vocab_size=256,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
        ),
    ),
    # alternating sliding and full layers, attention and final soft-capping
    "gemma2": Family(
        "Gemma2ForCausalLM", _config("Gemma2Config", **COMMON, head_dim=32, sliding_window=WINDOW), windowed=True
    ),
    # a rotary embedding per kind of layer, query and key norms
    "gemma3": Family(
        "Gemma3ForCausalLM",
        _config(
            "Gemma3TextConfig",
            **COMMON,
            head_dim=32,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        windowed=True,
    ),
}


def sharpen(model: torch.nn.Module, factor: float = 6.0) -> torch.nn.Module:
    """``model`` with its query and key projections scaled by ``factor``: a random tiny model's attention is near
    uniform, so its tokens barely depend on positions (switching rope factors moved its logits by 0.004) and a
    position or rope bug would pass unseen. (Fused projections, Phi-3's qkv and GPT-2's c_attn, scale their values
    too, which changes no attention pattern; query and key norms, Gemma 3's, undo the scale.)"""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight", "c_attn.weight")):
                parameter.mul_(factor)
    return model


@functools.cache
def family_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return sharpen(getattr(transformers, FAMILIES[name].model_class)(FAMILIES[name].make_config()).eval())


_step_traces: dict[tuple[str, int, int], TracedModel] = {}


@functools.cache
def family_lm(name: str, devices: int) -> moirai.CompiledLM:
    # The step's trace does not depend on the devices and takes most of a compile (torch.export, 5-8 s): a family is
    # traced once and planned for 2 and 3 devices, as CompiledModel.with_plan reuses a trace for another plan.
    trace_step = lm_module.trace_step

    def trace_once(step: torch.nn.Module, *limits: int) -> TracedModel:
        key = (name, *limits)
        if key not in _step_traces:
            _step_traces[key] = trace_step(step, *limits)
        return _step_traces[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_module, "trace_step", trace_once)
        lm = moirai.compile_lm(
            family_model(name),
            ["cpu"] * devices,
            max_batch_size=2,
            max_seq_len=PROMPT_TOKENS + NEW_TOKENS,
            max_prefill=8,
            placer="round_robin",
            calibration="none",
            progress=False,
        )
    return dataclasses.replace(lm, compiled=lm.compiled.with_plan(layers_apart(lm, devices)))


def two_device_lm(model: torch.nn.Module) -> moirai.CompiledLM:
    """``model`` split over two logical CPU devices by round robin, for a prompt and 12 new tokens."""
    return moirai.compile_lm(
        model, ["cpu", "cpu"], max_batch_size=2, max_seq_len=PROMPT_TOKENS + 12, max_prefill=8,
        placer="round_robin", calibration="none", progress=False,
    )  # fmt: skip


def layers_apart(lm: moirai.CompiledLM, devices: int) -> Plan:
    """A contiguous split with the first layer's cache and its ops on the first device, the last layer's on the last
    and what lies between on the others: every device works and the caches of two layers are apart (a placer's plan
    for so small a model may keep them together)."""
    compiled, problem = lm.compiled, lm.compiled.problem
    order = sorted(range(problem.num_tasks), key=lambda task: problem.topological_position[task])
    rank = {task: position for position, task in enumerate(order)}
    layer_tasks: dict[int, set[int]] = {}
    for buffer in mutable_buffers(compiled.traced.graph_module):
        if "_cache_" not in buffer.name:
            continue  # the seen-token flags: with the sampler, wherever it is
        layer = int(buffer.name.rsplit("_", 1)[1])
        layer_tasks.setdefault(layer, set()).update(compiled.graph.nodes_of_fx_names(buffer.op_names))
    first_end = min(rank[task] for task in layer_tasks[min(layer_tasks)])  # its set joins it below
    last_start = min(rank[task] for task in layer_tasks[max(layer_tasks)])
    middle = np.linspace(first_end + 1, last_start, devices - 1)[1:-1] if devices > 2 else []
    placement = np.zeros(problem.num_tasks, int)
    for task, position in rank.items():
        if position <= first_end:
            placement[task] = 0
        elif position >= last_start:
            placement[task] = devices - 1
        else:
            placement[task] = 1 + int((np.asarray(middle) <= position).sum())
    for members in problem.colocated:  # a buffer's ops (its write-back among them, late in the order) on one device
        placement[list(members)] = placement[min(members, key=rank.__getitem__)]
    return Plan(placement, problem.device_names, placer="layers apart")


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows and their attention mask: 11 tokens (two prefill chunks) and 8 left-padded to 11 (one chunk)."""
    ids = torch.randint(3, 256, (2, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


@functools.cache
def reference(name: str) -> torch.Tensor:
    """The model's own greedy ``generate``: the prompt rows, then 32 new tokens each."""
    ids, mask = prompts()
    expected = family_model(name).generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )
    assert expected.shape == (2, PROMPT_TOKENS + NEW_TOKENS)
    return expected


def cache_devices(lm: moirai.CompiledLM) -> set[int]:
    """The devices that hold a KV-cache buffer (each buffer is on one, with its ops)."""
    compiled = lm.compiled
    return {
        compiled.node_device[op] for buffer in mutable_buffers(compiled.traced.graph_module) for op in buffer.op_names
    }


@pytest.mark.slow
@pytest.mark.in_process
def test_sliding_windows_change_what_the_windowed_families_generate():
    """Without this, the equality tests below could not catch a window left out of the mask."""
    for name, family in FAMILIES.items():
        if not family.windowed:
            continue
        model = family_model(name)
        config = copy.deepcopy(model.config)
        config.sliding_window = 4096
        unwindowed = type(model)(config).eval()
        unwindowed.load_state_dict(model.state_dict())
        ids, mask = prompts()
        full = unwindowed.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert not torch.equal(full, reference(name)), f"{name}: its sliding window does not change its tokens"


@pytest.mark.slow
@pytest.mark.in_process
def test_the_families_generate_more_than_a_repeated_token():
    for name in FAMILIES:
        assert len(set(reference(name)[:, PROMPT_TOKENS:].flatten().tolist())) >= 8, name


@pytest.mark.slow
@pytest.mark.in_process  # the local runner: every part in this process
@pytest.mark.filterwarnings("ignore::moirai.OversubscriptionWarning")
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_equal_the_models_generate(name, devices):
    lm = family_lm(name, devices)
    assert len(set(lm.compiled.node_device.values())) == devices, "the plan leaves a device out"
    assert len(cache_devices(lm)) >= 2, "the plan keeps every layer's cache on one device"
    ids, mask = prompts()
    tokens = lm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    assert torch.equal(tokens, reference(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_equal_the_models_generate_through_the_server(name):
    lm = family_lm(name, 2)
    ids, mask = prompts()
    with lm.server() as server:
        tokens = server.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    assert torch.equal(tokens, reference(name))


@pytest.mark.slow
@pytest.mark.in_process
def test_mpt_whose_attention_clamps_a_size_with_sym_max_generates_its_tokens_with_its_ops_dealt_across_devices():
    """MPT slices its position bias at max(0, bias length - tokens): a shape scalar every part computes itself, so
    a plan may put it and the slices that read it on different devices (round robin does; it was a PlanError)."""
    torch.manual_seed(0)
    config = transformers.MptConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
    model = transformers.MptForCausalLM(config).eval()
    lm = moirai.compile_lm(
        model,
        ["cpu", "cpu"],
        max_batch_size=2,
        max_seq_len=PROMPT_TOKENS + 12,
        max_prefill=8,
        placer="round_robin",
        calibration="none",
        progress=False,
    )
    ids, mask = prompts()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(lm.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), expected)


@pytest.mark.slow
@pytest.mark.in_process
def test_deepseek_v3_whose_attention_caches_a_latent_generates_its_tokens_with_a_cache_of_the_latents_size():
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite) caches one compressed latent and one
    rotary key per token, not keys and values per head: the cache is sized by what the layers write (it was sized by
    the config's heads, and tracing failed in the latent's projection)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, n_group=1, topk_group=1,
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    lm = two_device_lm(model)
    assert len(cache_devices(lm)) == 2, "the test needs the layers' caches apart"
    step = lm.compiled.traced.graph_module
    slots, length = 2, PROMPT_TOKENS + 12 + 1  # max_seq_len and a spare position (CacheShape.positions)
    for layer in range(2):
        assert tuple(getattr(step, f"key_cache_{layer}").shape) == (slots, 1, length, 16)  # the latent
        assert tuple(getattr(step, f"value_cache_{layer}").shape) == (slots, 1, length, 8)  # the rotary key
    assert lm.cache.total_bytes == 2 * slots * length * (16 + 8) * 4 + slots * 256  # and the seen-token flags
    ids, mask = prompts()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert len(set(expected[:, PROMPT_TOKENS:].flatten().tolist())) >= 6
    assert torch.equal(lm.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), expected)


# More families, each once, locally over two devices: what each adds to the eight above.
MORE_FAMILIES = {
    # query and key norms, a sliding layer after a full one
    "qwen3": Family("Qwen3ForCausalLM", _config("Qwen3Config", **COMMON, head_dim=16, use_sliding_window=True,
                    sliding_window=WINDOW, max_window_layers=1), windowed=True),
    # rotary over a quarter of each head, one fused query-key-value projection, parallel residual
    "gpt_neox": Family("GPTNeoXForCausalLM", _config("GPTNeoXConfig", **COMMON, rotary_pct=0.25,
                       max_position_embeddings=64)),
    # learned positions offset by two, from the attention mask's cumulative sum
    "opt": Family("OPTForCausalLM", _config("OPTConfig", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                  ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=64,
                  tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=1)),
    # grouped key-value heads in Falcon's own fused layout
    "falcon": Family("FalconForCausalLM", _config("FalconConfig", vocab_size=256, hidden_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                     tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)),
    # experts picked per token by a router
    "mixtral": Family("MixtralForCausalLM", _config("MixtralConfig", **COMMON, num_local_experts=4,
                      num_experts_per_tok=2)),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.in_process
@pytest.mark.parametrize("name", MORE_FAMILIES)
def test_more_families_generate_their_tokens_with_their_caches_apart(name):
    family = MORE_FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, family.model_class)(family.make_config()).eval()
    lm = two_device_lm(model)
    lm = dataclasses.replace(lm, compiled=lm.compiled.with_plan(layers_apart(lm, 2)))
    assert len(cache_devices(lm)) == 2
    ids, mask = prompts()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert len(set(expected[:, PROMPT_TOKENS:].flatten().tolist())) >= 6
    assert torch.equal(lm.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), expected)


class _NoCacheLM(torch.nn.Module):
    """A causal LM by its signature whose forward never writes to the cache it is given."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, num_attention_heads=2)
        self.embed = torch.nn.Embedding(16, 8)
        self.fail = fail

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None, use_cache=None):
        if self.fail:
            raise RuntimeError("this model's attention wants a 2D mask")
        return (self.embed(input_ids) @ self.embed.weight.T,)


def test_the_token_ids_a_model_takes_are_its_input_embeddings_rows_whatever_module_holds_them():
    class ScaledEmbedding(torch.nn.Module):  # not a torch.nn.Embedding: a weight of rows, as many models' own
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(10, 4))

    model = _NoCacheLM()
    assert embedding_rows(model) is None
    model.get_input_embeddings = lambda: torch.nn.Embedding(12, 4)
    assert embedding_rows(model) == 12
    model.get_input_embeddings = ScaledEmbedding
    assert embedding_rows(model) == 10


def test_a_model_that_writes_nothing_to_its_cache_or_cannot_run_a_token_is_refused_saying_what_it_was_given():
    with pytest.raises(InputError, match="_NoCacheLM ran a token without writing to the cache it was given"):
        moirai.compile_lm(_NoCacheLM().eval(), ["cpu"], progress=False, calibration="none")
    failed = r"_NoCacheLM did not run one token .*RuntimeError: this model's"
    with pytest.raises(moirai.TraceError, match=failed) as cpu:
        moirai.compile_lm(_NoCacheLM(fail=True).eval(), ["cpu"], progress=False, calibration="none")
    assert "meta" not in str(cpu.value)
    # On meta the likelier cause is an op's meta kernel (a mixture of experts' grouped matrix product): said first.
    with torch.device("meta"):
        on_meta = _NoCacheLM(fail=True).eval()
    with pytest.raises(moirai.TraceError, match=r"this model's .*\(on the meta device, .*weights on the CPU"):
        moirai.compile_lm(on_meta, ["cpu"], progress=False, calibration="none")


def test_alibi_from_a_2d_mask_is_refused_saying_why():
    falcon = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    falcon.alibi = True
    with pytest.raises(InputError, match=r"FalconForCausalLM computes its config's ALiBi position biases \(alibi"):
        moirai.compile_lm(transformers.FalconForCausalLM(falcon).eval(), ["cpu"], progress=False, calibration="none")
    # Bloom's config has no alibi field: it always computes its biases so (it failed in a probe, a ValueError first)
    bloom = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)
    with pytest.raises(InputError, match="BloomForCausalLM computes Bloom's ALiBi position biases from a 2D"):
        moirai.compile_lm(transformers.BloomForCausalLM(bloom).eval(), ["cpu"], progress=False, calibration="none")


LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0] * 8,
    "long_factor": [1.0 + 3 * i for i in range(8)],
    "original_max_position_embeddings": 16,
}


@pytest.mark.slow
@pytest.mark.in_process
def test_longrope_is_refused_past_its_original_length_and_generates_its_tokens_within_it():
    """Longrope (Phi-3-mini-128k, Phi-3.5) switches every position to its long factors once a forward passes
    original_max_position_embeddings, and Hugging Face re-encodes the whole sequence then: chunked prefill and batched
    decode rows gave other tokens, silently. Within it only the short factors are used, on both sides."""
    config = transformers.Phi3Config(
        **COMMON, pad_token_id=0, max_position_embeddings=64, original_max_position_embeddings=16, rope_scaling=LONGROPE
    )
    torch.manual_seed(0)
    model = sharpen(transformers.Phi3ForCausalLM(config).eval())
    with pytest.raises(InputError, match=r"longrope .* Give max_seq_len <= 16 \(got 17\)"):
        moirai.compile_lm(model, ["cpu"], max_seq_len=17, max_prefill=8, progress=False, calibration="none")
    lm = moirai.compile_lm(
        model, ["cpu", "cpu"], max_batch_size=2, max_seq_len=16, max_prefill=4, placer="round_robin",
        calibration="none", progress=False,
    )  # fmt: skip
    ids, mask = prompts()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(lm.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0), expected)


def test_a_max_seq_len_past_a_tabled_position_limit_is_refused_naming_it_and_rope_has_no_limit():
    gpt2 = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16)
    with pytest.raises(InputError, match=r"positions 0 to 15 only \(n_positions=16.*give max_seq_len <= 16"):
        moirai.compile_lm(
            transformers.GPT2LMHeadModel(gpt2).eval(), ["cpu"], max_seq_len=17, progress=False, calibration="none"
        )
    check_positions("OPT", transformers.OPTConfig(max_position_embeddings=16), 16)
    with pytest.raises(InputError, match="max_position_embeddings=16"):
        check_positions("OPT", transformers.OPTConfig(max_position_embeddings=16), 17)
    with pytest.raises(InputError, match="max_seq_len=16"):
        check_positions("MPT", transformers.MptConfig(max_seq_len=16), 17)
    check_positions("Llama", transformers.LlamaConfig(**COMMON, max_position_embeddings=16), 4096)
    gemma3 = transformers.Gemma3TextConfig(**COMMON, max_position_embeddings=16)
    check_positions("Gemma3", gemma3, 4096)
    # transformers 4's Phi-3 configs call longrope "su" (a config as a checkpoint of then holds it).
    old_phi3 = types.SimpleNamespace(rope_scaling={"type": "su", "original_max_position_embeddings": 16})
    check_positions("Phi3", old_phi3, 16)
    with pytest.raises(InputError, match="longrope .* max_seq_len <= 16"):
        check_positions("Phi3", old_phi3, 17)


def test_dynamic_rope_is_refused_saying_why_and_what_gives_the_same_tokens():
    config = transformers.LlamaConfig(
        **COMMON, max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    )
    with pytest.raises(InputError, match=r"'dynamic' rotary .* static rope type .* max_seq_len <= 16 .* 'default'"):
        moirai.compile_lm(
            transformers.LlamaForCausalLM(config).eval(), ["cpu"], max_seq_len=16, progress=False, calibration="none"
        )


def test_a_sliding_window_mask_keeps_the_last_window_positions_and_a_chunked_one_its_chunk():
    positions = torch.tensor([[0, 5, 9]])
    seen = attention_mask(positions, 12, torch.float32, AttentionSpan(window=4))[0, 0] == 0
    assert [row.nonzero().flatten().tolist() for row in seen] == [[0], [2, 3, 4, 5], [6, 7, 8, 9]]
    assert (attention_mask(positions, 12, torch.float32)[0, 0, 2] == 0).sum() == 10
    seen = attention_mask(positions, 12, torch.float32, AttentionSpan(chunk=4))[0, 0] == 0
    assert [row.nonzero().flatten().tolist() for row in seen] == [[0], [4, 5], [8, 9]]


def test_layer_spans_follow_the_config():
    assert layer_spans(transformers.LlamaConfig(**COMMON)) == {"full_attention": AttentionSpan()}
    mistral = transformers.MistralConfig(**COMMON, sliding_window=7)
    assert layer_spans(mistral) == {"sliding_attention": AttentionSpan(window=7)}
    gemma2 = transformers.Gemma2Config(**COMMON, sliding_window=7)
    assert layer_spans(gemma2) == {"full_attention": AttentionSpan(), "sliding_attention": AttentionSpan(window=7)}
    chunked = transformers.LlamaConfig(**COMMON)
    chunked.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(InputError, match="chunked_attention layers and no attention_chunk_size"):
        layer_spans(chunked)
    chunked.attention_chunk_size = 8
    assert layer_spans(chunked) == {"chunked_attention": AttentionSpan(chunk=8), "full_attention": AttentionSpan()}
    hybrid = transformers.LlamaConfig(**COMMON)
    hybrid.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(InputError, match="linear_attention layers keep a recurrent or convolution state"):
        layer_spans(hybrid)
    bidirectional = transformers.Gemma3TextConfig(**COMMON, use_bidirectional_attention=True)
    with pytest.raises(InputError, match="bidirectional"):
        layer_spans(bidirectional)


@pytest.mark.slow
@pytest.mark.in_process
@pytest.mark.filterwarnings("ignore::moirai.OversubscriptionWarning")
def test_llama_4_whose_chunked_layers_see_their_own_chunk_generates_its_tokens():
    """Llama 4's text model: chunked attention layers (a chunk of 4 under the 11-token prompt), layers without
    rotary embeddings, a mixture of experts."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        **COMMON, head_dim=16, num_local_experts=2, intermediate_size_mlp=128, attention_chunk_size=4
    )
    model = transformers.Llama4ForCausalLM(config).eval()
    assert "chunked_attention" in config.layer_types
    lm = two_device_lm(model)
    assert len(cache_devices(lm)) == 2, "the test needs the layers' caches apart"
    ids, mask = prompts()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        unchunked_model = transformers.Llama4ForCausalLM(copy.deepcopy(config)).eval()
        unchunked_model.config.attention_chunk_size = 4096
        unchunked_model.load_state_dict(model.state_dict())
        unchunked = unchunked_model.generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert not torch.equal(expected, unchunked), "the chunks change no token"
    assert torch.equal(lm.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), expected)


@pytest.mark.slow
@pytest.mark.in_process
@pytest.mark.filterwarnings("ignore::moirai.OversubscriptionWarning")
def test_gemma_4_whose_last_layers_reuse_earlier_layers_keys_and_values_generates_its_tokens():
    """Gemma 4's text model: its last two layers attend over the keys and values of the last earlier layer of their
    kind (no cache of their own), full layers of a wider head, a mixture of experts beside each MLP, and a
    per-layer input embedding."""
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=32,
    )  # fmt: skip
    model = transformers.Gemma4ForCausalLM(config).eval()
    lm = two_device_lm(model)
    assert [layer.layer for layer in lm.cache.layers] == [0, 1], "the reusing layers would have caches"
    assert len(cache_devices(lm)) == 2, "the test needs the layers' caches apart"
    ids, mask = prompts()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(lm.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), expected)


def test_hugging_faces_static_cache_export_wrapper_splits_and_runs_stepwise():
    executorch = pytest.importorskip("transformers.integrations.executorch")
    model = family_model("llama")
    generation_config = model.generation_config
    model.generation_config = copy.deepcopy(generation_config)
    model.generation_config.cache_implementation = "static"  # the wrapper asks for it
    try:
        wrapper = executorch.TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=32)
        own = executorch.TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=32)
    finally:
        model.generation_config = generation_config
    example = {"input_ids": torch.tensor([[1]]), "cache_position": torch.tensor([0])}
    compiled = moirai.compile(
        wrapper, ["cpu", "cpu"], example_kwargs=example, placer="round_robin", calibration="none", progress=False
    )
    assert len(set(compiled.node_device.values())) == 2
    buffers = [b for b in mutable_buffers(compiled.traced.graph_module) if "cache" in b.name]
    assert len(buffers) == 2 * 2, [b.name for b in buffers]  # keys and values of two layers: the cache is state
    for buffer in buffers:
        assert len({compiled.node_device[op] for op in buffer.op_names}) == 1, buffer.name
    # Each cache written in place, not copied whole and copied back ([Note: writes put back in place]).
    graph = compiled.traced.graph_module.graph
    out_of_place = [n.name for n in graph.nodes if n.target in IN_PLACE and "cache" in str(n.args[0])]
    assert not out_of_place, out_of_place
    token = torch.tensor([[5]])
    with torch.no_grad():
        for position in range(12):
            inputs = {"input_ids": token, "cache_position": torch.tensor([position])}
            expected, logits = own(**inputs), compiled(**inputs)
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
            token = expected[:, -1:].argmax(-1)
            assert torch.equal(logits[:, -1:].argmax(-1), token)
