"""Models that keep state in buffers written in place: traced, placed with the ops that touch it, split, and kept by
the rank that holds it from call to call."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch
from models_for_tests import DoublesAndReturns

import moirai
from moirai.errors import InputError, PlanError, StateLeftBehindWarning
from moirai.frontend.state import mutable_buffers
from moirai.frontend.writes import written_operands
from moirai.planning.plan import Plan
from moirai.runtime.local import run_local
from moirai.runtime.rank_processes import started_ranks
from moirai.runtime.server import Server
from moirai.runtime.written_state import WrittenState, returning_state, write_back


class RunningMean(torch.nn.Module):
    """A running mean of its inputs' projections, kept in buffers between calls."""

    def __init__(self) -> None:
        super().__init__()
        self.project, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.register_buffer("total", torch.zeros(4, 16))
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        self.total.add_(h)
        self.calls.add_(1)
        return self.out(self.total / self.calls) + h


def twins() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model, reference = RunningMean().eval(), RunningMean().eval()
    reference.load_state_dict(model.state_dict())
    return model, reference


def inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=generator) for _ in range(4)]


def test_buffers_written_in_place_are_found_with_the_ops_that_touch_them() -> None:
    model, _ = twins()
    compiled = moirai.compile(model, ["cpu"], example_inputs=(inputs()[0],), placer="single", progress=False)
    buffers = {buffer.name: buffer for buffer in mutable_buffers(compiled.traced.graph_module)}
    assert set(buffers) == {"total", "calls"}
    assert all(len(buffer.op_names) >= 2 for buffer in buffers.values())  # the write and the read of its result
    assert buffers["total"].nbytes == 4 * 16 * 4


def test_a_split_stateful_model_equals_the_model_call_after_call() -> None:
    model, reference = twins()
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=inputs()[:1], placer="round_robin", progress=False)
    assert compiled.problem.colocated and len(set(compiled.plan.placement.tolist())) == 2
    with torch.no_grad():
        for x in inputs():
            torch.testing.assert_close(compiled(x), reference(x))


@pytest.mark.slow
def test_a_rank_other_than_0_keeps_the_state_between_requests() -> None:
    model, reference = twins()
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=inputs()[:1], placer="round_robin", progress=False)
    problem = compiled.problem
    state_tasks = {task for members in problem.colocated for task in members}
    placement = np.array([1 if task in state_tasks else 0 for task in range(problem.num_tasks)])
    on_rank_1 = compiled.with_plan(Plan(placement, problem.device_names))
    with pytest.warns(StateLeftBehindWarning, match="buffer .* on device 1"):  # closing loses rank 1's state
        with torch.no_grad(), on_rank_1.server(timeout_s=4) as server:
            for x in inputs():
                torch.testing.assert_close(server.submit(x).result(timeout=60), reference(x))
            # Rank 1 dies while the server is idle: the heartbeat finds it, no request fails, new ranks start from
            # the state's values before the server, and the next request ran from them, silently wrong.
            kill_rank_1_and_wait_for_the_restart(server)
            with pytest.raises(moirai.DistributedError, match=r"rank 1 .*state .*buffer .* on device 1.*new one"):
                server.submit(inputs()[0])


