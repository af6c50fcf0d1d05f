"""Generation across the split: tokens equal the model's own generate, caches stay with their ops, sequences in
flight through a server each equal their lone run, and what a user can get wrong is a moirai error."""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import os
import queue
import re
import signal
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
import torch
from models_for_tests import TINY_LLAMA_VOCAB, tiny_llama

import moirai
import moirai.generation.requests
from moirai.frontend.state import mutable_buffers
from moirai.generation.engine import SamplingParams, done_future
from moirai.generation.server import GenerationServer
from moirai.generation.step import ban_tokens, penalize_repetitions, sample_tokens
from moirai.planning.objective import Generation
from moirai.planning.plan import Plan
from moirai.planning.simulate import simulate
from tests.test_serving import close_in_a_done_callback

transformers = pytest.importorskip("transformers")

VOCAB = TINY_LLAMA_VOCAB


def compile_tiny(model: torch.nn.Module, devices=("cpu", "cpu"), **options) -> moirai.CompiledLM:
    settings = {"max_batch_size": 4, "max_seq_len": 64, "max_prefill": 8, "placer": "round_robin"}
    settings.update(options)
    devices = devices if isinstance(devices, moirai.Cluster) else list(devices)
    return moirai.compile_lm(model, devices, calibration="none", progress=False, **settings)


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def split_lm(llama: torch.nn.Module) -> moirai.CompiledLM:
    lm = compile_tiny(llama)
    assert len(set(lm.compiled.plan.placement.tolist())) == 2, "the test needs a plan on both devices"
    return lm


def hf_new_tokens(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        return model.generate(prompt[None], max_new_tokens=max_new_tokens, do_sample=False)[0, len(prompt) :].tolist()


def test_greedy_tokens_equal_the_models_generate_with_prompts_longer_than_a_prefill_chunk(llama, split_lm):
    prompt = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(1))  # 19 > max_prefill = 8
    with torch.no_grad():
        expected = llama.generate(prompt, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(split_lm.generate(prompt, max_new_tokens=24), expected)


def test_left_padded_rows_generate_as_their_unpadded_prompts(llama, split_lm):
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    padded = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        padded[row, 9 - len(prompt) :], mask[row, 9 - len(prompt) :] = prompt, 1
    output = split_lm.generate(padded, max_new_tokens=10, attention_mask=mask)
    assert torch.equal(output[:, :9], padded)
    for row, prompt in enumerate(prompts):
        assert output[row, 9:].tolist() == hf_new_tokens(llama, prompt, 10)


def test_a_row_that_ends_is_padded_and_the_others_go_on(split_lm):
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    free_run = split_lm.generate(prompt, max_new_tokens=8)[:, 6:].tolist()
    eos = free_run[0][2]  # the first row's third new token ends it

    def up_to_eos(tokens: list[int]) -> list[int]:
        return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens

    rows = [up_to_eos(tokens) for tokens in free_run]
    longest = max(len(row) for row in rows)
    output = split_lm.generate(prompt, max_new_tokens=8, eos_token_id=eos, pad_token_id=-1)
    assert output[:, 6:].tolist() == [row + [-1] * (longest - len(row)) for row in rows]


def test_a_sampled_run_with_a_seed_is_reproducible_and_another_seed_differs(split_lm):
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    options = {"max_new_tokens": 16, "do_sample": True, "temperature": 1.5, "top_k": 0, "top_p": 1.0}
    first = split_lm.generate(prompt, seed=11, **options)
    assert torch.equal(first, split_lm.generate(prompt, seed=11, **options))
    assert not torch.equal(first, split_lm.generate(prompt, seed=12, **options))
    # min_p 1 keeps only the likeliest token: the greedy one, whatever the seed
    assert torch.equal(
        split_lm.generate(prompt, seed=11, min_p=1.0, **options), split_lm.generate(prompt, max_new_tokens=16)
    )
    # num_return_sequences: each row's sequences one after another, as model.generate expands its batch
    rows = torch.cat([prompt, prompt.flip(1)])
    several = split_lm.generate(rows, seed=11, num_return_sequences=3, **options)
    assert torch.equal(several, split_lm.generate(rows.repeat_interleave(3, dim=0), seed=11, **options))
    assert torch.equal(several[:3, :7], prompt.expand(3, -1)) and len({tuple(r) for r in several.tolist()}) == 6
    with pytest.raises(moirai.InputError, match="num_return_sequences=2 without sampling"):
        split_lm.generate(prompt, max_new_tokens=2, num_return_sequences=2)


def test_a_sampled_run_without_a_seed_follows_torch_manual_seed_as_hugging_faces_does(split_lm):
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    options = {"max_new_tokens": 16, "do_sample": True, "temperature": 1.5, "top_k": 0, "top_p": 1.0}
    torch.manual_seed(5)
    first, second = split_lm.generate(prompt, **options), split_lm.generate(prompt, **options)
    assert not torch.equal(first, second)  # each call draws its own seed from the global generator
    torch.manual_seed(5)
    assert torch.equal(first, split_lm.generate(prompt, **options))
    assert torch.equal(second, split_lm.generate(prompt, **options))
    torch.manual_seed(5)
    greedy = split_lm.generate(prompt, max_new_tokens=4)
    assert torch.equal(first, split_lm.generate(prompt, **options))  # greedy draws nothing from it
    assert greedy.shape == (2, 11)


def _sorted_sampler(logits: torch.Tensor, rows: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The sampler as written over a sort of the whole vocabulary: the reference for the candidates' one."""
    temperature, top_k, top_p, uniform = rows.unbind(dim=-1)
    sorted_logits, order = (logits / temperature.unsqueeze(-1)).sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1]).unsqueeze(0)
    keep = (top_k.unsqueeze(-1) <= 0) | (rank < top_k.unsqueeze(-1))
    probabilities = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    keep = keep & ((probabilities.cumsum(dim=-1) - probabilities) < top_p.unsqueeze(-1))
    keep = keep & (probabilities >= min_p.unsqueeze(-1) * probabilities[:, :1])
    cdf = probabilities.masked_fill(~keep, 0.0).cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (uniform.unsqueeze(-1) * cdf[:, -1:]).contiguous(), right=True)
    return order.gather(-1, pick.clamp_max(logits.shape[-1] - 1)).squeeze(-1)


def test_the_sampler_cuts_among_its_candidates_exactly_as_over_the_sorted_vocabulary():
    """[Note: sampling among candidates]: with a top_k within the candidates, or a top_p or min_p cut the
    candidates hold, every uniform draws the token a sort of all 5,000 logits draws."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 5000, generator=generator) * 2.5  # the 1,024 likeliest hold 0.95 of the mass
    uniforms = torch.rand(400, generator=generator)
    settings = [(1.0, 50, 1.0, 0.0), (0.7, 20, 0.8, 0.0), (1.3, 1024, 0.95, 0.05), (1.0, 0, 0.9, 0.0),
                (0.8, 0, 1.0, 0.02), (1.0, 6000, 0.5, 0.0)]  # fmt: skip
    for temperature, top_k, top_p, min_p in settings:
        rows = torch.tensor([[temperature, top_k, top_p, 0.0]]).repeat(len(uniforms), 1)
        rows[:, 3] = uniforms
        minimum = torch.full((len(uniforms),), min_p)
        expected = _sorted_sampler(logits.expand(len(uniforms), -1), rows, minimum)
        drawn = sample_tokens(logits.expand(len(uniforms), -1), rows, min_p=minimum)
        assert torch.equal(drawn, expected), (temperature, top_k, top_p, min_p)
        assert len(set(drawn.tolist())) > 3


@pytest.mark.parametrize("probabilities", [[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5]])
def test_top_p_drops_a_token_whose_predecessors_already_reach_it_as_hugging_face_does(probabilities):
    """Probabilities exact in binary: the likeliest token alone reaches top_p 0.5, so the next one, whose
    predecessors' mass equals top_p exactly, is cut, as transformers' TopPLogitsWarper cuts it."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.tensor([probabilities]).log()
    assert torch.softmax(logits, dim=-1).tolist() == [probabilities]
    hugging_face = TopPLogitsWarper(0.5)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    kept = set(torch.isfinite(hugging_face[0]).nonzero().flatten().tolist())
    assert kept == {probabilities.index(0.5)}
    grid = torch.linspace(0.0, 0.999, 1000)
    rows = torch.stack([torch.ones_like(grid), torch.zeros_like(grid), torch.full_like(grid, 0.5), grid], 1)
    assert set(sample_tokens(logits.expand(len(grid), -1), rows).tolist()) == kept


def test_the_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones_as_hugging_face_does():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -2.0, 1.0]])
    penalized = penalize_repetitions(logits, torch.tensor([[True, True, False]]), torch.tensor([2.0]))
    assert penalized.tolist() == [[1.0, -4.0, 1.0]]
    hugging_face = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0, 1, 0]]), logits.clone())
    assert torch.equal(penalized, hugging_face)


def test_sampling_follows_temperature_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]])
    greedy = torch.tensor([[0.0, 0.0, 1.0, 0.5]])
    assert sample_tokens(logits, greedy).item() == 4
    grid = torch.linspace(0.0, 0.999, 1000)

    def drawn(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
        rows = torch.stack(
            [torch.full_like(grid, temperature), torch.full_like(grid, top_k), torch.full_like(grid, top_p), grid], 1
        )
        tokens = sample_tokens(logits.expand(len(grid), -1), rows, min_p=torch.full_like(grid, min_p))
        return np.bincount(tokens.numpy(), minlength=5) / len(grid)

    # Inverting the CDF at evenly spread uniforms draws each token in proportion to its probability.
    np.testing.assert_allclose(drawn(1.0, 0, 1.0), torch.softmax(logits[0], 0).numpy(), atol=2e-3)
    np.testing.assert_allclose(drawn(2.0, 0, 1.0), torch.softmax(logits[0] / 2, 0).numpy(), atol=2e-3)
    top2 = drawn(1.0, 2, 1.0)
    assert set(np.flatnonzero(top2)) == {0, 4}
    assert top2[4] == pytest.approx(np.exp(3) / (np.exp(3) + np.exp(2)), abs=2e-3)
    # top_p 0.5: token 4 alone has 0.63 of the mass, so it is the smallest set reaching 0.5.
    assert set(np.flatnonzero(drawn(1.0, 0, 0.5))) == {4}
    # top_p 0: the likeliest token alone, as Hugging Face keeps min_tokens_to_keep = 1 (nothing was kept, and every
    # draw fell past the last candidate).
    assert set(np.flatnonzero(drawn(1.0, 0, 0.0))) == set(np.flatnonzero(drawn(1.5, 3, 0.0, min_p=0.5))) == {4}
    # min_p 0.3: tokens at least 0.3 as likely as token 4 (e^3): token 0 (e^2 = 0.37 of it) stays, token 1 goes.
    assert np.array_equal(drawn(1.0, 0, 1.0, min_p=0.3), top2)


def test_a_repetition_penalty_gives_the_models_tokens_and_a_slot_used_before_starts_afresh(llama, split_lm):
    """Left-padded rows, as transformers 5 counts them (its pads are not in the penalty); twice, so that the second
    call's sequences take slots whose flags the first one's set."""
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(20 + n)) for n in (9, 5)]
    padded = torch.zeros(2, 9, dtype=torch.long)
    padded[0], padded[1, 4:] = prompts[0], prompts[1]
    options = {"attention_mask": (padded != 0).long() | torch.tensor([[1], [0]]), "max_new_tokens": 16}
    for penalty in (1.3, 0.8):
        with torch.no_grad():
            expected = llama.generate(padded, do_sample=False, repetition_penalty=penalty, **options)
        assert not torch.equal(expected, split_lm.generate(padded, **options)), "the penalty changes no token"
        for _ in range(2):
            assert torch.equal(split_lm.generate(padded, repetition_penalty=penalty, **options), expected)


