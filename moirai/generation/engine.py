"""The generation loop: sequences in cache slots, prefill chunks and batched decode steps kept in flight.

An :class:`Engine` owns the slots of one split step program (:mod:`moirai.generation.step`) and drives it through
a ``submit(flat_inputs) -> Future[tokens]`` function: the local runner (each step done before the next) or the
distributed server (steps pipelined through the ranks). Every round it fills the pipeline up to ``depth`` steps:

- a sequence whose prompt is not yet in its slot sends its next chunk of at most ``max_prefill`` tokens alone
  (``B = 1``); the token of its last chunk is its first new token;
- every sequence belongs to one of ``depth`` decode groups (the smallest when it joins; an idle one moves to the
  smallest where groups drift two apart as sequences leave, :meth:`Engine._balance_groups`); a group's sequences that
  wait for their next token go in one step (``T = 1``, at most the step's batch), one step of a group in flight at a
  time, so that as many steps as stages are in flight, each as large as its group: stage k decodes one group while
  stage k + 1 decodes another (steps cut from whoever was idle would stay as small as the first ones were);

and it takes each step's tokens as they come back. Sequences join (a free slot) and leave (end of sequence,
``max_new_tokens``, or their future cancelled) between steps: continuous batching. A sequence's step reads only
its own slot's positions up to its own, each written by that sequence before it is read, so slots need no clearing.
"""

from __future__ import annotations

import math
import queue
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from moirai.errors import DistributedError, InputError, MoiraiError, MoiraiWarning, RequestError, user_stacklevel
from moirai.generation.bans import SequenceBans
from moirai.generation.step import SAMPLING_CANDIDATES, SAMPLING_FIELDS, context_input
from moirai.runtime.driver import ServedFuture, settle_future

if TYPE_CHECKING:
    from moirai.runtime.runner import Worlds

# A top_k at least this large keeps every token of any vocabulary; float32 (the step's sampling input) holds it exactly.
_TOP_K_ALL = 2**24

SubmitStep = Callable[[tuple[torch.Tensor, ...]], "Future[torch.Tensor]"]


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence picks its tokens: ``temperature`` 0 is greedy; else top-k (0: all) and top-p sampling
    seeded by ``seed`` (a seeded sequence draws the same tokens on every run). Either way the logits of the tokens
    it has seen are penalized by ``repetition_penalty`` first, as Hugging Face's (1: not at all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # sampled tokens are at least this times as likely as the likeliest (0: any)

    def row(self, uniform: float) -> list[float]:
        """This sampling as a row of the step's ``sampling`` input (its columns: ``SAMPLING_FIELDS``), with the
        ``uniform`` number a sampled step draws at; a ``top_k`` past any vocabulary reads as all tokens, as it does."""
        values = {"uniform": uniform, "top_k": min(self.top_k, _TOP_K_ALL)}
        return [float(values[name] if name in values else getattr(self, name)) for name in SAMPLING_FIELDS]

    def __post_init__(self) -> None:
        # Written as "not ... ok" so that NaN, which fails every comparison, is refused too.
        if not (
            0 <= self.temperature < math.inf
            and self.top_k >= 0
            and 0 <= self.top_p <= 1  # 0 keeps the likeliest token alone, as Hugging Face's min_tokens_to_keep
            and 0 < self.repetition_penalty < math.inf
            and 0 <= self.min_p <= 1
        ):
            raise InputError(
                f"sampling needs a finite temperature >= 0, top_k >= 0, 0 <= top_p <= 1, a finite repetition_penalty "
                f"> 0 and 0 <= min_p <= 1; got temperature={self.temperature}, top_k={self.top_k}, "
                f"top_p={self.top_p}, repetition_penalty={self.repetition_penalty}, min_p={self.min_p}"
            )


