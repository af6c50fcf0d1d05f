"""The generation loop on its own, with a fake step program: chunked prefill, steps in flight, continuous batching."""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future

import pytest
import torch

import moirai
from moirai.errors import DistributedError, InputError, RequestError
from moirai.generation.bans import TokenBans
from moirai.generation.engine import Engine, SamplingParams, SequenceState, done_future
from moirai.runtime.driver import ServedFuture


class FakeSteps:
    """A step program whose next token is the last input token + 1, kept in flight until released."""

    def __init__(self) -> None:
        self.submitted: list[tuple[torch.Tensor, ...]] = []
        self.pending: list[tuple[Future, torch.Tensor]] = []
        self.most_in_flight = 0
        self.in_flight_at_submit: list[int] = []  # steps in flight once each step was submitted
        self.fail_next: BaseException | None = None

    def submit(self, inputs: tuple[torch.Tensor, ...]) -> Future:
        ids, positions, slots, sampling, banned, context = inputs
        assert ids.shape == positions.shape and ids.shape[0] == slots.shape[0] == sampling.shape[0] == banned.shape[0]
        # every row's positions lie in the context the step attends over, the longest row's ending it exactly
        assert context.shape == (int(positions[:, -1].max()) + 1,), (context.shape, positions)
        self.submitted.append(inputs)
        self.in_flight_at_submit.append(len(self.pending) + 1)
        future: Future = Future()
        self.pending.append((future, ids[:, -1] + 1))
        self.most_in_flight = max(self.most_in_flight, len(self.pending))
        return future

    def release_one(self) -> None:
        future, tokens = self.pending.pop(0)
        if self.fail_next is not None:
            future.set_exception(self.fail_next)
            self.fail_next = None
        else:
            future.set_result(tokens)


def run(engine: Engine, steps: FakeSteps, sequences: list[SequenceState]) -> None:
    """Drive the engine's loop from a thread while this one answers its steps in order, until every sequence ended
    and then until the loop did: it ends once its steps in flight are back, a step of a sequence that a failure
    ended meanwhile included (a step program answers every step it took)."""
    futures = [engine.add(sequence) for sequence in sequences]
    stopped = threading.Event()
    loop = threading.Thread(target=engine.serve_forever, args=(stopped,), daemon=True)  # a hung loop fails one test
    loop.start()
    while not all(future.done() for future in futures):
        answer(steps)
    stopped.set()
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while loop.is_alive():
        assert time.monotonic() < deadline, f"the engine's loop did not end; {len(steps.pending)} steps unanswered"
        answer(steps)


def answer(steps: FakeSteps) -> None:
    if steps.pending:
        steps.release_one()
    else:
        threading.Event().wait(0.001)


def sequence(prompt: list[int], new_tokens: int, eos: frozenset[int] = frozenset()) -> SequenceState:
    return SequenceState(prompt, new_tokens, SamplingParams(), eos)


def test_prompts_go_in_chunks_then_every_token_follows_the_last_one() -> None:
    steps = FakeSteps()
    engine = Engine(steps.submit, slots=2, max_seq_len=64, max_prefill=4, max_batch=2, depth=1)
    first = sequence(list(range(10)), 5)
    run(engine, steps, [first])
    assert first.future.result() == [10, 11, 12, 13, 14]
    chunks = [inputs[0].tolist() for inputs in steps.submitted[:3]]
    assert chunks == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9]]]
    positions = [inputs[1].tolist()[0] for inputs in steps.submitted]
    assert positions[:3] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert positions[3:] == [[10], [11], [12], [13]]  # each new token is written right after the one before


@pytest.mark.parametrize("min_length", [0, 2, 3, 4, 6])
def test_min_length_bans_the_end_token_until_the_step_hugging_face_stops_banning_it(min_length: int) -> None:
    """min_length counts the prompt as given and the new tokens: the end token is banned while fewer than
    min_length tokens are in the row, as transformers' MinLengthLogitsProcessor bans it."""
    logits_process = pytest.importorskip("transformers.generation.logits_process")

    prompt, eos, vocab = [5, 6, 7], 2, 10
    bans = TokenBans(min_length=min_length).for_sequence(prompt, {eos})
    processor = logits_process.MinLengthLogitsProcessor(min_length, eos)
    for generated in range(8):
        new_tokens = [8] * generated
        row = torch.tensor([prompt + new_tokens])
        hugging_face_bans = bool(torch.isinf(processor(row, torch.zeros(1, vocab))[0, eos]))
        moirai_bans = bans is not None and eos in bans.banned(new_tokens)
        assert moirai_bans == hugging_face_bans, generated
        assert moirai_bans == (len(prompt) + generated < min_length)


