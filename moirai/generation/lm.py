"""``moirai.compile_lm``: a causal LM split across devices, with ``generate`` and a generation server.

Example::

    lm = moirai.compile_lm(model, ["cpu", "cpu"], max_batch_size=4, max_seq_len=256)
    lm.summary()                                            # the plan, predicted TTFT, TPOT and tokens/s
    ids = lm.generate(input_ids, max_new_tokens=32)         # as model.generate: prompt + new tokens
    with lm.server() as server:                             # one process per device, sequences in flight
        future = server.submit(prompt_ids, max_new_tokens=32)
        for token in server.stream(prompt_ids, max_new_tokens=32): ...
    lm.save("lm-plan.json")                                 # later: moirai.load_lm("lm-plan.json", model)

One step graph serves prefill and decode (:mod:`moirai.generation.step`): traced once with the batch and token
dimensions dynamic, priced at both phases' shapes, placed once for the generation workload
(:class:`moirai.planning.objective.Generation`), split once. Each layer's KV cache is a buffer of the step, kept
with the ops that write and read it on one device (``Problem.colocated``), where it stays between steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.table import Table

from moirai import progress as _progress
from moirai import viz
from moirai.cluster.calibration.cluster import local_cluster
from moirai.cluster.cost import DEFAULT_COST_MODE, build_problem, check_cost_mode
from moirai.cluster.devices import Cluster
from moirai.compile import (
    CompiledModel,
    assemble,
    check_placer_options,
    describe_plan,
    from_plan_record,
    planned_problem,
    rank_cluster,
    saved_cluster,
)
from moirai.errors import (
    InfeasibleError,
    InputError,
    MoiraiWarning,
    PlanError,
    TraceError,
    UsageError,
    user_stacklevel,
)
from moirai.file_numbers import float_fault, int_fault
from moirai.frontend.coarsen import coarsen
from moirai.frontend.graph import OpGraph, build_op_graph
from moirai.frontend.state import colocated_groups, mutable_buffers
from moirai.frontend.symbolic_shapes import sizes_at
from moirai.frontend.trace import TracedModel, trace
from moirai.generation.engine import Engine, SamplingParams, SubmitStep, done_future
from moirai.generation.requests import (
    APPLIED_SETTINGS,
    GenerateOptions,
    GenerationDefaults,
    check_generate_signatures,
    end_tokens,
    generate_rows,
    prompt_rows,
    unapplied_settings,
)
from moirai.generation.server import GenerationServer, ServerClosing, Serving
from moirai.generation.step import (
    STEP_CALL,
    CacheShape,
    CausalLMStep,
    context_example,
    context_input,
    embedding_rows,
    grouped_query_attention,
)
from moirai.plan_records import LM_KEY, PlanHandover, read_plan_file
from moirai.planning.objective import LATENCY, Generation
from moirai.planning.placers import place
from moirai.planning.problem import Problem
from moirai.planning.simulate import simulate
from moirai.runtime.driver import DEFAULT_TIMEOUT_S
from moirai.runtime.runner import Worlds
from moirai.user_files import check_output_path, write_output

DEFAULT_MAX_PREFILL = 64  # tokens of a prompt's chunk where max_prefill is left out (and max_seq_len allows)


class Prediction(NamedTuple):
    """What the plan predicts for generation: time to the first token of a typical prompt, time per output token
    of one sequence alone, time per decode step with the plan's sequences in flight, and decode tokens/s then."""

    ttft_s: float
    tpot_s: float
    step_s: float
    tokens_per_s: float
    prompt_tokens: int
    decode_batch: int


