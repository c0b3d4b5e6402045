"""Retained KV (`coserve.inference.kv_retention` in `KVBlockManager`): a finished request's cached blocks kept
for a continuation survive the prefix cache's churn, yet are free (any allocation takes them, last), expire,
and are bounded; the scheduler retains only what a request that ended normally asked for (an aborted one,
a cancelled response, frees its KV at once)."""

from __future__ import annotations

from coserve.contract.sampling import EosIds, SamplingParams
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.kv_retention import RetainedBlocks
from coserve.inference.planner import InferencePlanner
from coserve.inference.request import RequestStatus, expand_request
from coserve.inference.scheduler_config import SchedulerConfig

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _finished(kv: KVBlockManager, request_id: str, tokens: list[int], retain_s: float = 0.0) -> None:
    """A request that computed `tokens`, registered its full blocks and ended."""
    kv.match_prefix(request_id, tokens, 0)
    assert kv.allocate_slots(request_id, len(tokens))
    kv.cache_full_blocks(request_id, tokens, len(tokens), 0)
    kv.free(request_id, retain_s)


CONVERSATION = list(range(100, 113))  # 3 full blocks and one token
OTHER = list(range(200, 213))


def test_retained_blocks_outlive_the_churn_that_evicts_ordinary_ones() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=BS, clock=Clock())
    _finished(kv, "turn1", CONVERSATION, retain_s=60)
    _finished(kv, "other", OTHER)
    assert kv.num_retained_blocks == 3 and kv.num_free_blocks == 8
    assert kv.allocate_slots("filler", 5 * BS)  # the 2 plain blocks, then the 3 ordinary cached ones
    assert kv.match_prefix("other-again", OTHER, 0) == 0
    assert kv.match_prefix("turn2", [*CONVERSATION, 7, 8, 9], 0) == 3 * BS  # the retained prefix is still here
    assert kv.num_retained_blocks == 0  # in use again


def test_without_retention_the_same_churn_evicts_the_conversation() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=BS, clock=Clock())
    _finished(kv, "turn1", CONVERSATION)
    _finished(kv, "other", OTHER)
    assert kv.allocate_slots("filler", 5 * BS)
    assert kv.match_prefix("turn2", [*CONVERSATION, 7], 0) == 0


def test_retained_blocks_are_free_for_any_allocation() -> None:
    kv = KVBlockManager(num_blocks=4, block_size=BS, max_retained_fraction=1.0, clock=Clock())
    _finished(kv, "turn1", list(range(16)), retain_s=60)  # all 4 blocks cached, retained
    assert kv.num_retained_blocks == 4 and kv.can_allocate("big", 4 * BS)
    assert kv.allocate_slots("big", 4 * BS) and kv.num_retained_blocks == 0 and kv.num_free_blocks == 0


def test_retention_expires_and_is_bounded() -> None:
    clock = Clock()
    kv = KVBlockManager(num_blocks=8, block_size=BS, max_retained_fraction=0.25, clock=clock)
    _finished(kv, "turn1", CONVERSATION, retain_s=10)
    assert kv.num_retained_blocks == 2  # 25% of 8: the prefix's first 2 blocks, its tail went ordinary
    assert kv.match_prefix("probe", CONVERSATION, 0) == 3 * BS
    kv.free("probe", retain_s=10)
    clock.now = 11
    _finished(kv, "other", OTHER)  # a free after the deadline: the expired blocks are ordinary, oldest first
    assert kv.num_retained_blocks == 0
    assert kv.allocate_slots("filler", 5 * BS)  # 2 plain, then the expired conversation's 3
    assert kv.match_prefix("turn2", [*CONVERSATION, 1], 0) == 0
    assert kv.match_prefix("other-again", OTHER, 0) == 3 * BS


def test_retained_blocks_bound_and_order() -> None:
    retained = RetainedBlocks(max_blocks=2)
    assert retained.add(1, 5.0) == [] and retained.add(2, 6.0) == [] and retained.add(3, 7.0) == [1]
    assert retained.expired(6.0) == [2] and len(retained) == 1 and retained.pop_oldest() == 3
    assert RetainedBlocks(max_blocks=0).add(9, 1.0) == [9]


def _scheduler(kv: KVBlockManager) -> InferencePlanner:
    config = SchedulerConfig(max_model_len=64, max_num_seqs=4, max_batch_tokens=64, block_size=BS)
    return InferencePlanner(config, kv, AdapterSlots(2))


def _run(scheduler: InferencePlanner, request_id: str, retain_s: float, max_tokens: int,
         prompt: list[int] = CONVERSATION) -> None:
    [request] = expand_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0),
                               EosIds(eos=None, extra=()), retain_kv_s=retain_s)
    scheduler.add_request(request)


def test_the_scheduler_retains_what_ended_and_frees_what_was_aborted() -> None:
    from coserve.contract.plan import IterationResult, SampledToken

    kv = KVBlockManager(num_blocks=16, block_size=BS, clock=Clock())
    scheduler = _scheduler(kv)
    _run(scheduler, "kept", 60, max_tokens=1)
    plan = scheduler.plan()
    scheduler.update(plan, IterationResult(step_id=plan.step_id, sampled=[SampledToken("kept-0", 5)]))
    assert kv.num_retained_blocks == 3  # the prompt's full blocks
    _run(scheduler, "aborted", 60, max_tokens=50, prompt=OTHER)
    plan = scheduler.plan()
    scheduler.update(plan, IterationResult(step_id=plan.step_id, sampled=[SampledToken("aborted-0", 5)]))
    assert scheduler.abort("aborted-0", RequestStatus.FINISHED_ABORTED)
    assert kv.num_retained_blocks == 3 and kv.num_cached_free_blocks == 6  # its 3 blocks: ordinary cached
    assert scheduler.get_request("aborted-0") is None
