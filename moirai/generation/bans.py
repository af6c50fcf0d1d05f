"""Tokens a sequence may not take next, as Hugging Face's logits processors that set logits to ``-inf`` ban them.

[Note: banned tokens]
Six of ``model.generate``'s settings ban tokens: ``min_length`` and ``min_new_tokens`` (the end tokens, until the
sequence is that long), ``suppress_tokens`` (always), ``begin_suppress_tokens`` (the first new token),
``bad_words_ids`` (a word's last token, where the tokens before it end the sequence so far) and
``no_repeat_ngram_size`` (a token that would repeat an n-gram of the sequence so far). What each bans depends on
the sequence's tokens, which the engine holds: it works out each row's banned tokens before a step that gives a
token, and the step takes them as an input ``banned [B, K]`` (token ids; ``-1`` where a row bans fewer than ``K``)
and sets their logits to ``-inf`` after the repetition penalty and before temperature and the cuts, where Hugging
Face's processors run. The bans compose (each only lowers logits to ``-inf``), so their order among themselves does
not matter. Hugging Face reads a row's ``input_ids`` as given, its padding and any hole in its mask included: the
sequence's history here starts with the row as given too, and ``min_length`` counts its padded width.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from moirai.errors import InputError
from moirai.file_numbers import is_integer


@dataclass(frozen=True)
class TokenBans:
    """The settings that ban tokens, named as Hugging Face's (unset: bans nothing)."""

    min_length: int = 0  # prompt (as given, padding included) and new tokens: no end token before it
    min_new_tokens: int | None = None  # no end token before this many new tokens (set, even 0: min_length is not)
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()

    @classmethod
    def settings(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def overridden_by(self, values: dict[str, Any], where: str) -> TokenBans:
        """These bans with each of ``values`` that is set (not None) standing before them; :class:`InputError`
        naming ``where`` for a value Hugging Face would refuse."""
        given = {name: value for name, value in values.items() if value is not None}
        return replace(self, **{name: _checked(name, value, where) for name, value in given.items()})

    @property
    def any(self) -> bool:
        return self != TokenBans()

    def for_sequence(self, row: Sequence[int], eos: Iterable[int]) -> SequenceBans | None:
        """The bans of one sequence whose ``generate`` row (or prompt) is ``row``, as given; None if it has none."""
        if not self.any:
            return None
        eos = frozenset(eos)
        # min_new_tokens stands before min_length, which counts the row's padded width (Hugging Face's).
        min_new = self.min_new_tokens if self.min_new_tokens is not None else max(self.min_length - len(row), 0)
        # Hugging Face leaves a bad word that is one end token out.
        words = tuple(word for word in self.bad_words_ids if not (len(word) == 1 and word[0] in eos))
        return SequenceBans(
            always=frozenset(self.suppress_tokens) | {word[0] for word in words if len(word) == 1},
            at_first=frozenset(self.begin_suppress_tokens),
            eos_until=min_new,
            eos=eos,
            words=tuple(word for word in words if len(word) > 1),
            word_tokens=frozenset(t for word in words for t in word),
            ngram_size=self.no_repeat_ngram_size,
            history=list(row),
        )


@dataclass
class SequenceBans:
    """One sequence's bans, and the n-grams of its tokens so far (kept as they come, not built again each step)."""

    always: frozenset[int]
    at_first: frozenset[int]
    eos_until: int  # the end tokens are banned while fewer new tokens than this have come
    eos: frozenset[int]
    words: tuple[tuple[int, ...], ...]  # bad words of two tokens or more
    word_tokens: frozenset[int]  # every token of the bad words (the one-token ones are in ``always``)
    ngram_size: int
    history: list[int]  # the row as given, then each new token
    _row_length: int = -1
    _followers: dict[tuple[int, ...], set[int]] = field(default_factory=dict)  # an (n-1)-gram: the tokens after it
    _indexed: int = 0  # n-grams ending before this index of history are in _followers

    def __post_init__(self) -> None:
        self._row_length = len(self.history)

    def banned(self, new_tokens: Sequence[int]) -> list[int]:
        """The tokens the next token may not be, after the sequence's ``new_tokens`` so far."""
        self.history[self._row_length :] = new_tokens
        generated = len(new_tokens)
        banned = set(self.always)
        if generated == 0:
            banned |= self.at_first
        if generated < self.eos_until:
            banned |= self.eos
        history = self.history
        for word in self.words:
            prefix = word[:-1]
            if len(history) >= len(prefix) and tuple(history[len(history) - len(prefix) :]) == prefix:
                banned.add(word[-1])
        if self.ngram_size:
            banned |= self._repeating(history)
        return sorted(banned)

    def _repeating(self, history: list[int]) -> set[int]:
        """The tokens that would complete an n-gram ``history`` already holds (Hugging Face's no_repeat_ngram)."""
        n = self.ngram_size
        for end in range(max(self._indexed, n), len(history) + 1):
            self._followers.setdefault(tuple(history[end - n : end - 1]), set()).add(history[end - 1])
        self._indexed = max(self._indexed, len(history) + 1)
        if len(history) < n:
            return set()
        return self._followers.get(tuple(history[len(history) - n + 1 :]), set())


def _checked(name: str, value: Any, where: str) -> Any:
    """``value`` of the setting ``name`` in :class:`TokenBans`' form, as Hugging Face takes it (any integer type, a
    tensor or array of ids; a size or length of 0 or less: none); :class:`InputError` where it takes none."""
    if name in ("min_length", "min_new_tokens", "no_repeat_ngram_size"):
        if not is_integer(value):
            raise InputError(f"{name} in {where} must be a whole number, got {value!r}")
        return int(value) if name == "min_new_tokens" else max(int(value), 0)
    value = value.tolist() if hasattr(value, "tolist") else value
    if name == "bad_words_ids":
        words = value if isinstance(value, (list, tuple)) else None
        if not words or any(not isinstance(w, (list, tuple)) or not w or not _token_ids(w) for w in words):
            raise InputError(
                f"bad_words_ids in {where} must be a non-empty list of non-empty lists of token ids (>= 0), as "
                f"model.generate takes it, got {value!r}"
            )
        return tuple(tuple(int(t) for t in word) for word in words)
    if not isinstance(value, (list, tuple)) or not all(is_integer(t) for t in value):
        raise InputError(f"{name} in {where} must be a list of token ids, got {value!r}")
    return tuple(int(t) for t in value)  # an id outside the logits bans nothing, as in Hugging Face's


def _token_ids(values: Sequence[Any]) -> bool:
    return all(is_integer(t) and t >= 0 for t in values)
