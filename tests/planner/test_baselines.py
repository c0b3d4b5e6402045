"""The baselines on the same plan contract: temporal sharing, dynamic temporal sharing, static split."""

from __future__ import annotations

import pytest

from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.dynamic_temporal import DynamicInterval
from coserve.planner.latency import LatencyModel
from coserve.planner.policy import CoServingPolicy
from coserve.planner.settings import CoServingConfig
from coserve.planner.share_kinds import ShareKind
from coserve.planner.static_split import StaticSplitShare, split_kv
from coserve.planner.temporal import temporal_share
from coserving_sim import BS, COEFFICIENTS, FP, FakeClock, make_job, make_policy, make_request, step


def kinds(policy, steps: int) -> str:
    """'I' for an inference iteration, 'F' for a fine-tuning one, per step."""
    out = ""
    for _ in range(steps):
        plan, _ = step(policy)
        assert not (plan.chunks and plan.training.forward_windows + plan.training.backward_tasklets)
        out += "F" if plan.training.forward_windows or plan.training.backward_tasklets else "I"
    return out


# ------------------------------------------------------------------------- temporal sharing

def temporal(n: int, **kwargs) -> CoServingPolicy:
    config = CoServingConfig(scheduler=SchedulerConfig(max_model_len=64, block_size=BS, max_num_seqs=4,
                                                       max_batch_tokens=64), tpot_slo_ms=20.0, **kwargs)
    return CoServingPolicy(config, KVBlockManager(64, BS), AdapterSlots(4),
                           LatencyModel(FP, COEFFICIENTS), share=temporal_share(n), clock=FakeClock())


def test_temporal_sharing_runs_n_inference_iterations_per_fine_tuning_iteration() -> None:
    policy = temporal(2)
    policy.add_request(make_request("r", "a", max_tokens=40))
    policy.jobs.add(make_job(policy, "j", "t", lengths=(400,)))
    assert kinds(policy, 9) == "IIFIIFIIF"


def test_temporal_fine_tuning_iteration_ignores_the_slo_and_stalls_decodes() -> None:
    policy = temporal(1)
    policy.add_request(make_request("r", "a", max_tokens=40))
    policy.jobs.add(make_job(policy, "j", "t", lengths=(400,), max_window_tokens=400))
    step(policy)
    plan, _ = step(policy)
    # The whole token budget, 6.4 ms of forward tokens, and no decode for "r" in that iteration.
    assert plan.training.forward_tokens == 64 and not plan.chunks


def test_temporal_sharing_is_work_conserving_across_kinds() -> None:
    policy = temporal(3)
    policy.jobs.add(make_job(policy, "j", "t", lengths=(400,)))
    assert kinds(policy, 3) == "FFF"  # no inference work: fine-tuning every iteration
    idle = temporal(1)
    idle.add_request(make_request("r", "a", max_tokens=5))
    assert kinds(idle, 4) == "IIII"  # no job: inference every iteration


def test_temporal_sharing_rejects_a_zero_interval() -> None:
    with pytest.raises(ValueError, match="inference_iterations"):
        temporal(0)


# ----------------------------------------------------------------- dynamic temporal sharing

def test_dynamic_interval_follows_algorithm_3_when_idle() -> None:
    interval = DynamicInterval()
    switches = [i for i in range(1, 400) if interval.step(0, 0, 0, 0)]
    # 64 steps; then twice f_p * 1.1 = 70.4 (71 steps each); then the recomputed interval: no
    # pressure gives f = 64, hysteresis (64 + 2*64)/3 = 64, floored at 80.
    assert switches[:4] == [64, 64 + 71, 64 + 2 * 71, 64 + 2 * 71 + 80]