@dataclass
class CompiledLM:
    """A causal LM split across a cluster: :meth:`generate` as Hugging Face's, :meth:`server` for many users."""

    compiled: CompiledModel  # the step program (its problem is the decode step's)
    prefill_problem: Problem
    objective: Generation
    cache: CacheShape
    max_prefill: int
    decode_batch: int  # sequences per decode step the plan was priced for
    prompt_tokens: int  # the typical prompt the plan was priced for
    model_name: str = "a causal LM"
    vocab_size: int | None = None  # rows of the input embedding: the token ids a prompt may hold
    logits_width: int | None = None  # the logits a step gives a token: the token ids it can sample or ban
    # The model's own generation_config and config as last read; while the model lives they are read from it at
    # every call, as model.generate reads them: a setting changed after compile_lm
    # (model.generation_config.max_new_tokens = 4) counts, and so does a config put in the old one's place.
    compiled_generation_config: Any = None
    compiled_model_config: Any = None
    model: weakref.ReferenceType[torch.nn.Module] | None = field(default=None, repr=False, compare=False)
    # [Note: one user of the caches at a time] The KV caches are buffers of the one step program, and every local
    # generate and the part an open server runs in this process write them, each engine handing out slots from 0.
    # So they take turns: a generate waits for another thread's, or runs through the open server; a server holds
    # the turn from its opening until its close has finished, and one is open at a time. Every choice between
    # these is made under one condition, and made again after each wait: a generate read the open server outside
    # any lock and then waited for the turn, so it waited out the whole life of a server opened meanwhile, or ran
    # into one closing and raised that "this generation server is closed" (the user never called it); two
    # server() calls both passed the check and the second opened once the first had closed. A server whose close
    # has begun is open no more: a generate or a server() that meets it waits for its close and takes the turn.
    _turn: threading.Condition = field(default_factory=threading.Condition, init=False, repr=False, compare=False)
    _turn_taken: bool = field(default=False, init=False, repr=False, compare=False)  # a generate's, or a server's
    _opening: bool = field(default=False, init=False, repr=False, compare=False)  # a server() starts its ranks
    _open_server: Serving | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def generation_config(self) -> Any:
        """The model's generation_config now (the last one read once the model is gone)."""
        config = self._model_attribute("generation_config", self.compiled_generation_config)
        self.compiled_generation_config = config  # kept when the model is collected, whenever the collector runs
        return config

    @property
    def model_config(self) -> Any:
        """The model's config now (the last one read once the model is gone)."""
        config = self._model_attribute("config", self.compiled_model_config)
        self.compiled_model_config = config
        return config

    def _model_attribute(self, name: str, last_read: Any) -> Any:
        model = self.model() if self.model is not None else None
        return last_read if model is None else getattr(model, name, last_read)

    @property
    def defaults(self) -> GenerationDefaults:
        """What a generate call leaves out takes (:class:`GenerationDefaults`), from the model's configs as they are."""
        return GenerationDefaults.of(self.generation_config, self.model_config)

    @property
    def eos_token_id(self) -> tuple[int, ...]:
        """The model's end tokens, in its config's order (the first pads rows that end early where no pad is set);
        none where its generation_config sets none (see :meth:`special_tokens_config`)."""
        return end_tokens(getattr(self.special_tokens_config, "eos_token_id", None), ())

    @property
    def pad_token_id(self) -> int | None:
        return getattr(self.special_tokens_config, "pad_token_id", None)

    @property
    def special_tokens_config(self) -> Any:
        """The config the model's end and pad tokens are read from: its generation_config, the only one
        model.generate reads them from (``_prepare_special_tokens``). Hugging Face copies them there from the model's
        config when it builds the model (``GenerationConfig.from_model_config``), so a model stops at its config's
        end token by default, and one whose generation_config sets ``eos_token_id = None`` generates to the full
        length, whatever its config says (reading the config where the generation_config had None stopped it there,
        and took the config's pad token for padding to strip). A model without a generation_config: its config, as
        ``from_model_config`` would build one."""
        generation_config = self.generation_config
        return self.model_config if generation_config is None else generation_config

    def check_generation_config(self) -> None:
        """:class:`InputError` unless the model's end tokens are token ids; a :class:`MoiraiWarning` naming what its
        generation_config sets that model.generate applies by default and moirai's generate does not (beams, forced
        tokens, typical-p...): their tokens would differ, with nothing to say why. At compile_lm and at every call,
        as the config may change between them."""
        self.eos_token_id  # noqa: B018 - raises for end tokens that are not token ids
        unapplied = unapplied_settings(self.generation_config)
        if unapplied:
            warnings.warn(
                f"{self.model_name}'s generation_config sets {', '.join(unapplied)}, which model.generate applies "
                f"and moirai's generate does not (it applies {APPLIED_SETTINGS}): their tokens can differ",
                MoiraiWarning,
                stacklevel=user_stacklevel(),
            )

    def engine(self, submit: SubmitStep, depth: int, worlds: Worlds | None = None) -> Engine:
        """The loop that steps this LM's sequences through ``submit``, ``depth`` steps in flight (``worlds``: the
        restarts of the ranks that hold the caches, as :class:`Engine` takes them)."""
        slots = self.cache.slots
        dynamic = {dim.name for dim in self.compiled.traced.dynamic_dims}
        min_context = 1 if "context" in dynamic else self.max_seq_len  # [Note: the context a step attends over]
        return Engine(
            submit,
            slots,
            self.max_seq_len,
            self.max_prefill,
            slots,
            depth,
            self.vocab_size,
            self.logits_width,
            worlds,
            min_context,
        )

    def __repr__(self) -> str:
        """One line (see :meth:`CompiledModel.__repr__`)."""
        return (
            f"<CompiledLM of {self.model_name}: {describe_plan(self.compiled.plan)}; {self.cache.slots} cache slots of "
            f"{self.max_seq_len} tokens; .summary() shows the plan and its TTFT, TPOT and tokens/s>"
        )

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    @property
    def stages(self) -> int:
        """Devices the plan uses: a server keeps as many decode steps in flight."""
        return len(set(self.compiled.plan.placement.tolist()))

    def prediction(self) -> Prediction:
        decode = simulate(self.compiled.problem, self.compiled.plan)
        one_sequence = replace(self.objective, sequences=1)
        in_flight = replace(self.objective, sequences=max(self.objective.sequences, self.stages))
        step_s = in_flight.step_s(decode)
        return Prediction(
            ttft_s=one_sequence.ttft_s(decode),
            tpot_s=decode.makespan_s,
            step_s=step_s,
            tokens_per_s=self.decode_batch / step_s if step_s > 0 else math.inf,
            prompt_tokens=self.prompt_tokens,
            decode_batch=self.decode_batch,
        )

    def summary(self, console: Console | None = None) -> None:
        """Print :meth:`summary_table` (and return nothing: a notebook cell ending in it shows it once)."""
        (console or Console()).print(self.summary_table())

    def summary_table(self) -> Table:
        """The plan per device, priced at a decode step, with the predicted TTFT, TPOT and tokens/s in its
        caption."""
        compiled = self.compiled
        table = viz.summary_table(
            compiled.problem,
            compiled.plan,
            torch_devices=compiled.torch_devices,
            ops_per_task=[len(node.targets) for node in compiled.graph.nodes],
            title=f"moirai plan for generating with {self.model_name} ({compiled.plan.placer})",
            objective=self.objective,
        )
        p = self.prediction()
        table.caption += (
            f"\ngeneration: TTFT {viz.format_seconds(p.ttft_s)} ({p.prompt_tokens}-token prompt), TPOT "
            f"{viz.format_seconds(p.tpot_s)} (one sequence), {viz.format_rate(p.tokens_per_s)} tokens/s with "
            f"{self.stages} decode step{'s' if self.stages > 1 else ''} of {p.decode_batch} in flight; KV cache "
            f"{viz.format_bytes_compact(self.cache.slot_bytes)} per sequence, {self.cache.slots} slots"
        )
        viz.widen_to_caption(table)
        return table

    def gantt(self, path: str | Path | None = None, phase: str = "decode", **options: Any) -> Any:
        """The simulated schedule of one decode step (``phase="prefill"``: of the typical prompt's prefill), titled
        with the predicted TTFT, TPOT and tokens/s."""
        if phase not in ("decode", "prefill"):
            raise InputError(f"gantt draws phase 'decode' or 'prefill', not {phase!r}")
        problem, objective = (
            (self.compiled.problem, self.objective) if phase == "decode" else (self.prefill_problem, LATENCY)
        )
        figure = viz.gantt(problem, self.compiled.plan, path=None, objective=objective, **options)
        p = self.prediction()
        figure.suptitle(
            f"{phase}: TTFT {p.ttft_s * 1e3:.3g} ms ({p.prompt_tokens} tokens), TPOT {p.tpot_s * 1e3:.3g} ms, "
            f"{p.tokens_per_s:.4g} tokens/s in flight",
            fontsize=9,
        )
        if path is not None:
            figure.savefig(path, bbox_inches="tight")
        return figure

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
        """Token ids ``[batch, prompt + new]`` (int64, whatever the prompt's integer dtype) as Hugging Face's
        ``generate`` returns them (with ``return_dict_in_generate=True``, as its output's ``.sequences``), run by the
        local runner (every part from this process; :meth:`server` runs one process per device).

        Each row is its own sequence (left or right padding, as ``attention_mask`` marks it, is left out of it; a
        mask that is not left padding alone gives a :class:`~moirai.errors.PaddingWarning`, as Hugging Face's tokens
        differ there); rows that end early (``eos_token_id``) are padded with ``pad_token_id`` (default: the
        model's, else the end token).
        ``do_sample`` samples with ``temperature``, ``top_k`` (0: all), ``top_p`` and ``min_p``, after the logits of the
        tokens a row has seen are penalized by ``repetition_penalty`` (greedy or not); each of these, left out, is the
        model's ``generation_config``'s where it sets it, else Hugging Face's default (greedy; 1.0, 50, 1.0, none; 1.0).
        The new tokens are ``max_new_tokens``, else up to ``max_length`` in all (prompt included), each the call's or
        else the ``generation_config``'s, else 20 (:meth:`GenerationDefaults.new_tokens`, as ``model.generate`` counts
        them). Sampling draws from ``seed`` (each row from ``seed + row``; None: a seed drawn from torch's global
        generator, so ``torch.manual_seed`` makes a sampled call repeat as it does Hugging Face's). A
        ``generation_config`` passed stands before the model's; a ``streamer`` (Hugging Face's ``TextStreamer``, one
        row) gets the prompt, then each token as it comes. ``others`` may be the settings that ban tokens
        (``min_new_tokens``, ``min_length``, ``no_repeat_ngram_size``, ``bad_words_ids``, ``suppress_tokens``,
        ``begin_suppress_tokens``: :class:`~moirai.generation.bans.TokenBans`) and ``num_return_sequences`` (sampled
        sequences of each row); any other argument of ``model.generate`` is an :class:`InputError` naming it. As
        there, the prompt may be passed as ``inputs``, and a ``GenerationConfig`` as the second argument
        (``generate(inputs, generation_config)``).
        """
        options = GenerateOptions.of(locals(), others)  # first: locals() is the parameters alone
        input_ids = prompt_rows(input_ids, inputs)
        while True:
            server = self._open_server_or_turn()  # [Note: one user of the caches at a time]
            if server is None:
                try:
                    engine = self.engine(lambda inputs: done_future(lambda: self.compiled(*inputs)), depth=1)
                    return generate_rows(self, engine, input_ids, attention_mask, options, drive=engine.run_until_idle)
                finally:
                    self._give_turn_back()
            try:
                return server.generate_for_lm(input_ids, attention_mask, options)
            except ServerClosing:
                continue  # its close began after it was chosen, before any row went in: wait for it, run here

    def _open_server_or_turn(self) -> Serving | None:
        """The open server a generate runs through, or None with the caches' turn taken (waiting for another
        thread's generate, or for a server's opening or close to finish)."""
        with self._turn:
            while True:
                server = self._open_server
                if server is not None and not server.closing:
                    return server
                if not self._turn_taken:
                    self._turn_taken = True
                    return None
                self._turn.wait()

    def _give_turn_back(self) -> None:
        """A generate's turn, or that of a server that failed to open (only the turn's holder opens one)."""
        with self._turn:
            self._turn_taken = self._opening = False
            self._turn.notify_all()

    def server(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, max_in_flight: int | None = None, *, progress: bool | None = None
    ) -> GenerationServer:
        """A server that generates for many sequences at once, one process per device (see
        :class:`GenerationServer`); ``max_in_flight`` steps in flight (default: one per stage, at least 2). One is
        open at a time (a second is a :class:`UsageError`; one whose close has begun is waited for), and
        :meth:`generate` runs through it while it is. ``progress``: whether starting the workers reports, by
        default as the model was compiled (as :meth:`CompiledModel.server`'s)."""
        depth = max(2, self.stages) if max_in_flight is None else max_in_flight
        self._take_turn_to_open()
        try:
            # The caches are each sequence's own, cleared by its first chunk: nothing of them need outlive the server.
            step_server = self.compiled.server(
                timeout_s=timeout_s, max_in_flight=depth, warn_state_left=False, progress=progress
            )
            server = GenerationServer(self, step_server, depth)
        except BaseException:
            self._give_turn_back()
            raise
        with self._turn:
            # What it runs, not the server itself: a server dropped unclosed must be collected to be closed.
            self._open_server, self._opening = server._serving, False
            self._turn.notify_all()  # the generates waiting for its opening run through it
        return server

    def _take_turn_to_open(self) -> None:
        """Take the caches' turn for a server about to open, waiting for a generate in another thread or a server's
        close to finish; a :class:`UsageError` where a server is open or opening ([Note: one user of the caches at a
        time]). The server holds the turn until :meth:`server_closed`."""
        with self._turn:
            while True:
                server = self._open_server
                if self._opening or (server is not None and not server.closing):
                    raise UsageError(
                        "this CompiledLM has a server open already, and its caches serve one at a time: submit to "
                        "that server (lm.generate runs through it too), or close it before opening another"
                    )
                if not self._turn_taken:
                    self._turn_taken = self._opening = True
                    return
                self._turn.wait()

    def server_closed(self, server: Serving) -> None:
        """``server`` (what this LM's open server runs) has closed: the caches are free for the next user."""
        with self._turn:
            if self._open_server is server:
                self._open_server, self._turn_taken = None, False
                self._turn.notify_all()

    def save(self, path: str | Path) -> None:
        """Write :meth:`plan_record` to ``path``, from which :func:`load_lm` rebuilds this LM without planning again."""
        check_output_path(path, "the plan", PlanError)  # before the record is made: a large problem takes a while
        write_output(path, json.dumps(self.plan_record(), indent=1), "the plan", PlanError)

    def plan_record(self) -> dict[str, Any]:
        """The step's plan record (:meth:`CompiledModel.plan_record`, whose problem is the decode step's) and an
        ``"lm"`` section: the limits the step was traced for and what the plan was made for, with the prefill's
        problem (plain JSON values)."""
        section = {
            "model": self.model_name,
            "max_batch_size": self.cache.slots,
            "max_seq_len": self.max_seq_len,
            "max_prefill": self.max_prefill,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.objective.new_tokens,
            "steps_in_flight": self.objective.sequences,
            "decode_batch": self.decode_batch,
            "max_ttft_s": self.objective.max_ttft_s,
            "prefill_problem": self.prefill_problem.to_dict(),
        }
        return {**self.compiled.plan_record(), LM_KEY: section}


