"""A problem file's every field is checked as it is read: a bad one is a ProblemError naming the file, the field and
what to give (one red line from ``moirai plan``), never a Python error or a silently different problem."""

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moirai import Problem
from moirai.cli import main
from moirai.errors import ProblemError
from moirai.planning.plan import Plan
from moirai.planning.simulate import simulate
from moirai.testing import random_problem

# Every kind of field a file can hold: links and bytes, transfer times, CPU times, per-request costs, a colocated set.
VALID: dict[str, Any] = {
    "devices": [{"name": "gpu0", "memory_bytes": 8e9}, {"name": "gpu1"}],
    "tasks": [
        {"name": "embed", "compute_s": [0.002, 0.004], "memory_bytes": 2e9},
        {"name": "left", "compute_s": [0.010, 0.020], "memory_bytes": 3e9},
        {"name": "right", "compute_s": [0.010, 0.020], "memory_bytes": 3e9},
        {"name": "head", "compute_s": [0.001, math.inf], "memory_bytes": 1e9},
    ],
    "edges": [
        {"src": "embed", "dst": "left", "tensor": "hidden", "bytes": 4e6},
        {"src": "embed", "dst": "right", "tensor": "hidden", "bytes": 4e6},
        {"src": "left", "dst": "head", "bytes": 4e6},
        {"src": "right", "dst": "head", "bytes": 4e6, "send_cpu_s": [[0, 1e-4], [1e-4, 0]]},
        {"src": "left", "dst": "right", "tensor": "mask", "transfer_s": [[0, 0.5], [0.5, 0]]},
    ],
    "links": {"bandwidth_bytes_per_s": [[0, 1e10], [1e10, 0]], "latency_s": [[0, 1e-5], [1e-5, 0]]},
    "request_costs": {"header_s": [0.0, 1e-4], "output_s": [[0, 0], [0, 0], [0, 0], [0, 2e-4]], "input_readers": [[0]]},
    "colocated": [["left", "head"]],
}


class Drop:
    """An edit that removes the key (named in test ids alike on every pytest worker)."""

    def __repr__(self) -> str:
        return "DROP"


DROP = Drop()


def edited(path: tuple[Any, ...], value: Any) -> Any:
    """VALID with the value at ``path`` (keys and indices) replaced by ``value``, or removed by DROP; the empty
    path replaces the whole description."""
    if not path:
        return value
    description = copy.deepcopy(VALID)
    *outer, last = path
    holder = description
    for key in outer:
        holder = holder[key]
    if value is DROP:
        del holder[last]
    else:
        holder[last] = value
    return description


NAN, INF = math.nan, math.inf