def test_the_settings_that_ban_tokens_give_the_models_tokens(llama, split_lm):
    """[Note: banned tokens]: each setting on left-padded rows, whose padding Hugging Face reads as part of the
    row (its n-grams, min_length's count)."""
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(20 + n)) for n in (9, 5)]
    padded = torch.zeros(2, 9, dtype=torch.long)
    padded[0], padded[1, 4:] = prompts[0], prompts[1]
    options = {"attention_mask": (padded != 0).long() | torch.tensor([[1], [0]]), "max_new_tokens": 16}
    plain = split_lm.generate(padded, **options)
    new = plain[:, 9:].tolist()
    end = new[0][3]  # an end token row 0 takes as its 4th
    cases = [
        {"no_repeat_ngram_size": 1},
        {"no_repeat_ngram_size": 2},
        {"bad_words_ids": [[new[0][1]], [new[1][2], new[1][3]]]},  # one token, and a word of two
        {"suppress_tokens": torch.tensor([new[0][0], new[1][4]])},  # a tensor of ids, as Hugging Face takes it
        {"begin_suppress_tokens": [new[0][0], new[1][0]]},
        {"min_new_tokens": 8, "eos_token_id": end},
        {"min_length": 14, "eos_token_id": end},  # 9 (the padded width) + 5
        {"min_new_tokens": 0, "min_length": 30, "eos_token_id": end},  # min_new_tokens stands before min_length
    ]
    for case in cases:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Hugging Face's on min_new_tokens and min_length both set
            expected = llama.generate(padded, do_sample=False, **options, **case)
        if "eos_token_id" not in case or "min_new_tokens" in case and case["min_new_tokens"] > 0:
            assert not torch.equal(expected, plain), f"{case} bans no token the rows take"
        assert torch.equal(split_lm.generate(padded, **options, **case), expected), case


def test_a_banned_token_is_minus_infinity_and_a_tie_with_the_top_kth_is_kept():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    banned = ban_tokens(logits, torch.tensor([[0, 3, -1, -1], [-1, -1, -1, -1]]))
    assert banned[0, [0, 3]].tolist() == [float("-inf")] * 2
    kept = torch.ones(2, 10, dtype=torch.bool)
    kept[0, [0, 3]] = False
    assert torch.equal(banned[kept], logits[kept])
    tied = torch.tensor([[5.0, 1.0, 5.0, 5.0, 0.0]]).expand(8, -1)
    rows = torch.tensor([[1.0, 1, 1.0, u / 8] for u in range(8)])  # top_k 1: Hugging Face keeps the three 5s
    assert set(sample_tokens(tied, rows).tolist()) == {0, 2, 3}


def test_each_cache_buffer_stays_on_the_device_of_the_ops_that_write_and_read_it(split_lm):
    compiled = split_lm.compiled
    buffers = mutable_buffers(compiled.traced.graph_module)
    assert len(buffers) == 2 * 2 + 1  # keys and values of two layers, and the seen-token flags
    for buffer in buffers:
        assert len({compiled.node_device[name] for name in buffer.op_names}) == 1, buffer
        holders = [part.device for part in compiled.program.parts if buffer.name in part.attribute_names]
        assert len(holders) == 1, f"{buffer.name} is held by parts {holders}"


def test_the_cache_counts_in_the_memory_of_the_devices_that_hold_it(split_lm):
    cache = split_lm.cache
    problem = split_lm.compiled.problem
    timeline = simulate(problem, split_lm.compiled.plan)
    # 2 layers' keys and values, 4 slots x (64 tokens and a spare position) x 2 heads x 16 dims of 4 bytes; a seen
    # flag a token a slot
    assert cache.total_bytes == 2 * 2 * 4 * 65 * 2 * 16 * 4 + 4 * VOCAB
    weights = sum(p.numel() * p.element_size() for p in split_lm.compiled.traced.graph_module.parameters())
    assert timeline.memory_bytes.sum() >= weights + cache.total_bytes


def test_devices_too_small_for_the_cache_split_it_or_say_what_does_not_fit(llama, split_lm):
    lm = split_lm  # compile_tiny(llama), read only
    cache_bytes = lm.cache.total_bytes
    cluster = moirai.Cluster.from_devices(["cpu", "cpu"])
    tight = lm.compiled.problem.memory_capacity_bytes  # what the plan's devices hold after the activation reserve
    assert np.all(tight > cache_bytes)
    weights = lm.compiled.graph.total_param_bytes - cache_bytes
    reserve = cluster.devices[0].memory_bytes - tight[0]
    # Room for a bit over half the model on each device: the plan must split the layers (and their caches).
    half = dataclasses.replace(
        cluster,
        devices=[
            dataclasses.replace(d, memory_bytes=reserve + 0.65 * (weights + cache_bytes)) for d in cluster.devices
        ],
    )
    split = moirai.compile_lm(
        llama, half, max_batch_size=4, max_seq_len=64, max_prefill=8, placer="heft", progress=False
    )
    assert simulate(split.compiled.problem, split.compiled.plan).fits_memory
    assert len(set(split.compiled.plan.placement.tolist())) == 2
    too_small = dataclasses.replace(
        cluster,
        devices=[dataclasses.replace(d, memory_bytes=reserve + 0.3 * (weights + cache_bytes)) for d in cluster.devices],
    )
    with pytest.raises(moirai.InfeasibleError, match=r"KV cache .* per sequence x 4 slots"):
        moirai.compile_lm(
            llama, too_small, max_batch_size=4, max_seq_len=64, max_prefill=8, placer="heft", progress=False
        )


def test_the_generation_objective_adds_ttft_to_new_tokens_times_tpot(split_lm):
    compiled, objective = split_lm.compiled, split_lm.objective
    decode = simulate(compiled.problem, compiled.plan)
    order = decode.execution_sequences
    prefill = simulate(split_lm.prefill_problem, Plan(compiled.plan.placement, compiled.plan.device_names, order=order))
    one = Generation(split_lm.prefill_problem, new_tokens=10, sequences=1)
    assert one.value_s(decode) == pytest.approx(prefill.makespan_s + 10 * decode.makespan_s)
    assert prefill.makespan_s > decode.makespan_s  # a prompt of 8 tokens costs more than one token
    two = Generation(split_lm.prefill_problem, new_tokens=10, sequences=2)
    assert two.value_s(decode) == pytest.approx(max(decode.period_s, decode.makespan_s / 2))
    assert not Generation(split_lm.prefill_problem, 10, 1, max_ttft_s=prefill.makespan_s / 2).acceptable(decode)
    assert objective.sequences == 1