# At import, so that a generate parameter GenerateOptions.of would drop fails before any call does.
check_generate_signatures(CompiledLM.generate, GenerationServer.generate, GenerationServer.submit)


@_progress.reports_progress
def compile_lm(
    model: torch.nn.Module,
    devices: Cluster | Sequence[str],
    max_batch_size: int = 4,
    max_seq_len: int = 256,
    max_prefill: int | None = None,
    prompt_tokens: int | None = None,
    new_tokens: int = 64,
    sequences: int = 1,
    max_ttft_s: float | None = None,
    placer: str = "milp",
    fusion_rules: str | Path = "default",
    cost: str = DEFAULT_COST_MODE,
    progress: bool = True,
    calibration: str | Path = "auto",
    **placer_options: Any,
) -> CompiledLM:
    """Split a Hugging Face-style causal LM across ``devices`` for generation (see the module doc).

    ``max_batch_size`` sequences are held at once (each its own KV-cache slot of ``max_seq_len`` tokens, on the
    devices of its layers); prompts go in chunks of at most ``max_prefill`` tokens (default
    ``min(64, max_seq_len)``; one over ``max_seq_len`` is an error). The plan is chosen for
    ``sequences`` sequences generated at once: 1, a prompt of ``prompt_tokens`` tokens (default
    ``min(32, max_prefill)``) answered with ``new_tokens`` tokens soonest; more, the most decode tokens/s with one
    decode step per device in flight, each of ``sequences / devices`` sequences, and the time to the first token at
    most ``max_ttft_s``. ``cost="measured"`` times both phases at their shapes on the local devices. ``devices``,
    ``placer``, ``calibration``, ``progress`` and ``placer_options`` as in :func:`moirai.compile`.
    """
    check_placer_options(placer_options, compile_lm, placer)
    check_cost_mode(cost)
    max_prefill, prompt_tokens = _checked_limits(max_batch_size, max_seq_len, max_prefill, prompt_tokens, sequences)
    handover = PlanHandover.under_torchrun(devices)  # under torchrun rank 0 plans, as compile does
    cluster, hosts = rank_cluster(devices, calibration, handover)  # checks devices: none, or no list, is refused
    steps_in_flight = min(sequences, len(cluster.devices))  # a server keeps about one decode step per stage in flight
    decode_batch = math.ceil(sequences / steps_in_flight)
    step, traced = _traced_step(model, max_batch_size, max_seq_len, max_prefill)
    graph = build_op_graph(traced)
    coarse = coarsen(graph, rules=fusion_rules).graph
    colocated = colocated_groups(coarse, mutable_buffers(traced.graph_module))
    prompt_chunk = min(prompt_tokens, max_prefill)
    remote_alike = hosts is not None  # devices on other hosts are priced as this host's of their kind
    # Several steps in flight: the stages compute at once, so each is profiled beside the others computing
    # (Generation.steady_state; [Note: steady-state profile]).
    steady_state = steps_in_flight > 1
    prefill_context, decode_context = phase_contexts(prompt_tokens, prompt_chunk, new_tokens, max_seq_len)
    prefill = phase_problem(
        traced,
        coarse,
        cluster,
        colocated,
        cost,
        1,
        prompt_chunk,
        remote_alike,
        steady_state,
        phase="prefill",
        context=prefill_context,
    )
    decode = phase_problem(
        traced,
        coarse,
        cluster,
        colocated,
        cost,
        decode_batch,
        1,
        remote_alike,
        steady_state,
        phase="decode",
        context=decode_context,
    )
    objective = _generation(prefill, new_tokens, steps_in_flight, max_ttft_s, prompt_tokens, max_prefill)
    if handover is not None and not handover.plans:
        # This rank takes rank 0's plan and serves it with moirai.serve_rank(lm.compiled).
        with handover.receiving():
            compiled = from_plan_record(handover.receive(), "rank 0's plan", traced, cluster, progress)
    else:
        with handover.planning() if handover is not None else contextlib.nullcontext():
            try:
                plan = place(decode, placer=placer, objective=objective, **placer_options)
            except InfeasibleError as error:
                raise InfeasibleError(
                    _does_not_fit(type(model).__name__, graph, step.cache_shape, decode, objective, error)
                ) from None
            compiled = assemble(traced, cluster, coarse, decode, plan, progress)
        if handover is not None:
            handover.send(compiled.plan_record())
    return _compiled_lm(model, step, compiled, prefill, objective, max_prefill, decode_batch, prompt_tokens)


