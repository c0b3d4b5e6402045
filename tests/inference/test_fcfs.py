"""InferencePlanner against a fake engine: hand-built IterationResults, no torch."""

from __future__ import annotations

from typing import Any

import pytest

from coserve.contract.plan import AdapterLoad, IterationPlan, IterationResult, SampledToken
from coserve.contract.sampling import AdapterRef, SamplingParams
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.planner import InferencePlanner
from coserve.inference.request import Request, RequestStatus
from coserve.inference.request_rules import check_stop
from coserve.inference.scheduler_config import SchedulerConfig

BS = 4
TOKEN = 50  # what the fake engine samples unless told otherwise


def make_policy(num_blocks: int = 64, num_slots: int = 2, **config: Any) -> InferencePlanner:
    config.setdefault("max_model_len", 64)
    config.setdefault("block_size", BS)
    caching = config.setdefault("enable_prefix_caching", True)
    kv = KVBlockManager(num_blocks=num_blocks, block_size=config["block_size"],
                        enable_prefix_caching=caching)
    return InferencePlanner(SchedulerConfig(**config), kv, AdapterSlots(num_slots))


def make_request(request_id: str, prompt_len: int = 6, *, prompt: list[int] | None = None,
                 eos: int | None = None, adapter: int | None = None, **sampling: Any) -> Request:
    sampling.setdefault("max_tokens", 16)
    ref = AdapterRef(adapter, f"lora{adapter}", f"/lora/{adapter}") if adapter is not None else None
    # Distinct ids get distinct default prompts, so prefix hits happen only where a test wants them.
    base = 1000 * sum(map(ord, request_id))
    tokens = prompt if prompt is not None else [base + i for i in range(prompt_len)]
    return Request(request_id, tokens, SamplingParams(**sampling), eos_token_id=eos, adapter=ref)


def step(policy: InferencePlanner,
         tokens: dict[str, int] | None = None) -> tuple[IterationPlan, list[Request]]:
    """Plan, 'execute' (sample TOKEN or tokens[id] for every sampled chunk) and update."""
    plan = policy.plan()
    sampled = [SampledToken(c.request_id, (tokens or {}).get(c.request_id, TOKEN))
               for c in plan.chunks if c.sample]
    result = IterationResult(step_id=plan.step_id, sampled=sampled, num_tokens=plan.num_tokens)
    return plan, policy.update(plan, result)


def spans(plan: IterationPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks]


# ------------------------------------------------------------------------------- batching