def test_each_step_that_gives_a_token_bans_what_its_rows_may_not_take_next() -> None:
    """[Note: banned tokens]: a prefill chunk that gives no token bans nothing; the others ban each row's own,
    padded with -1 to the step's widest row."""
    steps = FakeSteps()
    engine = Engine(steps.submit, slots=2, max_seq_len=64, max_prefill=4, max_batch=2, depth=1, logits_width=64)
    bans = TokenBans(min_new_tokens=2, suppress_tokens=(40, 70), no_repeat_ngram_size=1)  # 70: past the logits
    banned = sequence([1, 2, 3, 4, 5], 3, eos=frozenset({30}))
    banned.bans = bans.for_sequence(banned.prompt, banned.eos_token_ids)
    other = sequence([7], 3)
    run(engine, steps, [banned, other])
    assert banned.future.result() == [6, 7, 8] and other.future.result() == [8, 9, 10]
    rows = [(inputs[0].tolist(), inputs[4].tolist()) for inputs in steps.submitted]
    assert rows[0] == ([[1, 2, 3, 4]], [[-1]])  # a chunk that gives no token
    assert rows[1] == ([[5]], [[1, 2, 3, 4, 5, 30, 40]])  # the end token until 2 new ones, the prompt's own
    assert rows[2] == ([[7]], [[-1]])
    assert rows[3] == ([[6], [8]], [[1, 2, 3, 4, 5, 6, 30, 40], [-1] * 8])
    assert rows[4] == ([[7], [9]], [[1, 2, 3, 4, 5, 6, 7, 40], [-1] * 8])
    # An end token of -1 bans nothing (it would come first and stand for the row's padding); a bad word past the
    # logits is refused, as Hugging Face refuses it.
    steps.submitted.clear()
    negative = sequence([9], 1, eos=frozenset({-1}))
    negative.bans = TokenBans(min_new_tokens=1, suppress_tokens=(0,)).for_sequence([9], {-1})
    run(engine, steps, [negative])
    assert steps.submitted[0][4].tolist() == [[0]]
    past = sequence([9], 1)
    past.bans = TokenBans(bad_words_ids=((3, 64),)).for_sequence([9], ())
    with pytest.raises(InputError, match=r"bad_words_ids holds token ids \[64\], past the model's 64 logits"):
        engine.add(past)


def test_as_many_steps_as_the_depth_are_in_flight_and_sequences_share_them() -> None:
    steps = FakeSteps()
    engine = Engine(steps.submit, slots=4, max_seq_len=64, max_prefill=8, max_batch=4, depth=2)
    sequences = [sequence([10 * i], 6) for i in range(4)]
    run(engine, steps, sequences)
    assert [s.future.result() for s in sequences] == [[10 * i + k for k in range(1, 7)] for i in range(4)]
    assert steps.most_in_flight == 2
    decode_batches = [inputs[0].shape[0] for inputs in steps.submitted if inputs[0].shape[1] == 1]
    assert max(decode_batches) == 2  # four sequences in two steps of two


def test_groups_that_drift_apart_as_sequences_end_are_balanced_so_steps_stay_in_flight_together() -> None:
    # Slots 0 and 2 join decode group 0, slots 1 and 3 group 1; 0 and 2 end with their first token. The two left
    # decoded together, one step at a time, as one stage would; now one moves to the empty group.
    steps = FakeSteps()
    engine = Engine(steps.submit, slots=4, max_seq_len=64, max_prefill=8, max_batch=4, depth=2)
    sequences = [sequence([10 * i], 1 if i % 2 == 0 else 12) for i in range(4)]
    run(engine, steps, sequences)
    assert [s.future.result() for s in sequences] == [[1], list(range(11, 23)), [21], list(range(31, 43))]
    slots = [set(inputs[2].tolist()) for inputs in steps.submitted]
    last_early = max(k for k, step in enumerate(slots) if step & {0, 2})
    later = range(last_early + 1, len(slots))
    assert sum(slots[k] == {1, 3} for k in later) <= 1  # the step in flight when group 0 emptied, at most
    assert any(steps.in_flight_at_submit[k] == 2 for k in later)