def test_generation_settings_model_generate_applies_and_moirai_does_not_are_named_in_a_warning(llama):
    model = copy.deepcopy(llama)
    model.generation_config.typical_p = 0.9
    model.generation_config.num_beams = 4
    options = {"max_seq_len": 32, "max_prefill": 8, "placer": "heft", "progress": False, "calibration": "none"}
    with pytest.warns(moirai.MoiraiWarning, match=r"sets typical_p=0.9, num_beams=4, which model.generate"):
        moirai.compile_lm(model, ["cpu"], **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own FutureWarning from the step's decomposition among them
        model.generation_config.typical_p, model.generation_config.num_beams = 1.0, 1  # neutral: silent
        model.generation_config.repetition_penalty = 1.3  # applied: silent
        model.generation_config.no_repeat_ngram_size = 3
        moirai.compile_lm(model, ["cpu"], **options)


def test_arguments_left_out_are_the_generation_configs_as_model_generate_takes_them(llama):
    model = copy.deepcopy(llama)
    model.generation_config.update(
        do_sample=True, temperature=0.7, top_k=5, max_new_tokens=7, repetition_penalty=0.5, min_p=0.9
    )
    options = {"max_seq_len": 32, "max_prefill": 8, "placer": "heft", "progress": False, "calibration": "none"}
    lm = moirai.compile_lm(model, ["cpu"], **options)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(1)
    implied = lm.generate(prompt)
    torch.manual_seed(1)
    explicit = {"do_sample": True, "temperature": 0.7, "top_k": 5, "max_new_tokens": 7, "min_p": 0.9}
    assert torch.equal(implied, lm.generate(prompt, **explicit))
    torch.manual_seed(1)
    assert not torch.equal(implied, lm.generate(prompt, **{**explicit, "min_p": 0.0}))
    assert not torch.equal(
        lm.generate(prompt, do_sample=False), lm.generate(prompt, do_sample=False, repetition_penalty=1.0)
    )
    assert implied.shape == (1, 6 + 7)
    greedy = lm.generate(prompt, do_sample=False)  # an argument given overrides the config
    with torch.no_grad():
        assert torch.equal(greedy, model.generate(prompt, do_sample=False, attention_mask=torch.ones_like(prompt)))


def test_a_call_that_leaves_out_max_new_tokens_gets_as_many_tokens_as_model_generate_gives(llama, split_lm):
    """max_new_tokens, else max_length counting the prompt (the call's, else the generation_config's), else 20 new
    tokens capped at max_position_embeddings in all: as the installed transformers' generate counts them."""
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    model = copy.deepcopy(llama)

    def hf(**options):
        with torch.no_grad():
            return model.generate(prompt, do_sample=False, attention_mask=torch.ones_like(prompt), **options)

    ours_lm = dataclasses.replace(split_lm, model=weakref.ref(model))  # reads model's configs, as compile_lm's does

    def ours(**options):
        return ours_lm.generate(prompt, **options)

    for options in ({}, {"max_length": 10}, {"max_length": 10, "max_new_tokens": 3}):
        expected = hf(**options)
        assert torch.equal(ours(**options), expected), options
    assert ours().shape[1] == 6 + 20 and ours(max_length=10).shape[1] == 10
    model.generation_config.max_length = 9  # a checkpoint's generation_config may set it: prompt and new together
    assert torch.equal(ours(), hf()) and hf().shape[1] == 9
    model.generation_config.max_length = None
    model.config.max_position_embeddings = 16  # caps the default 20 new tokens
    assert torch.equal(ours(), hf()) and hf().shape[1] == 16
    with pytest.raises(ValueError, match="Input length of input_ids is 6, but `max_length` is set to 6"):
        hf(max_length=6)
    with pytest.raises(moirai.InputError, match=r"prompt's 6 tokens reach max_length=6, .* give a max_length over 6"):
        ours(max_length=6)


def test_a_cancelled_or_abandoned_sequence_stops_generating_on_the_server(split_lm):
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    with pytest.raises(KeyboardInterrupt), split_lm.server() as server:
        assert len(server.submit(prompt, max_length=9).result()) == 3  # max_length counts the prompt there too
        tokens, submitted, may_cancel = [], [], threading.Event()

        def on_token(token: int) -> None:  # the caller gives up after two tokens
            tokens.append(token)
            may_cancel.wait(60)
            if len(tokens) == 2:
                submitted[0].cancel()

        submitted.append(server.submit(prompt, max_new_tokens=50, on_token=on_token))
        may_cancel.set()
        streamed = []
        real_submit = server.submit
        server.submit = lambda *args, **kwargs: streamed.append(real_submit(*args, **kwargs)) or streamed[-1]
        stream = server.stream(prompt, max_new_tokens=50)
        next(stream)
        stream.close()  # a client that leaves
        deadline = time.monotonic() + 60
        while server.unfinished:  # a bound on a hang, not a timing
            assert time.monotonic() < deadline, "a cancelled sequence kept its slot"
            time.sleep(0.01)
        assert submitted[0].cancelled() and tokens == split_lm.generate(prompt[None], max_new_tokens=2)[0, 6:].tolist()
        assert streamed[0].cancelled()
        left = [real_submit(prompt, max_new_tokens=50) for _ in range(6)]  # 4 slots: two wait
        raise KeyboardInterrupt  # the caller stops: the block's exit cancels rather than generating all 300 tokens
    assert all(future.cancelled() for future in left)


class _StepsInThisProcess:
    """A step server that runs every step in the calling thread: a GenerationServer without ranks."""

    worlds = None  # no ranks to restart

    def __init__(self, lm: moirai.CompiledLM) -> None:
        self.lm = lm

    def submit_flat(self, inputs):
        return done_future(lambda: self.lm.compiled(*inputs))

    def close(self) -> None:
        pass


def test_a_server_whose_loop_fails_fails_its_sequences_and_refuses_later_ones(split_lm, monkeypatch):
    """A loop that died left later submits waiting for ever (a seed of 2**64 killed it)."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    with GenerationServer(split_lm, _StepsInThisProcess(split_lm), depth=2) as server:
        assert server.submit(prompt, max_new_tokens=3).result(timeout=60) == hf_like(split_lm, prompt, 3)
        with pytest.raises(moirai.InputError, match=r"one sequence's token ids, got shape \(2, 6\)"):
            server.submit(torch.stack([prompt, prompt]), max_new_tokens=3)
        with pytest.raises(moirai.InputError, match="seed must be between 0 and"):
            server.submit(prompt, max_new_tokens=3, do_sample=True, seed=2**64)

        def broken(*args):  # a fault injected into the loop
            raise RuntimeError("injected")

        # A step that cannot be built fails its own sequences, and the server serves on (a top_k of 10**400 was
        # an OverflowError there that ended the loop, failing every user's sequence with it).
        with monkeypatch.context() as patched:
            patched.setattr(server._engine, "_inputs", broken)
            with pytest.raises(moirai.RequestError, match=r"could not start \(RuntimeError\('injected'\)\)"):
                server.submit(prompt, max_new_tokens=3).result(timeout=60)
        assert server.submit(prompt, max_new_tokens=3).result(timeout=60) == hf_like(split_lm, prompt, 3)
        assert server.submit(prompt, max_new_tokens=3, do_sample=True, top_k=10**400, seed=1).result(timeout=60)

        monkeypatch.setattr(server._engine, "_next_step", broken)  # the loop itself fails
        with pytest.raises(moirai.RequestError, match=r"loop failed \(RuntimeError\('injected'\)\)") as failed:
            server.submit(prompt, max_new_tokens=3).result(timeout=60)
        assert isinstance(failed.value.__cause__, RuntimeError)
        with pytest.raises(moirai.RequestError, match=r"loop failed \(RuntimeError\('injected'\)\).*lm.server\(\)"):
            server.submit(prompt, max_new_tokens=3)
        with pytest.raises(moirai.RequestError, match="loop failed"):  # generate waited for ever there
            server.generate(prompt[None], max_new_tokens=3)


def test_generate_calls_from_several_threads_and_beside_a_server_each_get_their_own_tokens(llama, split_lm):
    """[Note: one user of the caches at a time] Every engine handed out cache slots from 0 of the one step program's
    caches: two threads' generate calls, or a generate beside an open server, wrote each other's caches and got
    wrong tokens, silently."""
    prompts = torch.randint(0, VOCAB, (2, 2, 20), generator=torch.Generator().manual_seed(21))
    expected = [split_lm.generate(rows, max_new_tokens=16) for rows in prompts]
    with torch.no_grad():
        assert torch.equal(expected[0], llama.generate(prompts[0], max_new_tokens=16, do_sample=False))
    results: dict[int, torch.Tensor] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, split_lm.generate(prompts[i], max_new_tokens=16)))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(torch.equal(results[i], expected[i]) for i in range(2))

    with split_lm.server() as server:
        futures = [server.submit(row, max_new_tokens=16) for row in prompts[0]]
        assert torch.equal(split_lm.generate(prompts[1], max_new_tokens=16), expected[1])  # through the server
        assert [f.result(timeout=120) for f in futures] == expected[0][:, 20:].tolist()
        with pytest.raises(moirai.UsageError, match="has a server open already"):
            split_lm.server()
    assert torch.equal(split_lm.generate(prompts[1], max_new_tokens=16), expected[1])  # the caches are free again
    with pytest.raises(moirai.MoiraiError, match="max_in_flight"):  # 0 read as "the default" here alone
        split_lm.server(max_in_flight=0)
    assert torch.equal(split_lm.generate(prompts[1], max_new_tokens=16), expected[1])  # a failed open gave it back


class _SlowStepsInThisProcess(_StepsInThisProcess):
    """Steps of ``step_s`` at least (20 ms: 20 tokens are in flight for 0.4 s, longer than a test needs to act)."""

    step_s = 0.02

    def submit_flat(self, inputs):
        time.sleep(self.step_s)
        return super().submit_flat(inputs)


def test_a_stream_and_a_generate_cut_short_by_a_cancelling_close_say_so(split_lm):
    """Each raised concurrent.futures' bare CancelledError."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    steps = _SlowStepsInThisProcess(split_lm)
    steps.step_s = 0.1  # 50 tokens take 5 s: the close below comes long before, however busy the machine
    server = GenerationServer(split_lm, steps, depth=2)
    stream = server.stream(prompt, max_new_tokens=50)
    next(stream)
    rows: list[BaseException] = []
    generating = threading.Thread(
        target=lambda: rows.append(pytest.raises(moirai.RequestError, server.generate, prompt[None], max_new_tokens=50))
    )
    generating.start()
    deadline = time.monotonic() + 60
    while server.unfinished < 2:  # a bound on a hang, not a timing
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.close(cancel=True)
    generating.join(60)
    with pytest.raises(moirai.RequestError, match="cancelled before it ended: its server was closed with cancel=True"):
        list(stream)
    assert "cancelled before it ended" in str(rows[0].value)


def test_done_callbacks_may_submit_and_are_told_not_to_close(split_lm):
    """A sequence's done callbacks run in the server's loop: one that submits gets its tokens, one that closes the
    server gets a UsageError (the join of its own thread was a RuntimeError), and the server closes after."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    follow_ups = queue.SimpleQueue()

    with GenerationServer(split_lm, _StepsInThisProcess(split_lm), depth=2) as server:
        server.submit(prompt, max_new_tokens=2).add_done_callback(
            lambda _: follow_ups.put(server.submit(prompt, max_new_tokens=3))
        )
        assert follow_ups.get(timeout=60).result(timeout=60) == hf_like(split_lm, prompt, 3)
        error = close_in_a_done_callback(server, lambda: server.submit(prompt, max_new_tokens=2))
        assert "close the server from your own thread" in str(error)
        assert server.submit(prompt, max_new_tokens=3).result(timeout=60) == hf_like(split_lm, prompt, 3)
    with pytest.raises(moirai.InputError, match="this generation server is closed"):
        server.generate(prompt[None], max_new_tokens=2)  # waited for ever: nothing serves it after close
    with pytest.raises(moirai.InputError, match="this generation server is closed"):
        server.submit(prompt, max_new_tokens=2)
    with pytest.raises(moirai.InputError, match="this generation server is closed"), server:
        pass  # entered again: said at the with, not at the block's first submit


def test_a_callback_that_streams_or_generates_is_told_to_call_from_its_own_thread(split_lm, monkeypatch):
    """A stream read in on_token waited for ever, in the server's thread, for tokens only that thread makes: the
    server hung, and a plain close with it."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    expected = hf_like(split_lm, prompt, 3)
    monkeypatch.setattr(split_lm.compiled, "server", lambda **options: _StepsInThisProcess(split_lm))
    server = split_lm.server()
    try:  # a failure below closes with cancel=True, which ends a callback stuck in the stream it reads
        made_here = server.stream(prompt, max_new_tokens=2)
        callbacks = [
            ("stream", lambda _: list(server.stream(prompt, max_new_tokens=2))),
            ("stream", lambda _: next(made_here)),  # a stream made elsewhere, read in the callback
            ("generate", lambda _: server.generate(prompt[None], max_new_tokens=2)),
            ("generate", lambda _: split_lm.generate(prompt[None], max_new_tokens=2)),  # through the server
        ]
        for call, on_token in callbacks:
            with pytest.raises(moirai.UsageError, match=f"{call} .*from a callback of a sequence.*your own thread"):
                server.submit(prompt, max_new_tokens=3, on_token=on_token).result(timeout=60)

        def wait_for_another(_: int) -> None:  # hung the server: only its thread makes that sequence's tokens
            server.submit(prompt, max_new_tokens=2).result()

        with pytest.raises(moirai.UsageError, match=r"future\.result\(\) of a request not yet served .*own thread"):
            server.submit(prompt, max_new_tokens=3, on_token=wait_for_another).result(timeout=60)
        assert server.submit(prompt, max_new_tokens=3).result(timeout=60) == expected
    finally:
        server.close(cancel=True)


class _StepsClosedOnce(_SlowStepsInThisProcess):
    """Slow steps whose server's close is cut short by a Ctrl-C the first time it stops them."""

    def __init__(self, lm: moirai.CompiledLM) -> None:
        super().__init__(lm)
        self.closes = 0

    def close(self) -> None:
        self.closes += 1
        if self.closes == 1:
            raise KeyboardInterrupt


def test_a_close_cut_short_by_ctrl_c_is_finished_by_the_next(split_lm, monkeypatch):
    """The next close returned at once and left the loop's thread, the ranks and the caches' turn held for good
    (lm.server() was a UsageError)."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    expected = hf_like(split_lm, prompt, 20)
    steps = _StepsClosedOnce(split_lm)
    monkeypatch.setattr(split_lm.compiled, "server", lambda **options: steps)
    server = split_lm.server()
    future = server.submit(prompt, max_new_tokens=20)  # 20 steps of 20 ms at least: in flight at close
    loop = server._serving._thread

    def interrupted_join(timeout: float | None = None) -> None:
        del loop.join  # the next close joins the loop
        raise KeyboardInterrupt  # as Ctrl-C in close while it waits for the sequences

    loop.join = interrupted_join
    with pytest.raises(KeyboardInterrupt):
        server.close()
    with pytest.raises(KeyboardInterrupt):
        server.close()  # waits for the sequence, then Ctrl-C while it stops the ranks
    server.close()
    assert not loop.is_alive() and steps.closes == 2 and future.result() == expected
    split_lm.server().close()  # the caches' turn was given back


class _TurnWaits(threading.Condition):
    """A CompiledLM's caches' turn that notes each thread that waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiters: set[threading.Thread] = set()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiters.add(threading.current_thread())
        return super().wait(timeout)


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class _StepsClosedWhenLetGo(_StepsInThisProcess):
    """Steps whose server's close, once begun, waits for the test to let it go on."""

    def __init__(self, lm: moirai.CompiledLM) -> None:
        super().__init__(lm)
        self.closing, self.let_go = threading.Event(), threading.Event()

    def close(self) -> None:
        self.closing.set()
        assert self.let_go.wait(60)


def _in_a_thread(results: dict, name: str, call) -> threading.Thread:
    def run() -> None:
        try:
            results[name] = call()
        except BaseException as error:
            results[name] = error

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def test_a_generate_or_a_server_that_meets_a_closing_server_waits_for_its_close(split_lm, monkeypatch):
    """[Note: one user of the caches at a time] lm.generate that met a server closing raised "this generation server
    is closed" (the user never called that server), and lm.server() then was a UsageError."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    expected = split_lm.generate(prompt[None], max_new_tokens=3)
    turn, steps, chosen = _TurnWaits(), _StepsClosedWhenLetGo(split_lm), threading.Event()
    monkeypatch.setattr(split_lm, "_turn", turn, raising=False)
    monkeypatch.setattr(split_lm.compiled, "server", lambda **options: steps)
    server = split_lm.server()

    def chosen_then_closed(call: str) -> None:  # a generate chose the server; its close begins before the rows go in
        chosen.set()
        assert steps.closing.wait(60)

    monkeypatch.setattr(server._serving, "check_outside_loop", chosen_then_closed)
    results: dict[str, object] = {}
    threads = [_in_a_thread(results, "chose it", lambda: split_lm.generate(prompt[None], max_new_tokens=3))]
    try:
        assert chosen.wait(60)
        closing = threading.Thread(target=server.close)
        closing.start()
        assert steps.closing.wait(60)  # the ranks are stopping: the server holds the caches still
        threads.append(_in_a_thread(results, "came after", lambda: split_lm.generate(prompt[None], max_new_tokens=3)))
        threads.append(_in_a_thread(results, "opens", split_lm.server))
        _until(lambda: set(threads) <= turn.waiters, "each waits for the close")
    finally:
        steps.let_go.set()
    for thread in [*threads, closing]:
        thread.join(60)
    assert torch.equal(results["chose it"], expected) and torch.equal(results["came after"], expected)
    assert isinstance(results["opens"], GenerationServer)
    results["opens"].close()


def test_a_generate_during_a_servers_opening_runs_through_it_and_a_second_server_is_a_usage_error(
    split_lm, monkeypatch
):
    """[Note: one user of the caches at a time] A generate waited for the caches' turn while a server opened, then
    for the server's whole life; a second lm.server() then waited for the first to close and opened."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    expected = split_lm.generate(prompt[None], max_new_tokens=3)
    turn, opening, let_open = _TurnWaits(), threading.Event(), threading.Event()
    monkeypatch.setattr(split_lm, "_turn", turn, raising=False)

    def slow_to_open(**options):
        opening.set()
        assert let_open.wait(60)
        return _StepsInThisProcess(split_lm)

    monkeypatch.setattr(split_lm.compiled, "server", slow_to_open)
    results: dict[str, object] = {}
    opener = _in_a_thread(results, "opened", split_lm.server)
    try:
        assert opening.wait(60)
        second = _in_a_thread(results, "second", split_lm.server)
        second.join(60)
        assert isinstance(results.get("second"), moirai.UsageError), results.get("second")
        assert "has a server open already" in str(results["second"])
        generating = _in_a_thread(results, "generated", lambda: split_lm.generate(prompt[None], max_new_tokens=3))
        _until(lambda: generating in turn.waiters, "the generate waits for the server to open")
    finally:
        let_open.set()
    opener.join(60)
    server = results["opened"]
    try:
        generating.join(60)  # while the server is open, holding the caches: it ran through the server
        assert torch.equal(results["generated"], expected)
    finally:
        server.close()


class _StepsClosedOnceAtATime(_StepsClosedWhenLetGo):
    """As the step server's close: one called while another runs returns at once."""

    def __init__(self, lm: moirai.CompiledLM) -> None:
        super().__init__(lm)
        self.closed = threading.Event()

    def close(self) -> None:
        if not self.closing.is_set():
            super().close()
            self.closed.set()


class _NotedLock:
    """A lock that notes each thread that comes to take it."""

    def __init__(self) -> None:
        self.lock, self.takers = threading.Lock(), set()

    def __enter__(self) -> None:
        self.takers.add(threading.current_thread())
        self.lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.lock.release()


def test_a_close_called_while_another_runs_returns_once_the_server_has_closed(split_lm, monkeypatch):
    """The second returned before the ranks had stopped and gave the caches back while they still stopped."""
    steps, closing = _StepsClosedOnceAtATime(split_lm), _NotedLock()
    monkeypatch.setattr(split_lm.compiled, "server", lambda **options: steps)
    server = split_lm.server()
    monkeypatch.setattr(server._serving, "_closing", closing, raising=False)
    at_return: dict[str, object] = {}
    first = threading.Thread(target=server.close)
    first.start()
    try:
        assert steps.closing.wait(60)  # the first close stops the ranks

        def close_again() -> tuple[bool, object]:
            server.close()
            return steps.closed.is_set(), split_lm._open_server

        second = _in_a_thread(at_return, "second", close_again)
        _until(lambda: second in closing.takers or not second.is_alive(), "the second close runs")
    finally:
        steps.let_go.set()
    for thread in (first, second):
        thread.join(60)
    assert at_return["second"] == (True, None)  # the ranks had stopped, and only then were the caches given back
    split_lm.server().close()


class _StepsThatSayClosed(_StepsInThisProcess):
    def __init__(self, lm: moirai.CompiledLM) -> None:
        super().__init__(lm)
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_a_server_dropped_unclosed_is_closed_with_a_resource_warning(split_lm, monkeypatch):
    """The loop's thread and the LM held it: it was never collected, its ranks and threads ran on, and every later
    lm.server() was a UsageError."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    expected = hf_like(split_lm, prompt, 3)
    steps = _StepsThatSayClosed(split_lm)
    monkeypatch.setattr(split_lm.compiled, "server", lambda **options: steps)
    server = split_lm.server()
    future = server.submit(prompt, max_new_tokens=3)
    with pytest.warns(ResourceWarning, match=r"dropped without close\(\).*with lm.server\(\) as server"):
        del server
        gc.collect()
    assert steps.closed.wait(60) and future.result(timeout=60) == expected  # its sequence finished first
    deadline = time.monotonic() + 60  # a bound on a hang: the close's thread gives the caches back after
    while split_lm._open_server is not None:
        assert time.monotonic() < deadline, "the dropped server's close did not give the caches back"
        time.sleep(0.01)
    split_lm.server().close()


def test_a_callback_that_raises_fails_its_own_sequence_alone_even_with_system_exit(split_lm, caplog):
    """A SystemExit from on_token ended the loop (every sequence failed, and every later submit), and one from a done
    callback left concurrent.futures' set_result and did the same; on_token=5 was a TypeError in the loop."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    expected = hf_like(split_lm, prompt, 5)
    callback_added = threading.Event()
    with GenerationServer(split_lm, _StepsInThisProcess(split_lm), depth=2) as server:
        with pytest.raises(moirai.InputError, match="on_token must be a function called with each new token"):
            server.submit(prompt, max_new_tokens=5, on_token=5)
        exits = server.submit(prompt, max_new_tokens=5, on_token=lambda _: sys.exit("on_token's exit"))
        others = [server.submit(prompt, max_new_tokens=5, on_token=lambda _: callback_added.wait(60))]
        others[0].add_done_callback(lambda _: sys.exit("a done callback's exit"))
        callback_added.set()
        others.append(server.submit(prompt, max_new_tokens=5))
        with pytest.raises(moirai.RequestError, match="on_token callback raised SystemExit") as failed:
            exits.result(timeout=60)
        assert isinstance(failed.value.__cause__, SystemExit)
        assert [future.result(timeout=60) for future in others] == [expected, expected]
        assert server.submit(prompt, max_new_tokens=5).result(timeout=60) == expected
    assert "exception calling callback" in caplog.text and "a done callback's exit" in caplog.text


def test_a_keyboard_interrupt_from_a_callback_fails_its_own_sequence_alone_in_the_servers_thread(split_lm, caplog):
    """[Note: whose KeyboardInterrupt] One from an on_token, a done callback or a streamer in the server's thread (no
    Ctrl-C reaches it) ended the loop: every sequence failed with it, and every later submit was refused. Where the
    loop runs in the caller's thread (a local generate), it stops the call, as the user's Ctrl-C must."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    expected = hf_like(split_lm, prompt, 5)
    callback_added = threading.Event()

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    class InterruptingStreamer:
        def put(self, value: torch.Tensor) -> None:
            if value.dim() == 1:  # a token, not the prompt
                interrupt()

        def end(self) -> None:
            pass

    with GenerationServer(split_lm, _StepsInThisProcess(split_lm), depth=2) as server:
        interrupted = server.submit(prompt, max_new_tokens=5, on_token=interrupt)
        others = [server.submit(prompt, max_new_tokens=5, on_token=lambda _: callback_added.wait(60))]
        others[0].add_done_callback(interrupt)
        callback_added.set()
        others.append(server.submit(prompt, max_new_tokens=5))
        with pytest.raises(moirai.RequestError, match="on_token callback raised KeyboardInterrupt") as failed:
            interrupted.result(timeout=60)
        assert isinstance(failed.value.__cause__, KeyboardInterrupt)
        assert [future.result(timeout=60) for future in others] == [expected, expected]
        with pytest.raises(moirai.RequestError, match="on_token callback raised KeyboardInterrupt"):
            server.generate(prompt[None], max_new_tokens=5, streamer=InterruptingStreamer())
        assert server.submit(prompt, max_new_tokens=5).result(timeout=60) == expected
    assert "exception calling callback" in caplog.text and "KeyboardInterrupt" in caplog.text
    with pytest.raises(KeyboardInterrupt):
        split_lm.generate(prompt[None], max_new_tokens=5, streamer=InterruptingStreamer())
    assert split_lm.generate(prompt[None], max_new_tokens=5)[0, 6:].tolist() == expected


def hf_like(lm: moirai.CompiledLM, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    return lm.generate(prompt[None], max_new_tokens=new_tokens)[0, len(prompt) :].tolist()


def test_a_streamer_and_a_generation_config_are_taken_as_model_generate_takes_them(llama, split_lm):
    class Collect(transformers.generation.streamers.BaseStreamer):
        def __init__(self) -> None:
            self.puts, self.ended = [], False

        def put(self, value: torch.Tensor) -> None:
            self.puts.append(value.tolist())

        def end(self) -> None:
            self.ended = True

    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(6))
    theirs, ours = Collect(), Collect()
    with torch.no_grad():
        expected = llama.generate(prompt, max_new_tokens=6, do_sample=False, streamer=theirs)
    assert torch.equal(split_lm.generate(prompt, max_new_tokens=6, streamer=ours), expected)
    assert ours.puts == theirs.puts and ours.ended and theirs.ended  # the prompt, then one token at a time
    with pytest.raises(moirai.InputError, match="a streamer takes the tokens of one row"):
        split_lm.generate(prompt.repeat(2, 1), max_new_tokens=2, streamer=Collect())
    config = transformers.GenerationConfig(max_new_tokens=4, do_sample=True, top_k=3)
    torch.manual_seed(5)
    implied = split_lm.generate(prompt, generation_config=config)
    torch.manual_seed(5)
    assert torch.equal(implied, split_lm.generate(prompt, max_new_tokens=4, do_sample=True, top_k=3))
    assert torch.equal(split_lm.generate(prompt, generation_config=config, do_sample=False), llama.generate(
        prompt, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(prompt)))  # fmt: skip
    penalized = transformers.GenerationConfig(max_new_tokens=8, repetition_penalty=0.5)
    with torch.no_grad():
        expected = llama.generate(prompt, generation_config=penalized, attention_mask=torch.ones_like(prompt))
    assert torch.equal(split_lm.generate(prompt, generation_config=penalized), expected)
    with pytest.raises(moirai.InputError, match=r"typical_p=0.5, which model.generate applies and moirai"):
        split_lm.generate(prompt, generation_config=transformers.GenerationConfig(typical_p=0.5))
    with pytest.raises(moirai.InputError, match=r"does not take num_beams, output_scores; num_beams would change"):
        split_lm.generate(prompt, num_beams=2, output_scores=True)
    assert split_lm.generate(prompt, max_new_tokens=2, num_beams=1, typical_p=1.0).shape == (1, 7)  # neutral
    # Hugging Face's output object, and arguments of what it returns that ask for nothing beside the tokens
    as_output = {"max_new_tokens": 3, "return_dict_in_generate": True, "use_cache": True, "output_scores": False}
    with torch.no_grad():
        theirs = llama.generate(prompt, do_sample=False, attention_mask=torch.ones_like(prompt), **as_output)
    ours = split_lm.generate(prompt, **as_output)
    assert type(ours) is type(theirs) and torch.equal(ours.sequences, theirs.sequences)
    returned = transformers.GenerationConfig(max_new_tokens=3, return_dict_in_generate=True)
    assert torch.equal(split_lm.generate(prompt, generation_config=returned).sequences, theirs.sequences)
    tensor = split_lm.generate(prompt, generation_config=returned, return_dict_in_generate=False)  # the call's first
    assert isinstance(tensor, torch.Tensor)
    scored = transformers.GenerationConfig(max_new_tokens=3, return_dict_in_generate=True, output_scores=True)
    with pytest.raises(moirai.InputError, match="sets output_scores=True: moirai's generate returns the tokens alone"):
        split_lm.generate(prompt, generation_config=scored)
    # None is unset; greedy search reads no sampling setting (a config's top_k of 50.0 among them), as model.generate
    neutral = {"tokenizer": None, "stop_strings": None, "top_k": 50.0, "temperature": "unread", "max_new_tokens": 3}
    assert torch.equal(split_lm.generate(prompt, **neutral), theirs.sequences)
    ngrams = transformers.GenerationConfig(max_new_tokens=10, no_repeat_ngram_size=1)
    with torch.no_grad():
        expected = llama.generate(prompt, generation_config=ngrams, attention_mask=torch.ones_like(prompt))
    assert torch.equal(split_lm.generate(prompt, generation_config=ngrams), expected)
    with pytest.raises(moirai.InputError, match="generation_config must be a transformers.GenerationConfig, got dict"):
        split_lm.generate(prompt, generation_config={"max_new_tokens": 2})


class _Transformers4Config:
    """A generation config as transformers 4 makes one: every field has a value, max_length 20 among them."""

    def __init__(self, **given: object) -> None:
        self.max_length, self.max_new_tokens, self.do_sample = 20, None, False
        self.temperature, self.top_k, self.top_p = 1.0, 50, 1.0
        self.__dict__.update(given)


def test_a_generation_configs_own_defaults_are_not_settings_as_transformers_4_tells_them_apart():
    model_config = transformers.LlamaConfig(max_position_embeddings=40)
    defaults = moirai.generation.requests.GenerationDefaults.of(_Transformers4Config(do_sample=True), model_config)
    assert defaults.do_sample and defaults.max_length is None  # 20 is the class's own: 20 new tokens, not 20 in all
    assert defaults.new_tokens(None, None, 25) == 15  # 20 new, at most max_position_embeddings = 40 in all
    assert defaults.new_tokens(None, None, 5) == 20
    passed = defaults.overridden_by(_Transformers4Config(max_new_tokens=5))  # its do_sample=False is a default
    assert passed.do_sample and passed.new_tokens(None, None, 25) == 5
    assert defaults.overridden_by(_Transformers4Config(max_length=30)).new_tokens(None, None, 25) == 5


def test_a_meta_model_plans_generation_for_a_cluster_it_is_not_on():
    """Planning a model too large to load (its weights on meta) for a cluster elsewhere: the step traces (a mask
    built with torch.tensor was a constant export wrote, a TraceError), the plan counts each device's cache."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    cluster = moirai.Cluster.preset("moirai-inter-server")
    lm = moirai.compile_lm(
        model, cluster, max_batch_size=2, max_seq_len=64, max_prefill=8, placer="heft", progress=False
    )
    prediction = lm.prediction()
    assert 0 < prediction.tpot_s < prediction.ttft_s * 10 and prediction.tokens_per_s > 0
    assert lm.cache.slots == 2 and lm.cache.max_seq_len == 64
    # Its devices are cuda:0 on four servers: named before anything starts. A server here would run every host's
    # part on this machine (torchrun on those hosts runs it); generate runs the parts in this process.
    with pytest.raises(moirai.InputError, match=r"devices are on hosts server-a, server-b, server-c, server-d: run"):
        lm.server()
    if not torch.cuda.is_available():
        with pytest.raises(moirai.ClusterError, match=r"device 'A' of the plan runs on cuda:0, but this machine"):
            lm.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)


