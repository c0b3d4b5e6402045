"""Fine-tuning's minimum share of the engine's time (`liveness.FinetuneFloor`, `share_account.ShareAccount`):
under an SLO the machine can just meet, beside three chatting clients, a job finishes within 1.5 /
`finetune_min_share` times its time alone, in simulated time (the latency model is the truth)."""

from __future__ import annotations

import pytest

from coserve.contract.plan import IterationPlan
from coserve.inference.request import Request
from coserve.planner.latency import LatencyModel, plan_features
from coserve.planner.policy import CoServingPolicy
from coserve.planner.settings import CoServingConfig
from coserve.planner.share_account import PlannedSplit, ShareAccount
from coserving_sim import FP, FakeClock, execute, make_job, make_policy, make_request

# A CPU-like engine: an iteration's fixed cost, decodes, prefill tokens, and fine-tuning pieces with a
# fixed cost each (a forward window, or a backward tasklet over one layer).
TRUTH = {"constant": 8e-3, "decode_tokens": 2e-3, "prefill_tokens": 3e-4, "ft_forward_tokens": 3e-4,
         "ft_backward_token_layers": 2e-5, "ft_pieces": 2e-3}
DECODE_ITERATION_S = 8e-3 + 3 * 2e-3  # three chatting clients' decodes
SHARE = 0.05


def test_the_account_owes_what_brings_fine_tuning_to_its_share() -> None:
    account = ShareAccount(0.05, 1.0)
    assert account.owed_s(0.010) == pytest.approx(0.05 * 0.010 / 0.95)  # nothing yet: this iteration's
    account.planned(0, PlannedSplit(0.020, 0.0, 0.0))
    account.observe(0, measured_s=0.040)  # inference alone, twice as slow as predicted
    assert account.debt_s == pytest.approx(0.05 * 0.040) and account.inference_scale == pytest.approx(1.2)
    account.planned(1, PlannedSplit(0.030, 0.5, 0.2))
    account.observe(1, measured_s=0.0)  # not measured: the prediction counts, the scales stay
    assert account.debt_s == pytest.approx(0.002 + 0.05 * 0.030 - 0.015)  # a piece bigger than the debt
    assert account.owed_s(0.0) < 0 and account.finetune_scale == 1.0
    for step in range(2, 200):  # a long stretch of inference: the debt stops at one window's share
        account.planned(step, PlannedSplit(0.040, 0.0, 0.0))
        account.observe(step, measured_s=0.040)
    assert account.debt_s == pytest.approx(0.05 * 1.0)
    for step in (200, 201):  # whole idle iterations of fine-tuning: the surplus stops at the last one
        account.planned(step, PlannedSplit(2.0, 1.0, 1.0))
        account.observe(step, measured_s=2.0)
    assert account.debt_s == pytest.approx(-2.0)
    account.observe(7, measured_s=1.0)  # never planned (another policy's): ignored
    scales = (account.finetune_scale, account.inference_scale)
    account.clear()  # no runnable job: the account starts over, what was learnt of the prices stays
    assert account.debt_s == 0.0 and (account.finetune_scale, account.inference_scale) == scales
    with pytest.raises(ValueError):
        ShareAccount(0.05, 0.0)


def test_measured_fine_tuning_time_corrects_a_model_that_underprices_it() -> None:
    account = ShareAccount(0.05, 1.0)
    for step in range(20):  # pieces the model prices at 1 ms take 10 ms: backward measured at 10 ms
        account.planned(step, PlannedSplit(0.051, 1 / 51, 0.0))
        account.observe(step, measured_s=0.060, backward_s=0.010)
    assert account.finetune_scale == pytest.approx(10.0, rel=0.05)
    assert account.inference_scale == pytest.approx(1.0, rel=0.05)


def test_fine_tuning_time_is_the_measured_backward_and_the_windows_part_of_the_forward() -> None:
    """The engine clocks what runs after the fused forward (backward tasklets, steps, saves); the model
    only divides the forward between inference and the forward windows."""
    split = PlannedSplit(0.050, 0.5, 0.2)
    assert split.finetune_s(0.100, 0.030) == pytest.approx(0.030 + 0.070 * 0.2)
    assert split.finetune_s(0.100, 0.0) == pytest.approx(0.050)  # no split said: the model's half
    assert PlannedSplit(0.050, 0.0, 0.0).finetune_s(0.100, 0.001) == 0.0  # no fine-tuning planned