def test_chunked_prefill_splits_a_long_prompt_under_the_budget() -> None:
    policy = make_policy(max_batch_tokens=8)
    policy.add_request(make_request("a", 20))
    plans = [step(policy)[0] for _ in range(4)]
    assert [spans(p) for p in plans] == [
        [("a", 0, 8, False)], [("a", 8, 8, False)], [("a", 16, 4, True)], [("a", 20, 1, True)]]
    assert len(plans[0].new_sequences) == 1 and not plans[1].new_sequences
    for plan in plans:  # the table covers every position the chunk writes
        chunk = plan.chunks[0]
        assert len(chunk.block_table) == -(-(chunk.start + chunk.num_tokens) // BS)
    assert policy.get_request("a").output_token_ids == (TOKEN, TOKEN)


def test_decodes_and_prefill_chunks_share_a_step() -> None:
    policy = make_policy(max_batch_tokens=8)
    policy.add_request(make_request("a", 4))
    policy.add_request(make_request("b", 10))
    plan, touched = step(policy)
    assert spans(plan) == [("a", 0, 4, True), ("b", 0, 4, False)]
    assert [r.request_id for r in touched] == ["a"]
    plan, _ = step(policy)
    assert spans(plan) == [("a", 4, 1, True), ("b", 4, 6, True)]
    plan, _ = step(policy)
    assert spans(plan) == [("a", 5, 1, True), ("b", 10, 1, True)]


def test_long_prefill_threshold_caps_one_request() -> None:
    policy = make_policy(max_batch_tokens=16, long_prefill_threshold=5)
    policy.add_request(make_request("a", 12))
    policy.add_request(make_request("b", 3))
    plan, _ = step(policy)
    assert spans(plan) == [("a", 0, 5, False), ("b", 0, 3, True)]


def test_max_num_seqs_limits_the_running_batch() -> None:
    policy = make_policy(max_num_seqs=2)
    policy.add_request(make_request("a", 4, max_tokens=1))
    policy.add_request(make_request("b", 4, max_tokens=3))
    policy.add_request(make_request("c", 4))
    plan, _ = step(policy)
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    assert (policy.num_running, policy.num_waiting) == (1, 1)  # a finished after one token
    plan, _ = step(policy)
    assert spans(plan) == [("b", 4, 1, True), ("c", 0, 4, True)]
    assert plan.freed == ["a"]


# ----------------------------------------------------------------------------- preemption

def _two_requests_filling_the_cache(caching: bool) -> InferencePlanner:
    """4 blocks of 4: a and b take 2 blocks each; the decode of a's 9th position needs a 5th."""
    policy = make_policy(num_blocks=4, max_model_len=16, enable_prefix_caching=caching)
    policy.add_request(make_request("a", 6, max_tokens=4))
    policy.add_request(make_request("b", 6, max_tokens=10))
    for _ in range(3):
        step(policy, {"a": 7, "b": 8})
    return policy


def test_preemption_frees_the_last_admitted_and_resumes_with_its_outputs() -> None:
    policy = _two_requests_filling_the_cache(caching=False)
    plan, touched = step(policy, {"a": 7})
    assert spans(plan) == [("a", 8, 1, True)]
    assert plan.freed == ["b"] and not plan.new_sequences
    b = policy.get_request("b")
    assert (b.status, b.num_computed_tokens, policy.num_waiting) == (RequestStatus.PREEMPTED, 0, 1)
    assert touched[0].status == RequestStatus.FINISHED_LENGTH_CAPPED  # a reached max_tokens=4
    plan, _ = step(policy)
    assert plan.freed == ["a"]
    (new,) = plan.new_sequences
    assert new.token_ids == b.prompt_token_ids + [8, 8, 8]
    assert new.num_output_tokens == 3
    assert spans(plan) == [("b", 0, 9, True)]
    assert b.status == RequestStatus.RUNNING and b.output_token_ids == (8, 8, 8, TOKEN)


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    policy = _two_requests_filling_the_cache(caching=True)
    step(policy)  # b is preempted; a's new block evicts b's tail block, b's first stays cached
    plan, _ = step(policy)
    assert spans(plan) == [("b", 4, 5, True)]


def test_last_running_request_preempts_itself_without_looping() -> None:
    policy = make_policy(num_blocks=4, max_model_len=16, enable_prefix_caching=False)
    policy.add_request(make_request("a", 7))
    policy.add_request(make_request("b", 8))
    step(policy)  # a: 8 tokens in 2 blocks, b: 9 tokens, 2 blocks computed
    plan, _ = step(policy)  # b's decode needs a third block; b itself is the last admitted
    assert spans(plan) == [("a", 7, 1, True)]
    assert plan.freed == ["b"]
    assert policy.get_request("b").status == RequestStatus.PREEMPTED


def test_no_admission_in_a_step_that_preempted() -> None:
    # The small budget makes b's first chunk after its preemption need one block only, which the
    # preemption itself freed: b would be re-admitted at once if the rule were missing.
    policy = make_policy(num_blocks=4, max_model_len=16, max_batch_tokens=5,
                         enable_prefix_caching=False)
    policy.add_request(make_request("a", 4, max_tokens=12))
    policy.add_request(make_request("b", 4, max_tokens=12))
    for _ in range(5):
        step(policy)
    plan, _ = step(policy)
    assert plan.freed == ["b"] and not plan.new_sequences
    assert policy.kv.num_free_blocks == 1
    plan, _ = step(policy)
    assert spans(plan) == [("a", 9, 1, True), ("b", 0, 4, False)]


# -------------------------------------------------------------------------------- stopping

@pytest.mark.parametrize("sampling, tokens, status, num_outputs", [
    ({}, [5, 5, 2], RequestStatus.FINISHED_STOPPED, 3),  # EOS
    ({"ignore_eos": True, "max_tokens": 4}, [2, 2, 2, 2], RequestStatus.FINISHED_LENGTH_CAPPED, 4),
    ({"min_tokens": 3}, [2, 2, 2], RequestStatus.FINISHED_STOPPED, 3),  # EOS ignored twice
    ({"stop_token_ids": [9]}, [5, 9], RequestStatus.FINISHED_STOPPED, 2),
    ({"stop_token_ids": [9], "min_tokens": 2}, [9, 9], RequestStatus.FINISHED_STOPPED, 2),
    ({"max_tokens": 3}, [5, 5, 5], RequestStatus.FINISHED_LENGTH_CAPPED, 3),
    ({"max_tokens": None}, [5] * 4, RequestStatus.FINISHED_LENGTH_CAPPED, 4),  # max_model_len 10
])
def test_stop_conditions(sampling: dict[str, Any], tokens: list[int], status: RequestStatus,
                         num_outputs: int) -> None:
    policy = make_policy(max_model_len=10)
    policy.add_request(make_request("a", 6, eos=2, **sampling))
    request = policy.get_request("a")
    for token in tokens:
        assert not request.is_finished
        step(policy, {"a": token})
    assert request.status == status
    assert request.num_output_tokens == num_outputs
    assert not policy.has_unfinished() and policy.has_work()
    plan, _ = step(policy)
    assert plan.freed == ["a"] and not plan.chunks
    assert not policy.has_work()


def test_eos_at_max_tokens_reports_stop() -> None:
    request = make_request("a", 3, eos=2, max_tokens=1)
    request.append_output_token(2)
    assert check_stop(request, 2, max_model_len=100) == RequestStatus.FINISHED_STOPPED


def test_finished_request_releases_blocks_and_adapter() -> None:
    policy = make_policy(num_slots=1)
    policy.add_request(make_request("a", 6, max_tokens=1, adapter=3))
    step(policy)
    assert policy.kv.num_free_blocks == policy.kv.num_blocks
    assert policy.adapters.pin_count(3) == 0 and policy.adapters.slot_of(3) == 0


# ---------------------------------------------------------------------------------- abort

def test_abort_running_request_frees_it_in_the_next_plan() -> None:
    policy = make_policy()
    policy.add_request(make_request("a"))
    policy.add_request(make_request("b"))
    step(policy)
    assert policy.abort("a", RequestStatus.FINISHED_STOPPED)
    assert policy.get_request("a") is None
    assert policy.kv.block_table("a") == []
    plan, _ = step(policy)
    assert plan.freed == ["a"] and [c.request_id for c in plan.chunks] == ["b"]
    assert not policy.abort("a")


def test_abort_waiting_request_never_reaches_the_engine() -> None:
    policy = make_policy(max_num_seqs=1)
    policy.add_request(make_request("a"))
    policy.add_request(make_request("b"))
    step(policy)
    assert policy.abort("b")
    plan, _ = step(policy)
    assert plan.freed == [] and policy.num_waiting == 0


def test_abort_between_plan_and_update_skips_the_request() -> None:
    policy = make_policy()
    policy.add_request(make_request("a"))
    plan = policy.plan()
    policy.abort("a")
    result = IterationResult(plan.step_id, [SampledToken("a", 5)])
    assert policy.update(plan, result) == []


def test_abort_needs_a_finished_status() -> None:
    policy = make_policy()
    with pytest.raises(ValueError, match="RUNNING"):
        policy.abort("a", RequestStatus.RUNNING)


# ---------------------------------------------------------------------------- prefix cache

def test_prefix_hit_gives_a_first_chunk_past_the_cached_blocks() -> None:
    policy = make_policy()
    prompt = list(range(10))
    policy.add_request(make_request("a", prompt=prompt))
    first, _ = step(policy)
    policy.add_request(make_request("b", prompt=prompt))
    plan, _ = step(policy)
    assert spans(plan) == [("a", 10, 1, True), ("b", 8, 2, True)]
    assert plan.new_sequences[0].token_ids == prompt
    b_table = plan.chunks[1].block_table
    assert b_table[:2] == first.chunks[0].block_table[:2] and len(b_table) == 3


def test_adapters_do_not_share_prefix_blocks() -> None:
    policy = make_policy()
    prompt = list(range(10))
    policy.add_request(make_request("a", prompt=prompt, adapter=1))
    step(policy)
    policy.add_request(make_request("b", prompt=prompt, adapter=2))
    policy.add_request(make_request("c", prompt=prompt))
    plan, _ = step(policy)
    assert spans(plan)[1:] == [("b", 0, 10, True), ("c", 0, 10, True)]


def test_versions_of_an_adapter_trained_in_place_do_not_share_prefix_blocks() -> None:
    """A reinforcement job samples its adapter between steps: the same id and slot, new weights."""
    policy = make_policy()
    prompt = list(range(10))
    ref = AdapterRef(7, "training:j", "training:j")
    policy.add_request(Request("a", prompt, SamplingParams(max_tokens=16), adapter=ref))
    step(policy)
    for request_id, version, cached in (("b", 0, 8), ("c", 1, 0)):
        versioned = AdapterRef(7, "training:j", "training:j", version=version)
        policy.add_request(Request(request_id, prompt, SamplingParams(max_tokens=16), adapter=versioned))
        plan, _ = step(policy)
        assert (plan.chunks[-1].request_id, plan.chunks[-1].start) == (request_id, cached)


# -------------------------------------------------------------------------------- adapters

def test_adapter_slot_exhaustion_makes_requests_wait() -> None:
    policy = make_policy(num_slots=1)
    policy.add_request(make_request("a", adapter=1, max_tokens=2))
    policy.add_request(make_request("a2", adapter=1, max_tokens=2))
    policy.add_request(make_request("b", adapter=2))
    policy.add_request(make_request("c"))  # base model, but FCFS keeps it behind b
    plan, _ = step(policy)
    assert [c.request_id for c in plan.chunks] == ["a", "a2"]
    assert plan.adapter_loads == [AdapterLoad(slot=0, adapter_id=1, path="/lora/1")]
    assert [s.adapter_slot for s in plan.new_sequences] == [0, 0]
    plan, _ = step(policy)
    assert [c.request_id for c in plan.chunks] == ["a", "a2"] and policy.num_waiting == 2
    plan, _ = step(policy)  # a and a2 finished: slot 0 is unpinned and goes to adapter 2
    assert plan.freed == ["a", "a2"]
    assert plan.adapter_unloads == [0]
    assert plan.adapter_loads == [AdapterLoad(slot=0, adapter_id=2, path="/lora/2")]
    assert [(s.request_id, s.adapter_slot) for s in plan.new_sequences] == [("b", 0), ("c", -1)]


# ------------------------------------------------------------------------------ validation

def test_prompt_longer_than_max_model_len_is_rejected() -> None:
    policy = make_policy(max_model_len=16)
    with pytest.raises(ValueError, match="17 tokens.*max_model_len=16"):
        policy.add_request(make_request("a", 17))
    with pytest.raises(ValueError, match="empty prompt"):
        policy.add_request(make_request("b", prompt=[]))
    policy.add_request(make_request("c", 16))
    with pytest.raises(ValueError, match="'c'"):
        policy.add_request(make_request("c", 3))


def test_policy_and_kv_must_agree() -> None:
    config = SchedulerConfig(max_model_len=64, block_size=BS)
    with pytest.raises(ValueError, match="block size 8"):
        InferencePlanner(config, KVBlockManager(64, 8), AdapterSlots(1))
    with pytest.raises(ValueError, match="prefix caching"):
        InferencePlanner(config, KVBlockManager(64, BS, enable_prefix_caching=False), AdapterSlots(1))
    with pytest.raises(ValueError, match="max_model_len=64"):
        InferencePlanner(config, KVBlockManager(15, BS), AdapterSlots(1))


def test_update_rejects_mismatched_results() -> None:
    policy = make_policy()
    policy.add_request(make_request("a"))
    plan = policy.plan()
    with pytest.raises(ValueError, match="step 7"):
        policy.update(plan, IterationResult(step_id=7))
    with pytest.raises(ValueError, match="no sampled token for 'a'"):
        policy.update(plan, IterationResult(step_id=plan.step_id))