def kill_rank_1_and_wait_for_the_restart(server: Server) -> None:
    world = server.worlds.current
    os.kill(started_ranks()[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 30  # a bound on a hang: the heartbeat finds it within a second or two
    while server.worlds.current == world:
        assert time.monotonic() < deadline, "the ranks were not restarted after rank 1 died"
        time.sleep(0.05)


class Counts(torch.nn.Module):
    """Counts its calls in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n.add_(1)
        return self.b(self.a(x)) * self.n


class CountsAndShifts(Counts):
    """Counts its calls in a buffer and adds 1 to its input in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        x.add_(1.0)
        return y


def counting_twins(
    model_class: type[torch.nn.Module], placer: str
) -> tuple[moirai.CompiledModel, torch.nn.Module, torch.Tensor]:
    """The model compiled for two CPUs (placer "single": every op on device 1), its eager twin and an input."""
    torch.manual_seed(0)
    model, reference = model_class().eval(), model_class().eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    compiled = moirai.compile(
        model, ["cpu", "cpu"], example_inputs=(x.clone(),), placer=placer, calibration="none", progress=False
    )
    if placer == "single":  # every op on device 1, device 0 only drives
        compiled = compiled.with_plan(Plan(np.ones(compiled.problem.num_tasks, int), compiled.problem.device_names))
    return compiled, reference, x


def test_the_state_a_part_but_0_writes_is_returned_and_written_back() -> None:
    compiled, reference, x = counting_twins(CountsAndShifts, "single")
    program = compiled.program
    returning, states = returning_state(program)
    assert set(states) == {WrittenState(1, attribute="n"), WrittenState(1, input_index=0)}
    assert len(returning.outputs) == len(program.outputs) + 2 and returning.parts[0] is program.parts[0]
    for _ in range(2):
        mine, theirs = x.clone(), x.clone()
        with torch.no_grad():
            # The returning program run on copies of the state (as ranks do): only write_back keeps it.
            flat = run_local(returning, [mine.clone()], ["cpu", "cpu"])
            torch.testing.assert_close(write_back(program, states, flat, [mine])[0], reference(theirs))
        torch.testing.assert_close(mine, theirs)


@pytest.mark.slow
def test_run_distributed_keeps_the_state_a_rank_other_than_0_writes() -> None:
    compiled, reference, x = counting_twins(Counts, "round_robin")
    (counter,) = mutable_buffers(compiled.traced.graph_module)
    assert {compiled.node_device[op] for op in counter.op_names} == {1}  # the counter is written on rank 1
    with torch.no_grad():
        for _ in range(3):  # each call a new world: rank 1's count must come back to the model
            mine, theirs = x.clone(), x.clone()
            torch.testing.assert_close(compiled.run_distributed(mine, progress=False), reference(theirs))
        torch.testing.assert_close(compiled(x.clone()), reference(x.clone()))  # the local runner goes on from it


@pytest.mark.slow
def test_run_distributed_writes_back_an_input_a_rank_other_than_0_writes() -> None:
    compiled, reference, x = counting_twins(CountsAndShifts, "single")
    mine, theirs = x.clone(), x.clone()
    with torch.no_grad():
        torch.testing.assert_close(compiled.run_distributed(mine, progress=False), reference(theirs))
    torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(mine, x + 1)


class TwoTowersThenClamp(torch.nn.Module):
    """Two towers read the input; then the input is clamped in place for the caller (its last op)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x) + self.b(x)
        x.clamp_(min=0)
        return out


def every_plan(compiled: moirai.CompiledModel) -> list[moirai.CompiledModel]:
    """``compiled`` split by every placement of its tasks on its two devices that its colocated sets allow."""
    problem = compiled.problem
    allowed = []
    for mask in range(2**problem.num_tasks):
        placement = np.array([(mask >> task) & 1 for task in range(problem.num_tasks)])
        if all(len(set(placement[list(members)].tolist())) == 1 for members in problem.colocated):
            allowed.append(compiled.with_plan(Plan(placement, problem.device_names)))
    return allowed


@pytest.mark.parametrize("model_class", [TwoTowersThenClamp, DoublesAndReturns])
def test_an_input_written_in_place_is_read_as_given_by_the_parts_that_read_it(model_class) -> None:
    """The write is a ``copy_`` into the input; a part that runs it before another part reads the input (one
    process, one tensor) made 24 of 128 placements of the towers wrong."""
    torch.manual_seed(0)
    model = model_class().eval()
    x = torch.randn(4, 8 if model_class is TwoTowersThenClamp else 4, generator=torch.Generator().manual_seed(1))
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x.clone(),), placer="single", progress=False)
    plans = every_plan(compiled)
    assert len(plans) == 2**compiled.problem.num_tasks  # an input, unlike a buffer, keeps no task on one device
    for split in plans:
        mine, theirs = x.clone(), x.clone()
        with torch.no_grad():
            got, expected = split(mine), model(theirs)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"placement {split.plan.placement.tolist()}")
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        if isinstance(got, tuple):  # the input written and returned is the caller's tensor, as in eager
            assert got[0] is mine


@pytest.mark.slow
def test_run_distributed_reads_an_input_as_given_where_rank_0_writes_it() -> None:
    torch.manual_seed(0)
    model = TwoTowersThenClamp().eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x.clone(),), placer="single", progress=False)
    writer = {task for task, node in enumerate(compiled.graph.nodes) if any("copy_" in n for n in node.fx_names)}
    placement = np.array([0 if task in writer else 1 for task in range(compiled.problem.num_tasks)])
    split = compiled.with_plan(Plan(placement, compiled.problem.device_names))
    mine, theirs = x.clone(), x.clone()
    with torch.no_grad():
        torch.testing.assert_close(split.run_distributed(mine, progress=False), model(theirs), rtol=0, atol=0)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


class WritesUnderNoGradAndAutocast(torch.nn.Module):
    """State written in place inside blocks torch.export wraps in higher-order ops (``wrap_with_set_grad_enabled``,
    ``wrap_with_autocast``): a running average read before its update, a step counter, a parameter, the input."""

    def __init__(self) -> None:
        super().__init__()
        self.project, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("average", torch.zeros(4))
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        y = self.out(h - self.average) * self.scale + self.steps
        with torch.no_grad():
            self.average.mul_(0.9).add_(0.1 * h.mean(0))
            self.scale.mul_(0.5)
            x.clamp_(min=0)
        with torch.autocast("cpu", enabled=False):
            self.steps.add_(1)
        return y


def wrapped_writes_twins() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, reference = WritesUnderNoGradAndAutocast().eval(), WritesUnderNoGradAndAutocast().eval()
    reference.load_state_dict(model.state_dict())
    return model, reference, torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def test_what_a_block_under_no_grad_or_autocast_writes_is_found_where_export_wraps_it() -> None:
    model, _, x = wrapped_writes_twins()
    exported = torch.export.export(model, (x.clone(),), strict=False)
    wrappers = [node for node in exported.graph.nodes if isinstance(node.target, torch._ops.HigherOrderOperator)]
    assert wrappers  # the blocks are higher-order ops whose bodies hold the writes
    written = {operand.name for node in wrappers for operand in written_operands(node)}
    assert written == {"b_average", "p_scale", "x", "b_steps"}
    compiled = moirai.compile(model, ["cpu"], example_inputs=(x.clone(),), placer="single", progress=False)
    assert {state.name for state in mutable_buffers(compiled.traced.graph_module)} == {"average", "scale", "steps"}


def test_state_written_under_no_grad_or_autocast_is_kept_by_every_placement() -> None:
    model, reference, x = wrapped_writes_twins()
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x.clone(),), placer="single", progress=False)
    assert compiled.problem.colocated  # the average's read, update and write on one device
    plans = every_plan(compiled)
    assert 1 < len(plans) < 2**compiled.problem.num_tasks
    initial = {name: value.clone() for name, value in reference.state_dict().items()}
    for split in plans:
        model.load_state_dict(initial)
        reference.load_state_dict(initial)
        for _ in range(3):
            mine, theirs = x.clone(), x.clone()
            with torch.no_grad():
                torch.testing.assert_close(split(mine), reference(theirs), rtol=0, atol=0)
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
            for name, value in reference.state_dict().items():
                torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_run_distributed_brings_back_state_written_under_no_grad_on_rank_1() -> None:
    model, reference, x = wrapped_writes_twins()
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x.clone(),), placer="single", progress=False)
    # Rank 0 runs the input's projection only; rank 1 every read and write of the state.
    placement = np.array([0 if node.fx_names == ("linear",) else 1 for node in compiled.graph.nodes])
    on_rank_1 = compiled.with_plan(Plan(placement, compiled.problem.device_names))
    for _ in range(3):  # each call a new world: rank 1's writes must come back to the model
        mine, theirs = x.clone(), x.clone()
        with torch.no_grad():
            torch.testing.assert_close(on_rank_1.run_distributed(mine, progress=False), reference(theirs))
        torch.testing.assert_close(mine, theirs)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], value, msg=name)


class ReadsThenCounts(torch.nn.Module):
    """Reads its counter, then adds 1 to it: the write must wait for the read, which no data edge says."""

    def __init__(self) -> None:
        super().__init__()
        self.project, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(self.project(x)) + self.steps
        self.steps.add_(1)
        return y


def test_a_buffer_is_written_after_every_read_of_its_old_value_whatever_the_order_of_the_plan() -> None:
    torch.manual_seed(0)
    model, reference = ReadsThenCounts().eval(), ReadsThenCounts().eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="single", progress=False)
    for split in every_plan(compiled):  # the read waits for the other device's linear where the write does not
        model.steps.zero_()
        reference.steps.zero_()
        for _ in range(2):
            with torch.no_grad():
                torch.testing.assert_close(split(x), reference(x), msg=f"placement {split.plan.placement.tolist()}")


class SendsAViewThenClamps(torch.nn.Module):
    """A view of the input (``x.t()``) made where the input is then written, read by an op that may be elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x.t()) + self.b(x)
        x.clamp_(min=0)
        return out


def test_a_view_of_an_input_sent_to_another_device_carries_the_value_before_the_write() -> None:
    """Before ([Note: a view of written state crosses as a copy]): the view went to the other part as the writer's
    tensor itself, read after the write (12 of 64 placements wrong), and a plan's order could make the view after the
    write (its reader being on another device, nothing held the write back)."""
    torch.manual_seed(0)
    model, x = SendsAViewThenClamps().eval(), torch.randn(4, 4)
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x.clone(),), placer="single", progress=False)
    for split in every_plan(compiled):
        mine, theirs = x.clone(), x.clone()
        with torch.no_grad():
            assert torch.equal(split(mine), model(theirs)), split.plan.placement.tolist()
        assert torch.equal(mine, theirs)


