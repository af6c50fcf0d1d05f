"""The generation server: many sequences generated at once through one split step program, one process per device.

Example::

    with lm.server() as server:
        future = server.submit(prompt_ids, max_new_tokens=32)     # a Future of the new token ids
        for token in server.stream(prompt_ids, max_new_tokens=32):  # each token as it comes
            ...
        ids = server.generate(input_ids, max_new_tokens=32)       # as CompiledLM.generate, rows in flight together
"""

from __future__ import annotations

import contextlib
import inspect
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from moirai.errors import InputError, UsageError, did_you_mean
from moirai.generation.bans import TokenBans
from moirai.generation.engine import SequenceState
from moirai.generation.requests import (
    GenerateOptions,
    end_tokens,
    generate_rows,
    prompt_rows,
    prompt_tokens,
    sequence_tokens,
)
from moirai.runtime.server import close_when_dropped

if TYPE_CHECKING:
    from moirai.generation.lm import CompiledLM


class ServerClosing(Exception):
    """The open server a :meth:`CompiledLM.generate` chose began to close before any of its rows went in: the
    generate waits for the close and runs in the calling process (never reaches a user)."""


class GenerationServer:
    """Sequences generated at once through one split step program: ``submit`` -> Future of the new token ids,
    ``stream`` -> the tokens as they come, ``generate`` as :meth:`CompiledLM.generate`. Thread-safe; sequences
    join and leave between steps, up to ``max_batch_size`` at once (more wait for a free slot)."""

    def __init__(self, lm: CompiledLM, step_server: Any, depth: int) -> None:
        self._lm = lm
        self._serving = Serving(lm, step_server, depth)
        self._engine = self._serving.engine
        # Alive until a close() has finished: closes a server dropped unclosed ([Note: a server dropped unclosed]).
        self._unclosed = close_when_dropped(self, self._serving.close, "lm.server()")

    def __enter__(self) -> GenerationServer:
        self._check_open()  # else the block's first submit would say so
        return self

    def _check_open(self) -> None:
        if self._engine.closed:
            raise InputError("this generation server is closed; open a new one with lm.server()")

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        # A block that raised (a KeyboardInterrupt among them) does not wait for its sequences to finish.
        self.close(cancel=exc_type is not None)

    def submit(
        self,
        prompt_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        on_token: Any = None,
        max_length: int | None = None,
        repetition_penalty: float | None = None,
        min_p: float | None = None,
        **bans: Any,
    ) -> Future:
        """A future of the new token ids of one sequence (``InputError`` at once if it cannot fit a slot);
        ``on_token(token)`` is called with each token as it comes, from the server's thread. Arguments left out are
        the model's ``generation_config``'s, as in :meth:`CompiledLM.generate` (``max_length`` counts the prompt
        too), and ``bans`` are the settings that ban tokens (:class:`~moirai.generation.bans.TokenBans`:
        ``min_new_tokens``, ``no_repeat_ngram_size``, ``bad_words_ids``...). ``future.cancel()`` ends the sequence
        after its step in flight and frees its slot. ``on_token`` and the future's done callbacks run in the
        server's thread, which makes every sequence's tokens: they may submit, but must not wait for a sequence
        (``other_future.result()`` there waits for ever; ``stream`` and ``generate`` there are a
        :class:`UsageError`)."""
        if on_token is not None and not callable(on_token):  # else a TypeError in the server's thread, tokens later
            raise InputError(f"on_token must be a function called with each new token, or None; got {on_token!r}")
        self._check_open()  # early too, before the work below (engine.add has the last word)
        unknown = sorted(set(bans) - set(TokenBans.settings()))
        if unknown:
            named = [p for p in inspect.signature(self.submit).parameters if p not in ("prompt_ids", "bans")]
            words = ", ".join(name + did_you_mean(name, [*named, *TokenBans.settings()]) for name in unknown)
            raise InputError(
                f"submit does not take {words}: it takes the prompt and {', '.join(named)}, "
                f"{', '.join(TokenBans.settings())}"
            )
        prompt = prompt_tokens(prompt_ids)
        self._lm.check_generation_config()
        defaults = self._lm.defaults
        eos = end_tokens(eos_token_id, self._lm.eos_token_id)
        sequence = SequenceState(
            prompt,
            defaults.new_tokens(max_new_tokens, max_length, len(prompt)),
            defaults.sampling(
                do_sample=do_sample,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                repetition_penalty=repetition_penalty,
                min_p=min_p,
            ),
            frozenset(eos),
            on_token=on_token,
            bans=defaults.bans.overridden_by(bans, "submit").for_sequence(prompt, eos),
        )
        return self._engine.add(sequence)

    def stream(
        self, prompt_ids: torch.Tensor | Sequence[int], max_new_tokens: int | None = None, **options: Any
    ) -> Iterator[int]:
        """The new tokens of one sequence, each as soon as the last stage has sampled it; ``options`` as
        :meth:`submit` takes them, but ``on_token``, which is this iterator's. Not from a callback of a sequence (in
        the server's thread, which must go on to make the tokens): a :class:`UsageError`."""
        if "on_token" in options:  # else Python's "got multiple values for keyword argument 'on_token'"
            raise InputError("stream yields each token itself and takes no on_token; use submit(..., on_token=f)")
        self._serving.check_outside_loop("stream")  # at the call: what follows runs at the first next()
        return self._streamed(prompt_ids, max_new_tokens, options)

    def _streamed(
        self, prompt_ids: torch.Tensor | Sequence[int], max_new_tokens: int | None, options: dict[str, Any]
    ) -> Iterator[int]:
        """:meth:`stream`'s tokens, its arguments checked."""
        tokens: queue.Queue[int] = queue.Queue()
        future = self.submit(prompt_ids, max_new_tokens, on_token=tokens.put, **options)
        try:
            while True:
                try:
                    yield tokens.get(timeout=0.05)
                    continue
                except queue.Empty:
                    self._serving.check_outside_loop("stream")  # one made elsewhere may be read in a callback
                if future.done():
                    sequence_tokens(future)  # a failed or cancelled sequence raises here
                    while not tokens.empty():
                        yield tokens.get()
                    return
        finally:
            future.cancel()  # a stream closed or left early frees its slot (a no-op once the sequence has ended)

    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        attention_mask: torch.Tensor | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        max_length: int | None = None,
        repetition_penalty: float | None = None,
        min_p: float | None = None,
        streamer: Any = None,
        generation_config: Any = None,
        inputs: torch.Tensor | None = None,
        **others: Any,
    ) -> Any:
        """As :meth:`CompiledLM.generate`, through this server: the rows are sequences in flight together."""
        options = GenerateOptions.of(locals(), others)  # first: locals() is the parameters alone
        return self.generate_with(prompt_rows(input_ids, inputs), attention_mask, options)

    def generate_with(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, options: GenerateOptions
    ) -> Any:
        """:meth:`generate` with its options read."""
        return self._serving.generate_with(input_ids, attention_mask, options)

    @property
    def unfinished(self) -> int:
        """Sequences submitted and not yet ended (generating, or waiting for a free slot)."""
        return self._engine.unfinished

    def close(self, cancel: bool = False) -> None:
        """Finish the sequences submitted (``cancel``: cancel every one that has not finished, each ending after
        its step in flight), then stop the other ranks. Leaving a ``with`` block by an exception cancels. A close
        cut short (Ctrl-C) is finished by the next."""
        self._serving.close(cancel)
        self._unclosed.detach()  # closed: only now, so that an interrupted close leaves the next one its work


