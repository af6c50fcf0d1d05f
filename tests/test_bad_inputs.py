"""A catalogue of mistakes a user can make, each answered by a moirai error that names it and says what to do.

Every case asserts the exception type and the key words of its message: what was wrong, where (file,
key, device, input, option) and what to try. Models are tiny so the whole catalogue runs in seconds.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
from rich.console import Console
from torch import nn

import moirai
from moirai.cluster.cost import activation_peak_bytes
from moirai.cluster.files import read_cluster_devices
from moirai.errors import (
    ClusterError,
    FusionRuleError,
    InputError,
    MoiraiError,
    OverMemoryWarning,
    PlacerOptionError,
    PlanError,
    ProblemError,
    RandomOpsWarning,
    TraceError,
    TrainingModeWarning,
)
from moirai.frontend.fusion_rules import load_rules
from moirai.planning.placers import devices_over_memory
from moirai.viz import summary_table, text_gantt

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()


X = torch.randn(3, 4)


@pytest.fixture(scope="module")
def compiled() -> moirai.CompiledModel:
    return moirai.compile(tiny(), ["cpu", "cpu"], (X,), placer="round_robin")


@pytest.fixture(scope="module")
def problem() -> moirai.Problem:
    return moirai.Problem.from_dict(
        {
            "devices": [{"name": "a", "memory_bytes": 10.0}, {"name": "b", "memory_bytes": 10.0}],
            "tasks": [{"name": n, "compute_s": [1.0, 1.0], "memory_bytes": 8.0} for n in "xyz"],
            "edges": [{"src": "x", "dst": "y", "transfer_s": [[0, 1], [1, 0]]}],
        }
    )


def raises(kind: type[Exception], *words: str):
    """``pytest.raises`` whose message must contain every word (regex-escaped, in any order)."""
    return pytest.raises(kind, match="".join(f"(?=[\\s\\S]*{re.escape(word)})" for word in words))


# --- compile: example inputs and the model -------------------------------------------------------------


def test_example_input_of_the_wrong_shape_names_the_module_and_chains_the_torch_error():
    with raises(TraceError, "do not fit", "module '0' (Linear)", "(3, 5)", "mat1 and mat2 shapes") as failure:
        moirai.compile(tiny(), ["cpu", "cpu"], (torch.randn(3, 5),), placer="heft")
    assert isinstance(failure.value.__cause__, RuntimeError), "the torch error is chained, not the headline"
    assert "ShapeProp" not in str(failure.value)


def test_missing_example_input_names_the_argument():
    with raises(TraceError, "missing a required argument: 'input'", "example_inputs=(...)"):
        moirai.compile(tiny(), ["cpu", "cpu"], (), placer="heft")


def test_too_many_example_inputs_are_named():
    with raises(TraceError, "too many positional arguments", "Sequential.forward"):
        moirai.trace(tiny(), (X, X))


def test_numpy_example_input_says_to_convert_it():
    with raises(TraceError, "example_inputs[0]", "numpy", "torch.from_numpy"):
        moirai.compile(tiny(), ["cpu", "cpu"], (np.zeros((3, 4), np.float32),), placer="heft")


def test_numpy_example_kwarg_is_named_by_its_key():
    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return x * scale

    with raises(TraceError, "example_kwargs['scale']", "numpy"):
        moirai.trace(Scaled(), (X,), {"scale": np.ones(4)})


def test_integer_example_input_into_a_linear_is_refused_at_compile_time():
    with raises(TraceError, "torch.int64", "example_inputs[0]", "module '0' (Linear)", "x.float()"):
        moirai.compile(tiny(), ["cpu", "cpu"], (torch.ones(3, 4, dtype=torch.long),), placer="heft")


def test_value_dependent_output_shape_names_the_line_and_the_fix():
    class Positive(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t[t > 0] * 2

    with raises(TraceError, "Positive", "index", "test_bad_inputs.py", "depends on the values", "torch.where"):
        moirai.compile(Positive(), ["cpu", "cpu"], (X,), placer="heft")


def test_value_dependent_control_flow_names_the_line_and_torch_cond():
    class Branchy(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            if t.sum() > 0:
                return t * 2
            return t

    with raises(TraceError, "could not trace Branchy", "test_bad_inputs.py", "if t.sum() > 0", "torch.cond"):
        moirai.trace(Branchy(), (X,))


def test_model_in_training_mode_warns_with_the_modules_and_eval():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    with pytest.warns(TrainingModeWarning, match=r"training mode: 1 \(Dropout\).*model\.eval\(\)"):
        moirai.trace(model, (X,))


def test_model_in_training_mode_warning_points_at_the_users_line():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    with pytest.warns(TrainingModeWarning) as caught:
        moirai.compile(model, ["cpu"], (X,), placer="heft", progress=False)
    assert [w.filename for w in caught if w.category is TrainingModeWarning] == [__file__]


class FunctionalDropout(nn.Module):
    """Dropout as Hugging Face's attention writes it: a call, no nn.Dropout module to find."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.linear, self.p = nn.Linear(4, 4), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.linear(x), self.p, training=self.training)


def test_a_training_model_whose_dropout_is_a_function_warns_with_its_line():
    """It gave no warning, and the compiled model dropped activations for ever, after model.eval() too."""
    with pytest.warns(TrainingModeWarning, match=r"training mode: dropout at test_bad_inputs.py.*model\.eval\(\)"):
        moirai.trace(FunctionalDropout(), (X,))


class Noise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x)


def test_noise_in_a_training_module_is_not_called_what_eval_removes():
    """torch.rand_like in a module never eval()'d was said to differ 'from the model in eval mode', which draws too."""
    with pytest.warns(RandomOpsWarning, match=r"Noise: rand_like at test_bad_inputs.py:\d+ .*draw random numbers"):
        moirai.trace(Noise(), (X,))