class CopiesThenCounts(torch.nn.Module):
    """``prev.copy_(cur)`` writes ``prev`` and reads ``cur`` before ``cur`` is written: a write that must come after
    one write's readers and before another write."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("prev", torch.zeros(4))
        self.register_buffer("cur", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) * self.prev
        self.prev.copy_(self.cur)
        self.cur.add_(1)
        return y


def test_chained_writes_keep_every_read_of_an_old_value_whatever_the_order_given() -> None:
    """Before: one move per write, in turn; moving ``prev``'s write after its reader left ``cur``'s write, moved
    earlier, before ``prev.copy_(cur)`` read ``cur`` (``prev`` came out 2 where eager has 1)."""
    from moirai.frontend.trace import trace
    from moirai.runtime.split import split_module

    torch.manual_seed(0)
    model, reference = CopiesThenCounts().eval(), CopiesThenCounts().eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    traced = trace(model, (x,))
    ops = [node.name for node in traced.graph_module.graph.nodes if node.op == "call_function"]
    assert ops == ["linear", "mul", "add", "copy__default", "copy__default_1"]  # copy_(prev, cur), copy_(cur, add)
    device = {name: 0 for name in ops} | {"linear": 1}
    on_0 = ["add", "copy__default_1", "copy__default", "mul"]  # both writes before the reads: a valid data order
    program = split_module(traced, device, 2, [on_0, ["linear"]])
    for call in range(2):
        with torch.no_grad():
            assert torch.equal(run_local(program, [x], ["cpu", "cpu"])[0], reference(x)), call
        prev = program.parts[0].graph_module.prev
        assert torch.equal(prev, reference.prev), (call, prev, reference.prev)


def _state_split_by_hand(record: dict, buffer_ops: set[str]) -> str:
    """``record`` (a plan on device 0 alone) edited as by hand, consistently in every field, to run one op group that
    touches a buffer on device 1, away from the buffer's other ops, with the file's colocated sets dropped; the name
    of a buffer op moved."""
    group = next(g for g, names in enumerate(record["groups"]) if buffer_ops & set(names) and buffer_ops - set(names))
    moved = record["groups"][group]
    record["node_device"].update(dict.fromkeys(moved, 1))
    record["device_order"] = [[name for name in record["device_order"][0] if name not in moved], list(moved)]
    record["plan"]["placement"][group] = 1
    record["plan"]["order"] = [[g for g in record["plan"]["order"][0] if g != group], [group]]
    record["plan"]["transfer_order"] = None
    record["problem"]["colocated"] = []
    return sorted(buffer_ops & set(moved))[0]


def test_load_keeps_a_buffer_with_its_ops_whatever_the_file_says_of_colocation(tmp_path) -> None:
    """Colocation comes from the model's buffers, not the file: a file that drops it would split the state (the
    local runner then gave wrong outputs from the first call)."""
    model, _ = twins()
    compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=inputs()[:1], placer="single", progress=False)
    total = next(buffer for buffer in mutable_buffers(compiled.traced.graph_module) if buffer.name == "total")
    record = compiled.plan_record()
    moved = _state_split_by_hand(record, set(total.op_names))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(record))
    with pytest.raises(PlanError, match=rf"plan.json: .*buffer 'total'.*{moved} on device 1.*save the plan again"):
        moirai.load(path, twins()[0], example_inputs=inputs()[:1], progress=False)


class ShiftsOneOfTwo(torch.nn.Module):
    """Reads ``y`` on both sides of an in-place write to ``x``: passed the same tensor twice, eager sees the write."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(y)
        x.add_(1)
        return h + self.b(y), y * 2


