"""The README's commands and examples are what the code does."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import moirai
from moirai.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command() -> None:
    commands = re.findall(r"```bash\n(.+?)\n```", README)
    demo_command, test_command = commands[0], commands[1]
    assert "python -m moirai demo" in demo_command
    assert "pytest" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_problem_example_plans_as_documented(tmp_path) -> None:
    (example,) = re.findall(r"```json\n(.+?)\n```", README, re.DOTALL)
    path = tmp_path / "problem.json"
    path.write_text(example)
    problem = moirai.Problem.from_json(path)
    plan = moirai.place(problem, placer="heft")
    np.testing.assert_array_equal(plan.placement, [0, 0, 0, 1])
    assert plan.order == ((0, 1, 2), (3,))
    assert moirai.lower_bound(problem) <= plan.makespan_s
    output = tmp_path / "plan.json"
    assert main(["plan", str(path), "--placer", "heft", "--output", str(output)]) == 0
    assert json.loads(output.read_text())["placement"] == [0, 0, 0, 1]


# A fenced block, with the HTML comment before it if any: "file: NAME" writes the block to NAME before the
# blocks after it run; "not run by tests/test_readme.py: needs torchrun" skips a block that only runs as one of
# several torchrun ranks (the only reason a block may be skipped). Every other python block runs as pasted, as a
# script file of its own: a block that needs an import or a guard must have it.
FENCED_BLOCK = re.compile(r"(?:<!-- (?P<marker>[^\n]*?) -->\n)?```(?P<language>\w*)\n(?P<code>.*?)\n```", re.DOTALL)


BLOCKS = list(FENCED_BLOCK.finditer(README))
PYTHON_BLOCKS = [number for number, block in enumerate(BLOCKS) if block["language"] == "python"]
# What a block leaves in its folder for the reader to look at.
LEAVES = {
    "plan.png": 'compiled.gantt("plan.png")',
    "plan.json": 'compiled.save("plan.json")',
    "stream.png": 'compiled.gantt("stream.png"',
}


def test_the_readme_has_five_python_blocks_to_run_and_one_that_needs_torchrun() -> None:
    markers = [BLOCKS[number]["marker"] or "" for number in PYTHON_BLOCKS]
    skipped = [number for number, marker in zip(PYTHON_BLOCKS, markers, strict=True) if marker.startswith("not run")]
    assert len(PYTHON_BLOCKS) - len(skipped) == 5 and len(skipped) == 1
    for number in skipped:
        assert BLOCKS[number]["marker"] == "not run by tests/test_readme.py: needs torchrun"
        assert "torchrun" in BLOCKS[number]["code"]
    assert all(any(text in BLOCKS[number]["code"] for number in PYTHON_BLOCKS) for text in LEAVES.values())


# One test per block, so that the two workers share them: each runs as pasted, after the file blocks before it.
@pytest.mark.slow
@pytest.mark.parametrize("number", [n for n in PYTHON_BLOCKS if not (BLOCKS[n]["marker"] or "").startswith("not run")])
def test_every_readme_python_block_runs_as_pasted_in_a_script_of_its_own(tmp_path, number: int) -> None:
    for block in BLOCKS[:number]:
        marker = block["marker"] or ""
        if marker.startswith("file: "):
            (tmp_path / marker.removeprefix("file: ")).write_text(block["code"] + "\n")
    code = BLOCKS[number]["code"]
    script = tmp_path / f"readme_block_{number}.py"
    shows = SHOWS_ITS_SPLIT if "compiled = moirai.compile(" in code else ""
    shows += SHOWS_ITS_LM_SPLIT if "lm = moirai.compile_lm(" in code else ""
    script.write_text(code + "\n" + shows)
    result = subprocess.run(
        [sys.executable, script.name], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_env()
    )
    assert result.returncode == 0, f"README python block {number} failed:\n{result.stdout}\n{result.stderr}"
    for name, text in LEAVES.items():
        if text in code:
            assert (tmp_path / name).stat().st_size > 0, name


# Appended to a block that compiles a model for two devices: the plan it shows uses both and is predicted better
# on its objective (latency, or the period of pipelined requests) than the best single device's.
SHOWS_ITS_SPLIT = """
if __name__ == "__main__":
    from moirai.planning.objective import as_objective

    alone = moirai.place(compiled.problem, placer="single", objective=compiled.plan.objective)
    value_s = lambda plan: as_objective(compiled.plan.objective).value_s(moirai.simulate(compiled.problem, plan))
    assert sorted(set(compiled.plan.placement.tolist())) == [0, 1], compiled.plan.placement
    assert value_s(compiled.plan) < 0.9 * value_s(alone), (value_s(compiled.plan), value_s(alone))
"""


# The same for a block that compiles a causal LM for generation, judged by its generation objective.
SHOWS_ITS_LM_SPLIT = """
if __name__ == "__main__":
    alone = moirai.place(lm.compiled.problem, placer="single", objective=lm.objective)
    value_s = lambda plan: lm.objective.value_s(moirai.simulate(lm.compiled.problem, plan))
    assert sorted(set(lm.compiled.plan.placement.tolist())) == [0, 1], lm.compiled.plan.placement
    assert value_s(lm.compiled.plan) < 0.9 * value_s(alone), (value_s(lm.compiled.plan), value_s(alone))
"""


def _env() -> dict[str, str]:
    """This process's environment, with this checkout first on the path (as an editable install has it)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