# (path, value, words the message must hold): one field of VALID edited.
EDITS = [
    # a string, null, a list or a bool where a number goes
    (("tasks", 3, "compute_s", 0), "fast", ['tasks[3].compute_s[0] is "fast", not a number', "seconds"]),
    (("tasks", 1, "memory_bytes"), None, ["tasks[1].memory_bytes is null, not a number", "bytes"]),
    (("tasks", 1, "memory_bytes"), True, ["tasks[1].memory_bytes is true, not a number"]),
    (("tasks", 2, "compute_s"), [True, 1.0], ["tasks[2].compute_s[0] is true, not a number"]),
    (("devices", 0, "memory_bytes"), "8GB", ['devices[0].memory_bytes is "8GB", not a number']),
    (("edges", 2, "bytes"), [4e6], ["edges[2].bytes is [4000000.0], not a number"]),
    (("edges", 4, "transfer_s", 0, 1), "x", ['edges[4].transfer_s[0][1] is "x", not a number']),
    (("edges", 4, "transfer_s"), None, ["edges[4].transfer_s must be a list of 2 lists of 2 numbers", "got null"]),
    (("edges", 4, "transfer_s", 1), [0.5], ["edges[4].transfer_s[1] must be a list of 2 numbers, got [0.5]"]),
    (("tasks", 0, "compute_s"), [1.0], ["tasks[0].compute_s must be a list of 2 numbers (one time per device)"]),
    (("links", "bandwidth_bytes_per_s"), "fast", ["links.bandwidth_bytes_per_s must be a list of 2 lists"]),
    (("links", "latency_s", 1, 0), None, ["links.latency_s[1][0] is null, not a number"]),
    (("request_costs", "header_s", 1), "a", ['request_costs.header_s[1] is "a", not a number']),
    (("request_costs", "output_s", 3), [0.0], ["request_costs.output_s[3] must be a list of 2 numbers"]),
    (("edges", 3, "send_cpu_s", 0), "x", ["edges[3].send_cpu_s[0] must be a list of 2 numbers"]),
    # NaN, negative, infinite where that means nothing
    (("tasks", 0, "compute_s", 1), NAN, ["tasks[0].compute_s[1] is NaN", "non-negative number of seconds"]),
    (("tasks", 0, "compute_s", 1), -1, ["tasks[0].compute_s[1] is -1.0", "Infinity (the task cannot run"]),
    (("tasks", 0, "memory_bytes"), -1, ["tasks[0].memory_bytes is -1.0", "finite non-negative number of bytes"]),
    # Planned, with sums that overflowed: 'busy inf', 'gap nan%' and numpy's overflow warnings.
    (("tasks", 0, "compute_s", 0), 1e308, ["tasks[0].compute_s[0] is 1e+308", "seconds up to 1e+18, or Infinity"]),
    (("tasks", 0, "memory_bytes"), INF, ["tasks[0].memory_bytes is Infinity", "finite"]),
    (("devices", 0, "memory_bytes"), NAN, ["devices[0].memory_bytes is NaN", "Infinity (unlimited memory)"]),
    (("devices", 0, "memory_bytes"), -8e9, ["devices[0].memory_bytes is -8000000000.0"]),
    (("edges", 2, "bytes"), -1, ["edges[2].bytes is -1.0", "bytes"]),
    (("edges", 2, "bytes"), INF, ["edges[2].bytes is Infinity"]),
    (("edges", 2, "bytes"), NAN, ["edges[2].bytes is NaN"]),
    (("edges", 4, "transfer_s", 0, 1), -0.5, ["edges[4].transfer_s[0][1] is -0.5"]),
    (("edges", 4, "transfer_s", 0, 1), NAN, ["edges[4].transfer_s[0][1] is NaN"]),
    (("edges", 3, "send_cpu_s", 0, 1), INF, ["edges[3].send_cpu_s[0][1] is Infinity", "finite"]),
    (("links", "bandwidth_bytes_per_s", 0, 1), NAN, ["links.bandwidth_bytes_per_s[0][1] is NaN", "bytes per second"]),
    (("links", "bandwidth_bytes_per_s", 0, 1), -1e10, ["links.bandwidth_bytes_per_s[0][1] is -10000000000.0"]),
    (("links", "bandwidth_bytes_per_s", 0, 1), 0, ["links.bandwidth_bytes_per_s[0][1] is 0", "positive"]),
    (("links", "latency_s", 1, 0), -1e-5, ["links.latency_s[1][0] is -1e-05"]),
    (("request_costs", "header_s", 1), -1, ["request_costs.header_s[1] is -1.0", "seconds"]),
    (("request_costs", "output_s", 3, 1), NAN, ["request_costs.output_s[3][1] is NaN"]),
    (("request_costs", "input_readers", 0), [INF], ["request_costs.input_readers[0] is [Infinity]"]),  # was raw
    (("request_costs", "input_readers", 0), [NAN], ["request_costs.input_readers[0] is [NaN]"]),
    # a time on the diagonal: a tensor does not move to the device it is on
    (("edges", 4, "transfer_s", 0, 0), 0.5, ["edges[4].transfer_s[0][0] is 0.5", "give 0"]),
    (("edges", 3, "send_cpu_s", 1, 1), 1e-4, ["edges[3].send_cpu_s[1][1] is 0.0001", "give 0"]),
    # an unknown key, with the known one it is closest to
    (("devices", 1, "memmory_bytes"), 4e9, ["devices[1] has unknown key 'memmory_bytes'", "'memory_bytes'?"]),
    (("tasks", 2, "memory_byte"), 4e9, ["tasks[2] has unknown key 'memory_byte'", "'memory_bytes'?"]),
    (("edges", 0, "tensr"), "x", ["edges[0] has unknown key 'tensr'", "'tensor'?"]),
    (("links", "latency"), [[0, 0], [0, 0]], ["links has unknown key 'latency'", "'latency_s'?"]),
    (("request_costs", "header"), [0, 0], ["request_costs has unknown key 'header'", "'header_s'?"]),
    (("link",), {}, ["the problem description has unknown key 'link'", "'links'?"]),
    (("edge",), [], ["the problem description has unknown key 'edge'", "'edges'?"]),
    # a name twice, or a name that is not one
    (("tasks", 2, "name"), "left", ["tasks[2].name is 'left', the name of tasks[1] too"]),
    (("devices", 1, "name"), "gpu0", ["devices[1].name is 'gpu0', the name of devices[0] too"]),
    (("tasks", 1, "name"), None, ["tasks[1].name must be a non-empty string, got null"]),
    (("devices", 0, "name"), 0, ["devices[0].name must be a non-empty string, got 0"]),
    (("edges", 0, "tensor"), 7, ["edges[0].tensor must be a non-empty string, got 7"]),
    (("edges", 0, "src"), "embd", ["edges[0].src is 'embd', which is no task's name", "'embed'?"]),
    (("edges", 1, "bytes"), 8e6, ["edges[1] gives tensor 'hidden' of 'embed' other", "than edges[0]"]),
    (("edges", 2, "dst"), "left", ["edges[2] goes from task 'left' to itself"]),
    (("colocated", 0, 1), "hed", ["colocated[0] names unknown tasks ['hed']"]),
    # a required key missing
    (("tasks", 0, "compute_s"), DROP, ["tasks[0] lacks ['compute_s']"]),
    (("devices", 1, "name"), DROP, ["devices[1] lacks ['name']"]),
    (("edges", 1, "dst"), DROP, ["edges[1] lacks ['dst']"]),
    (("tasks",), DROP, ["the problem description lacks ['tasks']"]),
    (("links", "bandwidth_bytes_per_s"), DROP, ["links lacks ['bandwidth_bytes_per_s']"]),
    (("links",), DROP, ["edges[0] ('embed' -> 'left') needs 'transfer_s', or 'bytes' with a top-level 'links'"]),
    # a value of the wrong type where a list or an object goes
    ((), [], ["the problem description must be an object", "got a list"]),
    ((), "problem", ["the problem description must be an object", 'got a string: "problem"']),
    (("devices",), {"gpu0": 8e9}, ["devices must be a list of objects, got an object"]),
    (("tasks", 0), "embed", ["tasks[0] must be an object", 'got a string: "embed"']),
    (("edges",), None, ["edges must be a list of objects, got null"]),
    (("links",), [1e10], ["links must be an object", "got a list"]),
    (("request_costs",), None, ["request_costs must be an object", "got null"]),
    (("request_costs", "input_readers", 0), [9], ["request_costs.input_readers[0] is [9]", "indices (0..3)"]),
    (("colocated",), "left", ["colocated must be a list of lists of task names", 'got a string: "left"']),
    (("colocated", 0), "left", ['colocated[0] must be a list of task names, got "left"']),
    # per-request costs both in request_costs and, as older files give them, in an entry: one would be dropped
    (("devices", 1, "header_s"), 0.5, ["devices[1].header_s is a per-request cost outside 'request_costs'"]),
]