@pytest.mark.parametrize(
    "draw",
    [
        lambda x: x + torch.rand_like(x),
        lambda x: x * torch.bernoulli(torch.full_like(x, 0.5)),
        lambda x: x + torch.randint(0, 3, x.shape).float(),
        lambda x: x + torch.multinomial(x.abs() + 0.1, 1).float(),
        lambda x: x + torch.empty_like(x).normal_(),
    ],
    ids=["rand_like", "bernoulli", "randint", "multinomial", "normal_"],
)
def test_random_ops_in_eval_mode_warn_that_the_split_draws_other_numbers(draw):
    """They said nothing in eval mode, though the split model's draws never equal the model's under one seed."""

    class Draws(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return draw(x)

    with pytest.warns(RandomOpsWarning, match=r"draw random numbers.*not equal the model's.*plan.*process") as caught:
        moirai.compile(Draws().eval(), ["cpu", "cpu"], (X,), placer="heft", progress=False)
    assert [w.filename for w in caught if w.category is RandomOpsWarning] == [__file__]
    assert not [w for w in caught if w.category is TrainingModeWarning]


def test_random_ops_that_draw_nothing_or_run_in_eval_mode_do_not_warn(recwarn):
    moirai.trace(FunctionalDropout(p=0.0), (X,))
    moirai.trace(FunctionalDropout().eval(), (X,))
    moirai.trace(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval(), (X,))
    assert not [w for w in recwarn if issubclass(w.category, (TrainingModeWarning, RandomOpsWarning))]


def test_a_training_dropout_is_a_training_mode_warning_alone():
    with pytest.warns(TrainingModeWarning) as caught:
        moirai.trace(FunctionalDropout(), (X,))
    assert not [w for w in caught if w.category is RandomOpsWarning]


class ReturnsABuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table


@pytest.mark.parametrize("model", [nn.Identity(), ReturnsABuffer()], ids=["identity", "a buffer"])
def test_a_model_that_computes_nothing_is_a_trace_error_not_a_numpy_one(model):
    """It was "ValueError: cannot reshape array of size 0" from the cost model."""
    with raises(TraceError, f"{type(model).__name__} computes nothing", "nothing to split", "call the model itself"):
        moirai.compile(model, ["cpu", "cpu"], (X,), placer="heft", progress=False)


def test_a_function_or_keyword_inputs_given_as_a_dict_say_what_to_pass():
    with raises(TraceError, "splits a torch.nn.Module, got function", "wrap the function in a module"):
        moirai.compile(lambda x: x * 2, ["cpu"], (X,), placer="heft")
    with raises(TraceError, "example_inputs is a dict of Sequential.forward's arguments ['input']", "example_kwargs"):
        moirai.compile(tiny(), ["cpu"], {"input": X}, placer="heft")


@pytest.mark.parametrize("kwargs", [[1], [("x", X)], "x"])
def test_example_kwargs_that_are_no_dict_say_what_to_pass(kwargs):
    """A list was a TypeError from dict(); a list of pairs was taken as a dict, which the compiled model is not."""
    with raises(TraceError, f"example_kwargs={kwargs!r}"[:60], "is not a dict", "example_kwargs={'name': value}"):
        moirai.compile(tiny(), ["cpu"], (X,), example_kwargs=kwargs, placer="heft")


def test_an_example_input_of_the_wrong_shape_logs_nothing_beside_its_error(caplog):
    with raises(TraceError, "mat1 and mat2 shapes"):
        moirai.compile(tiny(), ["cpu", "cpu"], (torch.randn(3, 5),), placer="heft", progress=False)
    assert not [r for r in caplog.records if r.name.startswith("torch") and r.levelno >= logging.ERROR]


def test_model_in_eval_mode_does_not_warn(recwarn):
    moirai.trace(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval(), (X,))
    assert not [w for w in recwarn if issubclass(w.category, TrainingModeWarning)]


# --- compile: devices ----------------------------------------------------------------------------------


def test_devices_given_as_one_string():
    with raises(ClusterError, "devices='cpu' is not a list", "['cpu', 'cpu']"):
        moirai.compile(tiny(), "cpu", (X,), placer="heft")
    with raises(ClusterError, "is not a list", "(a preset: moirai.Cluster.preset('moirai-intra-server'))"):
        moirai.compile(tiny(), "moirai-intra-server", (X,), placer="heft")


def test_devices_given_as_a_dict():
    """A dict was taken as its keys: {"cpu": 2} compiled for one CPU."""
    with raises(ClusterError, "devices={'cpu': 2} is not a list", "['cpu', 'cpu']"):
        moirai.compile(tiny(), {"cpu": 2}, (X,), placer="heft")


def test_devices_given_as_integers():
    with raises(ClusterError, "devices[0] is 0", "int", "'cuda:0'"):
        moirai.compile(tiny(), [0, 1], (X,), placer="heft")


def test_device_of_an_unknown_kind():
    with raises(ClusterError, "devices[0] is 'tpu'", "not a torch device", "'cpu' or 'cuda:N'"):
        moirai.compile(tiny(), ["tpu"], (X,), placer="heft")


def test_a_torch_device_kind_moirai_does_not_run_on():
    with raises(ClusterError, "devices[1] is 'meta'", "'cpu' and 'cuda:N'"):
        moirai.Cluster.from_devices(["cpu", "meta"])


def test_no_devices():
    with raises(ClusterError, "at least one device"):
        moirai.compile(tiny(), [], (X,), placer="heft")


@NO_CUDA
def test_cuda_device_on_a_machine_without_cuda():
    with raises(ClusterError, "cuda:0", "CUDA is not available"):
        moirai.compile(tiny(), ["cuda:0", "cpu"], (X,), placer="heft")


@NO_CUDA
def test_cuda_preset_plans_here_but_refuses_to_run_here():
    cm = moirai.compile(tiny(), moirai.Cluster.preset("moirai-inter-server"), (X,), placer="heft")
    with raises(ClusterError, "runs on cuda:", "0 CUDA device", "moirai.load there"):
        cm(X)
    # Its devices are on four servers: one process per device here would stand in for them.
    with raises(InputError, "devices are on hosts server-a, server-b, server-c, server-d", "under torchrun"):
        cm.run_distributed(X)


# --- calling the compiled model ------------------------------------------------------------------------


def test_call_with_the_wrong_shape(compiled):
    with raises(InputError, "input 0", "(5, 4)", "(3, 4)", "compile again"):
        compiled(torch.randn(5, 4))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_call_with_the_wrong_dtype_says_dtype_not_dynamic_shapes(compiled, dtype):
    """It said to compile for the shape served or declare the dimension dynamic: neither fixes a dtype."""
    with raises(InputError, f"input 0 has dtype {dtype}, the plan was made for dtype torch.float32", ".to(") as error:
        compiled(X.to(dtype))
    assert "dynamic" not in str(error.value)


@pytest.mark.parametrize(
    ("example", "axis"), [(torch.randn(16, 4), 0), (X, 1)], ids=["example out of range", "a dim the model fixes"]
)
def test_dynamic_shapes_torch_refuses_name_the_declared_ranges(example, axis):
    """Both were torch's 'ConstraintViolationError: 16 not in range [2, 8]' and tips on control flow and use_cache."""
    batch = torch.export.Dim("batch", min=1, max=8)
    with raises(TraceError, "dynamic_shapes given (declared: batch = 1..8)", "inside its declared range"):
        moirai.trace(tiny(), (example,), dynamic_shapes=({axis: batch},))


def test_dynamic_shapes_refused_name_the_declared_ranges_where_dim_is_a_function(monkeypatch):
    """Before torch 2.6 ``torch.export.Dim`` is a function (each dim a type of the ``_Dim`` metaclass): the check
    ``isinstance(leaf, torch.export.Dim)`` raised TypeError there, hiding both the TraceError and torch's error."""
    batch = torch.export.Dim("batch", min=1, max=8)
    real = torch.export.Dim
    monkeypatch.setattr(torch.export, "Dim", lambda *args, **kwargs: real(*args, **kwargs))
    with raises(TraceError, "dynamic_shapes given (declared: batch = 1..8)"):
        moirai.trace(tiny(), (torch.randn(16, 4),), dynamic_shapes=({0: batch},))


def test_call_with_the_wrong_number_of_inputs(compiled):
    with raises(InputError, "traced with 1 positional input(s)", "called with 2", "same arguments"):
        compiled(X, X)


def test_call_with_the_inputs_in_a_tuple_shows_both_structures(compiled):
    with raises(InputError, "structured as args (Tensor,), called with args ((Tensor,),)"):
        compiled((X,))


def test_call_with_a_non_tensor(compiled):
    with raises(InputError, "input 0 must be a tensor", "ndarray"):
        compiled(X.numpy())


# --- placers and their options -------------------------------------------------------------------------


def test_unknown_placer():
    with raises(MoiraiError, "unknown placer 'hef' (did you mean 'heft'?); choose one of"):
        moirai.compile(tiny(), ["cpu", "cpu"], (X,), placer="hef")


def test_unknown_objective_offers_the_closest():
    with raises(MoiraiError, "unknown objective 'latncy' (did you mean 'latency'?); choose one of"):
        moirai.compile(tiny(), ["cpu", "cpu"], (X,), objective="latncy")


def test_misspelled_placer_option_suggests_the_right_one():
    with raises(PlacerOptionError, "'milp' has no option 'time_limt_s'", "did you mean 'time_limit_s'", "mip_gap"):
        moirai.compile(tiny(), ["cpu", "cpu"], (X,), placer="milp", time_limt_s=5)


def test_option_the_placer_does_not_take_lists_its_options(problem):
    with raises(PlacerOptionError, "'heft' has no option 'time_limit_s'", "its options are contention"):
        moirai.place(problem, "heft", time_limit_s=5)


def test_option_to_a_placer_without_options(problem):
    with raises(PlacerOptionError, "'round_robin' has no option 'seed'", "takes no options"):
        moirai.place(problem, "round_robin", seed=1)


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("time_limit_s", -1, "non-negative number of seconds"),
        ("time_limit_s", "30", "non-negative number of seconds"),
        ("mip_gap", -5, "relative gap in [0, 1)"),
        ("threads", 0, "integer of at least 1"),
        ("threads", 2.5, "integer of at least 1"),
        ("window_tasks", 0, "integer of at least 1"),
        # A plain MoiraiError, raised after the trace and the costs.
        ("formulation", "weak", "one of 'strong', 'paper'"),
        ("solver", "cplex", "one of 'highs', 'gurobi'"),
        ("strategy", None, "one of 'auto', 'full', 'windows'"),
    ],
)
def test_milp_option_out_of_range(problem, option, value, words):
    with raises(PlacerOptionError, f"option {option}={value!r}", words):
        moirai.place(problem, "milp", **{option: value})


