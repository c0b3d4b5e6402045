"""The latency model: plan features, NNLS fit, held-out MAPE, RLS drift, JSON, fingerprints, budgets."""

from __future__ import annotations

import json
import math
import platform
import random
import subprocess
import sys

import numpy as np
import pytest

from coserve.contract.plan import AdapterLoad, IterationPlan, NewSequence, ScheduledChunk
from coserve.contract.sampling import SamplingParams
from coserve.contract.training_plan import BackwardTasklet, ForwardWindow, TrainingWork
from coserve.planner.latency import (
    COEFFICIENT_NAMES,
    LatencyModel,
    ModelFingerprint,
    PlanFeatures,
    machine_id,
    model_id_from_config,
    plan_features,
)
from coserve.planner.nonnegative import nnls, nonnegative_quadratic

FP = ModelFingerprint(model_id="abc123", machine="Linux-x86_64 | test-cpu x2 | cpu", dtype="float32")
# Plausible CPU costs (seconds per unit); the fine-tuning features stay 0 in these samples.
TRUE = {
    "constant": 2e-3, "prefill_tokens": 4e-5, "decode_tokens": 3e-4, "prefill_attention": 2e-8,
    "decode_context": 5e-7, "distinct_adapters": 1e-3, "num_sequences": 5e-5,
}