def _checked_limits(
    max_batch_size: Any, max_seq_len: Any, max_prefill: Any, prompt_tokens: Any, sequences: Any
) -> tuple[int, int]:
    """compile_lm's ``max_prefill`` and ``prompt_tokens`` as their defaults fill them, or an :class:`InputError`
    naming a limit that is no positive integer or does not fit the others."""
    limits = {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len}
    limits |= {} if max_prefill is None else {"max_prefill": max_prefill}
    for name, value in limits.items():
        if not isinstance(value, int) or value < 1:
            raise InputError(f"compile_lm: {name} must be a positive integer, got {value!r}")
    if max_prefill is None:
        # Left out, it fits any max_seq_len: a short one (32) was refused for a chunk size the caller never gave.
        max_prefill = min(DEFAULT_MAX_PREFILL, max_seq_len)
    elif max_prefill > max_seq_len:
        raise InputError(
            f"compile_lm: max_prefill={max_prefill} is over max_seq_len={max_seq_len}: a prompt's chunk is at most a "
            "whole sequence; give max_prefill <= max_seq_len, or leave it out for min(64, max_seq_len)"
        )
    if not 1 <= sequences <= max_batch_size:
        raise InputError(f"compile_lm: sequences={sequences} must be between 1 and max_batch_size={max_batch_size}")
    return max_prefill, prompt_tokens or min(32, max_prefill)


