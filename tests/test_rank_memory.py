"""A rank keeps the memory it frees: a step's buffers land on pages faulted in once, not on fresh ones each step."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_FAULTS_PER_STEP = textwrap.dedent(
    """
    import ctypes, ctypes.util, resource, sys, torch
    from moirai.runtime.resources import keep_freed_memory
    # glibc's static default, M_MMAP_THRESHOLD = 128 KiB, fixed: each MB buffer is mapped and unmapped
    assert ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 128 << 10) == 1
    if sys.argv[1] == "kept":
        assert keep_freed_memory()
    def step():
        # 16 buffers of 1 MB alive at once, as a decode step's cache gathers
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


# Left to itself glibc raises its mmap threshold when a mapped buffer is freed; buffers then come from the heap, and
# whether freeing them gives pages back (a trim) depends on what else lies at the heap's top, so a step faulted in
# 16 MB on one machine and nothing on another. The test fixes glibc's static threshold, so the process it measures
# gives every buffer back, and asks whether keep_freed_memory makes it keep them.
def _faults_per_step(mode: str) -> float:
    result = subprocess.run([sys.executable, "-c", _FAULTS_PER_STEP, mode], capture_output=True, text=True, check=True)
    return float(result.stdout.strip())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_rank_reuses_freed_pages_instead_of_faulting_in_fresh_ones() -> None:
    given_back, kept = _faults_per_step("given back"), _faults_per_step("kept")
    assert given_back > 500, f"a heap that gives memory back should fault in a fresh 16 MB a step: {given_back} pages"
    assert kept < 0.05 * given_back, f"kept: {kept} page faults a step against {given_back} given back"
