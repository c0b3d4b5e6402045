"""The SLO rule, the measured decode step and the latency fit's split."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from coserve.bench.calibration import calibrate_slo, decode_step_s, fit_latency_model, measure_decode_step_s
from coserve.planner.latency import LatencyModel, ModelFingerprint
from coserve.planner.latency_features import PlanFeatures

FP = ModelFingerprint("m", "here", "float32")


def test_slo_is_three_decode_steps_at_batch_8_and_ttft_forty_tpots() -> None:
    slo = calibrate_slo(0.015)
    assert slo.tpot_s == pytest.approx(0.045) and slo.ttft_s == pytest.approx(40 * 0.045)
    with pytest.raises(ValueError, match="decode step must be positive"):
        calibrate_slo(0.0)


def test_model_decode_step_counts_only_decode_work() -> None:
    model = LatencyModel(FP, {"constant": 0.01, "decode_tokens": 0.001, "decode_context": 1e-6,
                              "num_sequences": 0.0005, "prefill_tokens": 1.0})
    step = 0.01 + 8 * 0.001 + 8 * 256 * 1e-6 + 8 * 0.0005  # prefill costs nothing in a decode step
    assert decode_step_s(model) == pytest.approx(step)


def test_measured_decode_step_times_batch_8_decodes_on_the_engine(llama_dir: Path) -> None:
    from coserve.contract.engine_config import EngineConfig
    from coserve.torch_engine.engine import TorchEngine

    engine = TorchEngine(EngineConfig(model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=256,
                                 block_size=16, max_loras=1, max_lora_rank=8, seed=0))
    timed: list[tuple[int, float]] = []
    step = engine.step

    def recording_step(plan):  # type: ignore[no-untyped-def]
        result = step(plan)
        if len(plan.chunks) == 8 and all(c.num_tokens == 1 for c in plan.chunks):
            timed.append((min(c.start for c in plan.chunks), result.timings.total_s))
        return result

    engine.step = recording_step  # type: ignore[method-assign]
    median = measure_decode_step_s(engine, context=200, steps=6, warmup=2)
    # 8 x 200 prompt tokens take 4 prefill iterations (512 tokens each); then 8 full decode batches.
    assert len(timed) == 8 and all(start >= 200 for start, _ in timed)
    assert median == pytest.approx(statistics.median([s for _, s in timed[2:]]))
    assert engine.num_sequences == 0  # every request ran to its end


def test_fit_recovers_a_linear_truth_and_reports_held_out_error() -> None:
    truth = LatencyModel(FP, {"constant": 0.004, "decode_tokens": 0.0008, "ft_forward_tokens": 0.0002})
    samples = [(f, truth.predict(f)) for f in
               (PlanFeatures(decode_tokens=d, num_sequences=d, ft_forward_tokens=w)
                for d in range(1, 9) for w in (0, 16, 64, 128))]
    fit = fit_latency_model(samples, FP)
    model = fit.model
    assert fit.heldout_mape < 1.0  # percent: an exact linear truth is fitted almost exactly
    assert fit.heldout_mean_ratio == pytest.approx(1.0, abs=0.01)
    assert fit.safety_margin == pytest.approx(0.1)  # no bias: the floor
    probe = PlanFeatures(decode_tokens=5, num_sequences=5, ft_forward_tokens=100)
    assert model.predict(probe) == pytest.approx(truth.predict(probe), rel=0.01)


def test_safety_margin_absorbs_the_mean_under_prediction() -> None:
    from coserve.bench.calibration import LatencyFit

    model = LatencyModel(FP, {"constant": 0.01})
    assert LatencyFit(model, 10.0, 1.25).safety_margin == pytest.approx(1 - 1 / (1.05 * 1.25))
    assert LatencyFit(model, 10.0, 0.8).safety_margin == 0.1  # over-prediction: the floor
    assert LatencyFit(model, 90.0, 3.0).safety_margin == 0.4  # the ceiling


def test_a_fit_far_off_its_held_out_iterations_warns_that_the_machine_moved() -> None:
    from coserve.bench.calibration import LatencyFit

    model = LatencyModel(FP, {"constant": 0.01})
    assert LatencyFit(model, 8.3, 1.01).warning is None  # a quiet machine's fit
    assert LatencyFit(model, 15.0, 0.8).warning is None  # at both limits
    disturbed = LatencyFit(model, 17.6, 1.49).warning  # a run beside a micro-benchmark
    assert disturbed is not None and "MAPE 18%" in disturbed and "1.49" in disturbed
    assert LatencyFit(model, 9.0, 1.3).warning is not None  # biased, however tight
    assert LatencyFit(model, 16.0, 1.0).warning is not None  # unbiased, but scattered


def test_fit_leaves_out_iterations_without_inference() -> None:
    """Fine-tuning alone (a backward-only iteration runs no forward pass) is never decided by the model:
    such samples must not pull the per-iteration constant that every co-served iteration pays."""
    truth = LatencyModel(FP, {"constant": 0.02, "decode_tokens": 0.001, "ft_forward_tokens": 0.0002})
    served = [(f, truth.predict(f)) for f in (PlanFeatures(decode_tokens=d, num_sequences=d, ft_forward_tokens=w)
                                              for d in range(1, 9) for w in (0, 16, 64))]
    alone = [(PlanFeatures(ft_backward_token_layers=b), 0.001) for b in (256, 1024, 4096) for _ in range(8)]
    fit = fit_latency_model(served + alone, FP)
    assert fit.model.coefficients["constant"] == pytest.approx(0.02, rel=0.01)
    with pytest.raises(ValueError, match="inference work"):
        fit_latency_model(alone, FP)