@pytest.mark.parametrize(
    "placer,option,value",
    [("getf", "speed_ratio", 1.0), ("getf", "speed_ratio", float("nan")), ("m_sct", "threshold", -5.0)],
)
def test_a_heuristics_option_out_of_its_range_is_refused(problem, placer, option, value):
    """getf's speed groups at a ratio of 1 or less looped for ever."""
    with raises(PlacerOptionError, f"option {option}={value!r} must be"):
        moirai.place(problem, placer, **{option: value})


def test_option_of_the_wrong_type(problem):
    with raises(PlacerOptionError, "option seed='a'", "an integer"):
        moirai.place(problem, "hash", seed="a")
    with raises(PlacerOptionError, "option contention='yes'", "True or False"):
        moirai.place(problem, "heft", contention="yes")


@pytest.mark.parametrize("given", [None, {"devices": [{"name": "a"}]}, "problem.json"])
def test_place_simulate_and_lower_bound_of_no_problem_say_how_to_make_one(problem, given):
    """Each was an AttributeError from deep inside."""
    plan = moirai.Plan(np.array([0, 1, 0]), ("a", "b"))
    calls = {
        "moirai.place": lambda: moirai.place(given, "heft"),
        "moirai.simulate": lambda: moirai.simulate(given, plan),
        "moirai.lower_bound": lambda: moirai.lower_bound(given),
        "moirai.gantt": lambda: moirai.gantt(given, plan),
    }
    for name, call in calls.items():
        with raises(ProblemError, f"{name}'s problem must be a moirai.Problem, got {given!r}"[:70], "from_json(path)"):
            call()


@pytest.mark.parametrize("given", [None, {"placement": [0, 0, 0]}])
def test_simulate_with_plan_and_gantt_of_no_plan_say_how_to_make_one(problem, compiled, given):
    """simulate and with_plan were AttributeErrors from deep inside."""
    calls = {
        "moirai.simulate's plan": lambda: moirai.simulate(problem, given),
        "moirai.gantt's plan": lambda: moirai.gantt(problem, given),
        "CompiledModel.with_plan's plan": lambda: compiled.with_plan(given),
    }
    if given is not None:  # gantt's plan=None is its own plan
        calls["CompiledModel.gantt's plan"] = lambda: compiled.gantt(plan=given)
    for where, call in calls.items():
        with raises(PlanError, f"{where} must be a moirai.Plan, got {given!r}"[:70], "moirai.place(problem"):
            call()


def test_gantt_into_a_missing_folder_names_the_folder(compiled, tmp_path):
    """It was PIL's FileNotFoundError, after the picture was drawn."""
    picture = tmp_path / "nowhere" / "plan.png"
    for call in (lambda: compiled.gantt(picture), lambda: moirai.gantt(compiled.problem, compiled.plan, picture)):
        with raises(MoiraiError, "cannot write the Gantt picture", f"folder {str(picture.parent)!r} does not exist"):
            call()


@pytest.mark.parametrize("requests", [0, -1, "2", 2.0, True])
def test_gantt_of_no_whole_number_of_requests(compiled, requests):
    """0 and -1 drew one request; "2" was a TypeError."""
    with raises(MoiraiError, "requests must be a whole number, at least 1", f"got {requests!r}"):
        compiled.gantt(requests=requests)