def test_the_share_is_a_fraction_in_the_config() -> None:
    config = make_policy().config
    assert config.finetune_min_share == 0.05
    for bad in (0.0, 1.0, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match="finetune_min_share must be a fraction in"):
            CoServingConfig(scheduler=config.scheduler, finetune_min_share=bad)


def _chat(client: int, k: int, now: float) -> Request:
    return make_request(f"c{client}-{k}", f"chat{client}", prompt_len=20, max_tokens=32, arrival=now)


def _run(clients: int, tpot_slo_ms: float, *, lengths: tuple[int, ...] = (64,) * 8
         ) -> tuple[float, float, list[IterationPlan], CoServingPolicy]:
    """A job of 30 layers (batches of 8 sequences, 2 epochs) from the first plan to its success, with
    `clients` clients chatting the whole time (each sends its next request when the last one ends).
    Returns the job's simulated seconds, fine-tuning's share of that time (truth), the plans, the policy."""
    clock, truth = FakeClock(), LatencyModel(FP, TRUTH)
    policy = make_policy(tpot_slo_ms=tpot_slo_ms, coefficients=TRUTH, clock=clock, num_blocks=2048,
                         scheduler={"max_num_seqs": 3, "max_batch_tokens": 256, "max_model_len": 256})
    sent = [0] * clients
    for client in range(clients):
        policy.add_request(_chat(client, 0, clock.now))
    job = make_job(policy, "j", "ft", lengths=lengths, n_epochs=2, num_layers=30)
    policy.jobs.add(job)
    plans, total, finetune = [], 0.0, 0.0
    while not job.state.is_finished:
        plan = policy.plan()
        features = plan_features(plan, {c.request_id: -1 for c in plan.chunks})
        took = truth.predict(features)
        total, finetune = total + took, finetune + took - truth.predict(features.with_finetune(0, 0, 0))
        clock.now += took
        for request in policy.update(plan, execute(plan, took)):
            if request.is_finished:
                client = int(request.tenant.removeprefix("chat"))
                sent[client] += 1
                policy.add_request(_chat(client, sent[client], clock.now))
        plans.append(plan)
        assert len(plans) < 50_000, "the job did not finish"
    assert job.state.value == "succeeded"
    return clock.now, finetune / total, plans, policy


def test_under_an_slo_just_above_one_decode_iteration_a_job_meets_the_share_bound() -> None:
    """Three clients chat the whole time and the TPOT SLO is just above their decode iteration: the hybrid
    share leaves fine-tuning no room (one piece's fixed cost does not fit), so the job trains on its
    minimum share alone. It finishes within 1.5 / share times its time alone on an idle engine, with
    inference keeping its whole batch throughout; fine-tuning takes about its share of the time, not
    much more (what inference pays for it)."""
    alone_s, _, _, _ = _run(0, tpot_slo_ms=DECODE_ITERATION_S * 1000 * 1.05)
    flood_s, share, plans, policy = _run(3, tpot_slo_ms=DECODE_ITERATION_S * 1000 * 1.05)
    assert flood_s <= 1.5 * alone_s / SHARE, (flood_s, alone_s)
    assert SHARE * 0.95 <= share <= SHARE * 1.3, share
    decodes = [plan for plan in plans if len(plan.chunks) == 3 and not plan.new_sequences]
    assert decodes and all(len(plan.chunks) == 3 for plan in decodes)
    # The hybrid share gave nothing: every piece in a decode iteration was the floor's.
    hybrid_only = [p for p in decodes if p.training.forward_windows or p.training.backward_tasklets]
    assert len(hybrid_only) < len(decodes) / 2
    assert policy.slo_warning is None  # the SLO can be met: inference alone fits it


def test_a_long_sequence_job_finishes_beside_the_chat_too() -> None:
    """One sequence of 240 tokens a batch: its backward is 7200 token-layers, paid in pieces sized to the
    debt, not 16 token-layers at a time."""
    alone_s, _, _, _ = _run(0, tpot_slo_ms=DECODE_ITERATION_S * 1000 * 1.05, lengths=(240,))
    flood_s, share, _, _ = _run(3, tpot_slo_ms=DECODE_ITERATION_S * 1000 * 1.05, lengths=(240,))
    assert flood_s <= 1.5 * alone_s / SHARE, (flood_s, alone_s)
    assert share >= SHARE * 0.95