def _traced_step(
    model: torch.nn.Module, max_batch_size: int, max_seq_len: int, max_prefill: int
) -> tuple[CausalLMStep, TracedModel]:
    """The model's generation step for these limits, and its trace (compile_lm's and load_lm's alike, so that a saved
    plan's op names are the trace's)."""
    step = CausalLMStep(model, max_batch_size, max_seq_len).eval()
    return step, trace_step(step, max_batch_size, max_prefill)


def _generation(
    prefill: Problem,
    new_tokens: int,
    steps_in_flight: int,
    max_ttft_s: float | None,
    prompt_tokens: int,
    max_prefill: int,
) -> Generation:
    """The objective the plan is made for (and judged by: summary's TTFT and TPOT)."""
    # Every chunk is priced as one at the chunks' mean context (phase_contexts): a long prompt is whole chunks.
    prompt_chunk = min(prompt_tokens, max_prefill)
    return Generation(prefill, new_tokens, steps_in_flight, max_ttft_s, math.ceil(prompt_tokens / prompt_chunk))


def _compiled_lm(
    model: torch.nn.Module,
    step: CausalLMStep,
    compiled: CompiledModel,
    prefill: Problem,
    objective: Generation,
    max_prefill: int,
    decode_batch: int,
    prompt_tokens: int,
) -> CompiledLM:
    """The CompiledLM of ``model`` split as ``compiled``, its generation config checked (end tokens that are token
    ids; a warning for what it sets that moirai does not apply)."""
    lm = CompiledLM(
        compiled,  # its server's start reports as compile_lm (or load_lm) did (its progress)
        prefill,
        objective,
        step.cache_shape,
        max_prefill,
        decode_batch,
        prompt_tokens,
        type(model).__name__,
        embedding_rows(model),
        step.logits_width,
        getattr(model, "generation_config", None),
        model.config,
        weakref.ref(model),
    )
    lm.check_generation_config()
    return lm


