"""The liveness floor grows for a job the SLO holds back, only while the SLO is lost anyway, within a cost
bound; so a job under an SLO the machine cannot meet finishes in bounded time (`liveness.py`)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coserve.contract.plan import IterationPlan
from coserve.share.latency import LatencyModel, plan_features
from coserve.share.liveness import GROWN_PIECE_COST
from coserve.share.policy import CoServingPolicy
from coserving_sim import COEFFICIENTS, FP, FakeClock, execute, keep_busy, make_job, make_policy, make_request, step

FLOOR = 16  # CoServingConfig.finetune_floor_tokens' default


def _work(plan: IterationPlan) -> int:
    return plan.training.forward_tokens + plan.training.backward_token_layers


def _decoders(policy: CoServingPolicy, n: int, max_tokens: int = 10_000) -> None:
    for i in range(n):
        policy.add_request(make_request(f"d{i}", "bob", prompt_len=1, max_tokens=max_tokens))
    step(policy)  # their prefills


def test_a_held_back_job_gets_doubling_pieces_up_to_the_inference_cost() -> None:
    # 8 decodes: 8 ms by the model, the SLO 4 ms: lost in every iteration, the share gives nothing.
    policy = make_policy(tpot_slo_ms=4.0, finetune_floor_every=4, num_blocks=512,
                         scheduler={"max_num_seqs": 8, "max_model_len": 1024})
    _decoders(policy, 8)
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(200,), num_layers=30, n_epochs=5))
    pieces = []
    for _ in range(60):
        plan, _ = step(policy)
        if _work(plan):
            pieces.append((plan.training.forward_tokens, plan.training.backward_token_layers))
        assert len(plan.chunks) == 8  # inference keeps its whole batch
    # Forward: 16, then 32 = half the 64-token budget (its cap) until the 200 tokens are done; then
    # backward, 16 x 2^7 by now, capped at the 800 token-layers that the model says cost as much as
    # the 8 decodes (8 ms at 0.01 ms each). Before the growth: 16 token-layers a piece.
    assert pieces == [(16, 0)] + [(32, 0)] * 5 + [(24, 0)] + [(0, 800)] * 5
    # Still one piece every 4 + 1 plans, and no more of the SLO's budget than its inference takes.
    assert len(pieces) == 12


def test_the_floor_does_not_grow_while_inference_alone_fits_the_slo() -> None:
    # 8 decodes take 8 ms, the SLO is 8 ms: inference alone fits, nothing else does.
    policy = make_policy(tpot_slo_ms=8.0, finetune_floor_every=2, num_blocks=512,
                         scheduler={"max_num_seqs": 8, "max_model_len": 1024})
    _decoders(policy, 8)
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(200,), num_layers=30, n_epochs=5))
    work = [_work(step(policy)[0]) for _ in range(30)]
    assert work == [0, 0, 16] * 10
    assert policy.floor.streak("j") == 10  # it waited as long: the SLO is what keeps the piece small


def test_work_from_the_share_ends_the_run() -> None:
    policy = make_policy(tpot_slo_ms=4.0, finetune_floor_every=1, num_blocks=512,
                         scheduler={"max_num_seqs": 8, "max_model_len": 1024})
    _decoders(policy, 8, max_tokens=7)  # they finish after 6 more iterations: then the engine is idle
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,), num_layers=30, n_epochs=5))
    for _ in range(6):
        step(policy)
    assert policy.floor.streak("j") == 3
    plan, _ = step(policy)  # idle: the share gives the whole budget
    assert policy.num_running == 0 and _work(plan) == 64
    step(policy)
    assert policy.floor.streak("j") == 0


def _plan_costs(policy: CoServingPolicy, plan: IterationPlan) -> tuple[float, float, float]:
    """(inference alone, the whole plan, the whole plan with its fine-tuning as one piece) as the
    policy's own model predicts them when it planned. A backward piece over several layers runs as one
    tasklet per layer, which the planner cannot see beforehand (`hybrid.py`'s docstring): the grown
    piece is sized as one piece, and the others each add the model's fixed cost of a piece."""
    whole = plan_features(plan, {c.request_id: -1 for c in plan.chunks})
    training = plan.training
    one_piece = whole.with_finetune(training.forward_tokens, training.backward_token_layers,
                                    min(1, len(training.forward_windows) + len(training.backward_tasklets)))
    return (policy.latency.predict(whole.with_finetune(0, 0, 0)), policy.latency.predict(whole),
            policy.latency.predict(one_piece))


def _drive(tpot_slo_ms: float, max_num_seqs: int, arrival_rate: float, poison: float, seed: int,
           iterations: int) -> tuple[CoServingPolicy, list[tuple[float, float, float, float, int]], dict[str, int]]:
    """One job of 30 layers beside a long request and random ones; per plan (inference alone and whole
    plan by the policy's model, the budget it plans with, fine-tuning work), and the iteration the job
    finished in."""
    rng = random.Random(seed)
    clock = FakeClock()
    policy = make_policy(tpot_slo_ms=tpot_slo_ms, clock=clock, num_blocks=4096, finetune_floor_every=8,
                         scheduler={"max_batch_tokens": 64, "max_num_seqs": max_num_seqs, "max_model_len": 2048})
    policy._latency.model = LatencyModel(FP, {k: poison * v for k, v in COEFFICIENTS.items()})  # noqa: SLF001
    truth = LatencyModel(FP, COEFFICIENTS)
    keep_busy(policy, max_tokens=10_000)
    job = make_job(policy, "j", "a", lengths=(40, 24), num_layers=30)
    policy.jobs.add(job)
    rows, finished = [], {}
    for it in range(1, iterations + 1):
        for _ in range(int(arrival_rate) + (rng.random() < arrival_rate % 1)):
            policy.add_request(make_request(f"r{it}-{rng.random()}", rng.choice("xyz"),
                                            prompt_len=rng.randint(1, 30), max_tokens=rng.randint(1, 30)))
        plan = policy.plan()
        inference_s, whole_s, one_piece_s = _plan_costs(policy, plan)
        # the budget the share plans with: the SLO's, corrected by the model's measured bias
        rows.append((inference_s, whole_s, one_piece_s, policy.config.iteration_budget_s / policy.overrun,
                     _work(plan)))
        actual = truth.predict(plan_features(plan, {c.request_id: -1 for c in plan.chunks}))
        clock.now += actual
        policy.update(plan, execute(plan, actual))
        if job.state.is_finished:
            finished["j"] = it
            break
    return policy, rows, finished


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tpot_slo_ms=st.floats(0.05, 100.0), max_num_seqs=st.integers(1, 16), arrival_rate=st.floats(0.0, 1.5),
       poison=st.sampled_from([0.02, 1.0, 50.0]), seed=st.integers(0, 1000))