@dataclass
class SequenceState:
    """One sequence being generated: its slot, its prompt, the tokens so far and where it stands."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    future: ServedFuture = field(default_factory=ServedFuture)
    on_token: Callable[[int], None] | None = None
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the slot
    tokens: list[int] = field(default_factory=list)
    busy: bool = False  # a step of it is in flight
    group: int = 0  # the decode group it steps with (Engine._next_step)
    generator: torch.Generator | None = None
    bans: SequenceBans | None = None  # the tokens it may not take next ([Note: banned tokens]); None: none
    world: int = 0  # the ranks' world its first chunk ran in, where its cache is (Engine's worlds; 0: not begun)

    @property
    def next_position(self) -> int:
        return self.prefilled + max(len(self.tokens) - 1, 0) if self.tokens else self.prefilled

    @property
    def finished(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or (bool(self.tokens) and self.tokens[-1] in self.eos_token_ids)

    def uniform(self) -> float:
        if self.sampling.temperature == 0:
            return 0.0
        if self.generator is None:
            self.generator = torch.Generator()
            if self.sampling.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.sampling.seed)
        return float(torch.rand((), generator=self.generator))


@dataclass(frozen=True)
class _Step:
    """A step in flight: its sequences, and for a prefill chunk (one sequence) its length (0: a decode step);
    a decode step's tokens, and a prompt's last chunk's, are new tokens."""

    sequences: tuple[SequenceState, ...]
    prefill_tokens: int = 0
    cache_epoch: int = 0  # the ranks' caches it ran on: Engine's count of rank failures when it was submitted
    world: int = 0  # the ranks' world it was submitted to (Engine's worlds)

    @property
    def gives_tokens(self) -> bool:
        sequence = self.sequences[0]
        return not self.prefill_tokens or sequence.prefilled + self.prefill_tokens == len(sequence.prompt)


