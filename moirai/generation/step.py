"""One generation step of a causal LM as a module moirai can trace once and split: prefill and decode alike.

:class:`CausalLMStep` wraps a Hugging Face-style causal LM. Its KV cache is registered buffers, one key and one
value buffer per attention layer, each ``[slots, heads, max_seq_len + 1, dim]`` as that layer writes them (the
attention's own layout, so a batch's slots are gathered without a transpose): a sequence owns a slot for its life,
and a step writes its new keys and values at ``(slot, :, position)`` in place (``index_put_``) and attends over its
slot's first C positions. The step's inputs are plain tensors, so torch.export traces it once with the batch, token
and context dimensions dynamic::

    step(input_ids[B, T], positions[B, T], slots[B], sampling[B, 6], banned[B, K], context[C]) -> tokens[B]

A prefill chunk is ``B = 1, T = n``, a decode step ``B = sequences, T = 1``. Positions come in and an attention
mask over the slot's first C positions is built from them (C is ``context``'s length, [Note: the context a step
attends over]), so no cache length is read from the cache itself and nothing but the buffers is state. The last op
samples (:func:`sample_tokens`), so the step's output is token ids, not logits; the tokens a row may not take next
come in as ``banned`` (:func:`ban_tokens`, [Note: banned tokens] in :mod:`moirai.generation.bans`).

Nothing here names a model family: the cache's shape comes from what the layers write (:class:`CacheShape`), the
masks from the Hugging Face config (:func:`layer_spans`: a sliding window hides positions older than it, a chunk
those of earlier chunks, per kind of layer where the config's ``layer_types`` differ), and the wrapped model's own
layers do the rest (fused projections, embedding scales, soft-capping), so every family whose attention calls
``cache.update`` and takes a 4D mask works.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from moirai.environment import variable_set
from moirai.errors import InputError, TraceError
from moirai.planning.bounds import format_bytes
from moirai.runtime.zero_pages import zeros_on_demand

# The columns of a step's ``sampling`` input, one row per sequence: the first four are :func:`sample_tokens`'s, then
# a repetition penalty (1: none; [Note: seen tokens]) and a min-p (0: none).
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "uniform", "repetition_penalty", "min_p")
SAMPLING_CANDIDATES = 1024  # the likeliest tokens the sampler's cuts are made among ([Note: sampling among candidates])


@dataclass(frozen=True)
class LayerCache:
    """What one attention layer writes to its cache for each token: keys of ``[key_heads, key_dim]`` and values of
    ``[value_heads, value_dim]``, under the ``layer_idx`` its attention passes to ``cache.update``."""

    layer: int
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @property
    def elements_per_token(self) -> int:
        return self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class CacheShape:
    """What the KV cache holds: for each attention layer a key buffer ``[slots, key_heads, positions, key_dim]``
    and a value buffer ``[slots, value_heads, positions, value_dim]`` of ``dtype``, ``positions`` one more than
    ``max_seq_len`` ([Note: the context a step attends over]).

    [Note: the cache's shape from what the layers write]
    The shapes are those the model's attention layers hand ``cache.update`` on a one-token probe
    (:func:`probe_step`), not read from the config: a latent-attention model (DeepSeek-V2/V3's MLA) caches a
    compressed latent and its rotary key, one "head" of ``kv_lora_rank`` and one of ``qk_rope_head_dim``, and a
    config may name key-value heads its attention does not use, as Hugging Face's own static cache sizes a layer by
    the first keys it is given.
    """

    layers: tuple[LayerCache, ...]
    slots: int
    max_seq_len: int
    dtype: torch.dtype
    seen_width: int = 0  # one flag a slot per token id the logits (or the embedding) cover ([Note: seen tokens])

    @property
    def total_bytes(self) -> int:
        """Bytes of every slot's state: its keys and values over all layers and its seen-token flags."""
        return self.slots * self.slot_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes one sequence's state takes: its keys and values over all layers, and its seen-token flags."""
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        kv_bytes = self.positions * sum(layer.elements_per_token for layer in self.layers) * element_bytes
        return kv_bytes + self.seen_width  # a bool flag is a byte

    @property
    def positions(self) -> int:
        """A slot's positions: ``max_seq_len`` and one never written, so that the positions a step attends over
        are never the whole slot ([Note: the context a step attends over])."""
        return self.max_seq_len + 1

    def buffer_sizes(self, layer: LayerCache) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The sizes of ``layer``'s key and value buffers."""
        return (
            (self.slots, layer.key_heads, self.positions, layer.key_dim),
            (self.slots, layer.value_heads, self.positions, layer.value_dim),
        )


class _ShapeRecorder:
    """A cache that keeps nothing: it notes what each layer writes and hands it back as the layer's whole cache."""

    is_compileable = True

    def __init__(self) -> None:
        self.layers: dict[int, LayerCache] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.layers[int(layer_idx)] = LayerCache(
            int(layer_idx),
            int(key_states.shape[1]),
            int(key_states.shape[-1]),
            int(value_states.shape[1]),
            int(value_states.shape[-1]),
        )
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return 1


class SlotCache:
    """The cache object the wrapped model's attention layers call: ``update`` writes the step's keys and values
    into the step module's buffers at ``(slot, position)`` and returns each sequence's whole slot.

    Positions past a sequence's own are masked by the step's attention mask, so what an earlier sequence left
    in the slot is never attended to.
    """

    is_compileable = True

    def __init__(self, step: CausalLMStep, slots: torch.Tensor, positions: torch.Tensor, context: int) -> None:
        self._step, self._slots, self._positions, self._context = step, slots, positions, context

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._step.cache_buffers(layer_idx)
        # (slot [B, 1], every head, position [B, T]): the indexed entries come out as [B, T, heads, dim]
        where = [self._slots.view(-1, 1), None, self._positions]
        torch.ops.aten.index_put_(keys, where, key_states.transpose(1, 2).to(keys.dtype))
        torch.ops.aten.index_put_(values, where, value_states.transpose(1, 2).to(values.dtype))
        # Only the positions the step attends over are gathered ([Note: the context a step attends over]).
        keys, values = keys[:, :, : self._context], values[:, :, : self._context]
        return keys.index_select(0, self._slots), values.index_select(0, self._slots)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed in; nothing reads a length from the cache

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self._context  # the keys update returns: its mask's width


class CausalLMStep(torch.nn.Module):
    """One step of ``model`` over a slot-indexed KV cache that lives in this module's buffers (see the module doc)."""

    def __init__(self, model: torch.nn.Module, slots: int, max_seq_len: int) -> None:
        super().__init__()
        config = getattr(model, "config", None)
        if config is None:
            raise InputError(
                f"{type(model).__name__} has no config: compile_lm takes a Hugging Face-style causal LM "
                "(a model with .config whose forward takes input_ids, position_ids, attention_mask and a cache)"
            )
        self.model = model
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        # What the model is checked for first: a model refused should not cost a cache allocation.
        _check_alibi(type(model).__name__, config)
        check_positions(type(model).__name__, config, max_seq_len)
        self.spans = layer_spans(config)
        parameters = inspect.signature(model.forward).parameters
        self._cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        self._keep_last_logits = "logits_to_keep" in parameters
        self._dtype = dtype  # the masks' and the cache's
        layers, logits_width = probe_step(self, device)
        self._logits_width = logits_width
        seen_width = max(logits_width, embedding_rows(model) or 0)  # every token id a prompt may feed
        self.cache_shape = CacheShape(layers, slots, max_seq_len, dtype, seen_width)
        shape = self.cache_shape
        try:
            for layer in shape.layers:
                key_size, value_size = shape.buffer_sizes(layer)
                self.register_buffer(f"key_cache_{layer.layer}", _zeros(key_size, dtype, device))
                self.register_buffer(f"value_cache_{layer.layer}", _zeros(value_size, dtype, device))
            self.register_buffer("seen_tokens", _zeros((slots, shape.seen_width), torch.bool, device))
        # torch's allocators raise RuntimeError (OutOfMemoryError), a map the kernel refuses OSError
        except (RuntimeError, MemoryError, OSError) as error:
            raise InputError(
                f"the KV cache of {shape.slots} slots of {max_seq_len} tokens takes {format_bytes(shape.total_bytes)} "
                f"in all, which this process could not allocate on {device} ({type(error).__name__}); give fewer "
                "slots (max_batch_size) or a shorter max_seq_len, or build the model on the meta device to plan "
                "without weights or caches"
            ) from None

    def cache_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"key_cache_{layer}"), getattr(self, f"value_cache_{layer}")

    @property
    def logits_width(self) -> int:
        return self._logits_width

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        sampling: torch.Tensor,
        banned: torch.Tensor,
        context: torch.Tensor,
    ) -> torch.Tensor:
        width = context.shape[0]  # [Note: the context a step attends over]
        logits = self.last_logits(input_ids, positions, SlotCache(self, slots, positions, width), width)
        column = dict(zip(SAMPLING_FIELDS, sampling.unbind(dim=-1), strict=True))
        seen = self.seen(input_ids, positions, slots)
        penalized = penalize_repetitions(logits.float(), seen[:, : self._logits_width], column["repetition_penalty"])
        allowed = ban_tokens(penalized, banned)
        return sample_tokens(allowed, sampling[:, :4], min_p=column["min_p"])  # the first four are its own

    # [Note: the context a step attends over]
    # A slot holds max_seq_len positions, but a step's rows have written only the first few of them: attending
    # over the whole slot gathered every slot's max_seq_len keys and values a layer a step (index_select copies
    # them: at 2,048 positions half of a 4-sequence decode step) and masked most of them away. The step takes a
    # ``context`` input whose length (a dimension traced dynamic, 1..max_seq_len) is how many of a slot's first
    # positions it attends over, at least each row's last position plus one; the engine passes the longest row's
    # (Engine._inputs), so a step's cost grows with its sequences' lengths, not max_seq_len. The cache is written
    # in place at each row's positions as before, and the mask hides a shorter row's positions past its own.
    # Its values are never read (what torch.export traces is its length), and a ``max_seq_len`` too short to
    # trace it at a size of its own leaves it static, at max_seq_len (context_example). A slot has one position
    # more than max_seq_len, never written: torch.export guards on whether the slice of the first C positions is
    # contiguous, which it is where C is the whole slot, and refuses a dimension one of whose values (C =
    # max_seq_len) fails the guard; with the spare position no value does.

    def seen(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Each row's seen-token flags ``[B, seen_width]`` after this step's tokens, kept in the slot.

        [Note: seen tokens]
        Hugging Face's repetition penalty divides (or, where negative, multiplies) the logit of every token in its
        ``input_ids``, the prompt and the tokens generated so far. The step keeps which tokens a slot's sequence
        has fed in a buffer, ``seen_tokens[slots, seen_width]`` (a byte each): a sequence's first chunk (position
        0) clears its slot's row, every step sets the flags of the tokens it feeds, and the penalty reads the row.
        A prompt's left padding is never fed, and transformers 5 leaves it out of the penalty too
        (``prompt_ignore_length``; transformers 4 counted the pad token). Other tokens a mask leaves out (a hole
        after the first kept token), which Hugging Face still counts, are left out of the sequence, and so of
        its flags (a ``PaddingWarning`` says so at the call). On CUDA Hugging Face divides by a number as a product
        with its reciprocal, which may round a logit one unit in the last place from the division here.
        """
        flags = self.seen_tokens.index_select(0, slots) & (positions[:, :1] != 0)
        flags = flags.scatter(1, input_ids, True)
        torch.ops.aten.index_put_(self.seen_tokens, [slots], flags)
        return flags

    def last_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: object, cache_length: int
    ) -> torch.Tensor:
        """The model's logits at each row's last token, its attention reading and writing ``cache`` under masks
        over a slot's first ``cache_length`` positions (those ``cache.update`` returns)."""
        spans = self.spans.items()
        masks = {kind: attention_mask(positions, cache_length, self._dtype, span) for kind, span in spans}
        # one mask per kind of layer, as models whose layers differ take it; else the one 4D mask every model takes
        mask = masks if len(masks) > 1 else next(iter(masks.values()))
        options = {self._cache_keyword: cache, "use_cache": True}
        if self._keep_last_logits:
            options["logits_to_keep"] = 1
        output = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, **options)
        if not hasattr(output, "logits") and hasattr(output, "last_hidden_state"):
            raise InputError(_NO_LOGITS.format(name=type(self.model).__name__))
        logits = output.logits if hasattr(output, "logits") else output[0]
        return logits[:, -1, :]


