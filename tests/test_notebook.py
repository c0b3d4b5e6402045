"""`notebooks/walkthrough.ipynb` runs end to end (nbclient, a real kernel): local server, chat, upload,
fine-tune, events and loss curve, fine-tuned chat, a small co-serving benchmark. The stored copy keeps
small outputs and no error."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "walkthrough.ipynb"


def _text(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def _errors(nb: nbformat.NotebookNode) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]


def test_stored_notebook_has_small_outputs_and_no_error() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert NOTEBOOK.stat().st_size < 100_000
    assert not _errors(nb) and "succeeded ft:tiny-llama:demo:numbers:" in _text(nb)


def test_notebook_runs_end_to_end() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    assert not _errors(nb)
    text = _text(nb)
    assert "succeeded ft:tiny-llama:demo:numbers:" in text and "SLO attainment" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2