@pytest.mark.parametrize("width", [0, -5, 2.5, "60"])
def test_text_gantt_of_no_width(compiled, width):
    """0 and -5 drew a table of empty lanes without a word; 2.5 and "60" were TypeErrors."""
    with raises(MoiraiError, "text_gantt's width is the characters of time per lane", f"got {width!r}"):
        text_gantt(compiled.problem, compiled.plan, width)


@pytest.mark.parametrize(("names", "words"), [("ab", "must be a list of names"), ((1, 2), "must be strings, got 1")])
def test_device_names_that_are_no_list_of_strings(names, words):
    """'ab' was read as devices a and b; (1, 2) as devices named 1 and 2."""
    with raises(ProblemError, f"device_names {words}"):
        moirai.Problem(
            device_names=names,
            memory_capacity_bytes=[1.0, 1.0],
            task_names=("t",),
            compute_s=[[1.0, 1.0]],
            memory_bytes=[0.0],
            tensor_names=(),
            tensor_producer=[],
            tensor_consumers=(),
            transfer_s=np.zeros((0, 2, 2)),
        )


def test_memory_ignoring_placer_over_memory_warns_with_the_numbers_and_marks_the_plan(problem):
    with pytest.warns(OverMemoryWarning, match=r"'round_robin' plan.*a holds 16 B of 10 B.*'heft'") as caught:
        plan = moirai.place(problem, "round_robin")
    assert caught[0].filename == __file__, "attributed to the caller's line, not to moirai or contextlib"
    assert plan.report.notes["over_memory_devices"] == ["a"]
    assert devices_over_memory(problem, plan) == [0]


def test_the_over_memory_warning_counts_the_memory_kept_for_activations_as_the_summary_does(problem):
    """It said 'a holds 198.9 kB of 89.8 kB' where the summary's row read '209 kB / 100 kB'."""
    kept = dataclasses.replace(problem, memory_reserve_bytes=np.array([5.0, 5.0]))
    with pytest.warns(OverMemoryWarning, match=r"a holds 21 B of 15 B"):
        plan = moirai.place(kept, "round_robin")
    memory = [column for column in summary_table(kept, plan).columns if column.header == "memory / capacity"]
    assert str(memory[0]._cells[0]).startswith("21 B / 15 B"), memory[0]._cells


def test_a_device_filled_exactly_to_its_capacity_is_not_over_memory_and_one_byte_more_is(problem):
    plan = moirai.Plan(np.array([0, 1, 1]), problem.device_names)
    full = dataclasses.replace(problem, memory_bytes=np.array([10.0, 4.0, 6.0]))
    assert devices_over_memory(full, plan) == []
    assert devices_over_memory(dataclasses.replace(full, memory_bytes=np.array([11.0, 4.0, 6.0])), plan) == [0]
    assert devices_over_memory(dataclasses.replace(full, memory_bytes=np.array([10.0, 4.0, 7.0])), plan) == [1]


def test_memory_aware_placer_refuses_what_cannot_fit(problem):
    with raises(moirai.InfeasibleError, "needs 24 B", "20 B free in total", "add devices or memory"):
        moirai.place(problem, "heft")


def test_summary_shows_devices_over_memory_in_red(compiled):
    # Device A holds the activation reserve and 100 B of weights, less than the first Linear's 160 B; B holds all.
    reserve_gb = activation_peak_bytes(compiled.graph) / 1e9
    cluster = moirai.Cluster.from_dict(
        {
            "devices": [
                {
                    "name": n,
                    "memory_gb": reserve_gb + extra_bytes / 1e9,
                    "peak_tflops": {"fp32": 1.0},
                    "memory_bandwidth_gb_per_s": 10,
                }
                for n, extra_bytes in (("A", 100), ("B", 10_000))
            ],
            "links": [{"src": "A", "dst": "B", "bandwidth_gbps": 10, "both_directions": True}],
        }
    )
    # The device's own size, as the summary shows it: the activations' reserve counts on both sides.
    reserve = round(reserve_gb * 1e9)
    words = f"A holds {160 + reserve} B of {100 + reserve} B.*ignores memory"
    with pytest.warns(OverMemoryWarning, match=words) as caught:
        cm = moirai.compile(tiny(), cluster, (X,), placer="round_robin")
    assert [w.filename for w in caught if w.category is OverMemoryWarning] == [__file__], "the user's line"
    output = io.StringIO()
    cm.summary(Console(file=output, width=200))
    table = cm.summary_table()
    assert [row.style for row in table.rows] == ["bold red", None]
    assert "OVER MEMORY" in output.getvalue()
    assert not devices_over_memory(cm.problem, moirai.place(cm.problem, "heft")), "memory-aware placers fit it"


def test_measured_cost_on_devices_of_another_machine():
    cluster = moirai.Cluster.preset("two-hosts-100gbe")
    with raises(ClusterError, "is not on this machine", "mode='analytic'"):
        moirai.compile(tiny(), cluster, (X,), placer="heft", cost="measured")


def test_unknown_cost_mode():
    with raises(ClusterError, "unknown cost mode 'fast'", "'analytic', 'measured'"):
        moirai.compile(tiny(), ["cpu", "cpu"], (X,), placer="heft", cost="fast")


class _Untraceable(nn.Module):
    def forward(self, x):
        raise AssertionError("traced: the cost mode was not checked first")


@pytest.mark.parametrize("compiler", ["compile", "compile_lm"])
def test_misspelt_cost_mode_is_refused_before_tracing_with_did_you_mean(compiler):
    """Checked up front, as the placer's options are: not after the trace (and a first calibration's minute)."""
    with raises(ClusterError, "unknown cost mode 'measure'", "did you mean 'measured'?"):
        if compiler == "compile":
            moirai.compile(_Untraceable(), ["cpu", "cpu"], (X,), placer="heft", cost="measure", calibration="none")
        else:
            moirai.compile_lm(_Untraceable(), ["cpu", "cpu"], placer="heft", cost="measure", calibration="none")


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu"]])
@pytest.mark.parametrize("calibration", [None, 5])
def test_calibration_that_is_no_word_or_path(devices, calibration):
    """A TypeError inside the calibration cache with two devices; silently unread with one."""
    words = (f"calibration={calibration!r} ({type(calibration).__name__}) is not a word or a path", "'auto'", "'none'")
    with raises(ClusterError, *words):
        moirai.compile(tiny(), devices, (X,), placer="heft", calibration=calibration)


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu"]])
@pytest.mark.parametrize(
    ("calibration", "words"),
    [
        ("off", ("calibration='off' is not a calibration word nor a file", "'none' (the detected defaults)")),
        ("remeasure ", ("calibration='remeasure ' is not a calibration word (did you mean 'remeasure'?)",)),
        ("no/such/calibration.json", ("calibration file 'no/such/calibration.json' does not exist", "'none'")),
    ],
)
def test_calibration_of_an_unknown_word_or_a_missing_file(devices, calibration, words):
    """Silently unread on one device (and from the CLI's --devices cpu); on two the choices left out 'none'."""
    with raises(ClusterError, *words):
        moirai.compile(tiny(), devices, (X,), placer="heft", calibration=calibration, progress=False)


