"""KV reclaim and liveness: a fine-tuning sequence that inference keeps taking the KV blocks of is kept
after `MAX_DROPS` drops in a row (`finetune.sequence_kv`), so a long-sequence job finishes on a small cache
beside long prompts; and the watchdog's progress marker counts work that stays done, not restarts."""

from __future__ import annotations

import pytest

from coserve.contract.plan import IterationPlan
from coserve.finetune import sequence_kv
from coserve.finetune.job import CoservedJob
from coserve.planner.policy import CoServingPolicy
from coserving_sim import make_job, make_policy, make_request, step

PROMPT = 100  # tokens: 25 blocks of 4


def _small_cache() -> CoServingPolicy:
    """48 blocks of 4 tokens: a 120-token training sequence (30 blocks) and one 100-token prompt (25) do
    not fit together."""
    return make_policy(num_blocks=48, scheduler={"max_model_len": 128, "max_num_seqs": 4, "max_batch_tokens": 64})


def _chat_beside(policy: CoServingPolicy, job: CoservedJob, plans: int) -> tuple[int, int, int]:
    """Two clients send 100-token prompts the whole time (the next when the last ends) while the job
    trains, for at most `plans` plans. Returns (plans run, training sequences dropped, chats done)."""
    sent = [0, 0]
    for client in range(2):
        policy.add_request(make_request(f"c{client}-0", f"chat{client}", prompt_len=PROMPT, max_tokens=8))
    drops = done = 0
    for it in range(1, plans + 1):
        plan, touched = step(policy)
        drops += len(plan.training.sequence_drops)
        for request in touched:
            if request.is_finished:
                client = int(request.tenant.removeprefix("chat"))
                sent[client] += 1
                done += 1
                policy.add_request(make_request(f"c{client}-{sent[client]}", request.tenant, prompt_len=PROMPT,
                                                max_tokens=8))
        if job.state.is_finished:
            return it, drops, done
    return plans, drops, done


def test_a_long_sequence_job_finishes_on_a_small_cache_beside_long_prompts() -> None:
    policy = _small_cache()
    job = make_job(policy, "j", "ft", lengths=(120,), n_epochs=3, num_layers=4)
    policy.jobs.add(job)
    plans, drops, done = _chat_beside(policy, job, plans=1000)
    assert job.state.value == "succeeded", (plans, drops, job.sequence_restarts)
    # Each of its three sequences was taken back MAX_DROPS times at most, then kept its blocks.
    assert drops <= 3 * sequence_kv.MAX_DROPS and 1 <= job.sequence_restarts.kept <= 3
    assert job.sequence_restarts.tokens == 120
    assert done >= 10  # the chat went on: between the kept sequences, and beside them once they hold


def test_without_the_hold_the_same_sequence_restarts_for_ever(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the hold prevents: every admission takes the sequence's blocks, and the job redoes it."""
    monkeypatch.setattr(sequence_kv, "MAX_DROPS", 10**9)
    policy = _small_cache()
    job = make_job(policy, "j", "ft", lengths=(120,), n_epochs=3, num_layers=4)
    policy.jobs.add(job)
    plans, drops, _ = _chat_beside(policy, job, plans=1000)
    assert not job.state.is_finished and drops > 50 and job.sequence_restarts.kept == 0


def test_a_kept_sequence_refuses_reclaim_and_admissions_leave_it_the_blocks_it_needs() -> None:
    policy = make_policy(num_blocks=64, scheduler={"max_model_len": 128})
    job = make_job(policy, "j", "ft", lengths=(120,), num_layers=2, max_window_tokens=8)
    plan = IterationPlan(step_id=100)
    for drop in range(sequence_kv.MAX_DROPS):
        assert job.kv_reserve == 0
        job.schedule(IterationPlan(step_id=drop), 8, 0)  # a window: 2 blocks
        assert job.release_kv(plan) == 2
    assert job.sequence_restarts.kept == 1
    assert job.kv_reserve == 30  # its whole sequence, 120 tokens
    job.schedule(IterationPlan(step_id=101), 8, 0)  # its next window takes every block at once
    assert job.kv_reserve == 0 and policy.jobs.kv.num_free_blocks == 64 - 30
    assert job.release_kv(IterationPlan(step_id=102)) == 0  # kept: inference preempts its own instead


def test_the_progress_marker_counts_work_that_stays_done_not_restarts() -> None:
    policy = make_policy(num_blocks=64, scheduler={"max_model_len": 128})
    job = make_job(policy, "j", "ft", lengths=(40,), num_layers=2, max_window_tokens=16)
    job.schedule(IterationPlan(step_id=0), 16, 0)
    first = job.progress_marker
    assert first == 16 * 2  # 16 tokens through both layers
    assert job.release_kv(IterationPlan(step_id=1)) > 0
    job.schedule(IterationPlan(step_id=2), 16, 0)  # the same window again: no progress
    assert job.progress_marker == first
    job.schedule(IterationPlan(step_id=3), 16, 0)  # past where it had been
    assert job.progress_marker == 32 * 2
