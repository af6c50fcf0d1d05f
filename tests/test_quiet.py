"""moirai prints nothing the user did not ask for: no third-party banner on stdout."""

from __future__ import annotations

import subprocess
import sys


def test_planning_prints_no_solver_banner_on_stdout():
    code = (
        "from moirai.planning.highs import new_highs\n"
        "first = new_highs(); first.run()\n"
        "second = new_highs(threads=1); second.run()\n"
        "print('done')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "done\n", result.stdout
    assert "HiGHS" not in result.stderr