@_progress.reports_progress
def load_lm(
    path: str | Path,
    model: torch.nn.Module,
    devices: Cluster | Sequence[str] | None = None,
    progress: bool = True,
) -> CompiledLM:
    """The CompiledLM that :meth:`CompiledLM.save` wrote to ``path``, for ``model`` (with real weights), without
    planning again: the step is built and traced with the saved limits as :func:`compile_lm` does, and split by the
    saved plan (a model whose step has other ops or tensors is a :class:`PlanError`). ``devices`` (default: the
    plan's, under the names they were planned with) must be as many as the plan's; ``progress`` as in compile_lm."""
    record = read_plan_file(path)
    saved = _saved_lm(record, path)
    name = type(model).__name__
    if name != saved["model"]:
        raise PlanError(
            f"plan file {str(path)!r} was planned for a {saved['model']}, not a {name}: load it with the model it was "
            "saved for, or compile this one with moirai.compile_lm"
        )
    # Not `devices or ...`: an empty list is refused as compile refuses it, and an array has no truth value.
    cluster = saved_cluster(record, "none") if devices is None else local_cluster(devices, "none")
    if len(cluster) != len(record["devices"]):
        raise PlanError(f"{path} places the model on {len(record['devices'])} devices, {len(cluster)} were given")
    max_prefill, prompt_tokens = saved["max_prefill"], saved["prompt_tokens"]
    step, traced = _traced_step(model, saved["max_batch_size"], saved["max_seq_len"], max_prefill)
    compiled = from_plan_record(record, path, traced, cluster, progress)
    prefill = planned_problem(
        {"problem": saved["prefill_problem"]}, f"{path} ({LM_KEY}.prefill_problem)", compiled.graph, cluster, traced
    )
    prefill = replace(prefill, colocated=compiled.problem.colocated)  # the model's buffers say, as the decode's
    objective = _generation(
        prefill, saved["new_tokens"], saved["steps_in_flight"], saved["max_ttft_s"], prompt_tokens, max_prefill
    )
    return _compiled_lm(model, step, compiled, prefill, objective, max_prefill, saved["decode_batch"], prompt_tokens)


def _positive_int(value: Any) -> str | None:
    return int_fault(value, low=1)


def _seconds_or_null(value: Any) -> str | None:
    if value is None:
        return None
    fault = float_fault(value)
    return fault if fault is not None or value > 0 else "is 0, not a positive number of seconds"