@pytest.mark.parametrize(
    ("calibration", "words"),
    [
        ("remeasure ", "calibration='remeasure ' is not a calibration word (did you mean 'remeasure'?)"),
        ("none", "calibration='none' (the detected defaults) measures and reads no links"),
    ],
)
def test_local_calibration_checks_its_argument_as_compile_does(calibration, words):
    """local_calibration, public, kept its own check: 'is neither 'auto', 'remeasure' nor an existing calibration
    file', with no suggestion, and 'none' read as a missing file."""
    from moirai.cluster.calibration import local_calibration

    with raises(ClusterError, words):
        local_calibration(["cpu", "cpu"], calibration)


def test_load_and_compile_lm_check_calibration_as_compile_does(compiled, tmp_path):
    path = tmp_path / "plan.json"
    compiled.save(path)
    with raises(ClusterError, "calibration=5 (int) is not a word or a path"):
        moirai.load(path, tiny(), (X,), devices=["cpu", "cpu"], calibration=5)
    with raises(ClusterError, "calibration=5 (int) is not a word or a path"):  # refused before the model is read
        moirai.compile_lm(tiny(), ["cpu", "cpu"], placer="heft", calibration=5, progress=False)


def test_target_nodes_below_one():
    with raises(MoiraiError, "target_nodes must be at least 1"):
        moirai.compile(tiny(), ["cpu", "cpu"], (X,), placer="heft", target_nodes=0)


@pytest.mark.parametrize("target_nodes", [2.5, 2.0, "3", True])
def test_target_nodes_that_are_no_whole_number(target_nodes):
    """2.5 coarsened to 2 groups and True to 1; "3" was a TypeError."""
    words = (f"got {target_nodes!r} ({type(target_nodes).__name__})", "whole number of op groups")
    with raises(MoiraiError, "target_nodes must be at least 1", *words):
        moirai.compile(tiny(), ["cpu"], (X,), placer="heft", target_nodes=target_nodes)


def test_target_nodes_as_a_numpy_integer_is_taken():
    compiled = moirai.compile(tiny(), ["cpu"], (X,), placer="heft", target_nodes=np.int64(1))
    assert len(compiled.graph.nodes) == 1


# --- cluster files -------------------------------------------------------------------------------------

CLUSTER = """name = "two"

[[devices]]
name = "A"
torch_device = "cpu"
memory_gb = 1
peak_tflops = { fp32 = 1.0 }
memory_bandwidth_gb_per_s = 10

[[devices]]
name = "B"
torch_device = "cpu"
memory_gb = 1
peak_tflops = { fp32 = 1.0 }
memory_bandwidth_gb_per_s = 10

[[links]]
src = "A"
dst = "B"
bandwidth_gbps = 10
both_directions = true
"""


def cluster_file(tmp_path, text: str):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_valid_cluster_file_loads(tmp_path):
    assert moirai.Cluster.from_file(cluster_file(tmp_path, CLUSTER)).names == ("A", "B")


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (("bandwidth_gbps = 10", 'bandwidth_gbps = "fast"'), ("link 'A' -> 'B'", "bandwidth_gbps", "'fast'")),
        (("memory_gb = 1", 'memory_gb = "lots"'), ("device 'A'", "memory_gb is 'lots', not a number")),
        (('torch_device = "cpu"', 'torch_device = "tpu:0"'), ("device 'A': torch_device", "'tpu:0'")),
        (("memory_gb = 1", 'memory_gb = 1\nrank = "zero"'), ("device 'A'", "rank must be an integer")),
        (("both_directions = true", 'both_directions = "yes"'), ("both_directions must be true or false",)),
        (("peak_tflops = { fp32 = 1.0 }", "peak_tflops = 5"), ("device 'A'", "peak_tflops must be a table")),
        (("memory_gb = 1", "memory_gb = 1\nmemory = 2"), ("device 'A'", "unknown keys ['memory']")),
        (("memory_gb = 1", 'memory_gb = 1\ntype = "t5000"'), ("unknown type 't5000'", "known types")),
        (('name = "B"', 'name = "A"'), ("duplicate device names ['A']",)),
        (('dst = "B"', 'dst = "C"'), ("unknown device 'C'",)),
        (("memory_gb = 1", "memory_gb = -1"), ("device 'A'", "positive memory_gb")),
        (("bandwidth_gbps = 10", "bandwidth_gbps = 0"), ("bandwidth 0.0 Gbps", "positive")),
        (("memory_gb = 1", 'memory_gb = 1\ntype = ["t4"]'), ("device 'A'", "type must be a string", "['t4']")),
        (('name = "B"', "name = 5"), ("device 5", "name must be a string", "got 5")),
        (('name = "B"', "name = true"), ("name must be a string", "got True")),
        (('dst = "B"', "dst = 5"), ("dst must be a string", "got 5")),
        (("memory_gb = 1", "memory_gb = 1\nhost = 7"), ("device 'A'", "host must be a string", "got 7")),
        (("memory_gb = 1", "memory_gb = 1\nrank = -1"), ("device 'A' has rank -1", "whole number >= 0")),
    ],
    ids=lambda value: value[1][:24] if isinstance(value, tuple) and len(value) == 2 else None,
)
def test_bad_cluster_file_names_file_device_and_key(tmp_path, edit, words):
    path = cluster_file(tmp_path, CLUSTER.replace(*edit, 1))
    with raises(ClusterError, str(path), *words):
        moirai.Cluster.from_file(path)


def test_devices_written_as_one_table(tmp_path):
    one_device = CLUSTER.split("[[devices]]")[1].replace('name = "A"', "")
    with raises(ClusterError, "cluster.toml", "devices must be an array of tables", "a single table [devices]"):
        moirai.Cluster.from_file(cluster_file(tmp_path, f'[devices]\nname = "A"{one_device}'))