def test_the_slo_is_honoured_whenever_inference_alone_can_meet_it_and_a_grown_piece_is_bounded(
        tpot_slo_ms: float, max_num_seqs: int, arrival_rate: float, poison: float, seed: int) -> None:
    _, rows, _ = _drive(tpot_slo_ms, max_num_seqs, arrival_rate, poison, seed, iterations=120)
    for inference_s, whole_s, one_piece_s, budget_s, work in rows:
        if work <= FLOOR:
            continue  # none, or the floor's own piece: a job always gets it, whatever it costs (liveness)
        # Fine-tuning work is sized as one piece per job (`_plan_costs`): `one_piece_s` is what it planned.
        if inference_s <= budget_s:
            # The SLO can hold: fine-tuning fills up to it.
            assert one_piece_s <= budget_s * (1 + 1e-9), (inference_s, whole_s, one_piece_s, budget_s, work)
        else:
            # The SLO is lost anyway: a grown piece costs at most GROWN_PIECE_COST x the inference's
            # own time.
            assert one_piece_s <= inference_s * (1 + GROWN_PIECE_COST) + 1e-12, \
                (inference_s, whole_s, one_piece_s, budget_s, work)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tpot_slo_ms=st.floats(0.01, 0.9), max_num_seqs=st.integers(1, 16), arrival_rate=st.floats(0.0, 1.5),
       seed=st.integers(0, 1000))
def test_a_job_under_an_slo_that_cannot_hold_finishes_in_bounded_time(
        tpot_slo_ms: float, max_num_seqs: int, arrival_rate: float, seed: int) -> None:
    """An SLO below one decode (1 ms): the share never gives anything while a request runs. The job's
    1920 token-layers of backward would take 120 floor pieces of 16 (it finished after 1134 plans
    without the growth); grown pieces reach the inference's own cost (>= 100 token-layers beside one
    decode, the least inference there is) after a few: 243 plans at worst."""
    policy, _, finished = _drive(tpot_slo_ms, max_num_seqs, arrival_rate, 1.0, seed, iterations=400)
    assert "j" in finished, policy.jobs.finetune_held_back
    assert finished["j"] <= 300