def test_sequences_beyond_the_slots_wait_and_take_a_slot_as_one_leaves() -> None:
    steps = FakeSteps()
    engine = Engine(steps.submit, slots=2, max_seq_len=64, max_prefill=8, max_batch=2, depth=2)
    sequences = [sequence([100 * i + 1, 100 * i + 2], 3 + i) for i in range(5)]
    run(engine, steps, sequences)
    for i, s in enumerate(sequences):
        assert s.future.result() == [100 * i + 3 + k for k in range(3 + i)]
    assert max(int(inputs[2].max()) for inputs in steps.submitted) == 1  # two slots served all five


def test_a_sequence_ends_at_its_end_token_and_its_slot_is_free_again() -> None:
    steps = FakeSteps()
    engine = Engine(steps.submit, slots=1, max_seq_len=64, max_prefill=8, max_batch=1, depth=1)
    ended, after = sequence([5], 10, eos=frozenset({8})), sequence([20], 2)
    run(engine, steps, [ended, after])
    assert ended.future.result() == [6, 7, 8]
    assert after.future.result() == [21, 22]


def test_a_cancelled_sequence_stops_at_its_next_step_and_frees_its_slot() -> None:
    steps = FakeSteps()
    engine = Engine(steps.submit, slots=1, max_seq_len=128, max_prefill=8, max_batch=1, depth=1)
    cancelled = sequence([1], 50)
    cancelled.on_token = lambda token: token == 3 and cancelled.future.cancel()  # its caller gives up
    after, never = sequence([100], 2), sequence([200], 2)
    assert never.future.cancel()  # cancelled while it waits for a slot
    run(engine, steps, [cancelled, after, never])
    assert cancelled.future.cancelled() and never.future.cancelled()
    assert after.future.result() == [101, 102]  # took the slot the cancelled sequence left
    fed = [int(inputs[0][0, -1]) for inputs in steps.submitted]
    assert fed == [1, 2, 100, 101]  # no step for the cancelled sequence after its caller gave up, none for `never`
    assert engine.unfinished == 0


class _CancelledAsItEnds(ServedFuture):
    """A future its caller cancels from another thread just as the engine settles it."""

    def set_result(self, result: object) -> None:
        self.cancel()
        super().set_result(result)


def test_a_future_cancelled_as_its_sequence_ends_leaves_the_loop_serving_the_others() -> None:
    engine = Engine(lambda inputs: done_future(lambda: inputs[0][:, -1] + 1), 2, 64, 8, 2, 1)
    first = SequenceState([1], 3, SamplingParams(), frozenset(), future=_CancelledAsItEnds())
    second = sequence([10], 3)
    engine.add(first)
    engine.add(second)
    assert engine.unfinished == 2
    engine.run_until_idle()  # an InvalidStateError here ended the loop, and every other sequence with it
    assert first.future.cancelled() and second.future.result() == [11, 12, 13]
    assert engine.unfinished == 0


def test_a_request_error_fails_its_step_alone_and_a_rank_failure_every_begun_sequence() -> None:
    steps = FakeSteps()
    engine = Engine(steps.submit, slots=4, max_seq_len=64, max_prefill=8, max_batch=1, depth=1)
    steps.fail_next = RequestError("rank 1 failed op embedding: index out of range")
    sequences = [sequence([1], 3), sequence([2], 3)]
    run(engine, steps, sequences)
    with pytest.raises(RequestError):
        sequences[0].future.result()
    assert sequences[1].future.result() == [3, 4, 5]

    steps = FakeSteps()
    engine = Engine(steps.submit, slots=4, max_seq_len=64, max_prefill=8, max_batch=1, depth=2)
    sequences = [sequence([1], 3), sequence([2], 3)]
    steps.fail_next = DistributedError("rank 1 hung or died")
    run(engine, steps, sequences)
    for s in sequences:  # the second had begun too: its cache on rank 1 is gone
        with pytest.raises(DistributedError, match="rank 1"):
            s.future.result()


class FailureTakenFirst(FakeSteps):
    """Fails the next step answered, then answers no other until the engine has ended the ``sequences`` with that
    failure: the order a loaded machine may give, where the engine's thread runs before the answering one."""

    def __init__(self, sequences: list[SequenceState]) -> None:
        super().__init__()
        self.fail_next = DistributedError("rank 1 hung or died")
        self.sequences = sequences

    def release_one(self) -> None:
        failing = self.fail_next is not None
        super().release_one()
        deadline = time.monotonic() + 60
        while failing and not all(s.future.done() for s in self.sequences):
            assert time.monotonic() < deadline, "the engine did not take the failed step"
            threading.Event().wait(0.001)


