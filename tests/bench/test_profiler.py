"""`coserve profile`: the designed sweep runs real engine iterations whose features are the designed
ones, and the CLI writes a profile `LatencyModel` loads (a tiny sweep: no accuracy claim here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coserve.bench.profiler import DesignedPlans, Scenario, SweepSettings, _Harness, design
from coserve.cli import main
from coserve.contract.engine_config import EngineConfig
from coserve.contract.plan import IterationResult
from coserve.planner.latency import COEFFICIENT_NAMES, LatencyModel
from coserve.torch_engine.engine import TorchEngine

ROOT = Path(__file__).resolve().parents[2]


def test_design_is_seeded_and_fits_the_context() -> None:
    settings = SweepSettings(iterations=40, seed=3)
    first, again = design(settings, 2, 300), design(settings, 2, 300)
    assert first == again and len(first) == 40 + settings.warmup
    assert design(SweepSettings(iterations=40, seed=4), 2, 300) != first
    for s in first:
        assert all(c < 300 for c in s.decode_contexts)
        assert s.prefill is None or sum(s.prefill) <= 300
        assert 0 <= s.adapters <= 2 and not (s.forward_tokens and s.backward_tokens)
        assert s.decode_contexts or s.prefill  # inference work: what the latency model decides


def test_measured_iteration_does_the_designed_work(model_dirs: dict[str, Path]) -> None:
    engine = TorchEngine(EngineConfig(model=str(model_dirs["llama"]), dtype="float32", num_kv_blocks=128,
                                 block_size=16, max_loras=2, max_lora_rank=16))
    harness = _Harness(engine, [], SweepSettings(iterations=4, finetune_length=64))
    (features, seconds), _ = harness.measure(Scenario((16, 40), (32, 8), 0, 24, 0, 0))
    assert seconds > 0
    assert (features.decode_tokens, features.decode_context) == (2, 17 + 41)
    assert (features.prefill_tokens, features.prefill_attention) == (8, 8 * 32 + 36)
    assert (features.ft_forward_tokens, features.ft_backward_token_layers) == (24, 0)
    (features, _), _ = harness.measure(Scenario((), None, 0, 0, 1, 16))
    assert features.ft_backward_token_layers == 16 and features.num_sequences == 0
    assert harness.kv.num_free_blocks + len(harness.kv.block_table("profile-job/s1.0")) \
        == harness.kv.num_blocks  # only the training sequence still holds blocks


def test_profile_cli_writes_a_loadable_profile(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    code = main(["profile", "--model", str(model_dirs["llama"]), "--json", str(out), "--iterations", "6",
                 "--adapters", "1", "--max-context", "16", "--repeats", "1"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["heldout_samples"] >= 1 and data["train_samples"] >= 1
    assert data["heldout_mape"] >= 0 and set(data["coefficients"]) == set(COEFFICIENT_NAMES)
    model = LatencyModel.from_dict(data)
    assert all(v >= 0 for v in model.coefficients.values())
    assert model.fingerprint.dtype == "float32"


def test_profile_cli_profiles_with_the_threads_asked(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """In a fresh interpreter: torch's thread count is process-wide (and vLLM, loaded by other tests in this
    one, pins it)."""
    out = tmp_path / "p.json"
    for threads in (1, 2):
        run = subprocess.run([sys.executable, "-m", "coserve.cli", "profile", "--model", str(model_dirs["llama"]),
                              "--json", str(out), "--iterations", "4", "--adapters", "0", "--max-context", "16",
                              "--repeats", "1", "--threads", str(threads)],
                             capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == 0, run.stderr[-2000:]
        assert f"with {threads} torch thread(s); wrote {out}" in run.stdout, run.stdout
        assert LatencyModel.from_dict(json.loads(out.read_text())).fingerprint.dtype == "float32"


def test_profile_cli_rejects_bad_arguments(tmp_path: Path) -> None:
    assert main(["profile", "--model", str(tmp_path), "--json", str(tmp_path / "x.json"),
                 "--iterations", "2"]) == 2
    assert main(["profile", "--model", str(tmp_path), "--json", str(tmp_path / "x.json"),
                 "--threads", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["profile", "--json", "x.json"])


def test_designed_plans_yield_the_queued_plan_once_then_empty_ones() -> None:
    plans = DesignedPlans()
    first = plans.new()
    first.freed.append("x")
    assert not plans.has_work()
    plans.queue(first)
    assert plans.has_work() and plans.plan() is first and not plans.has_work()
    empty = plans.plan()
    assert empty.is_empty and empty.step_id > first.step_id
    assert plans.update(first, IterationResult(step_id=first.step_id)) == []
