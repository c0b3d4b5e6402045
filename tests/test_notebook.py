"""`notebooks/walkthrough.ipynb` runs end to end (nbclient, a real kernel) on SmolLM2-135M-Instruct: local
server, chat, streaming, a fine-tuning job that teaches "Ahoy!" openings, events and loss curve, the tuned
model on unseen questions beside the unchanged base model, a small co-serving benchmark. The stored copy
keeps small outputs and no error, and shows the habit learnt (from the full run: `python
notebooks/build_walkthrough.py --execute`). Here it runs as a smoke test (`COSERVE_NOTEBOOK_SMOKE=1`:
one epoch and a 3-second benchmark window, 2 minutes instead of 4-5): every cell runs, without error, and
shows what it shows; that a job teaches SmolLM2 the habit is tests/api/test_real_model_finetune.py's."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "walkthrough.ipynb"


def _text(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def _errors(nb: nbformat.NotebookNode) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]


def _check_outputs(text: str, learnt: bool = True) -> None:
    """What the notebook must show: the real model's answer, the job, the tuned model's answers to unseen
    questions (with `learnt`: the habit, after the full run's three epochs), the base model unchanged,
    the benchmark."""
    assert "The capital of France is Paris." in text
    assert "succeeded ft:smollm2-135m-instruct:demo:pirate:" in text
    tuned = [line for line in text.splitlines() if line.strip().startswith("tuned: ")]
    assert len(tuned) == 4, tuned
    if learnt:
        assert all(line.strip().startswith("tuned: Ahoy!") for line in tuned[:3]), tuned
        assert "Paris" in tuned[3]
    assert "base model answers unchanged by the job: True" in text
    assert "SLO attainment" in text


def test_stored_notebook_has_small_outputs_and_no_error() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert NOTEBOOK.stat().st_size < 100_000
    assert not _errors(nb)
    _check_outputs(_text(nb))


@pytest.mark.real_model
def test_notebook_runs_end_to_end(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (the fixture fetches the model it serves)
    monkeypatch.setenv("COSERVE_NOTEBOOK_SMOKE", "1")  # the kernel inherits this process's environment
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    assert not _errors(nb)
    _check_outputs(_text(nb), learnt=False)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2
