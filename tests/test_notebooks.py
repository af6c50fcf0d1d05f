"""Every notebook in notebooks/ runs top to bottom without an error and shows at least one picture."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# Notebooks that plan models on the meta device for a preset cluster: their kernel computes alone, starting no
# ranks and calibrating nothing, and what they show holds whatever a search's budget bought, so they run beside
# other tests (conftest.py, [Note: tests that run alone]). The others run alone.
PLAN_ONLY = {"cluster_tour.ipynb", "huggingface_meta.ipynb"}


def _marks(path: Path) -> list[pytest.MarkDecorator]:
    return [pytest.mark.slow, *([pytest.mark.in_process] if path.name in PLAN_ONLY else [])]


@pytest.mark.parametrize("path", [pytest.param(p, marks=_marks(p), id=p.name) for p in NOTEBOOKS])
def test_notebook_executes(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(path.parent)}}
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources=resources)
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert any("image/png" in output.get("data", {}) for output in outputs), f"{path.name} shows no picture"
    texts = [output.get("data", {}).get("text/plain", "") for output in outputs]
    if "moirai.compile(" in "".join(cell.source for cell in notebook.cells):
        assert any(text.startswith("✓ trace") for text in texts), "compile's progress lines are missing"


def test_the_notebooks_that_run_beside_other_tests_start_no_ranks() -> None:
    for path in NOTEBOOKS:
        if path.name in PLAN_ONLY:
            source = "".join(cell.source for cell in nbformat.read(path, as_version=4).cells)
            starts_ranks = [
                call for call in ("run_distributed", ".server(", "serve_rank", "calibration") if call in source
            ]
            assert not starts_ranks, f"{path.name} calls {starts_ranks}: take it out of PLAN_ONLY"