_NO_LOGITS = (
    "{name} returns hidden states, not logits: compile_lm takes the causal LM with its head (e.g. LlamaForCausalLM, "
    "AutoModelForCausalLM), whose tokens it samples from the logits"
)

# What the step hands the model, said where a model cannot take it: the cause may be there.
STEP_CALL = (
    "compile_lm calls the model with input_ids, position_ids, a 4D attention mask over each sequence's KV cache slot "
    "and a cache object of its own; a model that needs a 2D attention mask cannot generate through it"
)


def context_input(width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The step's ``context`` input for a step that attends over its slots' first ``width`` positions: only its
    length is read ([Note: the context a step attends over])."""
    return torch.zeros(width, dtype=torch.bool, device=device)


def context_example(tokens: int, max_seq_len: int, taken: set[int]) -> int | None:
    """The context width to trace the step at: at least the example's ``tokens`` and 2, and unlike the other
    dimensions' example sizes (``taken``), as torch.export takes equal example sizes for one symbol; None where
    ``max_seq_len`` leaves no such width (the context is then static, every step attending over whole slots)."""
    return next((size for size in range(max(2, tokens), max_seq_len + 1) if size not in taken), None)


def probe_step(step: CausalLMStep, device: torch.device) -> tuple[tuple[LayerCache, ...], int]:
    """What each attention layer of ``step.model`` writes to its cache, and how many logits it gives a token, from
    one token run through it with a cache that keeps nothing ([Note: the cache's shape from what the layers
    write]); on the meta device it costs nothing."""
    recorder = _ShapeRecorder()
    token = torch.zeros((1, 1), dtype=torch.long, device=device)
    name = type(step.model).__name__
    try:
        with torch.no_grad():
            logits = step.last_logits(token, token, recorder, 1)
    except InputError:
        raise
    except (torch.cuda.OutOfMemoryError, MemoryError) as error:
        raise InputError(
            f"{name} ran out of memory on {device} running one token to size its KV cache ({type(error).__name__}); "
            "free memory there, or build the model on the meta device to plan without weights"
        ) from None
    except Exception as error:  # whatever the model's own code raises: said with what it was called with
        # On meta the cause is more often an op without a meta kernel, or one stricter than the real one (torch's
        # grouped matrix product of mixture-of-experts layers wants bfloat16 there), than how the model is called.
        on_meta = (
            f"on the meta device, where an op of the model may have no meta kernel or one stricter than the real one "
            f"(mixture-of-experts layers' grouped matrix product in torch {torch.__version__}): build the model with "
            "its weights on the CPU to plan it, and see whether it runs there; else "
            if device.type == "meta"
            else ""
        )
        raise TraceError(
            f"{name} did not run one token with compile_lm's cache, which sizes the KV cache by what each attention "
            f"layer writes: {type(error).__name__}: {error} ({on_meta}{STEP_CALL})"
        ) from error
    if not recorder.layers:
        raise InputError(
            f"{name} ran a token without writing to the cache it was given ({STEP_CALL}): compile_lm needs attention "
            "layers that call cache.update with their keys and values"
        )
    width = int(logits.shape[-1])
    config = step.model.config
    head = getattr(step.model, "get_output_embeddings", lambda: True)()
    if head is None and width == getattr(config, "hidden_size", None) != getattr(config, "vocab_size", None):
        # A base model that returns a tuple (return_dict=False): its hidden states came out where logits would.
        raise InputError(_NO_LOGITS.format(name=name))
    return tuple(recorder.layers[layer] for layer in sorted(recorder.layers)), width


def embedding_rows(model: torch.nn.Module) -> int | None:
    """The rows of the model's input embedding (what a token id indexes), where the model says which it is."""
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    if isinstance(embedding, torch.nn.Embedding):
        return embedding.num_embeddings
    weight = getattr(embedding, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def penalize_repetitions(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` with each row's ``seen`` tokens penalized as Hugging Face's repetition penalty does: a
    positive logit divided by the row's ``penalty``, a negative one multiplied (1: every logit as it was)."""
    factor = penalty.float().unsqueeze(1)
    penalized = torch.where(logits < 0, logits * factor, logits / factor)
    return torch.where(seen, penalized, logits)


def ban_tokens(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` with each row's ``banned [B, K]`` token ids at ``-inf`` ([Note: banned tokens]); a row
    lists its ids first, then ``-1``s (all ``-1``: it bans nothing)."""
    # Each -1 takes its row's first entry, so every write to one logit writes one value: the row's first banned
    # id (-inf) or, in a row that bans nothing, logit 0 as it was.
    banned = torch.where(banned >= 0, banned, banned[:, :1])
    index = banned.clamp_min(0)
    blocked = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.scatter(1, index, torch.where(banned >= 0, blocked, logits.gather(1, index)))


def _zeros(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cache buffer of zeros; on the CPU one whose pages are committed as sequences write them, so this
    process's copy takes no memory where the cache's layers run elsewhere ([Note: zeros where they are used])."""
    if device.type == "cpu":
        return zeros_on_demand(size, dtype)
    return torch.zeros(size, dtype=dtype, device=device)


def _check_alibi(name: str, config: object) -> None:
    """:class:`InputError` for a model whose config asks for ALiBi biases computed from a 2D attention mask
    (Falcon's ``alibi``, and Bloom's always): the step's mask is 4D, over the whole slot. (MPT's ALiBi, a bias by
    key index over the whole slot, needs no mask and generates as it should.)"""
    bloom = getattr(config, "model_type", None) == "bloom"
    if getattr(config, "alibi", False) or bloom:
        asks = "Bloom's ALiBi position biases" if bloom else "its config's ALiBi position biases (alibi=True)"
        raise InputError(
            f"{name} computes {asks} from a 2D attention mask; compile_lm masks with a 4D mask over each sequence's "
            "KV cache slot, so it cannot generate with this model"
        )


def check_positions(name: str, config: object, max_seq_len: int) -> None:
    """:class:`InputError` for a ``max_seq_len`` the model's positions cannot take as one traced step encodes them.

    [Note: positions the step cannot encode]
    The step is traced once and runs every prefill chunk and every batched decode row through the same ops, so a
    position's encoding may depend on nothing but the position. Three kinds of config break that, or have no
    encoding for a position at all:

    - Learned or tabled absolute positions (GPT-2, GPT-J, OPT, GPT-Neo: a config without rotary parameters; its
      ``max_position_embeddings``, GPT-2's ``n_positions``; MPT's ALiBi bias, ``max_seq_len``) have no row past the
      table: a longer ``max_seq_len`` failed inside a step with an IndexError.
    - Longrope (Phi-3-mini-128k, Phi-3.5, Phi-4-mini, PhiMoE) picks short or long factors for a whole forward from its
      largest position, and Hugging Face's ``generate`` re-encodes the whole sequence with the long ones once it
      passes ``original_max_position_embeddings``: chunked prefill and batched decode rows give other tokens. Up to
      that length only the short factors are used, on both sides.
    - Dynamic rope recomputes its frequencies in Python from each forward's largest position, a branch the one traced
      step cannot hold (up to ``max_position_embeddings`` its frequencies are the unscaled ones).
    """
    for rope in _rope_parameter_sets(config):
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        if rope_type in ("longrope", "su"):  # "su": the name transformers 4's Phi-3 configs give it
            original = rope.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            if original is not None and max_seq_len > original:
                raise InputError(
                    f"{name}'s config uses longrope rotary embeddings, which switch to their long factors for a whole "
                    f"forward once it passes {original} positions (original_max_position_embeddings), and Hugging "
                    "Face's generate then re-encodes the whole sequence; compile_lm's one traced step encodes prefill "
                    f"chunks and batched decode rows apart, so past {original} tokens it would generate other tokens. "
                    f"Give max_seq_len <= {original} (got {max_seq_len}), where only the short factors are used"
                )
        elif "dynamic" in rope_type:
            limit = getattr(config, "max_position_embeddings", None)
            unscaled = (
                f"; up to max_position_embeddings={limit} its frequencies are the unscaled ones, so with max_seq_len "
                f"<= {limit} the same weights under rope_type 'default' (same rope_theta) give the same tokens"
                if limit is not None
                else ""
            )
            raise InputError(
                f"{name}'s config uses {rope_type!r} rotary embeddings, which recompute their frequencies from each "
                "forward's longest position in Python, a branch compile_lm's one traced step (every chunk and decode "
                "step alike) cannot hold. Give the config a static rope type (default, linear, yarn, llama3)" + unscaled
            )
    limit_field = _position_limit_field(config)
    if limit_field is not None:
        field, limit = limit_field
        if max_seq_len > limit:
            raise InputError(
                f"{name} has positions 0 to {limit - 1} only ({field}={limit}: a table of learned or fixed "
                f"position encodings), so a sequence cannot reach max_seq_len={max_seq_len}: give max_seq_len <= "
                f"{limit}"
            )


def _rope_parameter_sets(config: object) -> list[dict]:
    """The config's rotary parameters, one dict per kind of layer where they differ (Gemma 3); none without rope."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters is None:
        parameters = getattr(config, "rope_scaling", None)  # transformers 4's name
    if not isinstance(parameters, dict):
        return []
    if all(isinstance(value, dict) for value in parameters.values()) and parameters:
        return list(parameters.values())
    return [parameters]


def _position_limit_field(config: object) -> tuple[str, int] | None:
    """The config field that bounds the model's positions, and its value, for a model without rotary parameters
    ([Note: positions the step cannot encode]); None for a rotary model, whose positions have no hard limit."""
    if getattr(config, "rope_parameters", None) is not None or getattr(config, "rope_scaling", None) is not None:
        return None
    if any(getattr(config, marker, None) is not None for marker in ("rope_theta", "rotary_emb_base", "rotary_pct")):
        return None  # transformers 4's rotary configs (GPT-NeoX's among them) may have no rope_scaling
    for field in ("n_positions", "max_position_embeddings", "max_seq_len"):
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return field, value
    return None


# Hugging Face's sdpa attention reads this at each call: "1" passes grouped key-value heads to sdpa as they are.
_FORCE_GQA_VARIABLE = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextlib.contextmanager
def grouped_query_attention() -> Iterator[None]:
    """While tracing the step: Hugging Face's sdpa attention hands sdpa the grouped key-value heads
    (``enable_gqa``) instead of copying each of them per query head (``repeat_kv``), as it does whenever a mask is
    given and the token count is not known to be 1 (a decode step of batch 8 copied its whole cache twice a layer)."""
    with variable_set(_FORCE_GQA_VARIABLE, "1"):
        yield


class AttentionSpan(NamedTuple):
    """The earlier positions a kind of attention layer sees: all (None), the last ``window`` of them, or those in
    its own ``chunk`` of positions (Llama 4's chunked attention: positions 0..chunk-1, chunk..2 chunk-1, ...)."""

    window: int | None = None
    chunk: int | None = None


FULL_SPAN = AttentionSpan()  # every earlier position


def _chunk_span(config: object) -> AttentionSpan:
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk:
        raise InputError(
            "the model's config has chunked_attention layers and no attention_chunk_size: compile_lm cannot mask them"
        )
    return AttentionSpan(chunk=chunk)


# The layer types of Hugging Face configs moirai masks, each with its span as the config gives it.
ATTENTION_KINDS = {
    "full_attention": lambda config: FULL_SPAN,
    "sliding_attention": lambda config: AttentionSpan(window=getattr(config, "sliding_window", None)),
    "chunked_attention": _chunk_span,
}
# Layer types that keep a state other than keys and values: said as such where a config has them.
_RECURRENT_KINDS = ("linear_attention", "mamba", "conv", "recurrent")


def layer_spans(config: object) -> dict[str, AttentionSpan]:
    """Each kind of attention layer in ``config`` with what its mask keeps. A config without ``layer_types`` has
    one kind, windowed where it has a ``sliding_window``."""
    if getattr(config, "use_bidirectional_attention", False):
        raise InputError("the model's config asks for bidirectional attention: compile_lm generates with causal LMs")
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ())
    if not kinds:
        return {"full_attention" if window is None else "sliding_attention": AttentionSpan(window)}
    unknown = sorted(kinds - set(ATTENTION_KINDS))
    if unknown:
        recurrent = [kind for kind in unknown if kind in _RECURRENT_KINDS]
        why = (
            f"; {', '.join(recurrent)} layers keep a recurrent or convolution state, not keys and values, which "
            "compile_lm's step does not hold (moirai.compile splits one forward pass of such a model)"
            if recurrent
            else ""
        )
        raise InputError(
            f"the model's config has layers of type {unknown}: compile_lm masks only {list(ATTENTION_KINDS)} "
            f"layers{why}"
        )
    return {kind: ATTENTION_KINDS[kind](config) for kind in sorted(kinds)}


def attention_mask(
    positions: torch.Tensor, width: int, dtype: torch.dtype, span: AttentionSpan = FULL_SPAN
) -> torch.Tensor:
    """The additive mask ``[B, 1, T, width]`` over a slot's first ``width`` positions: a token at position p sees
    the slot's positions 0..p, or with
    a sliding window only the last ``span.window`` of them (p - window + 1..p, as Hugging Face's sliding masks),
    or with a chunk only those of its own chunk (as Hugging Face's chunked masks, counted from the sequence's first
    token, which is a slot's position 0)."""
    slot_positions = torch.arange(width, device=positions.device).view(1, 1, -1)
    seen = slot_positions <= positions.unsqueeze(-1)
    if span.window is not None:
        seen = seen & (slot_positions > positions.unsqueeze(-1) - span.window)
    if span.chunk is not None:
        seen = seen & (slot_positions // span.chunk == positions.unsqueeze(-1) // span.chunk)
    # torch.full, not torch.tensor: on the meta device export lifts a torch.tensor as a constant it then writes
    # (detach_), which reads as state outside the module's buffers.
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=positions.device)
    return torch.where(seen, torch.zeros((), dtype=dtype, device=positions.device), blocked).unsqueeze(1)


def sample_tokens(logits: torch.Tensor, sampling: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The next token of every row of ``logits [B, V]``, chosen as ``sampling [B, 4]`` says.

    A row's ``(temperature, top_k, top_p, uniform)``: temperature 0 is greedy (the first largest logit, as
    ``argmax`` and Hugging Face's greedy search take it); otherwise the logits are divided by the temperature,
    cut to the ``top_k`` largest (0: all), to the smallest set whose probability reaches ``top_p`` (0: the likeliest
    token alone), and to those at least a row's ``min_p`` times as likely as its likeliest token (Hugging Face's
    order: temperature, top-k, top-p, min-p), and the token is drawn by inverting the remaining distribution's CDF
    at ``uniform`` (a number in [0, 1) the caller draws, so a seeded run is reproducible wherever it runs).

    [Note: sampling among candidates]
    Nothing sorts the vocabulary: a sort of Llama 3's 128,256 logits took 77 ms for 8 rows on one core, every step
    and greedy ones too, where the model's own greedy search takes an argmax. The cuts are made among the
    :data:`SAMPLING_CANDIDATES` likeliest tokens (``topk``), priced against the whole vocabulary's probabilities, so
    they are exact wherever what a row keeps is among them: always with ``top_k`` at most that many, and with no
    cut at all (``top_k`` 0, ``top_p`` 1, ``min_p`` 0), where the draw is over the whole vocabulary in token order.
    A row with no ``top_k`` and a ``top_p`` or ``min_p`` draws among the candidates only: the engine warns of it,
    and refuses a ``top_k`` over the candidates and under the vocabulary (:func:`moirai.generation.engine.Engine.add`).
    A candidate tied with the ``top_k``-th is kept, as Hugging Face keeps every tie (a half-precision model's
    logits tie often).
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    temperature, top_k, top_p, uniform = sampling.float().unbind(dim=-1)
    min_p = torch.zeros_like(top_p) if min_p is None else min_p.float()
    vocab = logits.shape[-1]
    scaled = logits / temperature.clamp_min(1e-5).unsqueeze(-1)
    candidates = min(vocab, SAMPLING_CANDIDATES)
    values, order = scaled.topk(candidates, dim=-1)  # the likeliest first
    every_token = (top_k <= 0) | (top_k >= vocab)
    kth = values.gather(-1, (top_k.long() - 1).clamp(0, candidates - 1).unsqueeze(-1))  # ties with it are kept
    keep = every_token.unsqueeze(-1) | (values >= kth)
    # Probabilities over what top-k keeps: the row's top_k candidates, or the whole vocabulary.
    whole = torch.softmax(scaled, dim=-1)
    within = (~every_token & (top_k <= candidates)).unsqueeze(-1)
    kept = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    probabilities = torch.where(within, kept, whole.gather(-1, order).masked_fill(~keep, 0.0))
    # Top-p keeps the likeliest token whatever its probability, as Hugging Face's keeps min_tokens_to_keep = 1: a
    # top_p of 0 keeps it alone (where nothing was kept, the draw fell past the last candidate).
    likeliest = torch.arange(candidates, device=logits.device) == 0
    keep = keep & (((probabilities.cumsum(dim=-1) - probabilities) < top_p.unsqueeze(-1)) | likeliest)
    keep = keep & (probabilities >= min_p.unsqueeze(-1) * probabilities[:, :1])  # the first is the likeliest
    cdf = probabilities.masked_fill(~keep, 0.0).cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (uniform.unsqueeze(-1) * cdf[:, -1:]).contiguous(), right=True)
    among_candidates = order.gather(-1, pick.clamp_max(candidates - 1)).squeeze(-1)
    whole_cdf = whole.cumsum(dim=-1)
    whole_pick = torch.searchsorted(whole_cdf, (uniform.unsqueeze(-1) * whole_cdf[:, -1:]).contiguous(), right=True)
    over_vocabulary = whole_pick.clamp_max(vocab - 1).squeeze(-1)
    uncut = every_token & (top_p >= 1.0) & (min_p <= 0.0)
    return torch.where(temperature > 0, torch.where(uncut, over_vocabulary, among_candidates), greedy)