class Serving:
    """What a :class:`GenerationServer` runs: its engine, the loop's thread and the step server. Nothing here holds
    the server, so that one dropped unclosed is collected and closed (the loop's thread and the CompiledLM hold
    this); :meth:`CompiledLM.generate` runs through it while it is open."""

    def __init__(self, lm: CompiledLM, step_server: Any, depth: int) -> None:
        self._lm, self._step_server = lm, step_server
        self.engine = lm.engine(step_server.submit_flat, depth, step_server.worlds)
        self._stopped = threading.Event()
        self._closed = False  # a close has finished: the ranks are stopped and the caches given back
        # Held by the close under way: another waits for it to finish (it returned at once and gave the caches
        # back while the ranks still stopped); one cut short releases it, leaving its work to the next.
        self._closing = threading.Lock()
        # A generate of the LM's puts its rows in under it, and close marks the engine closed under it: all of
        # them are served, or none and it runs in the calling process (re-entrant: a streamer may close).
        self._admitting = threading.RLock()
        self._thread = threading.Thread(target=self._serve, name="moirai-generation", daemon=True)
        self._thread.start()

    def generate_with(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, options: GenerateOptions
    ) -> Any:
        """:meth:`GenerationServer.generate` with its options read."""
        self.check_outside_loop("generate")
        return generate_rows(self._lm, self.engine, input_ids, attention_mask, options)

    def generate_for_lm(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, options: GenerateOptions
    ) -> Any:
        """:meth:`CompiledLM.generate` through this server: :class:`ServerClosing` where its close has begun before
        the rows went in ([Note: one user of the caches at a time])."""
        self.check_outside_loop("generate")
        return generate_rows(self._lm, self.engine, input_ids, attention_mask, options, admitting=self._admitting_rows)

    @contextlib.contextmanager
    def _admitting_rows(self) -> Iterator[None]:
        with self._admitting:
            if self.closing:
                raise ServerClosing
            yield

    @property
    def closing(self) -> bool:
        """Its close has begun: sequences submitted before are served, later ones refused."""
        return self.engine.closed

    def check_outside_loop(self, call: str) -> None:
        """A :class:`UsageError` where ``call``, which waits for tokens, runs in the loop's own thread (a callback
        of a sequence): it would wait for ever for tokens only that thread makes."""
        if threading.current_thread() is self._thread:
            raise UsageError(
                f"{call} was called from a callback of a sequence (an on_token, a done callback of its future or a "
                "streamer), in the server's own thread, which would have to serve the call while waiting for it; "
                "call it from your own thread"
            )

    def close(self, cancel: bool = False) -> None:
        """:meth:`GenerationServer.close`. Each step below may run again: a close cut short (Ctrl-C while it waits
        for the sequences) is finished by the next, which joins the loop if it still runs and closes what is left.
        One called while another runs returns once that one has finished (it cancels first, when asked to)."""
        if threading.current_thread() is self._thread:
            raise UsageError(
                "the server was closed from a done callback of a sequence's future (or a streamer): it runs in the "
                "server's own thread, which must go on to serve the sequences left, so close cannot wait for them "
                "there; close the server from your own thread (the callback can set a threading.Event that thread "
                "waits for)"
            )
        if cancel:  # before waiting for a close under way: it waits for these sequences
            self.engine.cancel_all()
        with self._closing:
            if self._closed:
                return
            with self._admitting:  # a generate's rows all go in, or none
                self.engine.close()  # before the loop may end: a submit racing this close is served, or refused
            self._stopped.set()
            self._thread.join()
            self._step_server.close()  # finishes a close of its own that was cut short
            self._lm.server_closed(self)
            self._closed = True

    def _serve(self) -> None:
        try:
            self.engine.serve_forever(self._stopped)
        except BaseException as error:  # the loop itself failed: every sequence learns why, and every later one
            self.engine.fail_all(error)