def write(tmp_path: Path, description: Any, name: str = "problem.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(description))  # NaN and Infinity as Python's json writes and reads them
    return path


@pytest.mark.parametrize(("path", "value", "words"), EDITS, ids=[f"{'.'.join(map(str, p))}={v!r}" for p, v, _ in EDITS])
def test_a_bad_field_is_a_problem_error_naming_the_file_and_the_field(tmp_path, path, value, words) -> None:
    file = write(tmp_path, edited(path, value))
    with pytest.raises(ProblemError) as raised:
        Problem.from_json(file)
    message = str(raised.value)
    assert message.startswith(f"{file}: "), message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("tasks", 3, "compute_s", 0), "fast", "tasks[3].compute_s[0]"),
        (("devices", 1, "memory_bytes"), None, "devices[1].memory_bytes"),
        (("links", "bandwidth_bytes_per_s"), "fast", "links.bandwidth_bytes_per_s"),
        (("request_costs", "header_s", 1), "a", "request_costs.header_s[1]"),
        (("tasks", 0, "memory_bytes"), -1, "tasks[0].memory_bytes"),
        (("devices", 1, "memmory_bytes"), 4e9, "'memmory_bytes'"),
        (("links",), [1], "links must be an object"),
    ],
)
def test_moirai_plan_says_the_field_on_one_red_line(tmp_path, capsys, path, value, field) -> None:
    file = write(tmp_path, edited(path, value))
    assert main(["plan", str(file)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {file}: ") and field in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out


def test_what_is_not_a_json_text_is_a_problem_error_naming_the_file(tmp_path) -> None:
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(ProblemError, match=r"binary\.json.*not UTF-8"):
        Problem.from_json(binary)
    with pytest.raises(ProblemError, match=r"cannot be read"):
        Problem.from_json(tmp_path)  # a folder
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ProblemError, match=r"deep\.json.*too deeply"):
        Problem.from_json(deep)
    digits = tmp_path / "digits.json"
    digits.write_text('{"devices": ' + "7" * 5000 + "}")
    with pytest.raises(ProblemError, match=r"digits\.json' holds an integer of more than 4300 digits.*fewer digits"):
        Problem.from_json(digits)  # int()'s ValueError, about sys.set_int_max_str_digits, before


def test_an_integer_too_large_for_a_float_is_refused_not_read_as_infinity(tmp_path) -> None:
    """Infinity means something (compute_s: the task cannot run there); a 401-digit time was silently read as it."""
    huge = tmp_path / "huge.json"
    huge.write_text(
        '{"devices": [{"name": "d0"}, {"name": "d1"}], "tasks": [{"name": "a", "compute_s": [1' + "0" * 400 + ", 1]}]}"
    )
    words = r"tasks\[0\]\.compute_s\[0\] is an integer of about 401 digits, too large for a float"
    with pytest.raises(ProblemError, match=words):
        Problem.from_json(huge)
    with pytest.raises(ProblemError, match=words):
        Problem.from_dict(json.loads(huge.read_text()))


def test_a_float_too_large_for_a_float_is_refused_not_read_as_infinity(tmp_path) -> None:
    """Python's json reads 1e400 as Infinity, which means the task cannot run there; the literal Infinity still
    does."""
    devices = '{"devices": [{"name": "d0"}, {"name": "d1"}], '
    huge = tmp_path / "huge.json"
    huge.write_text(devices + '\n"tasks": [{"name": "a", "compute_s": [1e400, 1]}]}')
    with pytest.raises(ProblemError, match=r"holds the number 1e400 \(line 2, column 39\), too large for a float"):
        Problem.from_json(huge)
    meant = tmp_path / "meant.json"
    meant.write_text(devices + '"tasks": [{"name": "a", "compute_s": [Infinity, 1.5]}]}')
    assert Problem.from_json(meant).compute_s.tolist() == [[math.inf, 1.5]]


def test_a_problem_written_where_no_file_can_be_is_a_problem_error_naming_the_path(tmp_path) -> None:
    """Fault injected: a missing folder and a folder for the file, where to_json raised the OSError of its
    temporary file (FileNotFoundError: .../.problem.json.1f2e....tmp)."""
    problem = Problem.from_json(write(tmp_path, VALID))
    missing = tmp_path / "nowhere" / "problem.json"
    with pytest.raises(ProblemError, match=r"to '.*nowhere/problem\.json': folder .* does not exist"):
        problem.to_json(missing)
    with pytest.raises(ProblemError, match=r"cannot write the problem to '.*': it is a folder"):
        problem.to_json(tmp_path)
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_valid_file_loads_as_written_and_round_trips_exactly(tmp_path) -> None:
    problem = Problem.from_json(write(tmp_path, VALID))
    assert problem.device_names == ("gpu0", "gpu1") and problem.memory_capacity_bytes.tolist() == [8e9, math.inf]
    assert problem.compute_s[3].tolist() == [0.001, math.inf]
    assert problem.tensor_names == ("hidden", "left->head", "right->head", "mask")
    assert problem.tensor_consumers[0] == (1, 2), "edges of one src naming one tensor carry one tensor"
    assert problem.transfer_s[0, 0, 1] == pytest.approx(1e-5 + 4e6 / 1e10)
    assert problem.send_cpu_s[2, 0, 1] == 1e-4 and problem.costs.header_s.tolist() == [0.0, 1e-4]
    assert problem.colocated == ((1, 3),) and problem.costs.input_readers == ((0,),)
    path = tmp_path / "again.json"
    problem.to_json(path)
    again = Problem.from_json(path)
    assert again.to_dict() == problem.to_dict()
    assert path.read_text() == json.dumps(again.to_dict(), allow_nan=True), "written alike, byte for byte"


def test_tensors_of_two_tasks_named_alike_get_names_of_their_own_that_round_trip(tmp_path) -> None:
    description = edited(("edges", 3, "tensor"), "hidden")
    description["edges"][2]["tensor"] = "hidden"
    problem = Problem.from_dict(description)
    assert problem.tensor_names == ("hidden", "left:hidden", "right:hidden", "mask")
    again = Problem.from_dict(json.loads(json.dumps(problem.to_dict())))
    assert again.tensor_names == problem.tensor_names and again.to_dict() == problem.to_dict()


def test_a_generated_problem_with_every_cost_round_trips_exactly(tmp_path) -> None:
    problem = random_problem(3, 12, 3, send_cpu_s=0.1, recv_cpu_s=0.1, header_s=0.1, output_s=0.1, input_s=0.1)
    problem.to_json(tmp_path / "random.json")
    again = Problem.from_json(tmp_path / "random.json")
    assert again.to_dict() == problem.to_dict()
    for label in ("compute_s", "transfer_s", "send_cpu_s", "recv_cpu_s", "tensor_bytes", "memory_capacity_bytes"):
        np.testing.assert_array_equal(getattr(again, label), getattr(problem, label))


@pytest.mark.parametrize("seed", range(3))
def test_every_plan_keeps_its_value_through_json(seed) -> None:
    # A plan names tensors by index in its transfer_order: the problem read back must hold the same tensors in the
    # same order for the plan to mean the same thing.
    problem = random_problem(seed, 12, 3, send_cpu_s=0.1, recv_cpu_s=0.1, header_s=0.1, output_s=0.1)
    again = Problem.from_dict(json.loads(json.dumps(problem.to_dict())))
    rng = np.random.default_rng(seed)
    for _ in range(5):
        placement = rng.integers(0, problem.num_devices, problem.num_tasks)
        timeline = simulate(problem, Plan(placement, problem.device_names))
        plan = Plan(
            placement, problem.device_names, order=timeline.device_order(), transfer_order=timeline.transfer_order()
        )
        assert simulate(again, plan).makespan_s == simulate(problem, plan).makespan_s


def python_problem(**changes: Any) -> Problem:
    fields: dict[str, Any] = {
        "device_names": ("a", "b"),
        "memory_capacity_bytes": [10.0, math.inf],
        "task_names": ("x", "y", "z"),
        "compute_s": np.ones((3, 2)),
        "memory_bytes": [1.0, 1.0, 1.0],
        "tensor_names": ("t", "u"),
        "tensor_producer": [0, 1],
        "tensor_consumers": ((1,), (2,)),
        "transfer_s": np.ones((2, 2, 2)) - np.eye(2),
    }
    return Problem(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"memory_bytes": [1.0, -1.0, 1.0]}, ["memory_bytes[1] (task 'y') is -1.0", "finite non-negative"]),
        ({"memory_bytes": [1.0, 1.0, math.inf]}, ["memory_bytes[2] (task 'z') is Infinity"]),
        ({"memory_capacity_bytes": [math.nan, 1.0]}, ["memory_capacity_bytes[0] (device 'a') is NaN"]),
        ({"compute_s": [[1, 1], [1, -2], [1, 1]]}, ["compute_s[1, 1] (task 'y', device 'b') is -2.0"]),
        ({"transfer_s": np.full((2, 2, 2), math.nan)}, ["transfer_s[0, 0, 0] (tensor 't', from device 'a'"]),
        ({"tensor_bytes": [1.0, math.inf]}, ["tensor_bytes[1] (tensor 'u') is Infinity"]),
        ({"tensor_names": ("t", "t")}, ["duplicate tensor names ['t']"]),
        ({"task_names": ("x", "y", "x")}, ["duplicate task names ['x']"]),
        ({"compute_s": np.ones((3, 3))}, ["compute_s must hold 3 x 2 numbers", "shape (3, 3)"]),
        ({"memory_bytes": ["a", "b", "c"]}, ["memory_bytes must hold numbers"]),
        # a task index that is no whole number was cut to one (1.5 read as task 1)
        ({"tensor_producer": [0, 1.5]}, ["tensor_producer[1] is 1.5; give a task index"]),
        ({"tensor_consumers": ((1,), (2.7,))}, ["tensor_consumers[1][0] is 2.7; give a task index"]),
        # one tuple short or too many read past the tensors (a raw IndexError)
        ({"tensor_consumers": ((1,), (2,), (2,))}, ["tensor_consumers has 3 entries for the 2 tensors"]),
        ({"tensor_consumers": ((1,),)}, ["tensor_consumers has 1 entries for the 2 tensors"]),
        # the JSON form, an edge per consumer, dropped it, and a plan's transfer_order then named other tensors
        ({"tensor_consumers": ((), (2,))}, ["tensor 't' (tensor_consumers[0]) has no consumers", "leave it out"]),
        # a time on the diagonal was read by no placer and no simulator: a value there meant nothing, silently
        ({"transfer_s": np.ones((2, 2, 2))}, ["transfer_s[0, 0, 0] (tensor 't', device 'a') is 1.0", "give 0"]),
        ({"send_cpu_s": np.eye(2)[None].repeat(2, 0)}, ["send_cpu_s[0, 0, 0] (tensor 't', device 'a') is 1.0"]),
    ],
)
def test_a_problem_built_in_python_is_checked_by_the_same_rules(changes, words) -> None:
    with pytest.raises(ProblemError, match="".join(f"(?=[\\s\\S]*{re.escape(word)})" for word in words)):
        python_problem(**changes)