def _chunk(request_id: str, start: int, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(request_id, start, num_tokens, block_table=[0], sample=False)


def _random_features(rng: random.Random) -> PlanFeatures:
    """A mixed batch like a designed sweep's: decodes at one shared context length (so context and count
    vary independently), 0-8 prefill chunks at random offsets (so sequences and decodes do too)."""
    decodes = rng.randint(0, 64)
    chunks = [(rng.randint(0, 1024), rng.randint(16, 256)) for _ in range(rng.randint(0, 8))]
    if decodes + len(chunks) == 0:
        decodes = 1
    seqs = decodes + len(chunks)
    return PlanFeatures(
        prefill_tokens=sum(n for _, n in chunks),
        decode_tokens=decodes,
        prefill_attention=sum(n * s + n * (n + 1) // 2 for s, n in chunks),
        decode_context=decodes * rng.randint(1, 2048),
        distinct_adapters=rng.randint(0, min(4, seqs)),
        num_sequences=seqs,
    )


def _samples(coefs: dict[str, float], count: int, seed: int, noise: float = 0.01):
    """(features, measured) with multiplicative Gaussian noise around the true linear cost."""
    rng = random.Random(seed)
    truth = LatencyModel(FP, coefs)
    out = []
    for _ in range(count):
        features = _random_features(rng)
        out.append((features, truth.predict(features) * (1.0 + rng.gauss(0.0, noise))))
    return out


# --- features ---------------------------------------------------------------------------------------

def test_plan_features_counts_each_kind_of_work() -> None:
    plan = IterationPlan(
        step_id=1,
        new_sequences=[NewSequence("a", list(range(4)), SamplingParams(), adapter_slot=2)],
        chunks=[_chunk("a", 0, 4), _chunk("b", 9, 1), _chunk("c", 19, 1), _chunk("d", 4, 3)],
        adapter_loads=[AdapterLoad(slot=5, adapter_id=7, path="/x")],
        training=TrainingWork(
            forward_windows=[ForwardWindow("j/s0", 4, 3, [0, 1])],
            backward_tasklets=[BackwardTasklet("j/s1", 2, 4, 8, 13), BackwardTasklet("j/s1", 0, 1, 0, 3)],
        ),
    )
    # "a" in the map says 7, but the slot sent in this plan wins; "c" runs the base model (not counted).
    features = plan_features(plan, {"a": 7, "b": 2, "c": -1, "d": 5})
    pairs = sum(s + i + 1 for s, n in ((0, 4), (4, 3)) for i in range(n))  # causal pairs, by brute force
    assert features == PlanFeatures(
        prefill_tokens=7, decode_tokens=2, prefill_attention=pairs, decode_context=10 + 20,
        ft_forward_tokens=3, ft_backward_token_layers=5 * 2 + 3 * 1, distinct_adapters=2,
        num_sequences=4, adapter_loads=1, prefill_chunks=2, ft_pieces=3,
    )
    assert pairs == 28


def test_plan_features_refuses_unknown_adapter_slots_and_bad_chunks() -> None:
    plan = IterationPlan(step_id=1, chunks=[_chunk("ghost", 5, 1)])
    with pytest.raises(ValueError, match="ghost.*adapter_slots"):
        plan_features(plan)
    with pytest.raises(ValueError, match="num_tokens >= 1"):
        plan_features(IterationPlan(step_id=1, chunks=[_chunk("x", 0, 0)]), {"x": -1})
    assert plan_features(IterationPlan(step_id=2)) == PlanFeatures()


def test_fit_recovers_known_coefficients_and_heldout_mape_is_small() -> None:
    model = LatencyModel(FP)
    model.fit(_samples(TRUE, 400, seed=1))
    fitted = model.coefficients
    for name, value in TRUE.items():
        # 1% noise on 400 samples: a coefficient's standard error is ~1% / sqrt(400 / features) ~ 0.2%, and
        # correlated features (shared by every iteration) widen it; 10% is many standard errors
        assert fitted[name] == pytest.approx(value, rel=0.1), name
    for name in ("ft_forward_tokens", "ft_backward_token_layers", "adapter_loads"):
        assert fitted[name] == 0.0  # never exercised: no made-up cost
    assert model.heldout_mape(_samples(TRUE, 200, seed=2)) < 2.0


def test_heldout_mape_is_the_mean_relative_error_in_percent() -> None:
    model = LatencyModel(FP, {"constant": 1.0})
    samples = [(PlanFeatures(), 1.25), (PlanFeatures(), 0.8), (PlanFeatures(), 1.0)]
    # |1 - 1.25| / 1.25 = 0.2, |1 - 0.8| / 0.8 = 0.25, 0 -> mean 0.15
    assert model.heldout_mape(samples) == pytest.approx(15.0)


def test_nnls_meets_the_optimality_conditions_where_plain_least_squares_goes_negative() -> None:
    rng = np.random.default_rng(3)
    base = rng.uniform(0.0, 1.0, size=(60, 1))
    a = np.hstack([base, base + rng.normal(0.0, 0.1, size=(60, 1)), rng.uniform(0.0, 1.0, size=(60, 2))])
    b = a @ np.array([1.0, -0.3, 0.5, 0.2]) + rng.normal(0.0, 0.05, size=60)
    assert np.linalg.lstsq(a, b, rcond=None)[0].min() < 0  # the case worth testing
    x = nnls(a, b)
    gradient = a.T @ (b - a @ x)  # KKT: zero where x > 0, <= 0 where x == 0
    assert x.min() >= 0.0
    assert np.all(np.abs(gradient[x > 0]) < 1e-9)
    assert np.all(gradient[x == 0] < 1e-9)
    assert (x == 0).any()


def test_fit_keeps_coefficients_non_negative_on_correlated_noisy_features() -> None:
    # num_sequences is nearly decode_tokens here and costs nothing: OLS would trade them off freely.
    coefs = {**TRUE, "num_sequences": 0.0}
    samples = _samples(coefs, 150, seed=4, noise=0.05)
    model = LatencyModel(FP)
    model.fit(samples)
    assert min(model.coefficients.values()) >= 0.0
    assert model.heldout_mape(_samples(coefs, 200, seed=5, noise=0.05)) < 6.0


# --- online refinement ------------------------------------------------------------------------------

def test_rls_follows_a_step_change_faster_with_forgetting() -> None:
    drifted = {**TRUE, "constant": 3e-3, "decode_tokens": 6e-4}  # e.g. another process took a core
    before, after = _samples(TRUE, 300, seed=6), _samples(drifted, 150, seed=7)
    fresh = _samples(drifted, 200, seed=8)
    errors = {}
    for forgetting in (1.0, 0.95):
        model = LatencyModel(FP, forgetting=forgetting)
        model.fit(before)
        for features, measured in after:
            model.observe(features, measured)
        errors[forgetting] = model.heldout_mape(fresh)
    assert errors[0.95] < 3.0
    assert errors[1.0] > 3 * errors[0.95]


def test_rls_learns_from_scratch_and_never_winds_up() -> None:
    model = LatencyModel(FP, forgetting=0.5)  # extreme forgetting: 0.5**-2000 overflows without the cap
    features = PlanFeatures(decode_tokens=32, decode_context=32 * 500, num_sequences=32)
    truth = LatencyModel(FP, TRUE).predict(features)
    for _ in range(2000):
        model.observe(features, truth)
    assert all(math.isfinite(c) and c >= 0 for c in model.coefficients.values())
    assert model.predict(features) == pytest.approx(truth, rel=1e-3)  # noise-free: RLS converges to float64


def test_rls_stays_non_negative_when_a_cost_drifts_to_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    import coserve.planner.latency as latency

    calls = []
    monkeypatch.setattr(latency, "nonnegative_quadratic",
                        lambda s, r, p: calls.append(1) or nonnegative_quadratic(s, r, p))
    free_sequences = {**TRUE, "num_sequences": 0.0}
    model = LatencyModel(FP, forgetting=0.98)
    model.fit(_samples(TRUE, 200, seed=11))
    calls.clear()
    for features, measured in _samples(free_sequences, 300, seed=12, noise=0.05):
        model.observe(features, measured)
        assert min(model.coefficients.values()) >= 0.0
    assert calls  # the constrained solve did run: the unconstrained one went negative
    assert model.heldout_mape(_samples(free_sequences, 200, seed=13, noise=0.05)) < 6.0


def test_observe_returns_the_prediction_before_the_update() -> None:
    model = LatencyModel(FP, {"constant": 0.5})
    assert model.observe(PlanFeatures(decode_tokens=1), 1.0) == 0.5
    assert model.predict(PlanFeatures(decode_tokens=1)) > 0.5


# --- persistence and fingerprints -------------------------------------------------------------------

def test_json_round_trip_keeps_coefficients_scales_and_fingerprint() -> None:
    model = LatencyModel(FP, forgetting=0.98)
    model.fit(_samples(TRUE, 100, seed=9))
    data = json.loads(model.to_json())
    data["heldout_mape"] = 1.5  # the profiler adds its metrics next to the model
    loaded = LatencyModel.from_json(json.dumps(data))
    assert loaded.coefficients == model.coefficients
    assert loaded.fingerprint == FP and loaded.forgetting == 0.98
    assert loaded.to_dict() == model.to_dict()
    with pytest.raises(ValueError, match="format"):
        LatencyModel.from_dict({**data, "format": "other/9"})
    with pytest.raises(ValueError, match="malformed"):
        LatencyModel.from_dict({k: v for k, v in data.items() if k != "scales"})


def test_profile_from_another_machine_or_model_is_refused_with_a_clear_message() -> None:
    model = LatencyModel.from_json(LatencyModel(FP, TRUE).to_json())
    model.check_compatible(FP)  # same fingerprint: accepted
    other_machine = ModelFingerprint(FP.model_id, "Linux-aarch64 | other x64 | cuda:0", FP.dtype)
    with pytest.raises(ValueError, match=r"another model/machine \(differs in machine\).*other x64"):
        model.check_compatible(other_machine)
    with pytest.raises(ValueError, match=r"differs in model_id, dtype"):
        model.check_compatible(ModelFingerprint("zzz", FP.machine, "bfloat16"))


def test_fingerprint_helpers_are_stable_and_discriminating() -> None:
    config = {"hidden_size": 64, "num_hidden_layers": 2}
    assert model_id_from_config(config) == model_id_from_config(dict(reversed(config.items())))
    assert model_id_from_config(config) != model_id_from_config({**config, "hidden_size": 128})
    machine = machine_id("cuda:0 NVIDIA H100")
    assert platform.machine() in machine and machine.endswith("cuda:0 NVIDIA H100")
    assert machine != machine_id("cpu")


# --- budgets ----------------------------------------------------------------------------------------

def test_max_extra_tokens_exact_on_a_constructed_case() -> None:
    # Binary fractions: f(base) = 0.25 + 2 * 0.125 = 0.5; each token 0.0625; (1.0 - 0.5) / 0.0625 = 8.
    model = LatencyModel(FP, {"constant": 0.25, "decode_tokens": 0.125, "ft_forward_tokens": 0.0625})
    base, one = PlanFeatures(decode_tokens=2), PlanFeatures(ft_forward_tokens=1)
    assert model.max_extra_tokens(base, one, 1.0) == 8
    assert model.max_extra_tokens(base, one, 1.0, cap=5) == 5
    assert model.max_extra_tokens(PlanFeatures(decode_tokens=7), one, 1.0) == 0  # 1.125 > budget
    # Rounding: 0.7 * 3 == 2.0999999999999996 fits that budget exactly, yet the quotient is 2.99...96.
    rounding = LatencyModel(FP, {"ft_forward_tokens": 0.7})
    assert math.floor((0.7 * 3) / 0.7) == 2
    assert rounding.max_extra_tokens(PlanFeatures(), one, 0.7 * 3) == 3


def test_max_extra_tokens_matches_a_linear_scan() -> None:
    model = LatencyModel(FP, {**TRUE, "ft_forward_tokens": 3.7e-5, "ft_backward_token_layers": 1.3e-6})
    rng = random.Random(10)
    for _ in range(20):
        base = _random_features(rng)
        increment = rng.choice([PlanFeatures(ft_forward_tokens=1), PlanFeatures(ft_backward_token_layers=24)])
        budget = rng.uniform(0.005, 0.08)
        s = model.max_extra_tokens(base, increment, budget)
        expected = 0
        while model.predict(base + increment.scaled(expected + 1)) <= budget:
            expected += 1
        assert s == expected


def test_max_extra_tokens_rejects_bad_input() -> None:
    model = LatencyModel(FP, {"constant": 0.01})
    one = PlanFeatures(ft_forward_tokens=1)
    for budget in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="budget_s"):
            model.max_extra_tokens(PlanFeatures(), one, budget)
    with pytest.raises(ValueError, match="increment.decode_tokens"):
        model.max_extra_tokens(PlanFeatures(), PlanFeatures(decode_tokens=-1), 1.0)
    with pytest.raises(ValueError, match="pass cap"):  # fine-tuning cost still unknown (0)
        model.max_extra_tokens(PlanFeatures(), one, 1.0)
    assert model.max_extra_tokens(PlanFeatures(), one, 1.0, cap=64) == 64


# --- bad input --------------------------------------------------------------------------------------

def test_invalid_settings_and_samples_are_rejected_naming_the_setting() -> None:
    model = LatencyModel(FP)
    with pytest.raises(ValueError, match="samples must not be empty"):
        model.fit([])
    with pytest.raises(ValueError, match="samples must not be empty"):
        model.heldout_mape([])
    with pytest.raises(ValueError, match=r"samples\[1\].measured_s"):
        model.fit([(PlanFeatures(), 1.0), (PlanFeatures(), 0.0)])
    with pytest.raises(ValueError, match=r"samples\[0\].features.prefill_tokens"):
        model.fit([(PlanFeatures(prefill_tokens=-3), 1.0)])
    with pytest.raises(ValueError, match="measured_s"):
        model.observe(PlanFeatures(), -0.1)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="forgetting"):
            LatencyModel(FP, forgetting=bad)
    with pytest.raises(ValueError, match="prior_variance"):
        LatencyModel(FP, prior_variance=0)
    with pytest.raises(ValueError, match="unknown latency coefficients"):
        LatencyModel(FP, {"warp_speed": 1.0})
    with pytest.raises(ValueError, match="coefficient decode_tokens"):
        LatencyModel(FP, {"decode_tokens": -1e-3})
    assert COEFFICIENT_NAMES[0] == "constant"


def test_import_pulls_in_neither_torch_nor_ray() -> None:
    code = "import sys, coserve.planner.latency; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
