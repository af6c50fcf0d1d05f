"""Models that keep state in buffers written in place: traced, placed with the ops that touch it, split, and kept by
the rank that holds it from call to call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moirai
from moirai.frontend.state import mutable_buffers
from moirai.planning.plan import Plan


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
    with torch.no_grad(), on_rank_1.server() as server:
        for x in inputs():
            torch.testing.assert_close(server.submit(x).result(timeout=60), reference(x))