def test_a_ttft_limit_no_plan_meets_is_named_by_milp_and_a_heuristic_that_misses_it_warns(split_lm):
    problem = split_lm.compiled.problem
    impossible = Generation(split_lm.prefill_problem, new_tokens=10, sequences=2, max_ttft_s=1e-12)
    with pytest.raises(moirai.InfeasibleError, match=r"fits memory and meets max_ttft_s=1e-12 s; raise the limit"):
        moirai.place(problem, "milp", objective=impossible, time_limit_s=2)
    with pytest.warns(moirai.MoiraiWarning, match=r"'heft' plan does not meet max_ttft_s=1e-12 s"):
        plan = moirai.place(problem, "heft", objective=impossible)
    assert plan.report.notes["over_the_limit"] == "max_ttft_s=1e-12 s"


def test_a_kv_cache_this_process_cannot_allocate_is_an_input_error_with_its_size(llama, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")  # as the kernel refuses a map

    monkeypatch.setattr(moirai.generation.step, "zeros_on_demand", out_of_memory)
    with pytest.raises(moirai.InputError, match=r"KV cache of 4 slots of 4096 tokens takes .* could not allocate"):
        moirai.compile_lm(llama, ["cpu"], max_batch_size=4, max_seq_len=4096, progress=False, calibration="none")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_the_calling_process_commits_no_kv_cache_memory_until_sequences_write_it(llama):
    before = _resident_bytes()
    # 1 GiB of keys and values: 16 slots of 131,071 positions and a spare one
    step = moirai.generation.step.CausalLMStep(llama, slots=16, max_seq_len=131071)
    cache_bytes = step.cache_shape.total_bytes
    assert cache_bytes == 2**30 + 16 * VOCAB  # and a seen flag a token a slot
    keys, values = step.cache_buffers(0)
    assert not keys.any() and not values.any()  # zeros, read without committing them
    assert _resident_bytes() - before < cache_bytes // 8
    keys[3, :, :100] = 1.0  # written pages are this process's own, as any tensor's
    assert keys[3, 0, 99, 0].item() == 1.0 and not keys[2].any()


def test_a_generation_plans_summary_counts_decode_steps_not_requests(split_lm):
    """Its plan line said "91.7 req/s" where the next line called the same number tokens/s."""
    caption = split_lm.summary_table().caption
    one_sequence_s = split_lm.prediction().tpot_s  # the plan's objective: one sequence, a step per token
    assert f", {moirai.viz.format_rate(1 / one_sequence_s)} decode steps/s" in caption.splitlines()[0], caption
    assert "req/s" not in caption, caption


def test_a_generation_plans_summary_shows_each_devices_memory_as_its_capacity(llama):
    """The decode problem reserves the activation peak at a step of decode_batch sequences of one token; the summary
    added back the peak of the graph traced at 2 sequences of 3 tokens, so the capacity shown was no device's."""
    local = moirai.Cluster.from_devices(["cpu", "cpu"])
    small = tuple(dataclasses.replace(d, memory_bytes=5e6) for d in local.devices)  # 115 kB apart shows in 5 MB
    cluster = dataclasses.replace(local, devices=small)
    lm = compile_tiny(llama, devices=cluster, max_batch_size=8, sequences=8)
    shown = [moirai.viz.format_bytes_compact(d.memory_bytes) for d in small]
    column = next(c for c in lm.summary_table().columns if c.header == "memory / capacity")
    assert [str(cell).split(" / ")[1] for cell in column._cells] == shown


def test_a_compiled_lm_prints_as_one_short_line(split_lm):
    text = repr(split_lm)
    assert "\n" not in text and len(text) < 300 and text.startswith("<CompiledLM of LlamaForCausalLM: "), text


def test_max_prefill_left_out_fits_a_max_seq_len_under_64(llama):
    """A max_seq_len of 32 alone was refused: "max_prefill=64 is over max_seq_len=32", a value nobody gave."""
    lm = moirai.compile_lm(llama, ["cpu"], max_batch_size=1, max_seq_len=32, progress=False, calibration="none")
    assert lm.max_prefill == 32
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(2))
    assert lm.generate(prompt[None], max_new_tokens=4)[0, 20:].tolist() == hf_new_tokens(llama, prompt, 4)
    assert compile_tiny(llama, ["cpu"], max_prefill=None, max_seq_len=128).max_prefill == 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_sequence_generated_alone_in_half_precision_gives_the_models_tokens(dtype):
    # A step attended over the whole slot, whose masked positions rounded otherwise than Hugging Face's growing
    # cache: in bfloat16 2 of these 6 prompts parted from the model's tokens ([Note: the context a step attends
    # over]). A sequence alone attends over exactly its own positions now, as the model's cache does.
    model = tiny_llama().to(dtype)
    lm = compile_tiny(model, max_seq_len=128, max_prefill=16)
    for seed in range(6):
        prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(seed))
        assert lm.generate(prompt[None], max_new_tokens=32)[0, 20:].tolist() == hf_new_tokens(model, prompt, 32), seed