class Engine:
    """Runs sequences through a split step program; see the module doc. Thread-safe ``add``; one loop thread."""

    def __init__(
        self,
        submit: SubmitStep,
        slots: int,
        max_seq_len: int,
        max_prefill: int,
        max_batch: int,
        depth: int,
        vocab_size: int | None = None,
        logits_width: int | None = None,
        worlds: Worlds | None = None,
        min_context: int = 1,
    ) -> None:
        """``worlds``: the ranks' restarts, where ``submit`` runs steps on ranks that restart after a failure;
        ``min_context``: the least context a step is given (max_seq_len where the step's context is static)."""
        self._submit = submit
        self._worlds = worlds
        self._free_slots = list(range(slots))
        self.max_seq_len, self.max_prefill, self.max_batch, self.depth = max_seq_len, max_prefill, max_batch, depth
        self.vocab_size = vocab_size  # None: token ids are not checked
        self.logits_width = logits_width  # the token ids a step can ban (None: any)
        self.min_context = min_context
        self._waiting: queue.Queue[SequenceState] = queue.Queue()  # added, not yet given a slot
        self._active: list[SequenceState] = []  # in a slot (the loop thread's only)
        self._in_flight: dict[Future, _Step] = {}
        # Steps' futures as they settle (their done callbacks put them here): the loop waits on this one queue
        # rather than on every future in flight each round.
        self._settled: queue.SimpleQueue[Future] = queue.SimpleQueue()
        # Rank failures taken so far: each loses the caches of every sequence begun before it, once. A step of
        # before the last failure that fails late (its rank's other steps in flight) ends its own sequences only:
        # sequences begun since run on the restarted ranks.
        self._cache_epoch = 0
        self._unsettled: set[Future] = set()  # futures of sequences added, until they settle (any thread)
        self._unsettled_lock = threading.Lock()
        self.failure: BaseException | None = None  # what ended a serving loop: every later sequence fails with it
        self.closed = False  # its server is closing: sequences added so far are served, later ones refused
        self._in_callers_thread = False  # the loop runs in its caller's thread ([Note: whose KeyboardInterrupt])
        self._loop_thread: threading.Thread | None = None  # the thread that serves the sequences, once it began

    def check(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        """:class:`InputError` unless a sequence of this prompt and length fits a slot and its tokens are the
        model's."""
        if len(prompt) == 0:
            raise InputError("the prompt is empty: give at least one token")
        if self.vocab_size is not None:
            outside = next(((i, t) for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size), None)
            if outside is not None:
                position, token = outside
                raise InputError(
                    f"the prompt's token {token} (position {position}) is not a token id of the model, whose "
                    f"vocabulary has ids 0 to {self.vocab_size - 1}: give ids from the model's tokenizer"
                )
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise InputError(
                f"a prompt of {len(prompt)} tokens plus max_new_tokens={max_new_tokens} is "
                f"{len(prompt) + max_new_tokens} tokens, over max_seq_len={self.max_seq_len}: shorten the prompt, "
                "ask for fewer tokens, or compile_lm with a larger max_seq_len"
            )

    def add(self, sequence: SequenceState) -> Future:
        self.check(sequence.prompt, sequence.max_new_tokens)
        self._check_candidate_cuts(sequence.sampling)
        self._check_bans(sequence.bans)
        with self._unsettled_lock:
            if self.closed:  # checked under the lock close takes: a sequence added after would wait for ever
                raise InputError("this generation server is closed; open a new one with lm.server()")
            if self.failure is not None:  # no loop serves it any more (checked under the lock fail_all takes)
                raise RequestError(
                    f"the generation loop failed ({self.failure!r}) and serves no more sequences; open a new server "
                    "with lm.server()"
                ) from self.failure
            self._unsettled.add(sequence.future)
            self._waiting.put(sequence)
        sequence.future.add_done_callback(self._settle)  # at its result, its failure or its cancelling
        sequence.future.forbid_waits_where(self.in_loop_thread)
        return sequence.future

    def _check_bans(self, bans: SequenceBans | None) -> None:
        """:class:`InputError` for a bad word past the logits, as Hugging Face's ``ValueError`` (a suppressed
        token past them bans nothing there, nor here: :meth:`_banned`)."""
        width = self.logits_width
        outside = sorted(t for t in bans.word_tokens if t >= width) if bans and width else []
        if outside:
            raise InputError(
                f"bad_words_ids holds token ids {outside[:8]}, past the model's {width} logits (ids 0 to "
                f"{width - 1}): give ids from the model's tokenizer"
            )

    def _banned(self, sequence: SequenceState, step: _Step) -> list[int]:
        """The token ids ``sequence`` may not take next where ``step`` gives it one ([Note: banned tokens]); only
        ids among the logits, as Hugging Face's processors ban none past them (an end token of -1 among them)."""
        if sequence.bans is None or not step.gives_tokens:
            return []
        width = self.logits_width
        return [t for t in sequence.bans.banned(sequence.tokens) if 0 <= t and (width is None or t < width)]

    def _check_candidate_cuts(self, sampling: SamplingParams) -> None:
        """[Note: sampling among candidates] in step.py: :class:`InputError` for a top-k over the candidates (and
        under the vocabulary), which they cannot hold; a :class:`MoiraiWarning` for a top-p or min-p cut with no
        top-k, which may reach past them."""
        width = self.logits_width if self.logits_width is not None else self.vocab_size  # what the sampler cuts
        vocabulary = width if width is not None else float("inf")
        if sampling.temperature == 0 or vocabulary <= SAMPLING_CANDIDATES:
            return
        if SAMPLING_CANDIDATES < sampling.top_k < vocabulary:
            raise InputError(
                f"top_k={sampling.top_k} is over the {SAMPLING_CANDIDATES} likeliest tokens the step's sampler cuts "
                f"among: give a top_k of at most {SAMPLING_CANDIDATES}, or 0 for every token"
            )
        # A top_p of 0 keeps the likeliest token alone, always a candidate: that cut is exact.
        cut = sampling.top_p > 0 and (sampling.top_p < 1 or sampling.min_p > 0)
        if (sampling.top_k == 0 or sampling.top_k >= vocabulary) and cut:
            warnings.warn(
                f"top_p={sampling.top_p} and min_p={sampling.min_p} with no top_k are cut among the "
                f"{SAMPLING_CANDIDATES} likeliest tokens: where those hold less than top_p (or more tokens pass "
                f"min_p), the token is drawn among them only; a top_k of at most {SAMPLING_CANDIDATES} cuts exactly",
                MoiraiWarning,
                stacklevel=user_stacklevel(),
            )

    @property
    def unfinished(self) -> int:
        """Sequences added whose futures have not settled (generating, or waiting for a slot); any thread."""
        with self._unsettled_lock:
            return len(self._unsettled)

    def cancel_all(self) -> None:
        """Cancel every sequence added that has not settled; each ends after its step in flight (any thread)."""
        with self._unsettled_lock:
            unsettled = list(self._unsettled)
        for future in unsettled:
            future.cancel()  # its done callback takes the lock: called outside it

    def _settle(self, future: Future) -> None:
        with self._unsettled_lock:
            self._unsettled.discard(future)

    def in_loop_thread(self) -> bool:
        """The caller runs in the thread that serves the sequences (where their callbacks run)."""
        return threading.current_thread() is self._loop_thread

    def run_until_idle(self) -> None:
        """Serve every sequence added so far (and any added meanwhile) to its end, in the calling thread."""
        self._in_callers_thread = True
        self._loop_thread = threading.current_thread()
        while self._admit(block=False) or self._active or self._in_flight:
            self._round()

    def serve_forever(self, stopped: threading.Event) -> None:
        """Serve sequences as they are added until ``stopped`` is set and nothing is left (a server's thread)."""
        self._loop_thread = threading.current_thread()
        while not (stopped.is_set() and not self._active and not self._in_flight and self._waiting.empty()):
            if not self._active and not self._in_flight:
                self._admit(block=True)
            self._round()

    def close(self) -> None:
        """Refuse every sequence added from now on (any thread); the loop serves those added before."""
        with self._unsettled_lock:
            self.closed = True

    def fail_all(self, error: BaseException) -> None:
        """Fail every sequence added, and every one added from now on (the loop that served them has ended)."""
        with self._unsettled_lock:
            self.failure = error
        if not isinstance(error, MoiraiError):  # a fault of the loop's own: the sequences learn it as ours
            stopped = RequestError(f"the generation loop failed ({error!r}) and serves no more sequences")
            stopped.__cause__ = error
            error = stopped
        for sequence in [*self._active, *self._drain_waiting()]:
            settle_future(sequence.future, None, error)
        self._active.clear()

    # --- one round: admit, fill the pipeline, take what came back ---

    def _round(self) -> None:
        self._end_cancelled()
        self._end_lost_caches()
        self._admit(block=False)
        self._balance_groups()
        self._fill_pipeline()
        if self._in_flight:
            try:
                future = self._settled.get(timeout=0.5)
            except queue.Empty:
                return
            self._finish_step(self._in_flight.pop(future), future)

    def _admit(self, block: bool) -> bool:
        """Give waiting sequences free slots; whether any sequence is waiting or was admitted."""
        admitted = False
        while self._free_slots:
            try:
                sequence = self._waiting.get(timeout=0.2) if block and not admitted else self._waiting.get_nowait()
            except queue.Empty:
                break
            if sequence.future.cancelled():  # cancelled while it waited: it never takes a slot
                continue
            sequence.slot = self._free_slots.pop(0)
            sizes = self._group_sizes()
            sequence.group = sizes.index(min(sizes))  # the smallest decode group
            self._active.append(sequence)
            admitted = True
        return admitted or not self._waiting.empty()

    def _balance_groups(self) -> None:
        """Move idle sequences from the largest decode group to the smallest while their sizes differ by two or more.

        Sequences leave whenever they end, so groups filled evenly drift apart: two stages whose groups held 2 and 0
        sequences decoded one step at a time, as one stage would. A sequence that is not in a step in flight may
        step with any group: its slot and tokens are its own."""
        while True:
            sizes = self._group_sizes()
            largest, smallest = sizes.index(max(sizes)), sizes.index(min(sizes))
            idle = [s for s in self._active if s.group == largest and not s.busy]
            if sizes[largest] - sizes[smallest] < 2 or not idle:
                return
            idle[-1].group = smallest  # the latest to join: the earlier keep the steps they were in

    def _group_sizes(self) -> list[int]:
        """How many sequences in a slot each decode group holds."""
        sizes = [0] * self.depth
        for sequence in self._active:
            sizes[sequence.group] += 1
        return sizes

    def _fill_pipeline(self) -> None:
        while len(self._in_flight) < self.depth:
            step = self._next_step()
            if step is None:
                return
            for sequence in step.sequences:
                sequence.busy = True
            try:
                future = self._submit(self._inputs(step))
            except MoiraiError as error:
                self._fail_step(step, error)
                continue
            except Exception as error:  # a step that cannot be built fails its own sequences, not the server
                failed = RequestError(f"a step of {len(step.sequences)} sequence(s) could not start ({error!r})")
                failed.__cause__ = error
                self._fail_step(step, failed)
                continue
            step = self._begin(step)
            self._in_flight[future] = step
            future.add_done_callback(self._settled.put)  # at once if already settled (the local runner's)

    def _world(self) -> int:
        return self._worlds.current if self._worlds is not None else 0

    def _begin(self, step: _Step) -> _Step:
        """``step``, submitted, with the world it went to (read after the submit, which may start the ranks); a
        sequence's first step puts its cache there."""
        step = replace(step, world=self._world())
        for sequence in step.sequences:
            sequence.world = sequence.world or step.world
        return step

    def _end_lost_caches(self) -> None:
        """End the sequences whose cache was on ranks that have restarted since their last step: a rank can die
        while no step is in flight (its death then fails no step), and the next step would read an empty cache."""
        world = self._world()
        for sequence in [s for s in self._active if not s.busy and s.world not in (0, world)]:
            self._end(sequence, self._lost_cache(sequence))

    def _lost_cache(self, sequence: SequenceState) -> DistributedError:
        """Why ``sequence``'s cache is gone: the failure that ended its world, which names the rank."""
        failure = self._worlds.ended_by(sequence.world) if self._worlds is not None else None
        if isinstance(failure, DistributedError):
            return failure  # as a sequence failed with its step is told
        lost = DistributedError(
            f"the ranks that held this sequence's cache were restarted ({failure or 'after a failure'}): it cannot go "
            "on; submit it again"
        )
        lost.__cause__ = failure
        return lost

    def _next_step(self) -> _Step | None:
        idle = [s for s in self._active if not s.busy]
        for sequence in idle:
            if sequence.prefilled < len(sequence.prompt):
                chunk = min(self.max_prefill, len(sequence.prompt) - sequence.prefilled)
                return _Step((sequence,), chunk, self._cache_epoch)
        # Each group decodes together, one step of it in flight at a time: as many groups as steps in flight, so
        # that stage k decodes one group while stage k + 1 decodes another, each step as large as its group.
        busy_groups = {s.group for s in self._active if s.busy and s.tokens}
        for group in range(self.depth):
            members = [s for s in idle if s.tokens and s.group == group]
            if members and group not in busy_groups:
                return _Step(tuple(members[: self.max_batch]), 0, self._cache_epoch)
        return None

    def _inputs(self, step: _Step) -> tuple[torch.Tensor, ...]:
        ids, positions, rows, banned = [], [], [], []
        for sequence in step.sequences:
            if step.prefill_tokens:
                start = sequence.prefilled
                ids.append(sequence.prompt[start : start + step.prefill_tokens])
                positions.append(list(range(start, start + step.prefill_tokens)))
            else:
                ids.append([sequence.tokens[-1]])
                positions.append([sequence.next_position])
            rows.append(sequence.sampling.row(sequence.uniform()))
            banned.append(self._banned(sequence, step))
        slots = [s.slot for s in step.sequences]
        width = max(1, *map(len, banned))
        # Each row attends over its slot up to its last position ([Note: the context a step attends over]).
        context = max(self.min_context, 1 + max(row[-1] for row in positions))
        # On the host: each part moves the inputs it reads to its own device.
        return (
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            torch.tensor(slots, dtype=torch.long),
            torch.tensor(rows, dtype=torch.float32),
            torch.tensor([b + [-1] * (width - len(b)) for b in banned], dtype=torch.long),
            context_input(context),
        )

    def _finish_step(self, step: _Step, future: Future) -> None:
        error = future.exception()
        if isinstance(error, DistributedError) and step.cache_epoch == self._cache_epoch:
            # A rank failed: the caches it held are gone (a restarted rank starts empty), so every sequence that
            # has begun fails with it; sequences still waiting for a slot start afresh on the new ranks.
            self._cache_epoch += 1
            for sequence in list(self._active):
                self._end(sequence, error)
            return
        if error is not None:
            self._fail_step(step, error)
            return
        tokens = future.result().tolist()
        gives_tokens = step.gives_tokens
        for sequence, token in zip(step.sequences, tokens, strict=True):
            if sequence.world != step.world:  # its cache was on ranks that restarted before this step went out
                self._end(sequence, self._lost_cache(sequence))
                continue
            sequence.busy = False
            sequence.prefilled += step.prefill_tokens
            if gives_tokens:
                self._take_token(sequence, int(token))

    def _end_cancelled(self) -> None:
        """End the sequences whose futures their callers cancelled (``Future.cancel``, a stream closed), freeing
        their slots; one with a step in flight ends when that step comes back."""
        for sequence in [s for s in self._active if not s.busy and s.future.cancelled()]:
            self._end(sequence, None)

    def _take_token(self, sequence: SequenceState, token: int) -> None:
        if sequence.future.cancelled():
            self._end(sequence, None)
            return
        sequence.tokens.append(token)
        if sequence.on_token is not None:
            try:
                sequence.on_token(token)
            except BaseException as error:  # a caller's callback failing ends its own sequence only
                if self._in_callers_thread and isinstance(error, KeyboardInterrupt):
                    raise  # [Note: whose KeyboardInterrupt]
                self._end(sequence, _callback_failure(error))
                return
        if sequence.finished:
            self._end(sequence, None)

    def _fail_step(self, step: _Step, error: BaseException) -> None:
        for sequence in step.sequences:
            self._end(sequence, error)

    def _end(self, sequence: SequenceState, error: BaseException | None) -> None:
        sequence.busy = False
        if sequence in self._active:
            self._active.remove(sequence)
            self._free_slots.append(sequence.slot)
        settle_future(sequence.future, list(sequence.tokens), error, self._in_callers_thread)

    def _drain_waiting(self) -> list[SequenceState]:
        drained = []
        while True:
            try:
                drained.append(self._waiting.get_nowait())
            except queue.Empty:
                return drained


def _callback_failure(error: BaseException) -> BaseException:
    """What a sequence whose ``on_token`` raised ``error`` fails with: the error itself, but a BaseException that
    is no Exception (a ``sys.exit()``, a KeyboardInterrupt in a server's thread) as the cause of a
    :class:`RequestError`, as ``future.result()`` would raise it in the waiting thread (exiting it) and it ended the
    server's loop, every sequence with it."""
    if isinstance(error, Exception):
        return error
    failed = RequestError(f"the sequence's on_token callback raised {error!r}")
    failed.__cause__ = error
    return failed


def done_future(compute: Callable[[], torch.Tensor]) -> Future:
    """A future already settled with ``compute()``'s result or exception (the local runner's steps)."""
    future: Future = Future()
    try:
        future.set_result(compute())
    except Exception as error:
        future.set_exception(error)
    return future