def shifts_one_of_two() -> tuple[moirai.CompiledModel, torch.nn.Module]:
    torch.manual_seed(0)
    model = ShiftsOneOfTwo().eval()
    example = (torch.randn(2, 4), torch.randn(2, 4))
    return moirai.compile(model, ["cpu", "cpu"], example_inputs=example, placer="hash", progress=False), model


def _same_and_overlapping(base: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of (2, 4) tensors that share memory: one tensor twice, a tensor and a view of it, overlapping rows."""
    x = base[:2]
    return [(x, x), (x, x.view(2, 4)), (x, base[1:3]), (x[0].expand(2, 4), x)]


def test_inputs_that_share_memory_with_an_input_written_in_place_are_refused() -> None:
    """Eager writes ``x`` and reads the write as ``y``; the split program took them as two tensors: a wrong answer
    (out[0] off by 1.37, out[1] by 2.0), locally and distributed."""
    compiled, _ = shifts_one_of_two()
    array = np.zeros((3, 4), np.float32)  # two storages over one memory: views of one numpy array
    for x, y in [*_same_and_overlapping(torch.randn(3, 4)), (torch.from_numpy(array[:2]), torch.from_numpy(array[1:]))]:
        for call in (compiled, compiled.run_distributed):
            with pytest.raises(InputError, match=r"input 0 \(args\[0\]\) and input 1 \(args\[1\]\) share .*clone"):
                call(x, y)


def test_inputs_that_share_memory_but_are_not_written_are_served() -> None:
    """Only a write makes sharing matter: one tensor passed twice to a model that reads both, or two halves or two
    interleaved columns of one tensor (disjoint) to a model that writes one, equal the model."""
    compiled, model = shifts_one_of_two()
    base = torch.randn(4, 4)
    mine, theirs = base.clone(), base.clone()
    with torch.no_grad():
        torch.testing.assert_close(compiled(mine[:2], mine[2:]), model(theirs[:2], theirs[2:]), rtol=0, atol=0)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    batch = torch.randn(2, 2, 4)  # interleaved columns of one tensor share a span, not an element
    mine, theirs = batch.clone(), batch.clone()
    with torch.no_grad():
        torch.testing.assert_close(compiled(mine[:, 0], mine[:, 1]), model(theirs[:, 0], theirs[:, 1]), rtol=0, atol=0)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    reads = moirai.compile(ReadsTwo(), ["cpu", "cpu"], example_inputs=(base, base), placer="hash", progress=False)
    torch.testing.assert_close(reads(base, base), 2 * base)


class ReadsTwo(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def test_an_input_that_shares_memory_with_a_weight_is_refused_where_one_of_them_is_written() -> None:
    """An input written in place that is a parameter the model reads (the split read it before or after the write,
    off by 20), and an input that is a buffer the model writes, are the same fault."""
    compiled, model = shifts_one_of_two()
    weight = compiled.traced.graph_module.get_parameter("a_weight")
    with pytest.raises(InputError, match=r"input 0 \(args\[0\]\) and the model's parameter 'a_weight' share"):
        compiled(weight[:2], torch.randn(2, 4))
    counter, _, x = counting_twins(Counts, "round_robin")
    with pytest.raises(InputError, match=r"the model's buffer 'n' and input 0 \(args\[0\]\) share memory"):
        counter(counter.traced.graph_module.get_buffer("n").expand(2, 4))
    with torch.no_grad():
        counter(x)  # a program that writes a buffer serves inputs that share no memory with it