def test_cluster_matrix_with_text_and_of_the_wrong_size(tmp_path):
    devices = CLUSTER.split("[[links]]")[0]
    with raises(ClusterError, "[matrix] bandwidth_gbps must hold numbers"):
        moirai.Cluster.from_file(cluster_file(tmp_path, devices + '[matrix]\nbandwidth_gbps = [[0, "x"], [1, 0]]\n'))
    with raises(ClusterError, "[matrix] bandwidth_gbps must be 2x2"):
        moirai.Cluster.from_file(cluster_file(tmp_path, devices + "[matrix]\nbandwidth_gbps = [[0, 1]]\n"))
    with raises(ClusterError, "latency_us must be a number or a 2x2 matrix"):
        moirai.Cluster.from_file(
            cluster_file(tmp_path, devices + '[matrix]\nbandwidth_gbps = [[0, 1], [1, 0]]\nlatency_us = "low"\n')
        )


def test_missing_and_malformed_cluster_files(tmp_path):
    with raises(ClusterError, "does not exist"):
        moirai.Cluster.from_file(tmp_path / "nowhere.toml")
    with raises(ClusterError, "is not valid TOML"):
        moirai.Cluster.from_file(cluster_file(tmp_path, "name = \n"))
    with raises(ClusterError, str(tmp_path), "cannot be read"):
        moirai.Cluster.from_file(tmp_path)  # a folder


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('name = "caf\xe9"\n'.encode("latin-1"), ("is not UTF-8 text, so not TOML", "save it as UTF-8")),
        (b"x = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", ("nests arrays or tables too deeply to read",)),
        (b"x = " + b"7" * 5000 + b"\n", ("an integer of more than 4300 digits", "fewer digits")),
        (b"x = 1e400\n", ("the number 1e400 is too large for a float", "write inf where that is meant")),
    ],
    ids=["latin-1", "deep", "5000 digits", "1e400"],
)
def test_a_cluster_file_python_cannot_parse_is_a_cluster_error_naming_it(tmp_path, content, words):
    """Fault injected: text the TOML parser raises a Python error for (UnicodeDecodeError, RecursionError, int's
    ValueError), where ``moirai compile --cluster`` and ``calibrate --base`` printed a traceback."""
    path = tmp_path / "cluster.toml"
    path.write_bytes(content)
    with raises(ClusterError, "cluster file", str(path), *words):
        moirai.Cluster.from_file(path)
    with raises(ClusterError, str(path), *words):
        read_cluster_devices(path)


def test_no_two_devices_share_a_rank_in_a_file_or_in_python(tmp_path):
    """Fault injected: two devices on rank 0, where nothing reads a device's rank yet: the file was accepted."""
    path = cluster_file(tmp_path, CLUSTER.replace("memory_gb = 1", "memory_gb = 1\nrank = 0"))
    with raises(ClusterError, str(path), "devices ['A', 'B'] share rank 0", "its own rank, or none"):
        moirai.Cluster.from_file(path)
    with raises(ClusterError, str(path), "share rank 0"):
        read_cluster_devices(path)
    a, b = moirai.Cluster.from_file(cluster_file(tmp_path, CLUSTER)).devices
    with raises(ClusterError, "devices ['A', 'B'] share rank 1"):
        moirai.Cluster(
            (dataclasses.replace(a, rank=1), dataclasses.replace(b, rank=1)), np.full((2, 2), 1e9), np.zeros((2, 2))
        )
    with raises(ClusterError, "device 'A' has rank -2"):
        moirai.Cluster((dataclasses.replace(a, rank=-2),), np.full((1, 1), 1e9), np.zeros((1, 1)))


@pytest.mark.parametrize(
    ("matrix", "words"),
    [
        ('bandwidth_gbps = [[0, "100"], ["100", 0]]', ("[matrix] bandwidth_gbps must hold numbers", "'100'")),
        ("bandwidth_gbps = [[0, true], [true, 0]]", ("[matrix] bandwidth_gbps must hold numbers", "True")),
        ('bandwidth_gbps = [[0, 1], [1, 0]]\nlatency_us = [[0, "1"], ["1", 0]]', ("latency_us must hold numbers",)),
        ("bandwidth_gbps = [[0, 1], [1, 0]]\nlatency_us = { a = 1 }", ("latency_us must be a number or a 2x2",)),
    ],
)
def test_a_matrix_holds_numbers_as_links_do(tmp_path, matrix, words):
    """Fault injected: numpy reads "100" as 100 and true as 1, which [[links]] refuse."""
    path = cluster_file(tmp_path, CLUSTER.split("[[links]]")[0] + f"[matrix]\n{matrix}\n")
    with raises(ClusterError, str(path), *words):
        moirai.Cluster.from_file(path)


def test_unknown_preset():
    with raises(ClusterError, "no preset cluster 'moirai'", "moirai-inter-server"):
        moirai.Cluster.preset("moirai")


# --- fusion rules --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[[rule]]\nops = ["conv", "bnorm"]\n', ("rules.toml:2", "unknown op class 'bnorm'", "[classes]")),
        ("[[rule]]\nops = []\n", ("rules.toml", "non-empty list of op classes")),
        ('[[rule]]\nops = ["conv"]\nfuse = true\n', ("rules.toml", "unknown key(s) ['fuse']")),
        ('[[rule]]\nops = ["conv!"]\n', ("'conv!' is not an op class word",)),
        ("[[rule]\n", ("rules.toml", "not valid TOML")),
        ("[classes]\n", ("defines no rules", "[[rule]]")),
    ],
)
def test_bad_fusion_rule_file(tmp_path, text, words):
    path = tmp_path / "rules.toml"
    path.write_text(text)
    with raises(FusionRuleError, *words):
        moirai.compile(tiny(), ["cpu", "cpu"], (X,), placer="heft", fusion_rules=path)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b'[[rule]]\nname = "caf\xe9"\nops = ["conv"]\n', ("is not UTF-8 text, so not TOML",)),
        (b"x = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", ("nests arrays or tables too deeply",)),
        (b"x = " + b"7" * 5000 + b"\n", ("an integer of more than 4300 digits",)),
    ],
    ids=["latin-1", "deep", "5000 digits"],
)
def test_a_fusion_rule_file_python_cannot_parse_is_a_fusion_rule_error_naming_it(tmp_path, content, words):
    """Fault injected: a rule file read as UTF-8 raised UnicodeDecodeError, one nested deeply RecursionError."""
    path = tmp_path / "rules.toml"
    path.write_bytes(content)
    with raises(FusionRuleError, str(path), *words):
        load_rules(path)


def test_fusion_rules_neither_bundled_nor_a_file():
    with raises(FusionRuleError, "cudnn_v9 is neither a bundled rule set nor a file", "default"):
        moirai.compile(tiny(), ["cpu", "cpu"], (X,), placer="heft", fusion_rules="cudnn_v9")


