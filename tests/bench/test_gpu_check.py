"""The GPU check (issue 33), as CI runs it: `benchmarks/gpu_check.py --device cpu --quick` end to end in a
subprocess, every part passing within the 60 s the issue allows; and its runner: a part that raises is recorded
with its traceback while the next one runs, a part past the time budget is interrupted, one that no longer fits
is skipped."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _gpu_check import record, runner, shapes  # noqa: E402  (benchmarks/ is not a package)
from _gpu_check.context import Context  # noqa: E402
from _gpu_check.models import ModelStore  # noqa: E402

PARTS = ("attention", "parity", "gradient", "throughput", "trainer", "coserving")
QUICK_LIMIT_S = 60.0


def test_quick_cpu_run_passes_every_part(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["parts"]) == list(PARTS) and report["passed"]
    for name, part in report["parts"].items():
        assert part["status"] == "pass", (name, part["error"], [c for c in part["checks"] if c["ok"] is False])
        assert part["checks"] and part["seconds"] > 0 and part["summary"], name
    assert report["meta"]["total_s"] <= QUICK_LIMIT_S, report["meta"]["total_s"]
    parity = report["parts"]["parity"]["details"]
    assert {key.split("/")[0] for key in parity} == {"smollm2-135m", "llama-1b", "qwen-0.5b", "mistral-7b-2l"}
    assert "| parity | pass |" in (tmp_path / "gpu_check.md").read_text()
    assert json.loads((tmp_path / "coserving.json").read_text())["runs"]


def _context(tmp_path: Path, budget_s: float) -> Context:
    sizes, model_shapes = shapes.workload(True), shapes.shapes(True)
    return Context(device="cpu", quick=True, sizes=sizes, shapes=model_shapes,
                   models=ModelStore(tmp_path / "models", "cpu", model_shapes, sizes),
                   deadline=time.monotonic() + budget_s, out_dir=tmp_path)


def _meta() -> dict[str, object]:
    return {"device": "cpu", "device_name": "test", "date": "today", "versions": {}}


def test_a_failing_part_is_recorded_and_the_next_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: Context, rec: record.PartRecord) -> None:
        rec.at_most("measured before the failure", 1.0, 2.0)
        raise RuntimeError("CUDA error: an illegal memory access")

    def fine(ctx: Context, rec: record.PartRecord) -> None:
        rec.at_most("x", 1.0, 2.0)
        rec.summary = "fine"

    monkeypatch.setattr(runner, "PARTS", {"broken": broken, "fine": fine})
    monkeypatch.setattr(runner, "PART_NEEDS_S", {"broken": (0, 0), "fine": (0, 0)})
    records = runner.run_parts(_context(tmp_path, 30), ["broken", "fine"], _meta(), time.monotonic())
    assert [r.status for r in records] == ["error", "pass"]
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert "RuntimeError: CUDA error" in parts["broken"]["error"] and parts["broken"]["checks"][0]["ok"] is True
    assert "| broken | error | CUDA error" in (tmp_path / "gpu_check.md").read_text().replace("RuntimeError: ", "")


def test_the_time_budget_interrupts_then_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(ctx: Context, rec: record.PartRecord) -> None:
        rec.check("started", True)
        time.sleep(5)

    monkeypatch.setattr(runner, "PARTS", {"slow": slow, "later": slow})
    monkeypatch.setattr(runner, "PART_NEEDS_S", {"slow": (0, 0), "later": (1, 1)})
    start = time.monotonic()
    records = runner.run_parts(_context(tmp_path, 0.5), ["slow", "later"], _meta(), start)
    assert time.monotonic() - start < 3
    assert [r.status for r in records] == ["error", "skipped"]
    assert "OutOfBudget" in (records[0].error or "") and records[0].checks
