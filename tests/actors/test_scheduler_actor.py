"""SchedulerActor and EngineActor in-process, without HTTP: the policy seam, `poll` (the Ray gateway's
multiplexed streams), abort and quota refunds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from coserve.actors.client import LocalScheduler
from coserve.actors.engine_actor import EngineActor
from coserve.actors.scheduler import SchedulerActor, SchedulerSettings
from coserve.contract.messages import ChatSubmission, StreamBatch
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.sampling import SamplingParams
from coserve.platform.engine import EngineConfig
from coserve.policies.policy_factory import PolicyFactory, fcfs_policy
from coserve.policies.quotas import TenantLimits

HELLO = [{"role": "user", "content": "Hello there"}]


def submission(request_id: str, max_tokens: int | None = 8, origin: str = "", tenant: str = "t",
               n: int = 1) -> ChatSubmission:
    return ChatSubmission(request_id=request_id, tenant=tenant, messages=HELLO, origin=origin,
                          sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, ignore_eos=True))


async def collect(batches: AsyncIterator[StreamBatch]) -> tuple[dict[int, str], StreamBatch]:
    texts: dict[int, str] = {}
    last = StreamBatch()
    async for batch in batches:
        last = batch
        for delta in batch.deltas:
            texts[delta.index] = texts.get(delta.index, "") + delta.text
    return texts, last


@pytest.fixture(scope="module")
def engine_config(llama_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=160)


def run(llama_dir: Path, engine_config: EngineConfig, body: Callable[[LocalScheduler], Awaitable[object]],
        policy_factory: PolicyFactory = fcfs_policy, **settings: object) -> object:
    """Run `body(local)` on a fresh in-process scheduler + engine, on a new event loop."""
    async def main() -> object:
        local = LocalScheduler(SchedulerActor(SchedulerSettings(model=str(llama_dir), **settings),
                                              policy_factory),
                               EngineActor(engine_config))
        await local.start()
        try:
            return await body(local)
        finally:
            await local.close()
            assert not local.engine.running()
    return asyncio.run(main())


def test_policy_seam_gets_the_engine_layout(llama_dir: Path, engine_config: EngineConfig) -> None:
    built, plans = [], []

    def factory(config, layout):  # noqa: ANN001, ANN202 - the PolicyFactory signature
        policy = fcfs_policy(config, layout)
        real_plan = policy.plan

        def counting_plan():  # noqa: ANN202
            plans.append(1)
            return real_plan()

        policy.plan = counting_plan
        built.append((config, layout))
        return policy

    async def body(local: LocalScheduler) -> tuple[dict[int, str], StreamBatch]:
        assert (await local.submit(submission("a", max_tokens=5))).rejection is None
        return await collect(local.stream("a"))

    texts, last = run(llama_dir, engine_config, body, factory, max_num_seqs=3)
    config, layout = built[0]
    assert (config.max_num_seqs, config.max_model_len, layout.num_kv_blocks) == (3, layout.max_model_len, 160)
    assert last.done and last.error is None and last.completion_tokens == 5 and len(plans) >= 5


def test_poll_returns_every_request_of_its_origin(llama_dir: Path, engine_config: EngineConfig) -> None:
    async def body(local: LocalScheduler) -> None:
        scheduler = local.scheduler
        for rid in ("p1", "p2"):
            assert (await local.submit(submission(rid, origin="gw-1"))).rejection is None
        assert (await local.submit(submission("other", origin="gw-2", n=2))).rejection is None
        texts: dict[str, str] = {"p1": "", "p2": ""}
        done: set[str] = set()
        while done != {"p1", "p2"}:
            batches = await scheduler.poll("gw-1", timeout_s=5.0)
            assert batches and set(batches) <= {"p1", "p2"}
            for rid, batch in batches.items():
                texts[rid] += "".join(d.text for d in batch.deltas)
                if batch.done:
                    done.add(rid)
        assert texts["p1"] == texts["p2"] and texts["p1"]  # same prompt, greedy
        assert await scheduler.poll("gw-1", timeout_s=0.05) == {}
        others = await scheduler.poll("gw-2", timeout_s=5.0)
        assert set(others) == {"other"}
        unknown_texts, unknown = await collect(scheduler.stream("never-submitted"))
        assert unknown.done and "unknown request" in unknown.error and unknown_texts == {}

    run(llama_dir, engine_config, body)


def test_abort_refunds_the_quota(llama_dir: Path, engine_config: EngineConfig) -> None:
    async def body(local: LocalScheduler) -> None:
        first = await local.submit(submission("big", max_tokens=200, tenant="q"))
        assert first.rejection is None
        refused = await local.submit(submission("second", max_tokens=200, tenant="q"))
        assert refused.rejection is not None and refused.rejection.status == 429
        assert refused.rejection.retry_after_s > 0
        assert await local.abort("big") is True and await local.abort("big") is False
        again = await local.submit(submission("third", max_tokens=200, tenant="q"))
        assert again.rejection is None  # the aborted request's unused tokens came back
        _, last = await collect(local.stream("third"))
        assert last.done and last.completion_tokens == 200
        metrics = await local.metrics_text()
        assert 'coserve_requests_total{outcome="abort",tenant="q"} 1.0' in metrics
        assert 'coserve_requests_total{outcome="rejected",tenant="q"} 1.0' in metrics

    run(llama_dir, engine_config, body, tenant_limits={"q": TenantLimits(tokens_per_minute=300)})


def test_a_failed_engine_step_fails_its_requests_and_the_loop_goes_on(llama_dir: Path,
                                                                      engine_config: EngineConfig) -> None:
    async def body(local: LocalScheduler) -> None:
        engine = local.engine.engine
        real_step, calls = engine.step, []

        def failing_once(plan: IterationPlan) -> IterationResult:
            calls.append(plan.step_id)
            if len(calls) == 1:
                raise RuntimeError("device lost")
            return real_step(plan)

        engine.step = failing_once  # type: ignore[method-assign]
        assert (await local.submit(submission("doomed", max_tokens=4))).rejection is None
        _, last = await collect(local.stream("doomed"))
        assert last.done and "The engine failed while generating: RuntimeError: device lost" in last.error
        assert (await local.submit(submission("next", max_tokens=4))).rejection is None
        _, after = await collect(local.stream("next"))
        assert after.done and after.error is None and after.completion_tokens == 4
        assert 'coserve_requests_total{outcome="error",tenant="t"} 1.0' in await local.metrics_text()

    run(llama_dir, engine_config, body)