def test_tensors_named_alike_would_merge_on_the_way_through_json() -> None:
    """Why tensor names must differ: the JSON form knows a tensor by its task and name, so two of one name would
    come back as one tensor, sent once instead of twice."""
    assert python_problem().num_tensors == 2
    with pytest.raises(ProblemError, match="duplicate tensor names"):
        python_problem(tensor_names=("t", "t"), tensor_producer=[0, 0])


def test_infinite_numbers_load_where_they_mean_something(tmp_path: Path) -> None:
    """A free link (Infinity bytes/s) and no link (Infinity latency). An integer too long for a float is refused, not
    read as Infinity (test_an_integer_too_large_for_a_float_is_refused_not_read_as_infinity)."""
    description = edited(("links", "bandwidth_bytes_per_s", 0, 1), INF)
    description["links"]["latency_s"][1][0] = INF
    description["tasks"][1]["compute_s"][1] = INF
    path = tmp_path / "p.json"
    path.write_text(json.dumps(description))
    problem = Problem.from_json(path)
    assert problem.compute_s[1, 1] == INF
    assert np.isinf(problem.transfer_s[:, 1, 0]).any()  # no link, where no edge gives its own time


def test_a_task_no_device_can_run_is_named_as_such(tmp_path: Path) -> None:
    """It said the task needs 0 B and no device that can run it has that much (largest: inf GB)."""
    from moirai.errors import InfeasibleError
    from moirai.planning.placers import place

    problem = Problem.from_dict(edited(("tasks", 3, "compute_s"), [INF, INF]))
    with pytest.raises(InfeasibleError, match="task 'head' can run on no device"):
        place(problem, "heft")


def test_a_task_that_reads_a_tensor_twice_is_its_consumer_once() -> None:
    """Listed twice, the tensor was twice among the task's inputs (Problem.input_tensors), for every cost to count."""
    twice = python_problem(tensor_consumers=((1, 1), (2,)))
    assert twice.tensor_consumers == python_problem().tensor_consumers == ((1,), (2,))
