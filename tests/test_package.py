"""The package boundary: planning code loads no torch, and the top-level names resolve lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_planning_modules_leave_torch_unimported():
    code = (
        "import moirai.problem, moirai.simulate, moirai.bounds, moirai.placers.milp, sys; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_top_level_names_stay_functions_after_their_modules_are_imported():
    code = (
        "import moirai.compile, moirai.simulate, moirai.trace, moirai.coarsen\n"
        "import moirai\n"
        "for name in ('compile', 'simulate', 'trace', 'coarsen'):\n"
        "    assert callable(getattr(moirai, name)) and not isinstance(getattr(moirai, name), type(moirai)), name\n"
        "from moirai.placers import place\n"
        "assert moirai.place is place and 'heft' in moirai.list_placers()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_placers_is_the_package_and_the_old_listing_call_says_what_it_became():
    import moirai
    import moirai.placers.heft as heft

    assert moirai.placers.heft is heft
    with pytest.raises(moirai.MoiraiError, match="list_placers"):
        moirai.placers()
    with pytest.raises(AttributeError):
        moirai.no_such_name  # noqa: B018