def test_a_max_seq_len_too_short_for_a_dynamic_context_attends_over_whole_slots_and_gives_the_models_tokens(llama):
    # The context is traced at a size unlike the batch's (2), the tokens' (3) and the bans' (4): max_seq_len 4
    # leaves none, so it is static and every step attends over whole slots ([Note: the context a step attends over]).
    lm = compile_tiny(llama, ["cpu", "cpu"], max_seq_len=4, max_prefill=3)
    assert "context" not in {dim.name for dim in lm.compiled.traced.dynamic_dims}
    longer = compile_tiny(llama, ["cpu"], max_seq_len=5, max_prefill=3)
    assert "context" in {dim.name for dim in longer.compiled.traced.dynamic_dims}
    prompt = torch.randint(0, VOCAB, (3,), generator=torch.Generator().manual_seed(4))
    assert lm.generate(prompt[None], max_new_tokens=1)[0, 3:].tolist() == hf_new_tokens(llama, prompt, 1)


def test_compile_lm_names_each_phase_on_its_progress_lines(llama, capfd):
    """It printed "op graph" three times and "cost" twice, the phase unnamed."""
    moirai.compile_lm(llama, ["cpu", "cpu"], max_seq_len=32, placer="heft", calibration="none")
    stages = re.findall(r"^moirai: ([^:]+?) \S+ \S+$", capfd.readouterr().err, re.MULTILINE)
    assert stages == ["trace", "op graph", "coarsen", "cost (prefill)", "cost (decode)", "place", "split"], stages


