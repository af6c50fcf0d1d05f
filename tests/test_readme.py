"""The README's test command is what CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command() -> None:
    commands = re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())
    demo_command, test_command = commands[0], commands[1]
    assert "python -m moirai demo" in demo_command
    assert "pytest" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()
