"""Every notebook in notebooks/ runs top to bottom without an error and shows at least one picture."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
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