# The "lm" section's fields, each with what makes a value no value of it (None: it is one).
_LM_FIELDS: dict[str, Any] = {
    "model": lambda v: None if isinstance(v, str) else f"is {str(v)[:40]!r}, not the model's class name",
    **{
        name: _positive_int
        for name in (
            "max_batch_size",
            "max_seq_len",
            "max_prefill",
            "prompt_tokens",
            "new_tokens",
            "steps_in_flight",
            "decode_batch",
        )
    },
    "max_ttft_s": _seconds_or_null,
    "prefill_problem": lambda v: None if isinstance(v, dict) else f"is a {type(v).__name__}, not an object",
}


def _saved_lm(record: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The record's ``"lm"`` section, each field checked as :meth:`CompiledLM.plan_record` writes it, or a
    :class:`PlanError` naming the file and the field."""
    subject = f"plan file {str(path)!r}"
    if LM_KEY not in record:
        raise PlanError(
            f"{subject} is a plan of moirai.compile (CompiledModel.save wrote it), not of moirai.compile_lm: load it "
            "with moirai.load(path, model, example_inputs)"
        )
    again = "save the LM again with CompiledLM.save(path), or compile it again with moirai.compile_lm"
    saved = record[LM_KEY]
    if not isinstance(saved, dict):
        raise PlanError(f"{subject}: {LM_KEY!r} is a {type(saved).__name__}, not an object; {again}")
    for name, fault_of in _LM_FIELDS.items():
        if name not in saved:
            raise PlanError(f"{subject}: {LM_KEY!r} lacks {name!r}; {again}")
        fault = fault_of(saved[name])
        if fault is not None:
            raise PlanError(f"{subject}: '{LM_KEY}.{name}' {fault}; {again}")
    over = [
        (f"'{LM_KEY}.{small}' ({saved[small]})", f"'{LM_KEY}.{large}' ({bound})")
        for small, large, bound in (
            ("max_prefill", "max_seq_len", saved["max_seq_len"]),
            ("decode_batch", "max_batch_size", saved["max_batch_size"]),
            ("steps_in_flight", "devices", len(record["devices"])),
        )
        if saved[small] > bound
    ]
    if over:
        raise PlanError(f"{subject}: {over[0][0]} is over {over[0][1]}, which compile_lm never saves; {again}")
    limits = _traced_limits(record)
    if saved["max_seq_len"] - 1 in limits["max_seq_len"]:  # slots of max_seq_len positions: no spare one
        raise PlanError(
            f"{subject} was saved by an earlier moirai, whose generation step attended over whole cache slots (this "
            "one's attends over its sequences' positions, [Note: the context a step attends over]); its plan is of "
            "another step: compile the LM again with moirai.compile_lm and save it"
        )
    for name, traced in limits.items():
        if traced and saved[name] not in traced:
            raise PlanError(
                f"{subject}: '{LM_KEY}.{name}' is {saved[name]}, but the plan's step was traced for "
                f"{' or '.join(map(str, sorted(traced)))}; {again}"
            )
    return saved


def _traced_limits(record: dict[str, Any]) -> dict[str, set[int]]:
    """The limits the record's own trace was made for: its cache buffers' slots and positions
    (``[slots, heads, max_seq_len + 1, dim]``, ``seen_tokens`` ``[slots, width]``) and its batch and token dimensions'
    ranges. Checked before the step is built: a ``max_seq_len`` edited to 10**9 would allocate its cache first."""
    limits: dict[str, set[int]] = {"max_batch_size": set(), "max_seq_len": set(), "max_prefill": set()}
    weights = (record.get("tensors") or {}).get("weights", {})
    for name, tensor in weights.items():
        shape = tensor["shape"]
        if re.fullmatch(r"(key|value)_cache_\d+", name) and len(shape) == 4:
            limits["max_batch_size"].add(shape[0])
            limits["max_seq_len"].add(shape[2] - 1)  # a slot's spare position (CacheShape.positions)
        elif name == "seen_tokens" and len(shape) == 2:
            limits["max_batch_size"].add(shape[0])
    for dim in (record.get("dynamic_dims") or {}).get("dims", []):
        limit = {"batch": "max_batch_size", "tokens": "max_prefill"}.get(dim["name"])
        if limit is not None and dim.get("max") is not None:
            limits[limit].add(dim["max"])
    return limits


def trace_step(step: CausalLMStep, max_batch_size: int, max_prefill: int) -> TracedModel:
    """The step traced once, its batch and token dimensions dynamic (static where their range is one size)."""
    batch = _dim("batch", max_batch_size)
    tokens = _dim("tokens", max_prefill)
    banned = _dim("banned", max(step.logits_width, 2))  # a row's banned token ids ([Note: banned tokens])
    # torch.export takes an example size of 1 for a constant, and two dimensions of one example size for one
    # symbol: trace at sizes 2, 3 and 4 where the ranges allow, and the context at a size of its own.
    b, t, k = min(2, max_batch_size), min(3, max_prefill), min(4, step.logits_width)
    max_seq_len = step.cache_shape.max_seq_len
    c = context_example(t, max_seq_len, taken={b, t, k})
    context = _dim("context", max_seq_len) if c is not None else _STATIC
    device = step.seen_tokens.device
    example = (
        torch.zeros(b, t, dtype=torch.long, device=device),
        torch.arange(t, device=device).repeat(b, 1),
        torch.arange(b, device=device),
        torch.tensor(SamplingParams().row(0.0), device=device).repeat(b, 1),  # greedy, no penalty
        torch.full((b, k), -1, device=device),  # nothing banned
        context_input(c or max_seq_len, device),
    )
    shapes = ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch}, {0: batch}, {0: batch, 1: banned}, {0: context})
    with grouped_query_attention():
        try:
            return trace(step, example, dynamic_shapes=shapes)
        except TraceError as error:
            # What the step hands the model is not what its own generate does: say so, as the cause may be there.
            raise TraceError(f"{error} ({STEP_CALL})") from error


_STATIC = getattr(torch.export.Dim, "STATIC", None)  # a dimension traced at its example's size (None before torch 2.6)


def _dim(name: str, upper: int) -> Any:
    if upper > 1:
        return torch.export.Dim(name, min=1, max=upper)
    return _STATIC  # a range of one size


def phase_contexts(prompt_tokens: int, prompt_chunk: int, new_tokens: int, max_seq_len: int) -> tuple[int, int]:
    """The contexts the prefill and decode phases are priced at ([Note: the context a step attends over]): a
    step's cost grows with its context about in proportion, so each phase is priced at its steps' mean context, the
    prompt's chunks' (the k-th of ``prompt_chunk`` tokens attends over k chunks) and the decode steps' (the prompt
    and half the new tokens)."""
    chunks = math.ceil(prompt_tokens / prompt_chunk)
    prefill = min(max_seq_len, round(prompt_chunk * (chunks + 1) / 2))
    decode = min(max_seq_len, prompt_tokens + math.ceil(new_tokens / 2))
    return prefill, decode


def phase_problem(
    traced: TracedModel,
    coarse: OpGraph,
    cluster: Cluster,
    colocated: tuple[tuple[int, ...], ...],
    cost: str,
    batch: int,
    tokens: int,
    remote_alike: bool = False,
    steady_state: bool = False,
    phase: str = "decode",
    context: int | None = None,
) -> Problem:
    """The placement problem of the step's coarse graph priced at ``batch`` sequences of ``tokens`` tokens attending
    over ``context`` positions of their slots (default: ``tokens``; [Note: the context a step attends over])
    (``remote_alike`` and ``steady_state`` as :func:`moirai.cluster.cost.build_problem`'s); ``phase`` names it on the
    progress line."""
    wanted = {"batch": batch, "tokens": tokens, "banned": 1, "context": max(tokens, context or tokens)}
    sizes = {dim.symbol: wanted[dim.name] for dim in traced.dynamic_dims if dim.name in wanted}
    # One line per phase: its op graph and costs inside showed as a second and third "op graph" and "cost".
    with _progress.stage(f"cost ({phase})"), sizes_at(sizes):
        at_size = build_op_graph(traced)
        coarse_at_size = at_size.merge([at_size.nodes_of_fx_names(node.fx_names) for node in coarse.nodes])
        return build_problem(
            coarse_at_size,
            cluster,
            cost,  # type: ignore[arg-type]
            traced,
            symbol_values=sizes,
            colocated=colocated,
            remote_alike=remote_alike,
            steady_state=steady_state,
        )


def _does_not_fit(
    name: str, graph: OpGraph, cache: CacheShape, problem: Problem, objective: Generation, error: InfeasibleError
) -> str:
    """Why no plan was found, with the numbers: memory, and the objective's limit where it has one (either may be
    the cause; the placer's own message, at the end, says which it could not meet)."""
    cache_bytes = cache.total_bytes
    free = ", ".join(
        f"{device} {viz.format_bytes_compact(capacity)}"
        for device, capacity in zip(problem.device_names, problem.memory_capacity_bytes, strict=True)
    )
    sizes = (
        f"weights {viz.format_bytes_compact(graph.total_param_bytes - cache_bytes)}, KV cache "
        f"{viz.format_bytes_compact(cache.slot_bytes)} per sequence x {cache.slots} slots = "
        f"{viz.format_bytes_compact(cache_bytes)}, free after the activation reserve: {free}"
    )
    if objective.limit is not None:
        return (
            f"{name} has no plan for generation that fits the devices and meets {objective.limit}: raise the limit "
            f"or add devices ({sizes}; {error})"
        )
    return (
        f"{name} does not fit the devices for generation: {sizes}; give fewer slots (max_batch_size), a shorter "
        f"max_seq_len, or more devices ({error})"
    )
