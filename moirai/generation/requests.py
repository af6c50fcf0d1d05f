"""A Hugging Face-style ``generate`` call as sequences for the :class:`~moirai.generation.engine.Engine`, and its
tokens put back as ``model.generate`` returns them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from moirai.errors import InputError
from moirai.generation.engine import Engine, SamplingParams, SequenceState

if TYPE_CHECKING:
    from moirai.generation.lm import CompiledLM

# Hugging Face's new tokens when neither the call nor the generation_config says how many.
_DEFAULT_NEW_TOKENS = 20
# Seeds drawn for sampled sequences: below 2**62, so that a row's (seed + row) still fits a generator's seed.
_SEEDS = 2**62


@dataclass(frozen=True)
class GenerateRequest:
    """A ``generate`` call's rows as sequences, and how to put their tokens back as Hugging Face returns them."""

    input_ids: torch.Tensor
    prompts: tuple[list[int], ...]
    max_new_tokens: int
    eos: frozenset[int]
    pad_token_id: int

    @classmethod
    def of(
        cls,
        lm: CompiledLM,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        max_new_tokens: int | None,
        max_length: int | None,
        eos_token_id: int | Sequence[int] | None,
        pad_token_id: int | None,
    ) -> GenerateRequest:
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise InputError(
                f"input_ids must be token ids [batch, tokens] (int64), got shape {tuple(input_ids.shape)} and dtype "
                f"{input_ids.dtype}"
            )
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise InputError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}: "
                "give one mask value per token"
            )
        rows = input_ids.cpu().tolist()
        keep = attention_mask.cpu().bool().tolist() if attention_mask is not None else None
        prompts = tuple(
            [t for t, kept in zip(row, keep[i], strict=True) if kept] if keep else list(row)
            for i, row in enumerate(rows)
        )
        eos = end_tokens(eos_token_id, lm.eos_token_id)
        pad = pad_token_id if pad_token_id is not None else lm.pad_token_id
        if pad is None:
            pad = min(eos) if eos else 0
        new_tokens = lm.defaults.new_tokens(max_new_tokens, max_length, input_ids.shape[1])
        return cls(input_ids, prompts, new_tokens, eos, pad)

    def submit(self, engine: Engine, sampling: SamplingParams) -> list[Future]:
        for prompt in self.prompts:
            engine.check(prompt, self.max_new_tokens)
        futures = []
        for row, prompt in enumerate(self.prompts):
            row_sampling = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + row)
            futures.append(engine.add(SequenceState(prompt, self.max_new_tokens, row_sampling, self.eos)))
        return futures

    def assemble(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """The prompt rows as given, then each row's new tokens, padded to the longest with the pad token."""
        longest = max((len(tokens) for tokens in new_tokens), default=0)
        padded = [tokens + [self.pad_token_id] * (longest - len(tokens)) for tokens in new_tokens]
        generated = torch.tensor(padded, dtype=self.input_ids.dtype).reshape(len(new_tokens), longest)
        return torch.cat([self.input_ids.cpu(), generated], dim=1).to(self.input_ids.device)


class GenerationDefaults(NamedTuple):
    """What ``generate`` and ``submit`` take for an argument left out (None), as ``model.generate`` does: the
    model's ``generation_config`` where it sets it, else Hugging Face's defaults."""

    max_new_tokens: int | None = None
    max_length: int | None = None  # prompt and new tokens together
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    max_position_embeddings: int | None = None  # the model config's: caps Hugging Face's default length

    @classmethod
    def of(cls, generation_config: object, config: object = None) -> GenerationDefaults:
        names = [name for name in cls._fields if name != "max_position_embeddings"]
        given = {name: getattr(generation_config, name, None) for name in names}
        given["max_position_embeddings"] = getattr(config, "max_position_embeddings", None)
        return cls(**{name: value for name, value in given.items() if value is not None})

    def new_tokens(self, max_new_tokens: int | None, max_length: int | None, input_length: int) -> int:
        """How many tokens a call generates after ``input_length`` prompt tokens (the padded width of a batch), as
        ``model.generate`` counts them: ``max_new_tokens`` (the call's, else the config's); else up to
        ``max_length`` tokens in all (the call's, else the config's: transformers 4 sets 20 there); else 20 new
        tokens, at most ``max_position_embeddings`` in all (transformers 5's default). A prompt that already reaches
        the length is an :class:`InputError`, as it is Hugging Face's ``ValueError``."""
        for given in (max_new_tokens, self.max_new_tokens):
            if given is not None:
                return given
        if max_length is None:
            max_length = self.max_length
        if max_length is None:
            max_length = _DEFAULT_NEW_TOKENS + input_length
            if self.max_position_embeddings is not None:
                max_length = min(max_length, self.max_position_embeddings)
        if input_length >= max_length:
            raise InputError(
                f"the prompt's {input_length} tokens reach max_length={max_length}, which counts the prompt and the "
                f"new tokens together: give a max_length over {input_length}, or max_new_tokens"
            )
        return max_length - input_length

    def sampling(
        self,
        do_sample: bool | None,
        temperature: float | None,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
    ) -> SamplingParams:
        """The sampling of a call, each argument left out taken from these defaults (see :func:`sampling_params`)."""
        return sampling_params(
            self.do_sample if do_sample is None else do_sample,
            self.temperature if temperature is None else temperature,
            self.top_k if top_k is None else top_k,
            self.top_p if top_p is None else top_p,
            seed,
        )


def prompt_tokens(prompt_ids: torch.Tensor | Sequence[int]) -> list[int]:
    """One sequence's prompt as token ids; :class:`InputError` for anything but integers (a float would be cut)."""
    prompt = torch.as_tensor(prompt_ids)
    if prompt.numel() > 0 and (prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool):
        raise InputError(f"a prompt must be token ids (integers), got {prompt.dtype} of shape {tuple(prompt.shape)}")
    return [int(t) for t in prompt.reshape(-1).tolist()]


def sampling_params(
    do_sample: bool, temperature: float, top_k: int | None, top_p: float | None, seed: int | None = None
) -> SamplingParams:
    """Hugging Face's sampling arguments as :class:`SamplingParams` (greedy unless ``do_sample``).

    Sampling without a ``seed`` takes one from torch's global generator, in the caller's thread: as with
    Hugging Face's ``generate``, ``torch.manual_seed`` before the call makes it draw the same tokens again.
    """
    if not do_sample:
        return SamplingParams(seed=seed)
    if seed is None:
        seed = int(torch.randint(0, _SEEDS, ()))
    return SamplingParams(temperature, int(top_k or 0), float(top_p if top_p is not None else 1.0), seed)


def end_tokens(given: int | Sequence[int] | None, default: Sequence[int]) -> frozenset[int]:
    if given is None:
        return frozenset(default)
    return frozenset([given] if isinstance(given, int) else [int(t) for t in given])


def generate_rows(
    lm: CompiledLM,
    engine: Engine,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int | None,
    max_length: int | None,
    sampling: SamplingParams,
    eos_token_id: int | Sequence[int] | None,
    pad_token_id: int | None,
    drive: Callable[[], None] | None = None,
) -> torch.Tensor:
    """A ``generate`` call through ``engine`` (``drive``: what runs the engine until the rows are done, when no
    thread of its own serves it): its rows as sequences, their tokens as Hugging Face returns them."""
    request = GenerateRequest.of(lm, input_ids, attention_mask, max_new_tokens, max_length, eos_token_id, pad_token_id)
    futures = request.submit(engine, sampling)
    if drive is not None:
        drive()
    return request.assemble([f.result() for f in futures])