@pytest.mark.parametrize("rules", [5, None, b"eigen", {"eigen": 1}, ["eigen", 5]])
def test_fusion_rules_of_another_type_say_what_to_pass(rules):
    """5 and None were TypeErrors; a dict was taken as its keys."""
    wrong = rules[1] if isinstance(rules, list) else rules
    with raises(FusionRuleError, f"fusion_rules={wrong!r} ({type(wrong).__name__}) names no rule set", "'default'"):
        moirai.compile(tiny(), ["cpu"], (X,), placer="heft", fusion_rules=rules)


def test_fusion_rules_at_any_path_like(tmp_path):
    class RulePath:  # an os.PathLike that is no pathlib.Path: it was iterated, a TypeError
        def __fspath__(self) -> str:
            return str(tmp_path / "rules.toml")

    (tmp_path / "rules.toml").write_text('[[rule]]\nname = "mm_relu"\nops = ["gemm", "relu"]\n')
    assert [rule.name for rule in load_rules(RulePath()).rules] == ["rules:mm_relu"]


# --- plan files (moirai.load) --------------------------------------------------------------------------


def test_load_of_a_missing_plan_file(tmp_path):
    with raises(PlanError, "nowhere.json", "does not exist", "CompiledModel.save"):
        moirai.load(tmp_path / "nowhere.json", tiny(), (X,))


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("", ("is empty", "save the plan again")),
        ('{"format": 1, "devices": [', ("not valid JSON", "line 1", "cut short")),
        ("[1, 2]", ("holds a JSON list", "not a moirai plan")),
        ('{"format": 7}', ("not a moirai plan of format 1",)),
        ('{"format": true}', ("not a moirai plan of format 1", "'format' is 'True'")),  # true == 1 passed
        ('{"format": 1.0}', ("not a moirai plan of format 1", "'format' is '1.0'")),
        ("[" * 100_000 + "]" * 100_000, ("nests arrays or objects too deeply", "Save the plan again")),
        ('{"format": ' + "1" * 5000 + "}", ("an integer of more than 4300 digits", "Save the plan again")),
        ('{"format": 1,\n "objective_s": 1e400}', ("the number 1e400 (line 2, column 17)", "too large for a float")),
    ],
)
def test_load_of_a_broken_plan_file(tmp_path, content, words):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with raises(PlanError, str(path), *words):
        moirai.load(path, tiny(), (X,))


def test_load_of_a_plan_with_a_key_missing(compiled, tmp_path):
    path = tmp_path / "plan.json"
    compiled.save(path)
    record = json.loads(path.read_text())
    del record["node_device"], record["plan"]["placement"]
    path.write_text(json.dumps(record))
    with raises(PlanError, "lacks ['node_device', 'plan.placement']", "save the plan again"):
        moirai.load(path, tiny(), (X,))


def _set_report_field(key: str, value: object) -> Callable[[dict], None]:
    return lambda plan: plan["report"].__setitem__(key, value)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        # Fault injected: a JSON integer no float holds was a raw OverflowError (math.isfinite in the check).
        (lambda plan: plan.__setitem__("objective_s", 10**400), ("'plan.objective_s'", "finite number of seconds")),
        # ... and one no int64 holds an OverflowError in numpy (Plan.from_dict); a device index past the devices
        # was named only by the simulator.
        (lambda plan: plan["placement"].__setitem__(0, 2**63), ("'plan.placement'", "device indices 0..len(devices)")),
        (lambda plan: plan["placement"].__setitem__(0, 2), ("'plan.placement'", "device indices 0..len(devices)")),
        # A report's field not of its type loaded, then failed summary() with a TypeError.
        (_set_report_field("unfused_lower_bound_s", "x"), ("report's 'unfused_lower_bound_s'", "null or a finite")),
        (_set_report_field("predicted_makespan_s", 10**400), ("report's 'predicted_makespan_s'", "finite number")),
        (_set_report_field("contention", 5), ("report's 'contention'", "null, true or false")),
        (_set_report_field("kind", 5), ("report's 'kind' is '5'", "'SolverReport'")),
        (
            lambda plan: plan["report"].update(kind="SolverReport", solve_s="x"),
            ("report's 'solve_s' is 'x'", "null or a finite number"),
        ),
    ],
    ids=[
        "objective 10**400",
        "placement 2**63",
        "placement past devices",
        "report str",
        "report 10**400",
        "report contention",
        "report kind",
        "solver report",
    ],
)
def test_load_of_a_plan_with_a_number_or_report_field_it_cannot_hold_names_the_field(compiled, tmp_path, edit, words):
    """The plan file's rule: what it hands in is a PlanError naming the field, never a raw error, at load or
    later (summary: _saved_plan's docstring)."""
    path = tmp_path / "plan.json"
    compiled.save(path)
    record = json.loads(path.read_text())
    edit(record["plan"])
    path.write_text(json.dumps(record))
    with raises(PlanError, str(path), *words, "save the plan again"):
        moirai.load(path, tiny(), (X,), progress=False).summary()


def test_load_of_a_plan_for_another_model(compiled, tmp_path):
    path = tmp_path / "plan.json"
    compiled.save(path)
    other = nn.Sequential(nn.Linear(4, 2)).eval()
    with raises(PlanError, "does not have", "compile again"):
        moirai.load(path, other, (X,))


@pytest.mark.parametrize(
    ("model", "example", "words"),
    [
        (tiny(), torch.randn(6, 4), "input 0 is (6, 4) float32, planned (3, 4) float32"),
        (tiny().double(), X.double(), "input 0 is (3, 4) float64, planned (3, 4) float32"),
        (nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)).eval(), X, "is (16, 4) float32, planned (8, 4)"),
    ],
    ids=["other batch", "other dtype", "other widths"],
)
def test_load_of_a_plan_for_other_sizes_names_the_tensor(compiled, tmp_path, model, example, words):
    """Same ops, other sizes: it loaded silently, its summary the new memory beside the planned times."""
    path = tmp_path / "plan.json"
    compiled.save(path)
    with raises(PlanError, f"{path} was planned for Sequential with other tensors", words, "compile again"):
        moirai.load(path, model, (example,), progress=False)


def test_load_of_a_plan_saved_before_it_kept_its_tensors(compiled, tmp_path):
    path = tmp_path / "plan.json"
    compiled.save(path)
    record = json.loads(path.read_text())
    del record["tensors"]
    path.write_text(json.dumps(record))
    assert moirai.load(path, tiny(), (X,), progress=False).node_device == compiled.node_device


def test_load_with_devices_as_one_string(compiled, tmp_path):
    path = tmp_path / "plan.json"
    compiled.save(path)
    with raises(ClusterError, "devices='cpu' is not a list"):
        moirai.load(path, tiny(), (X,), devices="cpu")


