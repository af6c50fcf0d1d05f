"""A Hugging Face-style ``generate`` call as sequences for the :class:`~moirai.generation.engine.Engine`, and its
tokens put back as ``model.generate`` returns them."""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
import reprlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from moirai.errors import InputError, PaddingWarning, RequestError, did_you_mean, user_stacklevel
from moirai.frontend.trace import layout_name
from moirai.generation.bans import TokenBans
from moirai.generation.engine import Engine, SamplingParams, SequenceState

if TYPE_CHECKING:
    from moirai.generation.lm import CompiledLM

# Hugging Face's new tokens when neither the call nor the generation_config says how many.
_DEFAULT_NEW_TOKENS = 20
# Seeds drawn for sampled sequences: below 2**62, so that a row's (seed + row) still fits a generator's seed.
_SEEDS = 2**62
_MAX_SEED = 2**63  # a seed a row adds its index to still fits a generator's (at most 2**64 - 1)


@dataclass(frozen=True)
class GenerateRequest:
    """A ``generate`` call's rows as sequences, and how to put their tokens back as Hugging Face returns them."""

    input_ids: torch.Tensor
    rows: tuple[list[int], ...]  # each row as given, padding included (what Hugging Face's bans read)
    prompts: tuple[list[int], ...]
    max_new_tokens: int
    eos: tuple[int, ...]
    pad_token_id: int
    bans: TokenBans = TokenBans()
    copies: int = 1  # num_return_sequences: each row's sequences

    @classmethod
    def of(
        cls,
        lm: CompiledLM,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        options: GenerateOptions,
        defaults: GenerationDefaults,
    ) -> GenerateRequest:
        input_ids = token_tensor(input_ids, "input_ids")
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise InputError(
                f"input_ids must be token ids [batch, tokens] (int64), got shape {tuple(input_ids.shape)} and dtype "
                f"{input_ids.dtype}"
            )
        given = options.generation_config
        eos = end_tokens(_first_given(options.eos_token_id, getattr(given, "eos_token_id", None)), lm.eos_token_id)
        pad = _first_given(options.pad_token_id, getattr(given, "pad_token_id", None), lm.pad_token_id)
        pad = _whole("pad_token_id", pad)
        masked_by = "attention_mask"
        if attention_mask is None and pad is not None and pad not in eos and bool((input_ids == pad).any()):
            # Hugging Face's rule: a pad token that is no end token and stands in the rows marks their padding.
            attention_mask, masked_by = input_ids != pad, f"the pad token {pad} (no attention_mask was given)"
        attention_mask = None if attention_mask is None else _mask_tensor(attention_mask)
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise InputError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}: "
                "give one mask value per token"
            )
        if attention_mask is not None:
            _warn_unless_left_padding(attention_mask, masked_by)
        copies = _first_given(options.num_return_sequences, defaults.num_return_sequences)
        if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
            raise InputError(f"num_return_sequences must be a whole number >= 1, got {copies!r}")
        # Each row's copies one after another, as model.generate expands its batch (repeat_interleave).
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        if attention_mask is not None:
            attention_mask = attention_mask.repeat_interleave(copies, dim=0)
        if options.streamer is not None and input_ids.shape[0] != 1:
            raise InputError(
                f"a streamer takes the tokens of one row, as Hugging Face's TextStreamer does; input_ids has "
                f"{input_ids.shape[0] // copies} rows of {copies} sequences each (num_return_sequences): generate "
                "one sequence at a time, or stream each with server().stream"
            )
        rows = tuple(input_ids.cpu().tolist())
        keep = attention_mask.cpu().bool().tolist() if attention_mask is not None else None
        prompts = tuple(
            [t for t, kept in zip(row, keep[i], strict=True) if kept] if keep else list(row)
            for i, row in enumerate(rows)
        )
        if pad is None:
            pad = eos[0] if eos else 0  # model.generate pads with the first end token where no pad is set
        new_tokens = defaults.new_tokens(options.max_new_tokens, options.max_length, input_ids.shape[1])
        bans = defaults.bans.overridden_by(options.bans or {}, "the generate call")
        return cls(input_ids, rows, prompts, new_tokens, eos, pad, bans, copies)

    def submit(self, engine: Engine, sampling: SamplingParams, streamer: Any = None) -> list[Future]:
        """Every row as a sequence of ``engine``; a ``streamer`` gets the prompt, then each token as it comes."""
        if self.copies > 1 and sampling.temperature == 0:
            raise InputError(
                f"num_return_sequences={self.copies} without sampling (do_sample=True and a temperature over 0) "
                "would give each row's one greedy sequence that many times (model.generate refuses it too): "
                "sample, or ask for one sequence a row"
            )
        for prompt in self.prompts:
            engine.check(prompt, self.max_new_tokens)
        if streamer is not None:
            streamer.put(self.input_ids.cpu())  # as model.generate starts a streamer: the prompt first
        futures = []
        for row, prompt in enumerate(self.prompts):
            row_sampling = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + row)
            on_token = None if streamer is None else (lambda token: streamer.put(torch.tensor([token])))
            bans = self.bans.for_sequence(self.rows[row], self.eos)  # [Note: banned tokens]
            eos = frozenset(self.eos)
            state = SequenceState(prompt, self.max_new_tokens, row_sampling, eos, on_token=on_token, bans=bans)
            futures.append(engine.add(state))
        return futures

    def assemble(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """The prompt rows as given, then each row's new tokens, padded to the longest with the pad token: int64
        whatever the prompt's dtype, as model.generate's concatenation with its int64 tokens promotes int32 rows."""
        longest = max((len(tokens) for tokens in new_tokens), default=0)
        padded = [tokens + [self.pad_token_id] * (longest - len(tokens)) for tokens in new_tokens]
        generated = torch.tensor(padded, dtype=torch.long).reshape(len(new_tokens), longest)
        return torch.cat([self.input_ids.cpu().long(), generated], dim=1).to(self.input_ids.device)


def _warn_unless_left_padding(attention_mask: torch.Tensor, masked_by: str) -> None:
    """A :class:`PaddingWarning` where ``attention_mask`` leaves out a token after a row's first kept one.

    Each row is generated as its kept tokens alone, which is what model.generate gives for left padding only: after
    right padding it goes on from the padding (its positions and its last logits), and a hole's tokens stay in its
    repetition penalty (they are left out of the sequence here, and so of its seen tokens; [Note: seen tokens]).
    The tokens differ without an error, so say so; Hugging Face warns of right padding too."""
    kept = attention_mask.cpu().bool()
    after_first_kept = kept.int().cummax(dim=1).values.bool()
    rows = (after_first_kept & ~kept).any(dim=1).nonzero().flatten().tolist()
    if rows:
        shown = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
        warnings.warn(
            f"{masked_by} leaves out tokens after the first kept one in row {shown} (right padding, or holes): "
            "moirai generates each row as if its masked tokens were absent, where model.generate, made for left "
            "padding, goes on after right padding and counts masked tokens in a repetition penalty, so its tokens "
            "can differ; pad on the left (padding_side='left' in the tokenizer) for model.generate's tokens",
            PaddingWarning,
            stacklevel=user_stacklevel(),
        )


class GenerateOptions(NamedTuple):
    """The Hugging Face arguments of one ``generate`` call, as given (None: left out)."""

    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None
    seed: int | None = None
    max_length: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    streamer: Any = None  # Hugging Face's streamer protocol: put(token ids), end()
    generation_config: Any = None  # a GenerationConfig whose values stand before the model's
    bans: dict[str, Any] | None = None  # the settings of TokenBans the call names
    num_return_sequences: int | None = None  # sampled sequences of each row
    return_dict_in_generate: bool | None = None  # Hugging Face's output with .sequences, not the tensor alone

    @classmethod
    def of(cls, call: dict[str, Any], others: dict[str, Any]) -> GenerateOptions:
        """The options of a generate call, from its ``locals()`` (the parameters it names, which
        :func:`check_generate_signatures` keeps to these fields and :data:`PROMPT_PARAMETERS`) and ``others``,
        its ``**others``: those that ban tokens (:class:`TokenBans`) and :data:`OPTIONS_IN_OTHERS`;
        :class:`InputError` for the rest of ``others``, arguments moirai's generate does not take (with those that
        change model.generate's tokens named as such)."""
        bans = {name: others.pop(name) for name in TokenBans.settings() if name in others}
        given = {name: value for name, value in call.items() if name in cls._fields}
        given.update({name: others.pop(name, None) for name in OPTIONS_IN_OTHERS})
        # An argument given as None is unset, as in model.generate. A setting moirai does not apply, given at the
        # value that leaves the tokens alone (num_beams=1), is taken, and so is an argument of how model.generate
        # runs or what it returns beside the tokens, at a value that asks for nothing moirai does not do
        # (output_scores=False; use_cache either way: moirai always caches).
        others = {
            name: v
            for name, v in others.items()
            if v is not None
            and not (name in UNAPPLIED_SETTINGS and not _changes(name, v))
            and not (name in ASKING_NOTHING and _asks_nothing(name, v))
        }
        if others:
            changes = sorted(set(others) & set(UNAPPLIED_SETTINGS))
            said = f"; {', '.join(changes)} would change the tokens model.generate gives" if changes else ""
            if set(others) & OUTPUT_ARGUMENTS:
                said += "; it returns the tokens alone (as .sequences with return_dict_in_generate=True)"
            taken = [f for f in cls._fields if f != "bans"]
            # A misspelt argument (max_new_token) offers the one meant, as a placer's options do; model.generate's
            # own arguments (num_beams) are no misspelling.
            known = set(UNAPPLIED_SETTINGS) | OUTPUT_ARGUMENTS
            unknown = ", ".join(
                name + ("" if name in known else did_you_mean(name, [*taken, *TokenBans.settings(), "attention_mask"]))
                for name in sorted(others)
            )
            raise InputError(
                f"generate does not take {unknown}{said}: moirai's generate takes {', '.join(taken)}, "
                f"{', '.join(TokenBans.settings())} and attention_mask"
            )
        if hasattr(given["max_new_tokens"], "to_dict"):
            # model.generate(inputs, generation_config): Hugging Face's second parameter, moirai's max_new_tokens. A
            # GenerationConfig is never a number of tokens, so it is taken as what model.generate takes it for.
            if given["generation_config"] is not None:
                raise InputError(
                    "generate was given two generation configs, one as its second argument (model.generate's "
                    "generation_config, moirai's max_new_tokens) and one as generation_config: pass one"
                )
            given = {**given, "max_new_tokens": None, "generation_config": given["max_new_tokens"]}
        options = cls(**given, bans=bans)
        config = options.generation_config
        if config is not None and not hasattr(config, "to_dict"):
            raise InputError(
                f"generation_config must be a transformers.GenerationConfig, got {type(config).__name__}; pass "
                "GenerationConfig(**settings), or the settings as arguments"
            )
        streamer = options.streamer
        if streamer is not None and not all(callable(getattr(streamer, name, None)) for name in ("put", "end")):
            # Checked before any step runs: a put missing was an AttributeError once the prompt had been checked.
            raise InputError(
                f"streamer must have put(token ids) and end(), as transformers.TextStreamer has; got "
                f"{reprlib.repr(streamer)}: pass TextStreamer(tokenizer), or take each token from server().stream"
            )
        _refuse_unapplied(config, "the generation_config passed to generate")
        asked = [f"{name}={getattr(config, name)!r}" for name in OUTPUT_ARGUMENTS if getattr(config, name, None)]
        if asked:
            raise InputError(
                f"the generation_config passed to generate sets {', '.join(sorted(asked))}: moirai's generate returns "
                "the tokens alone (as .sequences with return_dict_in_generate=True)"
            )
        return options


# The options a generate takes in **others, not as parameters: model.generate's rarer arguments.
OPTIONS_IN_OTHERS = ("num_return_sequences", "return_dict_in_generate")
# A generate's parameters that are no GenerateOptions field: the prompt and its mask, which the call reads itself.
PROMPT_PARAMETERS = ("input_ids", "inputs", "attention_mask")
# submit's parameters that no generate has: its one prompt, and the function called with each token.
SUBMIT_PARAMETERS = ("prompt_ids", "on_token")


def check_generate_signatures(generate: Callable, server_generate: Callable, submit: Callable) -> None:
    """A ``TypeError`` unless ``CompiledLM.generate`` and ``GenerationServer.generate`` have one signature whose named
    parameters are the :class:`GenerateOptions` fields (less ``bans`` and :data:`OPTIONS_IN_OTHERS`, read from
    ``**others``) and :data:`PROMPT_PARAMETERS`, and ``GenerationServer.submit``'s, :data:`SUBMIT_PARAMETERS` aside,
    are among them with the same defaults and types.

    Run at import (moirai/generation/lm.py): each generate hands ``GenerateOptions.of`` its ``locals()``, which
    keeps the fields alone, so a parameter added to one generate only, or to no ``GenerateOptions`` field, would
    otherwise be dropped without a word."""
    signature, server_signature = inspect.signature(generate), inspect.signature(server_generate)
    if signature != server_signature:
        either = [set(map(str, s.parameters.values())) for s in (signature, server_signature)]
        only = ", ".join(sorted(either[0] ^ either[1])) or "in their order or return type"
        raise TypeError(
            f"CompiledLM.generate and GenerationServer.generate differ ({only}): give both the same parameters"
        )
    named = {
        name: parameter
        for name, parameter in signature.parameters.items()
        if name != "self" and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }
    taken = set(GenerateOptions._fields) - {"bans", *OPTIONS_IN_OTHERS}
    stray = sorted(set(named) - taken - set(PROMPT_PARAMETERS))
    if stray:
        raise TypeError(
            f"generate names {', '.join(stray)}, which is no GenerateOptions field and would be dropped: add it "
            "there (or to PROMPT_PARAMETERS, where the call reads it itself)"
        )
    unnamed = sorted(taken - set(named))
    if unnamed:  # else generate would refuse it as an argument it does not take
        raise TypeError(
            f"GenerateOptions has {', '.join(unnamed)}, which generate does not name: add it to both generates (or "
            "to OPTIONS_IN_OTHERS, read from **others)"
        )
    for name, parameter in inspect.signature(submit).parameters.items():
        if name == "self" or name in SUBMIT_PARAMETERS or parameter.kind is parameter.VAR_KEYWORD:
            continue
        own = named.get(name)
        if own is None or (own.default, own.annotation) != (parameter.default, parameter.annotation):
            raise TypeError(
                f"GenerationServer.submit's {parameter} is not generate's {own}: give it generate's name, default "
                "and type"
            )


# Settings of a Hugging Face generation_config that change model.generate's tokens and that moirai's generate does
# not apply, with the values that leave the tokens alone (None: unset).
APPLIED_SETTINGS = (
    "max_new_tokens, max_length, temperature, top_k, top_p, min_p, repetition_penalty, num_return_sequences, the end "
    "tokens and " + ", ".join(TokenBans.settings())
)
UNAPPLIED_SETTINGS = {
    "encoder_repetition_penalty": 1.0,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "num_beams": 1,
    "guidance_scale": 1.0,
    "penalty_alpha": None,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "max_time": None,
    "stop_strings": None,
    "watermarking_config": None,
    "top_h": None,
    "dola_layers": None,
    "constraints": None,
    "force_words_ids": None,
    "token_healing": False,
    "remove_invalid_values": False,  # its processor replaces NaN and infinite logits
}


# Arguments of model.generate that change how it runs or what it returns beside the tokens, with the values that
# ask for nothing moirai's generate does not do (None: any value; None itself is always unset).
OUTPUT_ARGUMENTS = {"output_attentions", "output_hidden_states", "output_scores", "output_logits"}
ASKING_NOTHING: dict[str, tuple[Any, ...] | None] = {
    "use_cache": None,  # moirai always caches; the tokens are the same either way
    **dict.fromkeys(OUTPUT_ARGUMENTS, (False,)),
    "synced_gpus": (False,),
    "logits_processor": ([],),
    "stopping_criteria": ([],),
    "bos_token_id": None,  # read only where there is no prompt
    "tokenizer": None,  # read only for stop_strings (refused)
    "length_penalty": None,  # beam search's (refused)
    "early_stopping": None,  # beam search's
    "renormalize_logits": None,  # a log-softmax after the processors: the same argmax and distribution
}


def _asks_nothing(name: str, value: Any) -> bool:
    neutral = ASKING_NOTHING[name]
    return neutral is None or any(_equal(value, n) for n in neutral)


def _equal(value: Any, neutral: Any) -> bool:
    try:
        return bool(value == neutral)
    except (TypeError, ValueError, RuntimeError):  # a comparison that gives no truth value (an array's)
        return False


def unapplied_settings(generation_config: object) -> list[str]:
    """``name=value`` of each setting of ``generation_config`` that model.generate applies and moirai does not."""
    given = {setting: getattr(generation_config, setting, None) for setting in UNAPPLIED_SETTINGS}
    return [f"{setting}={value!r}" for setting, value in given.items() if _changes(setting, value)]


def _changes(setting: str, value: object) -> bool:
    """Whether ``value`` of an unapplied ``setting`` would change model.generate's tokens (unset or neutral: no)."""
    return value is not None and value != UNAPPLIED_SETTINGS[setting] and value != [] and value != {}


def _refuse_unapplied(generation_config: object, where: str) -> None:
    unapplied = unapplied_settings(generation_config)
    if unapplied:
        raise InputError(
            f"{where} sets {', '.join(unapplied)}, which model.generate applies and moirai's generate does not (it "
            f"applies {APPLIED_SETTINGS})"
        )


def _first_given(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def _set_in(generation_config: object, names: Sequence[str]) -> dict[str, Any]:
    """The values among ``names`` that ``generation_config`` sets: not None and not its class's default, as
    ``model.generate`` tells a setting from a default (transformers 4 gives every field a value, ``max_length``
    20 among them, which means 20 new tokens where nothing else is set; transformers 5 leaves them None)."""
    try:
        library_defaults = type(generation_config)()
    except Exception:  # noqa: BLE001 - not a GenerationConfig: every value it has is its own
        library_defaults = None
    given = {name: getattr(generation_config, name, None) for name in names}
    return {
        name: value
        for name, value in given.items()
        if value is not None and value != getattr(library_defaults, name, None)
    }


class GenerationDefaults(NamedTuple):
    """What ``generate`` and ``submit`` take for an argument left out (None), as ``model.generate`` does: the
    model's ``generation_config`` where it sets it, else Hugging Face's defaults."""

    max_new_tokens: int | None = None
    max_length: int | None = None  # prompt and new tokens together
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    max_position_embeddings: int | None = None  # the model config's: caps Hugging Face's default length
    bans: TokenBans = TokenBans()
    num_return_sequences: int = 1
    return_dict_in_generate: bool = False

    @classmethod
    def of(cls, generation_config: object, config: object = None) -> GenerationDefaults:
        """The defaults of a model with this ``generation_config`` and model ``config``."""
        defaults = cls(max_position_embeddings=getattr(config, "max_position_embeddings", None))
        return defaults.overridden_by(generation_config)

    def overridden_by(self, generation_config: object) -> GenerationDefaults:
        """These defaults with the values ``generation_config`` sets (:func:`_set_in`) standing before them."""
        if generation_config is None:
            return self
        values = _set_in(generation_config, [n for n in self._fields if n not in ("max_position_embeddings", "bans")])
        bans = self.bans.overridden_by(_set_in(generation_config, TokenBans.settings()), "the generation_config")
        return self._replace(**values, bans=bans)

    def new_tokens(self, max_new_tokens: int | None, max_length: int | None, input_length: int) -> int:
        """How many tokens a call generates after ``input_length`` prompt tokens (the padded width of a batch), as
        ``model.generate`` counts them: ``max_new_tokens`` (the call's, else the config's); else up to
        ``max_length`` tokens in all (the call's, else one the config sets); else 20 new tokens, at most
        ``max_position_embeddings`` in all. A prompt that already reaches the length is an :class:`InputError`, as
        it is Hugging Face's ``ValueError``."""
        for given in (max_new_tokens, self.max_new_tokens):
            if given is not None:
                return _whole("max_new_tokens", given)
        max_length = _whole("max_length", max_length if max_length is not None else self.max_length)
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
        *,  # by name: seven settings of like types, where a swapped pair would sample silently otherwise
        do_sample: bool | None,
        temperature: float | None,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
        repetition_penalty: float | None = None,
        min_p: float | None = None,
    ) -> SamplingParams:
        """The sampling of a call, each argument left out taken from these defaults (see :func:`sampling_params`)."""
        return sampling_params(
            self.do_sample if do_sample is None else do_sample,
            self.temperature if temperature is None else temperature,
            self.top_k if top_k is None else top_k,
            self.top_p if top_p is None else top_p,
            seed,
            self.repetition_penalty if repetition_penalty is None else repetition_penalty,
            self.min_p if min_p is None else min_p,
        )


def prompt_rows(input_ids: Any, inputs: Any) -> Any:
    """The prompt rows of a ``generate`` call: ``input_ids``, or ``inputs``, model.generate's name for its first
    parameter (which takes ``input_ids=`` too); :class:`InputError` for both or neither."""
    if input_ids is not None and inputs is not None:
        raise InputError(
            "generate was given both input_ids and inputs, two names for the prompt's token ids (model.generate "
            "refuses both too): pass one"
        )
    if input_ids is None and inputs is None:
        raise InputError(
            "generate needs the prompt's token ids: pass input_ids (or inputs, as model.generate names them)"
        )
    return input_ids if input_ids is not None else inputs


def prompt_tokens(prompt_ids: torch.Tensor | Sequence[int]) -> list[int]:
    """One sequence's prompt as token ids; :class:`InputError` for anything but integers (a float would be cut)."""
    prompt = token_tensor(prompt_ids, "a prompt")
    if prompt.numel() > 0 and (prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool):
        raise InputError(f"a prompt must be token ids (integers), got {prompt.dtype} of shape {tuple(prompt.shape)}")
    if prompt.dim() > 1 and prompt.shape[:-1].numel() > 1:
        raise InputError(
            f"a prompt is one sequence's token ids, got shape {tuple(prompt.shape)}: submit each row alone, or pass "
            "the rows to server.generate"
        )
    return [int(t) for t in prompt.reshape(-1).tolist()]


def token_tensor(value: Any, what: str) -> torch.Tensor:
    """``value`` (token ids: a tensor, or nested lists) as a tensor; :class:`InputError` for a tokenizer's output
    passed whole, or rows of different lengths."""
    if isinstance(value, Mapping):
        raise InputError(
            f"{what} is a {type(value).__name__} with {', '.join(map(str, value))}: pass its fields, "
            "lm.generate(**inputs), as to model.generate"
        )
    if isinstance(value, (str, bytes)) or (isinstance(value, Sequence) and value and isinstance(value[0], str)):
        raise InputError(
            f"{what} is text ({str(value)[:40]!r}), not token ids: tokenize it first, e.g. "
            "tokenizer(text, return_tensors='pt').input_ids, as model.generate takes"
        )
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InputError(
            f"{what} must be token ids, a tensor or lists of one length ({error}): pad rows to one length and "
            "pass attention_mask, or submit each prompt alone"
        ) from None
    _refuse_meta(tensor, what)
    return tensor


def _refuse_meta(tensor: torch.Tensor, what: str) -> None:
    """:class:`InputError` for a tensor on the meta device: it has a shape and no values to read (reading one was a
    raw RuntimeError or NotImplementedError deep in the call); and for one that is not dense (sparse, nested)."""
    if tensor.is_meta:
        raise InputError(
            f"{what} is on the meta device, which holds shapes and no values: pass the token ids on a real device "
            "(torch.tensor(ids), or .to('cpu') of tensors made with values)"
        )
    if tensor.is_nested or tensor.layout != torch.strided:  # their values are not read as a dense tensor's are
        raise InputError(f"{what} is a {layout_name(tensor)} tensor: pass it dense (.to_dense(), or token lists)")


def _mask_tensor(value: Any) -> torch.Tensor:
    """An ``attention_mask`` as a tensor (it may be nested lists); :class:`InputError` for anything else."""
    try:
        mask = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InputError(
            f"attention_mask must be a tensor, or lists of 1 (a token) and 0 (padding), one per token of input_ids "
            f"({error})"
        ) from None
    _refuse_meta(mask, "attention_mask")
    return mask


def sampling_params(
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int | None = None,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
) -> SamplingParams:
    """Hugging Face's sampling arguments as :class:`SamplingParams` (greedy unless ``do_sample``; the repetition
    penalty either way).

    Sampling without a ``seed`` takes one from torch's global generator, in the caller's thread: as with
    Hugging Face's ``generate``, ``torch.manual_seed`` before the call makes it draw the same tokens again.
    """
    # What greedy search reads is checked either way; the sampling settings only where it samples, as model.generate
    # ignores them otherwise (a config's top_k of 50.0 among them).
    (penalty,) = _numbers(repetition_penalty=repetition_penalty)
    seed = _whole("seed", seed)
    if seed is not None and not 0 <= seed < _MAX_SEED:
        raise InputError(f"seed must be between 0 and 2**63 - 1, got {seed}")
    if not do_sample:
        return SamplingParams(seed=seed, repetition_penalty=penalty)
    temperature, top_p, min_p = _numbers(temperature=temperature, top_p=1.0 if top_p is None else top_p, min_p=min_p)
    if temperature <= 0:  # model.generate refuses it too: greedy search is do_sample=False
        raise InputError(
            f"do_sample=True samples with a temperature over 0, got temperature={temperature}: for the likeliest token "
            "at every step, pass do_sample=False"
        )
    top_k = _whole("top_k", top_k)
    if seed is None:
        seed = int(torch.randint(0, _SEEDS, ()))
    return SamplingParams(temperature, top_k or 0, top_p, seed, penalty, min_p)


def sequence_tokens(future: Future) -> list[int]:
    """A sequence's new tokens from its future; cancelled by the server (closed with ``cancel=True``, or left by an
    exception), a :class:`RequestError` that says so rather than concurrent.futures' bare ``CancelledError``."""
    try:
        return future.result()
    except CancelledError:
        raise RequestError(
            "the sequence was cancelled before it ended: its server was closed with cancel=True (a with block left "
            "by an exception does that)"
        ) from None


def _numbers(**given: Any) -> list[float]:
    """``given`` as floats; :class:`InputError` naming them unless each is a finite number."""
    wrong = {name: v for name, v in given.items() if isinstance(v, (str, bytes)) or not _is_finite_number(v)}
    if wrong:
        said = ", ".join(f"{name}={reprlib.repr(value)}" for name, value in wrong.items())
        raise InputError(f"{' and '.join(wrong)} must be finite numbers, got {said}")
    return [float(v) for v in given.values()]


def _whole(name: str, value: Any) -> int | None:
    """``value`` as an int (None: None); :class:`InputError` unless it is a whole number (50.0 is)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise InputError(f"{name} must be a whole number, got {value!r}") from None


def _is_finite_number(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past float's range (10**400)
        return False


def end_tokens(given: int | Sequence[int] | None, default: Sequence[int]) -> tuple[int, ...]:
    """The end tokens a call gives (one id, or several: a tensor or list), else ``default``, in their order (the
    first pads a row that ends early where no pad token is set); :class:`InputError` for anything but token ids."""
    if given is None:
        return tuple(default)
    given = given.tolist() if hasattr(given, "tolist") else given
    ids = [given] if not isinstance(given, (list, tuple, set, frozenset)) else list(given)
    try:
        if any(isinstance(t, bool) for t in ids):
            raise TypeError
        return tuple(dict.fromkeys(operator.index(t) for t in ids))
    except TypeError:
        raise InputError(f"eos_token_id must be a token id or a list of them, got {given!r}") from None


def generate_rows(
    lm: CompiledLM,
    engine: Engine,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    options: GenerateOptions,
    drive: Callable[[], None] | None = None,
    admitting: Callable[[], AbstractContextManager] = contextlib.nullcontext,
) -> Any:
    """A ``generate`` call through ``engine`` (``drive``: what runs the engine until the rows are done, when no
    thread of its own serves it; ``admitting``: what the rows go in under): its rows as sequences, their tokens as
    Hugging Face returns them."""
    lm.check_generation_config()  # the model's generation_config as it is now, as model.generate reads it
    defaults = lm.defaults.overridden_by(options.generation_config)
    request = GenerateRequest.of(lm, input_ids, attention_mask, options, defaults)
    # in the caller's thread: a seed drawn from torch's global generator is drawn here
    sampling = defaults.sampling(
        do_sample=options.do_sample,
        temperature=options.temperature,
        top_k=options.top_k,
        top_p=options.top_p,
        seed=options.seed,
        repetition_penalty=options.repetition_penalty,
        min_p=options.min_p,
    )
    with admitting():
        futures = request.submit(engine, sampling, options.streamer)
    try:
        if drive is not None:
            drive()
        tokens = request.assemble([sequence_tokens(f) for f in futures])
    except BaseException:  # the caller interrupted (or a row failed): the other rows stop too, freeing their slots
        for future in futures:
            future.cancel()
        raise
    if options.streamer is not None:
        options.streamer.end()
    if _first_given(options.return_dict_in_generate, defaults.return_dict_in_generate):
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=tokens)
    return tokens
