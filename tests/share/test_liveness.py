"""Liveness: every runnable fine-tuning job makes progress under any SLO and load, or says why not."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coserve.contract.plan import IterationPlan
from coserve.share.latency import LatencyModel, plan_features
from coserve.share.policy import CoServingPolicy
from coserve.share.sample_guard import SampleGuard
from coserving_sim import (
    COEFFICIENTS,
    FP,
    FakeClock,
    execute,
    keep_busy,
    make_job,
    make_policy,
    make_request,
    step,
)


def _work(plan: IterationPlan) -> int:
    return plan.training.forward_tokens + plan.training.backward_token_layers


def _run_one(policy: CoServingPolicy, truth: LatencyModel, clock: FakeClock) -> IterationPlan:
    """Plan an iteration, 'execute' it in the time `truth` gives it, and report that to the policy."""
    plan = policy.plan()
    features = plan_features(plan, {c.request_id: -1 for c in plan.chunks})
    training = plan.training
    actual = truth.predict(features.with_finetune(training.forward_tokens, training.backward_token_layers,
                                                  len(training.forward_windows) + len(training.backward_tasklets)))
    clock.now += actual
    policy.update(plan, execute(plan, actual))
    return plan


def test_an_idle_engine_gives_fine_tuning_the_whole_budget_whatever_the_model_predicts() -> None:
    # The model says one forward token takes a second, and the SLO is 1 ms: nothing would fit.
    poisoned = {**COEFFICIENTS, "constant": 1.0, "ft_forward_tokens": 1.0}
    policy = make_policy(tpot_slo_ms=1.0, coefficients=poisoned, scheduler={"max_batch_tokens": 256})
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,), max_window_tokens=400))
    plan, _ = step(policy)
    assert plan.training.forward_tokens == 256  # the whole max_batch_tokens
    assert policy.jobs.finetune_held_back is None


def test_the_floor_moves_a_job_that_the_slo_would_hold_back_forever() -> None:
    # 8 decodes take 8 ms, the SLO is 8 ms: the latency allowance is 0 in every iteration.
    policy = make_policy(tpot_slo_ms=8.0, finetune_floor_every=4, scheduler={"max_num_seqs": 8})
    for i in range(8):
        policy.add_request(make_request(f"r{i}", "bob", prompt_len=1, max_tokens=60))
    step(policy)
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,)))
    work = []
    for _ in range(15):
        plan, _ = step(policy)
        work.append(_work(plan))
        if not work[-1]:
            assert policy.jobs.finetune_held_back is not None
            assert "predicted iteration 8 ms > the 8 ms" in policy.jobs.finetune_held_back
        assert len(plan.chunks) + bool(_work(plan)) >= 8  # inference keeps running beside the floor
    assert work == [0, 0, 0, 0, 16] * 3  # one 16-token piece after every 4 starved plans


def test_the_floor_reaches_a_job_while_requests_wait_and_says_why_it_waited() -> None:
    policy = make_policy(finetune_floor_every=3, scheduler={"max_num_seqs": 1})
    for i in range(6):
        policy.add_request(make_request(f"r{i}", "bob", max_tokens=30))
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,)))
    work, reasons = [], set()
    for _ in range(12):
        plan, _ = step(policy)
        work.append(_work(plan))
        reasons.add(policy.jobs.finetune_held_back)
    assert work.count(16) == 3 and sum(work) == 48
    assert "held back: 5 inference request(s) wait for admission" in reasons


def test_an_untrusted_model_gives_small_pieces_beside_inference_until_it_has_measured() -> None:
    policy = make_policy(coefficients={}, num_blocks=256, scheduler={"max_batch_tokens": 256})  # unfitted
    assert not policy.latency.trusted
    keep_busy(policy)
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,), max_window_tokens=400))
    sizes = []
    for _ in range(12):
        plan = policy.plan()
        sizes.append(plan.training.forward_tokens)
        features = plan_features(plan, {c.request_id: -1 for c in plan.chunks})
        truth = LatencyModel(FP, COEFFICIENTS).predict(features.with_finetune(
            plan.training.forward_tokens, 0, len(plan.training.forward_windows)))
        policy.update(plan, execute(plan, truth))
    warmup = policy.latency.guard.warmup_samples
    assert sizes[:warmup - 1] == [16] * (warmup - 1)  # the prefill's sample counts too
    assert policy.latency.trusted and max(sizes[warmup:]) > 16  # then it plans by the model


def test_the_guard_drops_an_isolated_outlier_and_bounds_a_persistent_shift() -> None:
    guard = SampleGuard(warmup_samples=0, outlier_ratio=4.0, max_consecutive_outliers=2, max_step=2.0)
    assert guard.admit(0.01, 0.5) is None and guard.admit(0.01, 0.5) is None  # a hiccup: dropped
    assert guard.admit(0.01, 0.5) == 0.02  # the third in a row is real: taken, clipped to 2x
    assert guard.admit(0.01, 0.011) == 0.011  # ordinary samples pass unchanged
    assert guard.admit(0.01, 0.001) == 0.005  # a much faster one pulls down by at most 2x


def test_a_poisoned_latency_model_recovers_from_what_it_measures() -> None:
    """The model thinks every iteration takes 50x what it does (one slow first call, say): under load
    only the floor trains at first, and its measurements bring the model back to filling the SLO."""
    truth = LatencyModel(FP, COEFFICIENTS)
    poisoned = LatencyModel(FP, {k: 50 * v for k, v in COEFFICIENTS.items()})
    clock = FakeClock()
    policy = make_policy(tpot_slo_ms=20.0, clock=clock, num_blocks=1024, scheduler={"max_batch_tokens": 256,
                                                                   "max_model_len": 512})
    policy._latency.model = poisoned  # noqa: SLF001 - the policy's own model, poisoned in place
    keep_busy(policy, max_tokens=400)
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(2000,) * 4, max_window_tokens=400,
                                 n_epochs=50))
    sizes = []
    for _ in range(300):
        sizes.append(_work(_run_one(policy, truth, clock)))
    assert sizes[0] == 0  # poisoned: nothing fits at first
    late = sizes[-50:]
    assert min(late) > 0 and sum(late) / len(late) > 100  # back to filling iterations


def _drive(tpot_slo_ms: float, max_batch_tokens: int, max_num_seqs: int, arrival_rate: float, poison: float,
           seed: int, iterations: int = 200) -> dict[str, list[int]]:
    """Three jobs (tenants a, b, b) beside random requests; returns the iterations in which each job
    got a piece of work."""
    rng = random.Random(seed)
    clock = FakeClock()
    policy = make_policy(tpot_slo_ms=tpot_slo_ms, clock=clock, num_blocks=4096, finetune_floor_every=8,
                         scheduler={"max_batch_tokens": max(max_batch_tokens, max_num_seqs),
                                    "max_num_seqs": max_num_seqs, "max_model_len": 64})
    policy._latency.model = LatencyModel(FP, {k: poison * v for k, v in COEFFICIENTS.items()})  # noqa: SLF001
    truth = LatencyModel(FP, COEFFICIENTS)
    jobs = [make_job(policy, f"j{k}", tenant, lengths=(40, 24), adapter_id=10 + k, n_epochs=100)
            for k, tenant in enumerate(("a", "b", "b"))]
    for job in jobs:
        policy.jobs.add(job)
    worked: dict[str, list[int]] = {job.job_id: [] for job in jobs}
    for it in range(1, iterations + 1):
        for _ in range(int(arrival_rate) + (rng.random() < arrival_rate % 1)):
            policy.add_request(make_request(f"r{it}-{rng.random()}", rng.choice("xyz"),
                                            prompt_len=rng.randint(1, 30), max_tokens=rng.randint(1, 30)))
        plan = _run_one(policy, truth, clock)
        training = plan.training
        for job_id in {p.sequence_id.split("/")[0] for p in [*training.forward_windows, *training.backward_tasklets]}:
            worked[job_id].append(it)
    return worked


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tpot_slo_ms=st.floats(0.05, 200.0), max_batch_tokens=st.integers(16, 256),
       max_num_seqs=st.integers(1, 16), arrival_rate=st.floats(0.0, 1.5),
       poison=st.sampled_from([0.02, 1.0, 50.0]), seed=st.integers(0, 1000))
def test_under_any_slo_and_load_every_job_keeps_making_progress(
        tpot_slo_ms: float, max_batch_tokens: int, max_num_seqs: int, arrival_rate: float, poison: float,
        seed: int) -> None:
    worked = _drive(tpot_slo_ms, max_batch_tokens, max_num_seqs, arrival_rate, poison, seed)
    for job_id, its in worked.items():
        gaps = [b - a for a, b in zip([0, *its], [*its, 201])]
        # The floor serves the longest-waiting job: three jobs each move once every 3 * (8 + 1).
        assert max(gaps) <= 3 * (8 + 1), (job_id, its)


def test_the_slo_warning_waits_for_measured_decodes_and_then_names_the_flag() -> None:
    policy = make_policy(coefficients={}, num_blocks=256, tpot_slo_ms=20.0, scheduler={"max_model_len": 256})
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(200,), n_epochs=50))
    for _ in range(20):  # an idle engine's fine-tuning iterations, 150 ms each: no decode measured
        plan = policy.plan()
        policy.update(plan, execute(plan, 0.150))
    assert policy.latency.trusted and policy.slo_warning is None
    keep_busy(policy)
    for _ in range(8):  # decodes that take 30 ms each, beside small fine-tuning pieces: over the SLO
        plan = policy.plan()
        policy.update(plan, execute(plan, 0.030))
    assert policy.slo_warning is not None and "raise --tpot-slo-ms" in policy.slo_warning