@pytest.mark.parametrize("path", [None, 5])
def test_load_of_a_path_that_is_no_path(path):
    with raises(PlanError, f"path is {path!r} ({type(path).__name__})", "str or pathlib.Path", "CompiledModel.save"):
        moirai.load(path, tiny(), (X,))


def test_load_on_no_devices_is_refused_as_compile_refuses_it(compiled, tmp_path):
    path = tmp_path / "plan.json"
    compiled.save(path)
    with raises(ClusterError, "at least one device"):  # not the plan's own devices
        moirai.load(path, tiny(), (X,), devices=[])


def test_load_on_devices_given_as_an_array(compiled, tmp_path):
    path = tmp_path / "plan.json"
    compiled.save(path)
    loaded = moirai.load(path, tiny(), (X,), devices=np.array(["cpu", "cpu"]))  # compile takes one too
    assert loaded.cluster.names == ("cpu_0", "cpu_1")


def test_load_on_a_different_number_of_devices(compiled, tmp_path):
    path = tmp_path / "plan.json"
    compiled.save(path)
    with raises(PlanError, "on 2 devices, 3 were given"):
        moirai.load(path, tiny(), (X,), devices=["cpu", "cpu", "cpu"])


# --- problems (plan your own graph) --------------------------------------------------------------------

DEVICES = [{"name": "a"}, {"name": "b"}]


@pytest.mark.parametrize(
    ("description", "words"),
    [
        ({"devices": DEVICES}, ("lacks ['tasks']",)),
        ([DEVICES], ("the problem description must be an object", "'devices'", "'tasks'", "got a list")),
        ({"devices": DEVICES, "tasks": [{"name": "t"}]}, ("tasks[0] lacks ['compute_s']",)),
        ({"devices": [{"memory_bytes": 1}], "tasks": []}, ("devices[0] lacks ['name']",)),
        (
            {"devices": DEVICES, "tasks": [{"name": "t", "compute_s": [1.0]}]},
            ("tasks[0].compute_s must be a list of 2 numbers (one time per device), got [1.0]",),
        ),
        (
            {"devices": DEVICES, "tasks": [{"name": "t", "compute_s": ["1", "x"]}]},
            ('tasks[0].compute_s[0] is "1", not a number',),
        ),
        ({"devices": DEVICES, "tasks": {"t": [1, 1]}}, ("tasks must be a list of objects, got an object",)),
        (
            {"devices": DEVICES, "tasks": [{"name": "t", "compute_s": [1, 1]}], "edges": [{"src": "t"}]},
            ("edges[0] lacks ['dst']",),
        ),
        (
            {"devices": DEVICES, "tasks": [{"name": "t", "compute_s": [1, 1]}], "edges": [{"src": "t", "dst": "u"}]},
            ("edges[0].dst is 'u', which is no task's name",),
        ),
        (
            {
                "devices": DEVICES,
                "tasks": [{"name": n, "compute_s": [1, 1]} for n in "tu"],
                "edges": [{"src": s, "dst": d, "transfer_s": [[0, 1], [1, 0]]} for s, d in ("tu", "ut")],
            },
            ("cycle", "needs a DAG"),
        ),
    ],
)
def test_bad_problem_description(description, words):
    with raises(ProblemError, *words):
        moirai.Problem.from_dict(description)


def test_problem_json_files(tmp_path):
    with raises(ProblemError, "does not exist"):
        moirai.Problem.from_json(tmp_path / "nowhere.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"devices": [')
    with raises(ProblemError, "broken.json", "not valid JSON"):
        moirai.Problem.from_json(broken)
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"devices": DEVICES, "tasks": [{"name": "t", "compute_s": [1, 2, 3]}]}))
    with raises(
        ProblemError,
        "short.json",
        "tasks[0].compute_s must be a list of 2 numbers (one time per device), got [1, 2, 3]",
    ):
        moirai.Problem.from_json(short)


@pytest.mark.parametrize(
    ("path", "words"),
    [
        (None, ("path is None (NoneType)",)),
        (b"problem.json", ("path is b'problem.json' (bytes)",)),
        ({"devices": DEVICES}, ("(dict)", "Problem.from_dict")),
        ("a\0b.json", ("holds a NUL character",)),
    ],
)
def test_problem_json_of_no_path(path, words):
    """None and a dict were TypeErrors; a NUL was said to be a value in the file."""
    with raises(ProblemError, "the problem file's path", *words):
        moirai.Problem.from_json(path)


def test_a_file_descriptor_is_no_path_and_stays_the_callers(tmp_path):
    """open() took an int for a descriptor: from_json and from_file read the caller's file and closed it."""
    (tmp_path / "problem.json").write_text(json.dumps({"devices": DEVICES, "tasks": []}))
    (tmp_path / "cluster.toml").write_text(CLUSTER)
    readers = [
        (moirai.Problem.from_json, "problem.json", ProblemError, "problem file"),
        (moirai.Cluster.from_file, "cluster.toml", ClusterError, "cluster file"),
    ]
    for read, name, error, subject in readers:
        with open(tmp_path / name) as held:
            with raises(error, f"the {subject}'s path is {held.fileno()} (int)", "file descriptor", "pathlib.Path"):
                read(held.fileno())
            assert held.read(1) in "{n"  # still open, unread


def test_plan_for_other_devices_or_other_tasks(problem):
    with raises(PlanError, "plan is for devices ['a', 'c']"):
        moirai.Plan(np.zeros(3, int), ("a", "c")).check(problem)
    with raises(PlanError, "plan places 2 tasks, problem has 3"):
        moirai.Plan(np.zeros(2, int), ("a", "b")).check(problem)
    with raises(PlanError, "unknown device 5"):
        moirai.Plan(np.array([0, 5, 1]), ("a", "b")).check(problem)


def test_every_report_field_has_a_json_type_that_load_checks() -> None:
    """A field added to a report with a type load does not know would be a KeyError at every load of its plans."""
    from moirai.planning.report import _FIELD_TYPES, PlacerReport, SolverReport

    for kind in (PlacerReport, SolverReport):
        unknown = [f"{f.name}: {f.type}" for f in dataclasses.fields(kind) if f.type not in _FIELD_TYPES]
        assert not unknown, f"add these types to moirai.planning.report._FIELD_TYPES: {unknown}"
        round_trip = PlacerReport.from_dict(kind().to_dict())
        assert type(round_trip) is kind


@pytest.mark.parametrize("value", ["no", "yes", 0, 1])
def test_progress_other_than_true_false_or_none_is_an_input_error(value):
    """``progress="no"`` switched reporting on: any word is true."""
    with pytest.raises(InputError, match=rf"progress={value!r} \(\w+\): give True, False or None"):
        moirai.compile(torch.nn.Linear(4, 4), ["cpu"], (torch.randn(2, 4),), progress=value)