def test_a_rank_failure_taken_before_the_other_steps_in_flight_come_back_still_lets_the_loop_end() -> None:
    """The loop waited for a step of a sequence the failure had ended, which nobody answered any more: its
    non-daemon thread never ended and held the interpreter at exit."""
    sequences = [sequence([1], 3), sequence([2], 3)]
    steps = FailureTakenFirst(sequences)
    engine = Engine(steps.submit, slots=4, max_seq_len=64, max_prefill=8, max_batch=1, depth=2)
    run(engine, steps, sequences)
    for s in sequences:
        with pytest.raises(DistributedError, match="rank 1"):
            s.future.result()
    assert not steps.pending


def wait_until(condition, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while not condition():
        assert time.monotonic() < deadline, what
        threading.Event().wait(0.001)


def test_a_late_failure_of_a_step_from_before_a_rank_failure_leaves_sequences_begun_since_alone() -> None:
    """Fault injected: a rank fails with two steps in flight. The engine takes the first failure (both sequences
    had begun: both end), a new sequence begins on the restarted ranks, and only then the second step's failure
    comes back: it must end no sequence begun after the failure (it ended every active sequence before)."""
    steps = FakeSteps()
    engine = Engine(steps.submit, slots=4, max_seq_len=64, max_prefill=8, max_batch=1, depth=2)
    before = [sequence([1], 3), sequence([2], 3)]
    for s in before:
        engine.add(s)
    stopped = threading.Event()
    loop = threading.Thread(target=engine.serve_forever, args=(stopped,), daemon=True)
    loop.start()
    try:
        wait_until(lambda: len(steps.pending) == 2, "the two sequences' steps were not submitted")
        steps.fail_next = DistributedError("rank 1 hung or died")
        steps.release_one()
        wait_until(lambda: all(s.future.done() for s in before), "the failure did not end the begun sequences")
        after = sequence([5], 3)
        engine.add(after)
        wait_until(lambda: len(steps.submitted) == 3, "the new sequence's step was not submitted")
        steps.fail_next = DistributedError("rank 1 hung or died")  # the old step's failure, late
        steps.release_one()
        while not after.future.done():
            answer(steps)
    finally:
        stopped.set()
        while loop.is_alive():
            answer(steps)
    for s in before:
        with pytest.raises(DistributedError, match="rank 1"):
            s.future.result()
    assert after.future.result() == [6, 7, 8]


def test_a_sequence_that_cannot_fit_a_slot_is_refused_at_once() -> None:
    engine = Engine(FakeSteps().submit, slots=1, max_seq_len=16, max_prefill=8, max_batch=1, depth=1)
    with pytest.raises(InputError, match="over max_seq_len=16"):
        engine.add(sequence(list(range(10)), 7))
    with pytest.raises(InputError, match="empty"):
        engine.add(sequence([], 2))


def test_a_cut_the_samplers_candidates_may_not_hold_is_warned_of_and_a_top_k_they_cannot_hold_refused():
    """[Note: sampling among candidates] in step.py: no top_k with a top-p cut, or a top_k over 1,024 and under the
    vocabulary."""
    big, small = (Engine(FakeSteps().submit, 2, 64, 8, 2, 1, vocab) for vocab in (32000, 512))
    for every_token in (0, 40000):  # no top_k, or one over the vocabulary
        with pytest.warns(moirai.MoiraiWarning, match=r"top_p=0.9 and min_p=0.0 with no top_k are cut among"):
            big.add(SequenceState([1, 2], 4, SamplingParams(1.0, every_token, 0.9, seed=1), frozenset()))
    with pytest.raises(InputError, match=r"top_k=1100 is over the 1024 likeliest tokens .* at most 1024, or 0"):
        big.add(SequenceState([1, 2], 4, SamplingParams(1.0, 1100, 1.0, seed=1), frozenset()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", moirai.MoiraiWarning)
        big.add(SequenceState([1, 2], 4, SamplingParams(1.0, 50, 0.9, seed=1), frozenset()))  # top_k: exact
        big.add(SequenceState([1, 2], 4, SamplingParams(1.0, 0, 1.0, seed=1), frozenset()))  # no cut: exact
        small.add(SequenceState([1, 2], 4, SamplingParams(1.0, 0, 0.9, seed=1), frozenset()))  # all candidates
        small.add(SequenceState([1, 2], 4, SamplingParams(1.0, 1100, 0.9, seed=1), frozenset()))  # every token
