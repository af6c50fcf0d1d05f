"""The README's commands and examples are what the code does."""

import json
import re
from pathlib import Path

import numpy as np

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
