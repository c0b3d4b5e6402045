"""Liveness: every runnable fine-tuning job makes progress under any SLO and load, or says why not."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from coserve.contract.plan import IterationPlan
from coserve.planner.latency import LatencyModel, plan_features
from coserve.planner.policy import CoServingPolicy
from coserve.planner.sample_guard import SampleGuard
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


def _finetune_share(policy: CoServingPolicy, plans: list[IterationPlan]) -> float:
    """Fine-tuning's part of the plans' time by the policy's own model (`step` measures nothing, so the
    policy's account counts the same predictions)."""
    total = finetune = 0.0
    for plan in plans:
        features = plan_features(plan, {c.request_id: -1 for c in plan.chunks})
        inference = policy.latency.predict(features.with_finetune(0, 0, 0))
        total += policy.latency.predict(features)
        finetune += policy.latency.predict(features) - inference
    return finetune / total


def test_the_floor_moves_a_job_that_the_slo_would_hold_back_forever() -> None:
    # 8 decodes take 8 ms, the SLO is 8 ms: the latency allowance is 0 in every iteration.
    policy = make_policy(tpot_slo_ms=8.0, num_blocks=512, scheduler={"max_num_seqs": 8})
    for i in range(8):
        policy.add_request(make_request(f"r{i}", "bob", prompt_len=1, max_tokens=200))
    step(policy)
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,)))
    plans = []
    for _ in range(60):
        plan, _ = step(policy)
        plans.append(plan)
        if not _work(plan):
            assert policy.jobs.finetune_held_back is not None
            assert "predicted iteration 8 ms > the 8 ms" in policy.jobs.finetune_held_back
        assert len(plan.chunks) == 8  # inference keeps its whole batch beside the floor
    worked = [k for k, plan in enumerate(plans) if _work(plan)]
    # A piece when the debt is worth one (16 tokens, 1.6 ms, owed at 0.05 x 8 ms / 0.95 per plan).
    assert worked[0] == 3 and all(b - a == 4 for a, b in zip(worked, worked[1:]))
    assert _finetune_share(policy, plans[4:]) >= policy.config.finetune_min_share


def test_the_floor_reaches_a_job_while_requests_wait_and_says_why_it_waited() -> None:
    clock = FakeClock(now=2.49)  # the waiting requests are 10 ms from the TTFT guard (2.5 s)
    policy = make_policy(num_blocks=512, clock=clock, scheduler={"max_num_seqs": 1})
    for i in range(6):
        policy.add_request(make_request(f"r{i}", "bob", max_tokens=30))
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,)))
    plans, reasons = [], set()
    for _ in range(120):  # one decode a plan (1 ms): a 16-token piece (1.6 ms) is owed every ~30 plans
        plan, _ = step(policy)
        plans.append(plan)
        reasons.add(policy.jobs.finetune_held_back)
        assert policy.num_waiting  # the queue never drains: the share gives fine-tuning nothing
    assert sum(1 for plan in plans if _work(plan)) >= 3
    assert _finetune_share(policy, plans) >= policy.config.finetune_min_share * 0.9
    assert any(r.startswith("held back: 5 inference request(s) wait for admission") for r in reasons if r), reasons


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
           seed: int, seconds: float = 6.0) -> tuple[dict[str, list[float]], list[tuple[float, float, float, float]]]:
    """Three jobs (tenants a, b, b) beside random requests, for `seconds` of simulated time (the truth
    model's); returns the times at which each job got a piece of work, and per iteration its end, its
    time, and fine-tuning's part of it by the truth model and as the policy's model split it."""
    rng = random.Random(seed)
    clock = FakeClock()
    policy = make_policy(tpot_slo_ms=tpot_slo_ms, clock=clock, num_blocks=4096,
                         scheduler={"max_batch_tokens": max(max_batch_tokens, max_num_seqs),
                                    "max_num_seqs": max_num_seqs, "max_model_len": 64})
    policy._latency.model = LatencyModel(FP, {k: poison * v for k, v in COEFFICIENTS.items()})  # noqa: SLF001
    truth = LatencyModel(FP, COEFFICIENTS)
    jobs = [make_job(policy, f"j{k}", tenant, lengths=(40, 24), adapter_id=10 + k, n_epochs=1000)
            for k, tenant in enumerate(("a", "b", "b"))]
    for job in jobs:
        policy.jobs.add(job)
    worked: dict[str, list[float]] = {job.job_id: [] for job in jobs}
    times = []
    it = 0
    while clock.now < seconds:
        it += 1
        for _ in range(int(arrival_rate) + (rng.random() < arrival_rate % 1)):
            policy.add_request(make_request(f"r{it}-{rng.random()}", rng.choice("xyz"),
                                            prompt_len=rng.randint(1, 30), max_tokens=rng.randint(1, 30)))
        model = policy.latency
        plan = policy.plan()
        features = plan_features(plan, {c.request_id: -1 for c in plan.chunks})
        total, inference = truth.predict(features), truth.predict(features.with_finetune(0, 0, 0))
        seen = model.predict(features)
        times.append((clock.now + total, total, total - inference,
                      total * (1 - model.predict(features.with_finetune(0, 0, 0)) / seen) if seen > 0 else 0.0))
        clock.now += total
        policy.update(plan, execute(plan, total))
        training = plan.training
        for job_id in {p.sequence_id.split("/")[0] for p in [*training.forward_windows, *training.backward_tasklets]}:
            worked[job_id].append(clock.now)
    return worked, times


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(tpot_slo_ms=0.05, max_batch_tokens=16, max_num_seqs=16, arrival_rate=1.5, poison=50.0, seed=1)
@example(tpot_slo_ms=1.0, max_batch_tokens=64, max_num_seqs=8, arrival_rate=0.5, poison=1.0, seed=2)
@given(tpot_slo_ms=st.floats(0.05, 200.0), max_batch_tokens=st.integers(16, 256),
       max_num_seqs=st.integers(1, 16), arrival_rate=st.floats(0.0, 1.5),
       poison=st.sampled_from([0.02, 1.0, 50.0]), seed=st.integers(0, 1000))
def test_under_any_slo_and_load_fine_tuning_gets_its_share_and_every_job_moves(
        tpot_slo_ms: float, max_batch_tokens: int, max_num_seqs: int, arrival_rate: float, poison: float,
        seed: int) -> None:
    worked, times = _drive(tpot_slo_ms, max_batch_tokens, max_num_seqs, arrival_rate, poison, seed)
    end = times[-1][0]
    for job_id, moments in worked.items():
        gaps = [b - a for a, b in zip([0.0, *moments], [*moments, end])]
        # The floor serves the longest-waiting job, at least once per window (1 s) and longest iteration.
        assert max(gaps) <= 3 * (1.0 + max(t for _, t, _, _ in times)), (job_id, max(gaps))
    if poison != 1.0:
        # The share is kept as the model splits each measured iteration: a model that prices fine-tuning
        # 50x too high relative to inference (its fit learns it back slowly) shorts it in truth, one that
        # prices it at ~0 gives capped pieces it counts as free (and far more than the share in truth).
        return
    # After the first window fine-tuning has its minimum share of the engine's time, in truth and as the
    # policy's model splits each measured iteration.
    later = [row for row in times if row[0] >= 2.0]
    total = sum(row[1] for row in later)
    assert sum(row[2] for row in later) / total >= 0.9 * 0.05
    assert sum(row[3] for row in later) / total >= 0.9 * 0.05


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