def test_a_misspelt_generate_argument_offers_the_one_meant(split_lm):
    """generate listed what it takes, but unlike a placer's options named none as the one meant."""
    prompt = torch.tensor([[3, 4]])
    with pytest.raises(moirai.InputError, match=r"does not take max_new_token \(did you mean 'max_new_tokens'\?\)"):
        split_lm.generate(prompt, max_new_token=3)
    with pytest.raises(moirai.InputError, match=r"does not take num_beams; num_beams would change"):
        split_lm.generate(prompt, num_beams=2)  # model.generate's own argument, not a misspelling
    with split_lm.server() as server:  # refused before any worker starts
        misspelt = r"does not take max_new_token \(did you mean 'max_new_tokens'"
        with pytest.raises(moirai.InputError, match=misspelt) as e:
            server.submit(prompt[0], max_new_token=3)
        assert "max_new_tokens, do_sample, temperature, top_k, top_p" in str(e.value)  # what it takes, each named


def test_what_a_user_can_get_wrong_is_a_moirai_error(split_lm, llama):
    with pytest.raises(moirai.InputError, match="over max_seq_len=64"):
        split_lm.generate(torch.zeros(1, 60, dtype=torch.long), max_new_tokens=10)
    with pytest.raises(moirai.InputError, match="token ids"):
        split_lm.generate(torch.zeros(1, 5), max_new_tokens=2)
    with pytest.raises(moirai.InputError, match="max_prefill"):
        moirai.compile_lm(llama, ["cpu"], max_seq_len=16, max_prefill=32, progress=False, calibration="none")
    for devices, words in ((5, "devices=5 is not a list"), ([], "at least one device"), (None, "is not a list")):
        with pytest.raises(moirai.ClusterError, match=words):  # a TypeError and a ZeroDivisionError before
            moirai.compile_lm(llama, devices, max_seq_len=16, max_prefill=8, progress=False, calibration="none")
    with pytest.raises(moirai.MoiraiError, match="did you mean 'max_batch_size'"):
        moirai.compile_lm(llama, ["cpu"], max_batch_sise=2, progress=False, calibration="none")
    with pytest.raises(moirai.InputError, match="sampling needs"):
        split_lm.generate(torch.zeros(1, 5, dtype=torch.long), do_sample=True, top_p=-0.5)
    with pytest.raises(moirai.InputError, match="repetition_penalty > 0 .*; got .*repetition_penalty=0.0"):
        split_lm.generate(torch.zeros(1, 5, dtype=torch.long), repetition_penalty=0.0)
    with pytest.raises(moirai.InputError, match="0 <= min_p <= 1; got .*min_p=1.5"):
        split_lm.generate(torch.zeros(1, 5, dtype=torch.long), do_sample=True, min_p=1.5)
    # Values that fail every comparison or overflow a float (NaN sampled at random; 10**400 was an OverflowError)
    with pytest.raises(moirai.InputError, match="temperature must be finite numbers, got temperature=nan"):
        split_lm.generate(torch.zeros(1, 5, dtype=torch.long), do_sample=True, temperature=math.nan)
    with pytest.raises(moirai.InputError, match="temperature must be finite numbers, got temperature=1000000"):
        split_lm.generate(torch.zeros(1, 5, dtype=torch.long), do_sample=True, temperature=10**400)
    with pytest.raises(moirai.InputError, match="repetition_penalty must be finite numbers"):
        split_lm.generate(torch.zeros(1, 5, dtype=torch.long), repetition_penalty=math.inf)
    with pytest.raises(moirai.InputError, match="sampling needs a finite temperature"):
        SamplingParams(temperature=math.nan)
    with pytest.raises(moirai.InputError, match=rf"bad_words_ids holds token ids \[{VOCAB}\], past the model's"):
        split_lm.generate(torch.zeros(1, 5, dtype=torch.long), bad_words_ids=[[3, VOCAB]])
    with pytest.raises(moirai.InputError, match="bad_words_ids in the generate call must be a non-empty list of"):
        split_lm.generate(torch.zeros(1, 5, dtype=torch.long), bad_words_ids=[3, 4])
    # Arguments of the wrong type (each was a raw TypeError, RuntimeError or ValueError, or cut silently)
    prompt = torch.tensor([[3, 4]])
    with pytest.raises(moirai.InputError, match="must be finite numbers, got temperature='0.7'"):
        split_lm.generate(prompt, do_sample=True, temperature="0.7", max_new_tokens=2)
    with pytest.raises(moirai.InputError, match="seed must be a whole number, got 1.5"):
        split_lm.generate(prompt, do_sample=True, seed=1.5, max_new_tokens=2)
    with pytest.raises(moirai.InputError, match="top_k must be a whole number, got 2.5"):
        split_lm.generate(prompt, do_sample=True, top_k=2.5, max_new_tokens=2)
    with pytest.raises(moirai.InputError, match="eos_token_id must be a token id or a list of them, got '</s>'"):
        split_lm.generate(prompt, eos_token_id="</s>", max_new_tokens=2)
    with pytest.raises(moirai.InputError, match="max_new_tokens must be a whole number, got '5'"):
        split_lm.generate(prompt, max_new_tokens="5")
    with pytest.raises(moirai.InputError, match="pad_token_id must be a whole number, got 'x'"):
        split_lm.generate(prompt, pad_token_id="x", max_new_tokens=2)
    with pytest.raises(moirai.InputError, match=r"seed must be between 0 and 2\*\*63 - 1, got 18446744073709551616"):
        split_lm.generate(prompt, do_sample=True, seed=2**64, max_new_tokens=2)
    with pytest.raises(
        moirai.InputError, match="do_sample=True samples with a temperature over 0, got temperature=0.0"
    ):
        split_lm.generate(prompt, do_sample=True, temperature=0.0, max_new_tokens=2)
    with pytest.raises(moirai.InputError, match="attention_mask must be a tensor, or lists of 1"):
        split_lm.generate(prompt, attention_mask=[[1, "a"]], max_new_tokens=2)
    assert torch.equal(
        split_lm.generate(prompt, attention_mask=[[1, 1]], max_new_tokens=2),
        split_lm.generate(prompt, max_new_tokens=2),
    )
    # The base model, without its head: its hidden states would have been sampled as if they were logits
    with pytest.raises(moirai.InputError, match="LlamaModel returns hidden states, not logits"):
        moirai.compile_lm(llama.model, ["cpu"], max_seq_len=16, max_prefill=8, progress=False, calibration="none")
    # A tokenizer's output passed whole, or rows of different lengths (each was a ValueError from torch)
    with pytest.raises(moirai.InputError, match=r"input_ids is a dict with input_ids, attention_mask: pass its fields"):
        split_lm.generate({"input_ids": torch.zeros(1, 5, dtype=torch.long), "attention_mask": None})
    with pytest.raises(moirai.InputError, match="lists of one length .*: pad rows to one length"):
        split_lm.generate([[3, 4], [5]], max_new_tokens=2)
    # Text, not token ids: said to tokenize it (it was torch's "invalid data type 'str'" and advice to pad)
    for text in ("Hello world", ["Hello", "world"]):
        with pytest.raises(moirai.InputError, match=r"input_ids is text \(.*Hello.*: tokenize it first"):
            split_lm.generate(text, max_new_tokens=2)
    # A token id the embedding has no row for: named at once, before any step runs (it was an IndexError).
    with pytest.raises(moirai.InputError, match=rf"token {VOCAB} \(position 1\).*ids 0 to {VOCAB - 1}"):
        split_lm.generate(torch.tensor([[3, VOCAB, 4]]), max_new_tokens=2)
    with pytest.raises(moirai.InputError, match=r"token -1 \(position 0\)"):
        split_lm.generate(torch.tensor([[-1, 3]]), max_new_tokens=2)
    # Left padding outside the vocabulary is not the prompt's: the mask leaves it out.
    padded = split_lm.generate(torch.tensor([[-1, 3, 4]]), attention_mask=torch.tensor([[0, 1, 1]]), max_new_tokens=2)
    assert padded[0, 3:].tolist() == split_lm.generate(torch.tensor([[3, 4]]), max_new_tokens=2)[0, 2:].tolist()