def test_dynamic_interval_grows_with_queue_pressure() -> None:
    interval = DynamicInterval(s=3.0, d=2)
    for _ in range(2):
        assert not interval.step(30, 8, 1, 0)
    assert interval.step(30, 8, 1, 0)
    # p = min(1, 30/20) + min(0.5, 30/25) + (1 - 0)/8 = 1.625; f = (64 + 0.6875*0.6*448)*1.35
    f = (64 + (1.625 - 0.8) / 1.2 * 0.6 * 448) * 1.35
    assert interval.s == pytest.approx((f + 2 * 64) / 3)
    assert interval.f_p == pytest.approx((f + 2 * 64) / 3) and interval.d == 0
    assert not interval.queue_lengths and interval.arrivals == 0  # stats reset at the switch


def test_dynamic_temporal_policy_switches_after_the_first_interval() -> None:
    policy = make_policy(ShareKind.DYNAMIC_TEMPORAL, scheduler={"max_num_seqs": 4, "max_model_len": 128})
    policy.add_request(make_request("r", "a", max_tokens=100))
    policy.jobs.add(make_job(policy, "j", "t", lengths=(200,)))
    pattern = kinds(policy, 66)
    assert pattern == "I" * 63 + "F" + "II"


# ----------------------------------------------------------------------------- static split

def static(fraction: float = 0.25, num_blocks: int = 32) -> CoServingPolicy:
    inference_kv, finetune_kv = split_kv(num_blocks, BS, fraction)
    config = CoServingConfig(scheduler=SchedulerConfig(max_model_len=64, block_size=BS, max_num_seqs=4,
                                                       max_batch_tokens=64), tpot_slo_ms=20.0,
                             max_backward_token_layers=400)
    return CoServingPolicy(config, inference_kv, AdapterSlots(4), LatencyModel(FP, COEFFICIENTS),
                           share=StaticSplitShare(config, fraction), finetune_kv=finetune_kv,
                           clock=FakeClock())


def test_split_kv_gives_disjoint_block_ranges() -> None:
    inference, finetune = split_kv(32, BS, 0.25)
    assert (inference.num_blocks, finetune.num_blocks) == (24, 8)
    assert inference.allocate_slots("r", 24 * BS) and finetune.allocate_slots("s", 8 * BS)
    assert set(inference.block_table("r")) == set(range(24))
    assert set(finetune.block_table("s")) == set(range(24, 32))


def test_static_split_gives_fixed_shares_whatever_the_load() -> None:
    policy = static(0.25)
    policy.jobs.add(make_job(policy, "j", "t", lengths=(400,), max_window_tokens=400))
    plan, _ = step(policy)
    assert plan.training.forward_tokens == 16  # 25 % of 64, though inference is idle
    policy.add_request(make_request("r", "a", prompt_len=60, max_tokens=2))
    plan, _ = step(policy)
    assert plan.num_tokens == 48 and plan.training.forward_tokens == 16  # inference: 75 % only
    assert all(block >= 24 for w in plan.training.forward_windows for block in w.block_table)
    assert all(block < 24 for c in plan.chunks for block in c.block_table)


def test_static_split_never_takes_fine_tuning_memory_for_inference() -> None:
    policy = static(0.5, num_blocks=32)  # 16 blocks each side: 64 tokens of inference
    policy.jobs.add(make_job(policy, "j", "t", lengths=(60,), max_window_tokens=400))
    for _ in range(2):  # the 60-token forward (32 tokens per iteration); its backward comes next
        step(policy)
    held = policy.jobs.kv.num_blocks - policy.jobs.kv.num_free_blocks
    assert held > 0
    policy.add_request(make_request("r1", "a", prompt_len=40, max_tokens=20))
    policy.add_request(make_request("r2", "b", prompt_len=40, max_tokens=20))
    plan, _ = step(policy)
    assert [s.request_id for s in plan.new_sequences] == ["r1"]  # r2 does not fit inference's range
    assert not plan.training.sequence_drops


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_static_split_rejects_fractions_outside_0_1(fraction: float) -> None:
    with pytest.raises(ValueError, match="finetune_fraction"):
        static(fraction)
