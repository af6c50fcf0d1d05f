"""A rank keeps the memory it frees: a step's buffers land on pages faulted in once, not on fresh ones each step."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_FAULTS_PER_STEP = textwrap.dedent(
    """
    import resource, sys, torch
    from moirai.runtime.resources import keep_freed_memory
    if sys.argv[1] == "kept":
        assert keep_freed_memory()
    def step():
        # 16 buffers of 1 MB alive at once, as a decode step's cache gathers: freed together, they leave more free
        # memory at the top of the heap than glibc keeps by default, and it goes back to the kernel
        held = [torch.ones(1 << 18) for _ in range(16)]
        return float(sum(t[-1] for t in held))
    for _ in range(5):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)
    """
)


def _faults_per_step(mode: str) -> float:
    result = subprocess.run([sys.executable, "-c", _FAULTS_PER_STEP, mode], capture_output=True, text=True, check=True)
    return float(result.stdout.strip())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_rank_reuses_freed_pages_instead_of_faulting_in_fresh_ones() -> None:
    default, kept = _faults_per_step("default"), _faults_per_step("kept")
    assert default > 500, f"the default heap should fault in a fresh 16 MB each step; it faulted {default} pages"
    assert kept < 0.05 * default, f"kept: {kept} page faults a step against {default} by default"