@pytest.mark.slow
def test_twenty_sequences_in_flight_each_equal_their_lone_run(llama, split_lm):
    lengths = [3 + (7 * i) % 23 for i in range(20)]  # 3..25 tokens: some in several prefill chunks
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(100 + n)) for n in lengths]
    alone = [split_lm.generate(prompt[None], max_new_tokens=12)[0, len(prompt) :].tolist() for prompt in prompts]
    assert alone[0] == hf_new_tokens(llama, prompts[0], 12)
    with split_lm.server() as server:
        futures = [server.submit(prompt, max_new_tokens=12) for prompt in prompts]  # 20 sequences, 4 slots
        assert [future.result(timeout=120) for future in futures] == alone
        assert list(server.stream(prompts[5], max_new_tokens=12)) == alone[5]
        with pytest.raises(moirai.InputError, match="stream yields each token itself and takes no on_token"):
            next(server.stream(prompts[5], max_new_tokens=12, on_token=print))  # a TypeError of Python's before
        batch = torch.stack([prompts[i][:3] for i in range(3)])
        assert torch.equal(server.generate(batch, max_new_tokens=6), split_lm.generate(batch, max_new_tokens=6))
        penalized = {"max_new_tokens": 12, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2}
        assert torch.equal(server.generate(batch, **penalized), split_lm.generate(batch, **penalized))
        banned = server.submit(batch[0], max_new_tokens=6, suppress_tokens=alone[0][:3]).result(timeout=60)
        assert banned == split_lm.generate(batch[:1], max_new_tokens=6, suppress_tokens=alone[0][:3])[0, 3:].tolist()
        # A prompt of floats (token ids cut to integers before) or of an id outside the vocabulary: refused at
        # submit, and the server serves on.
        with pytest.raises(moirai.InputError, match="token ids \\(integers\\), got torch.float32"):
            server.submit([1.5, 2.0], max_new_tokens=2)
        with pytest.raises(moirai.InputError, match=f"token {VOCAB + 7} \\(position 0\\)"):
            server.submit([VOCAB + 7], max_new_tokens=2)
        # Sampled, seeded by torch's global generator: the server's rows draw the tokens the local run draws.
        sampled = {"max_new_tokens": 6, "do_sample": True, "temperature": 1.5, "top_k": 0}
        torch.manual_seed(9)
        served = server.generate(batch, **sampled)
        torch.manual_seed(9)
        assert torch.equal(served, split_lm.generate(batch, **sampled))
        torch.manual_seed(9)
        assert server.submit(batch[0], **sampled).result(timeout=60) == served[0, 3:].tolist()


@pytest.mark.slow
def test_a_killed_rank_fails_every_pending_sequence_naming_it(split_lm):
    prompts = [torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(200 + i)) for i in range(4)]
    with split_lm.server(timeout_s=5) as server:
        assert server.submit(prompts[0], max_new_tokens=2).result(timeout=60)
        started = threading.Event()
        futures = [server.submit(prompt, max_new_tokens=58, on_token=lambda _: started.set()) for prompt in prompts]
        assert started.wait(60)
        os.kill(_worker_pids(server)[0], signal.SIGKILL)  # 58 tokens each: every sequence is still going
        for future in futures:
            with pytest.raises(moirai.DistributedError, match="rank 1"):
                future.result(timeout=60)
        # Rank 1 dies with no step in flight (the loop sits in a callback): no step fails, the ranks restart, and
        # the sequence went on from an empty cache, its tokens silently wrong.
        alone = hf_like(split_lm, prompts[1], 12)
        idle = server.submit(prompts[1], max_new_tokens=12, on_token=lambda _: kill_rank_1_once(server))
        with pytest.raises(moirai.DistributedError, match="rank 1"):
            idle.result(timeout=60)
        assert server.submit(prompts[1], max_new_tokens=12).result(timeout=60) == alone  # begun on the new ranks


def kill_rank_1_once(server) -> None:
    """In a sequence's callback (the loop waits meanwhile): kill rank 1, and return once new ranks have started."""
    worlds = server._serving.engine._worlds
    if worlds.current > 2:  # killed once already (world 2 started after the first kill)
        return
    os.kill(_worker_pids(server)[0], signal.SIGKILL)
    deadline = time.monotonic() + 30  # a bound on a hang: the idle driver's heartbeat finds it within seconds
    while worlds.current == 2:
        assert time.monotonic() < deadline, "the ranks were not restarted after rank 1 died"
        time.sleep(0.05)


def _worker_pids(server) -> list[int]:
    from moirai.runtime.rank_processes import started_ranks

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ranks := started_ranks():
            return [rank.pid for rank in ranks]
        time.sleep(0.05)
    raise AssertionError("the server started no worker process")


TORCHRUN_SCRIPT = """
import os
import torch
import transformers
import moirai

torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
model = transformers.LlamaForCausalLM(config).eval()
lm = moirai.compile_lm(model, ["cpu", "cpu"], max_batch_size=4, max_seq_len=64, max_prefill=8, placer="round_robin",
                       calibration="none", progress=False)
if int(os.environ["RANK"]) == 0:
    prompts = torch.randint(0, 512, (3, 10), generator=torch.Generator().manual_seed(5))
    with lm.server() as server:
        tokens = server.generate(prompts, max_new_tokens=12)
    with torch.no_grad():
        expected = model.generate(prompts, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompts))
    print("EQUAL", torch.equal(tokens, expected), flush=True)
else:
    moirai.serve_rank(lm.compiled)
"""


@pytest.mark.slow
def test_under_torchrun_rank_0_generates_and_the_other_rank_serves(tmp_path):
    import subprocess
    import sys

    (tmp_path / "generate.py").write_text(TORCHRUN_SCRIPT)
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "generate.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "EQUAL True" in result.stdout


def test_the_simulator_refuses_exactly_the_placements_that_separate_a_cache_from_its_ops(split_lm):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    problem = split_lm.compiled.problem
    assert problem.colocated

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.integers(0, 1), min_size=problem.num_tasks, max_size=problem.num_tasks))
    def check(devices: list[int]) -> None:
        placement = np.array(devices)
        separates = any(len(set(placement[list(members)].tolist())) > 1 for members in problem.colocated)
        plan = Plan(placement, problem.device_names)
        if separates:
            with pytest.raises(moirai.PlanError, match="colocated|share"):
                simulate(problem, plan)
        else:
            simulate(problem, plan)

    check()


def test_the_summary_and_the_gantt_show_the_predicted_ttft_tpot_and_tokens_per_s(split_lm, tmp_path):
    pytest.importorskip("matplotlib")
    from rich.console import Console

    console = Console(record=True, width=120)
    split_lm.summary(console)
    text = console.export_text()
    prediction = split_lm.prediction()
    assert "TTFT" in text and "TPOT" in text and "tokens/s" in text and "per sequence" in text
    # The first figure is one decode step's latency, named so: "predicted" read as the value the bound is of.
    assert f"decode step {moirai.viz.format_seconds(prediction.tpot_s)} · TTFT + " in text
    assert prediction.ttft_s > prediction.tpot_s > 0 and prediction.tokens_per_s > 0
    for phase in ("decode", "prefill"):
        figure = split_lm.gantt(tmp_path / f"{phase}.png", phase=phase)
        assert (tmp_path / f"{phase}.png").stat().st_size > 0
        assert figure._suptitle.get_text().startswith(f"{phase}: TTFT")


def test_token_id_0_in_the_generation_config_is_the_pad_and_end_token(split_lm):
    config = copy.deepcopy(split_lm.generation_config)
    config.pad_token_id, config.eos_token_id = 0, 0
    lm = dataclasses.replace(split_lm, compiled_generation_config=config, model=None)
    assert lm.pad_token_id == 0 and lm.eos_token_id == (0,)


