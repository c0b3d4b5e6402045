"""The SLO rule and the latency fit's split, on hand-made models and samples (no engine)."""

from __future__ import annotations

import pytest

from coserve.bench.calibration import calibrate_slo, decode_step_s, fit_latency_model
from coserve.policies.latency import LatencyModel, ModelFingerprint
from coserve.policies.latency_features import PlanFeatures

FP = ModelFingerprint("m", "here", "float32")


def test_slo_is_three_decode_steps_at_batch_8_and_ttft_forty_tpots() -> None:
    model = LatencyModel(FP, {"constant": 0.01, "decode_tokens": 0.001, "decode_context": 1e-6,
                              "num_sequences": 0.0005, "prefill_tokens": 1.0})
    step = 0.01 + 8 * 0.001 + 8 * 256 * 1e-6 + 8 * 0.0005  # prefill costs nothing in a decode step
    assert decode_step_s(model) == pytest.approx(step)
    slo = calibrate_slo(model)
    assert slo.tpot_s == pytest.approx(3 * step) and slo.ttft_s == pytest.approx(40 * 3 * step)


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
