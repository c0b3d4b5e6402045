"""The fine-tuning share strategies: the registry builds each by name, refuses unknown names, and the
co-serving policy plans with any `FinetuneShare` (a test strategy below), calling it as the protocol says."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from coserve.cluster.policy_factory import CoServingPolicyFactory
from coserve.finetune.roster import Allowance, fixed_allowance
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.request import Request
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.dynamic_temporal import DynamicTurns
from coserve.planner.hybrid import HybridShare
from coserve.planner.latency import LatencyModel, PlanFeatures
from coserve.planner.policy import CoServingPolicy
from coserve.planner.settings import CoServingConfig
from coserve.planner.share_kinds import ShareKind, ShareOptions, build_policy, make_share, share_kind
from coserve.planner.static_split import StaticSplitShare, split_kv
from coserve.planner.strategy import IGNORE_REQUESTS, FinetuneShare, NoFinetuneShare, ShareContext
from coserve.planner.temporal import FixedTurns, TurnTakingShare
from coserving_sim import BS, COEFFICIENTS, FP, FakeClock, make_job, make_policy, make_request, step

CONFIG = CoServingConfig(scheduler=SchedulerConfig(max_model_len=64, block_size=BS, max_num_seqs=4,
                                                   max_batch_tokens=64), tpot_slo_ms=20.0)


# ------------------------------------------------------------------------------------ registry

@pytest.mark.parametrize(("name", "kind"), [
    ("hybrid", ShareKind.HYBRID), ("temporal", ShareKind.TEMPORAL),
    ("dynamic-temporal", ShareKind.DYNAMIC_TEMPORAL), ("static-split", ShareKind.STATIC_SPLIT),
    ("none", ShareKind.NONE)])
def test_every_share_is_found_by_its_name(name: str, kind: ShareKind) -> None:
    assert share_kind(name) is kind


def test_each_kind_builds_its_strategy() -> None:
    hybrid = make_share(ShareKind.HYBRID, CONFIG)
    assert isinstance(hybrid, HybridShare) and hybrid.floor_applies and hybrid.kv_fraction is None
    temporal = make_share(ShareKind.TEMPORAL, CONFIG, ShareOptions(inference_iterations=3))
    assert isinstance(temporal, TurnTakingShare) and isinstance(temporal.turns, FixedTurns)
    assert not temporal.floor_applies  # turns give fine-tuning whole iterations instead
    assert temporal.watcher is IGNORE_REQUESTS
    dynamic = make_share(ShareKind.DYNAMIC_TEMPORAL, CONFIG)
    assert isinstance(dynamic, TurnTakingShare) and isinstance(dynamic.turns, DynamicTurns)
    assert dynamic.watcher is dynamic.turns  # it counts arrivals and completions
    static = make_share(ShareKind.STATIC_SPLIT, CONFIG, ShareOptions(finetune_fraction=0.25))
    assert isinstance(static, StaticSplitShare) and static.finetune_fraction == 0.25
    assert static.kv_fraction == 0.25  # fine-tuning's range is its own
    none = make_share(ShareKind.NONE, CONFIG)
    assert isinstance(none, NoFinetuneShare) and not none.hosts_jobs
    assert all(make_share(kind, CONFIG).hosts_jobs for kind in ShareKind if kind is not ShareKind.NONE)


def test_each_call_builds_a_fresh_strategy() -> None:
    # Strategies keep state (turn counters, first-token times): two policies never share one.
    assert make_share(ShareKind.TEMPORAL, CONFIG) is not make_share(ShareKind.TEMPORAL, CONFIG)


def test_an_unknown_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        share_kind("round-robin")
    message = str(info.value)
    assert "'round-robin'" in message
    for kind in ShareKind:
        assert kind.value in message


@pytest.mark.parametrize(("kind", "options", "setting"), [
    (ShareKind.TEMPORAL, ShareOptions(inference_iterations=0), "inference_iterations"),
    (ShareKind.STATIC_SPLIT, ShareOptions(finetune_fraction=1.5), "finetune_fraction"),
    (ShareKind.STATIC_SPLIT, ShareOptions(finetune_fraction=0.001), "finetune_fraction"),
])
def test_options_out_of_range_are_refused_naming_the_setting(kind: ShareKind, options: ShareOptions,
                                                             setting: str) -> None:
    with pytest.raises(ValueError, match=setting):
        make_share(kind, CONFIG, options)


@pytest.mark.parametrize("kind", [ShareKind.HYBRID, ShareKind.TEMPORAL, ShareKind.DYNAMIC_TEMPORAL])
def test_every_job_hosting_share_trains_a_job_to_its_end(kind: ShareKind) -> None:
    policy = make_policy(kind, scheduler={"max_num_seqs": 4})
    policy.add_request(make_request("r", "a", max_tokens=8))
    job = make_job(policy, "j", "t", lengths=(24,))
    policy.jobs.add(job)
    for _ in range(200):
        if not policy.has_work():
            break
        step(policy)
    assert job.state.is_finished and job.trained_tokens == 23
    assert policy.get_request("r") is None


def test_the_none_share_serves_inference_in_vtc_order_and_never_trains() -> None:
    policy = make_policy(ShareKind.NONE, scheduler={"max_num_seqs": 1})
    for name in ("a0", "a1"):
        policy.add_request(make_request(name, "a", max_tokens=1))
    policy.add_request(make_request("b0", "b", max_tokens=1))
    order = []
    for _ in range(3):
        plan, _ = step(policy)
        order += [s.request_id for s in plan.new_sequences]
        assert not plan.training.forward_windows and not plan.training.backward_tasklets
    assert order == ["a0", "b0", "a1"]
    assert not policy.share.hosts_jobs


def test_build_policy_cuts_the_kv_cache_only_for_a_share_with_a_range_of_its_own() -> None:
    latency = LatencyModel(FP, COEFFICIENTS)
    for kind in ShareKind:
        options = ShareOptions(finetune_fraction=0.25)
        policy = build_policy(kind, CONFIG, 64, AdapterSlots(4), latency, options, clock=FakeClock())
        assert policy.share.label == make_share(kind, CONFIG, options).label
        if kind is ShareKind.STATIC_SPLIT:
            assert policy.jobs is not None
            assert (policy.kv.num_blocks, policy.jobs.kv.num_blocks) == (48, 16)
        elif kind is ShareKind.NONE:
            assert policy.jobs is None and policy.kv.num_blocks == 64
        else:
            assert policy.jobs is not None and policy.jobs.kv is policy.kv and policy.kv.num_blocks == 64


def test_a_kv_range_goes_with_a_share_that_keeps_one() -> None:
    inference, finetune = split_kv(64, BS, 0.25)
    latency = LatencyModel(FP, COEFFICIENTS)
    with pytest.raises(ValueError, match="finetune_kv"):
        CoServingPolicy(CONFIG, inference, AdapterSlots(4), latency, share=HybridShare(),
                        finetune_kv=finetune)
    with pytest.raises(ValueError, match="finetune_kv"):
        CoServingPolicy(CONFIG, inference, AdapterSlots(4), latency, share=StaticSplitShare(CONFIG, 0.25))


class _Layout:
    num_kv_blocks, block_size, max_model_len, num_adapter_slots, max_lora_rank = 64, BS, 64, 4, 16


@pytest.mark.parametrize("kind", list(ShareKind))
def test_the_servers_policy_factory_builds_any_share(kind: ShareKind) -> None:
    factory = CoServingPolicyFactory(FP, tpot_slo_ms=20.0, share=kind)
    policy = factory(CONFIG.scheduler, _Layout())
    assert isinstance(policy, CoServingPolicy)
    assert policy.share.label == make_share(kind, CONFIG).label
    assert (policy.jobs is None) == (kind is ShareKind.NONE)  # the scheduler opens no job manager then
    assert CoServingPolicyFactory(FP).share is ShareKind.HYBRID  # the server's default


# ------------------------------------------------------------------------ the protocol, plugged in

class RecordingShare:
    """A share strategy of its own: 10 inference tokens, 5 forward tokens per iteration, every call
    recorded."""

    label = "recording share"
    hosts_jobs = True
    floor_applies = False
    kv_fraction = None
    learns_latency = True

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.watcher = self  # it follows the requests itself

    def begin_iteration(self, ctx: ShareContext) -> bool:
        self.calls.append(f"begin {ctx.num_waiting}w {ctx.num_running}r")
        return True

    def inference_token_budget(self, ctx: ShareContext) -> int:
        return 10

    def allowance(self, ctx: ShareContext, base: PlanFeatures) -> Allowance | None:
        self.calls.append(f"allowance {base.prefill_tokens:g}")
        return fixed_allowance(5, 0)

    def on_request_added(self, request: Request) -> None:
        self.calls.append(f"added {request.request_id}")

    def on_request_finished(self, request: Request) -> None:
        self.calls.append(f"finished {request.request_id}")

    def on_tokens(self, ctx: ShareContext, touched: Sequence[Request]) -> None:
        self.calls.append("tokens " + ",".join(r.request_id for r in touched))


def test_the_policy_plans_with_any_share_and_calls_it_as_the_protocol_says() -> None:
    share = RecordingShare()
    typed: FinetuneShare = share  # it is one, structurally (checked by the type checker)
    policy = CoServingPolicy(CONFIG, KVBlockManager(64, BS), AdapterSlots(4), LatencyModel(FP, COEFFICIENTS),
                             share=typed, clock=FakeClock())
    policy.add_request(make_request("r", "a", prompt_len=30, max_tokens=1))
    policy.jobs.add(make_job(policy, "j", "t", lengths=(400,), max_window_tokens=400))
    plan, _ = step(policy)
    assert plan.num_tokens == 10 and plan.training.forward_tokens == 5  # the share's budgets
    plan, _ = step(policy)
    plan, _ = step(policy)  # the prompt's last 10 tokens: it samples its one token and finishes
    assert share.calls == ["added r",
                           "begin 1w 0r", "allowance 10", "tokens ",
                           "begin 0w 1r", "allowance 10", "tokens ",
                           "begin 0w 1r", "allowance 10", "finished r", "tokens r"]