# Its rows' padding includes a hole (a pad token inside a row), which model.generate, without a penalty, generates
# as moirai does: the PaddingWarning that says it might not is not this test's.
@pytest.mark.filterwarnings("ignore::moirai.errors.PaddingWarning")
def test_the_pad_token_and_the_models_generation_config_are_read_as_model_generate_reads_them(llama, split_lm):
    """Each was a silent difference from model.generate: the smallest end token padded a row (not the first
    listed), a pad token in the rows without a mask was read as a token, a generation_config changed after
    compile_lm was not read, and a watermark in it was left out without a word."""
    model = copy.deepcopy(llama)
    lm = dataclasses.replace(split_lm, model=weakref.ref(model))  # reads model's configs, as compile_lm's does
    prompt = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))

    def hf(rows: torch.Tensor, **options) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(rows, do_sample=False, **options)

    # The first end token listed pads a row that ends early, where no pad token is set.
    first = lm.generate(prompt, max_new_tokens=6)[0, 7:].tolist()
    ends = [VOCAB - 1, first[1]]  # row 0 ends at its second new token; the padding is the other, larger id
    assert ends[0] > ends[1] and first[1] not in first[:1]
    options = {"max_new_tokens": 6, "eos_token_id": ends, "attention_mask": torch.ones_like(prompt)}
    expected = hf(prompt, **options)
    assert expected[0, 9:].tolist() == [ends[0]] * 4
    assert torch.equal(lm.generate(prompt, **options), expected)
    # A pad token that is no end token marks the rows' padding where no mask is given, anywhere in the row.
    padded = prompt.clone()
    padded[0, :3], padded[1, 4] = 0, 0
    assert not torch.equal(hf(padded, max_new_tokens=6, pad_token_id=0), hf(padded, max_new_tokens=6))
    assert torch.equal(
        lm.generate(padded, max_new_tokens=6, pad_token_id=0), hf(padded, max_new_tokens=6, pad_token_id=0)
    )
    # The model's generation_config as it is at the call: a pad token set there, and a length.
    model.generation_config.pad_token_id, model.generation_config.max_new_tokens = 0, 4
    assert torch.equal(lm.generate(padded), hf(padded)) and hf(padded).shape[1] == 7 + 4
    # ... and a generation_config put in the old one's place.
    model.generation_config = transformers.GenerationConfig(pad_token_id=0, max_new_tokens=3)
    assert torch.equal(lm.generate(padded), hf(padded)) and hf(padded).shape[1] == 7 + 3
    alone = dataclasses.replace(lm, model=weakref.ref(copy.deepcopy(model)))  # a model collected at once ...
    gc.collect()
    assert alone.model() is None and alone.generate(padded).shape[1] == 7 + 3  # ... leaves the config last read
    # A watermark changes even greedy tokens: refused in a call's config, named in a warning in the model's.
    watermark = transformers.WatermarkingConfig(bias=8.0)
    with pytest.raises(moirai.InputError, match="sets watermarking_config=.*which model.generate applies"):
        lm.generate(prompt, generation_config=transformers.GenerationConfig(watermarking_config=watermark))
    model.generation_config.watermarking_config = watermark
    with pytest.warns(moirai.MoiraiWarning, match="generation_config sets watermarking_config="):
        lm.generate(prompt)


def test_the_end_and_pad_tokens_are_the_generation_configs_alone_as_model_generate_reads_them(llama, split_lm):
    """The model's config was read where the generation_config sets None: a pad token set there alone dropped the
    prompt's tokens equal to it as padding, and an end token set there alone stopped a model whose
    generation_config sets none (to generate to the full length), where model.generate reads neither."""
    model = copy.deepcopy(llama)
    lm = dataclasses.replace(split_lm, model=weakref.ref(model))
    prompt = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))

    def hf(**options) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=8, do_sample=False, **options)

    model.generation_config.eos_token_id = None
    free_run = hf()[0, 10:].tolist()  # the full length, no end token
    model.config.pad_token_id, model.generation_config.pad_token_id = int(prompt[0, 4]), None
    assert lm.pad_token_id is None
    assert torch.equal(lm.generate(prompt, max_new_tokens=8), hf())  # the whole prompt, as model.generate reads it
    model.config.pad_token_id = None
    end = next(token for token in free_run[1:] if token not in free_run[:1])
    model.config.eos_token_id, model.generation_config.eos_token_id = end, None
    assert lm.eos_token_id == () and hf()[0, 10:].tolist() == free_run
    assert torch.equal(lm.generate(prompt, max_new_tokens=8), hf())
    with GenerationServer(lm, _StepsInThisProcess(lm), depth=2) as server:
        assert server.submit(prompt[0], max_new_tokens=8).result(timeout=60) == free_run
        assert list(server.stream(prompt[0], max_new_tokens=8)) == free_run
    # Hugging Face builds a model's generation_config from its config, end token included: stopped there, as it is.
    model.generation_config = transformers.GenerationConfig.from_model_config(model.config)
    assert lm.eos_token_id == (end,) and hf().shape[1] < 18
    assert torch.equal(lm.generate(prompt, max_new_tokens=8), hf())
    # A model without a generation_config: its config, as from_model_config would read it.
    model.generation_config = None
    assert lm.eos_token_id == (end,)


def test_int32_prompts_give_int64_tokens_as_model_generate_returns_them(llama, split_lm):
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    with torch.no_grad():
        expected = llama.generate(prompt, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(prompt))
    ours = split_lm.generate(prompt, max_new_tokens=3)
    assert expected.dtype == ours.dtype == torch.int64 and torch.equal(ours, expected)


def test_the_prompt_as_inputs_and_a_generation_config_second_are_taken_as_model_generate_takes_them(llama, split_lm):
    """model.generate's first parameter is ``inputs`` and its second ``generation_config``: generate(inputs=ids)
    was a TypeError, and generate(ids, config) said max_new_tokens must be a whole number."""
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(9))
    config = transformers.GenerationConfig(max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        expected = llama.generate(inputs=prompt, generation_config=config, attention_mask=torch.ones_like(prompt))
        assert torch.equal(llama.generate(prompt, config, attention_mask=torch.ones_like(prompt)), expected)
    assert torch.equal(split_lm.generate(inputs=prompt, max_new_tokens=3), expected)
    assert torch.equal(split_lm.generate(prompt, config), expected)
    with GenerationServer(split_lm, _StepsInThisProcess(split_lm), depth=2) as server:
        assert torch.equal(server.generate(inputs=prompt, max_new_tokens=3), expected)
        assert torch.equal(server.generate(prompt, config), expected)
    with pytest.raises(moirai.InputError, match="both input_ids and inputs, two names for the prompt's token ids"):
        split_lm.generate(prompt, inputs=prompt, max_new_tokens=3)
    with pytest.raises(moirai.InputError, match="needs the prompt's token ids: pass input_ids"):
        split_lm.generate(max_new_tokens=3)
    with pytest.raises(moirai.InputError, match="two generation configs, one as its second argument"):
        split_lm.generate(prompt, config, generation_config=config)


def test_sampling_with_a_top_p_of_0_keeps_the_likeliest_token_as_model_generate_does(llama, split_lm):
    """It was an InputError (0 < top_p), where model.generate's top-p keeps the likeliest token."""
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(12))
    options = {"max_new_tokens": 6, "do_sample": True, "top_p": 0.0, "temperature": 1.3, "top_k": 0}
    with torch.no_grad():
        expected = llama.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
    assert torch.equal(split_lm.generate(prompt, seed=3, **options), expected)


def test_a_streamer_without_put_and_end_and_token_ids_on_meta_are_input_errors(split_lm):
    """Each was a raw error from deep in the call: an AttributeError ('bool' object has no attribute 'put') and a
    RuntimeError or NotImplementedError reading a meta tensor's values."""
    prompt = torch.tensor([[3, 4, 5]])
    for streamer in (True, print):
        with pytest.raises(moirai.InputError, match="streamer must have put\\(token ids\\) and end\\(\\)"):
            split_lm.generate(prompt, max_new_tokens=2, streamer=streamer)
    meta = prompt.to("meta")
    with pytest.raises(moirai.InputError, match="input_ids is on the meta device, which holds shapes and no values"):
        split_lm.generate(meta, max_new_tokens=2)
    with pytest.raises(moirai.InputError, match="attention_mask is on the meta device"):
        split_lm.generate(prompt, attention_mask=torch.ones_like(meta), max_new_tokens=2)
    with pytest.raises(moirai.InputError, match="input_ids is a sparse_coo tensor: pass it dense"):
        split_lm.generate(prompt.to_sparse(), max_new_tokens=2)
    with GenerationServer(split_lm, _StepsInThisProcess(split_lm), depth=2) as server:
        with pytest.raises(moirai.InputError, match="a prompt is on the meta device"):
            server.submit(meta[0], max_new_tokens=2)
        with pytest.raises(moirai.InputError, match="streamer must have put"):
            server.generate(prompt, max_new_tokens=2, streamer=object())


def test_right_padding_and_holes_in_the_mask_warn_that_model_generate_gives_other_tokens(llama, split_lm):
    """moirai generates each row as its kept tokens alone; model.generate goes on after right padding and counts a
    hole's tokens in a repetition penalty, so each gave other tokens, silently."""
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    right = torch.zeros(2, 9, dtype=torch.long)
    right[0, :5], right[1] = prompts
    mask = (right != 0).long()
    said = r"attention_mask leaves out tokens after the first kept one in row 0 \(right padding, or holes\)"
    with pytest.warns(moirai.PaddingWarning, match=said):
        ours = split_lm.generate(right, attention_mask=mask, max_new_tokens=6)
    assert [row[9:] for row in ours.tolist()] == [hf_new_tokens(llama, prompt, 6) for prompt in prompts]
    hole = torch.cat([prompts[1][:4], torch.tensor([0]), prompts[1][4:]])[None]
    with pytest.warns(moirai.PaddingWarning, match=r"the pad token 0 \(no attention_mask was given\) leaves out"):
        split_lm.generate(hole, pad_token_id=0, max_new_tokens=2)
    left = torch.zeros(2, 9, dtype=torch.long)
    left[0, 4:], left[1] = prompts
    with warnings.catch_warnings():
        warnings.simplefilter("error", moirai.PaddingWarning)
        split_lm.generate(left, attention_mask=(left != 0).long(), max_new_tokens=2)
        split_lm.generate(left, pad_token_id=0, max_new_tokens=2)
