"""SchedulerActor and EngineActor in-process, without HTTP, behind the gateway's `SchedulerFrontend`: the
policy seam, `poll` (the Ray gateway's multiplexed token streams), `stop`, abort and quota refunds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from coserve.actors.client import LocalSchedulerClient
from coserve.actors.engine_actor import EngineActor
from coserve.actors.scheduler_actor import SchedulerActor, SchedulerSettings
from coserve.actors.step_faults import ENGINE_BROKEN_AFTER, GENERIC_MESSAGE
from coserve.cluster.policy_factory import CoServingPolicyFactory, PolicyFactory
from coserve.contract.engine_config import EngineConfig
from coserve.contract.messages import TokenSubmission
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.sampling import EosIds, SamplingParams
from coserve.frontend.messages import ChatSubmission, StreamBatch
from coserve.frontend.scheduler_frontend import SchedulerFrontend
from coserve.frontend.tokenizer import Tokenizer
from coserve.planner.latency import ModelFingerprint
from coserve.planner.share_kinds import ShareKind
from coserve.tenancy.quotas import TenantLimits

HELLO = [{"role": "user", "content": "Hello there"}]
# Inference only (no fine-tuning share): what these tests drive is the actor around the policy.
INFERENCE_ONLY = CoServingPolicyFactory(ModelFingerprint("tiny-llama", "cpu", "float32"), share=ShareKind.NONE)


def submission(request_id: str, max_tokens: int | None = 8, tenant: str = "t", n: int = 1) -> ChatSubmission:
    return ChatSubmission(request_id=request_id, tenant=tenant, messages=HELLO,
                          sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, ignore_eos=True))


def token_submission(request_id: str, prompt: list[int], origin: str, n: int = 1) -> TokenSubmission:
    return TokenSubmission(request_id=request_id, tenant="t", prompt_token_ids=prompt, origin=origin,
                           sampling=SamplingParams(temperature=0.0, max_tokens=8, n=n, ignore_eos=True),
                           eos=EosIds(eos=None, extra=()))


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


def run(llama_dir: Path, engine_config: EngineConfig, body: Callable[[SchedulerFrontend], Awaitable[object]],
        policy_factory: PolicyFactory = INFERENCE_ONLY, **settings: object) -> object:
    """Run `body(gateway)` on a fresh in-process scheduler + engine behind the gateway's frontend, on a
    new event loop (`gateway.client` is the `LocalSchedulerClient`)."""
    async def main() -> object:
        engine = EngineActor(engine_config)
        local = LocalSchedulerClient(SchedulerActor(SchedulerSettings(model=str(llama_dir), **settings),
                                              policy_factory), engine)
        layout = engine.layout()
        gateway = SchedulerFrontend.for_engine(str(llama_dir), local, layout)
        await gateway.start()
        try:
            return await body(gateway)
        finally:
            await gateway.close()
            assert not local.engine.running()
    return asyncio.run(main())


def test_policy_seam_gets_the_engine_layout(llama_dir: Path, engine_config: EngineConfig) -> None:
    built, plans = [], []

    class Factory:
        tenant_weights: dict[str, float] = {}

        def __call__(self, config, layout, shared):  # noqa: ANN001, ANN204 - the PolicyFactory signature
            return factory(config, layout, shared)

    def factory(config, layout, shared):  # noqa: ANN001, ANN202
        policy = INFERENCE_ONLY(config, layout, shared)
        real_plan = policy.plan

        def counting_plan():  # noqa: ANN202
            plans.append(1)
            return real_plan()

        policy.plan = counting_plan
        built.append((config, layout))
        return policy

    async def body(gateway: SchedulerFrontend) -> tuple[dict[int, str], StreamBatch]:
        assert (await gateway.submit(submission("a", max_tokens=5))).rejection is None
        return await collect(gateway.stream("a"))

    texts, last = run(llama_dir, engine_config, body, Factory(), max_num_seqs=3)
    config, layout = built[0]
    assert (config.max_num_seqs, config.max_model_len, layout.num_kv_blocks) == (3, layout.max_model_len, 160)
    assert last.done and last.error is None and last.completion_tokens == 5 and len(plans) >= 5


def test_poll_returns_every_request_of_its_origin(llama_dir: Path, engine_config: EngineConfig) -> None:
    async def body(gateway: SchedulerFrontend) -> None:
        scheduler = gateway.client.scheduler
        prompt = Tokenizer.from_spec(gateway.client.engine.layout().tokenizer).encode("Hello there")
        for rid in ("p1", "p2"):
            assert (await scheduler.submit(token_submission(rid, prompt, origin="gw-1"))).rejection is None
        assert (await scheduler.submit(token_submission("other", prompt, origin="gw-2", n=2))).rejection is None
        tokens: dict[str, list[int]] = {"p1": [], "p2": []}
        done: set[str] = set()
        while done != {"p1", "p2"}:
            batches = await scheduler.poll("gw-1", timeout_s=5.0)
            assert batches and set(batches) <= {"p1", "p2"}
            for rid, batch in batches.items():
                tokens[rid] += [t for d in batch.deltas for t in d.token_ids]
                if batch.done:
                    done.add(rid)
        assert tokens["p1"] == tokens["p2"] and len(tokens["p1"]) == 8  # same prompt, greedy
        assert await scheduler.poll("gw-1", timeout_s=0.05) == {}
        others = await scheduler.poll("gw-2", timeout_s=5.0)
        assert set(others) == {"other"}
        unknown = [batch async for batch in scheduler.stream("never-submitted")]
        assert len(unknown) == 1 and unknown[0].done and "unknown request" in unknown[0].error
        assert not unknown[0].deltas

    run(llama_dir, engine_config, body)


def test_abort_refunds_the_quota(llama_dir: Path, engine_config: EngineConfig) -> None:
    async def body(gateway: SchedulerFrontend) -> None:
        first = await gateway.submit(submission("big", max_tokens=200, tenant="q"))
        assert first.rejection is None
        refused = await gateway.submit(submission("second", max_tokens=200, tenant="q"))
        assert refused.rejection is not None and refused.rejection.status == 429
        assert refused.rejection.retry_after_s > 0
        assert await gateway.abort("big") is True and await gateway.abort("big") is False
        again = await gateway.submit(submission("third", max_tokens=200, tenant="q"))
        assert again.rejection is None  # the aborted request's unused tokens came back
        _, last = await collect(gateway.stream("third"))
        assert last.done and last.completion_tokens == 200
        metrics = await gateway.metrics_text()
        assert 'coserve_requests_total{outcome="abort",tenant="q"} 1.0' in metrics
        assert 'coserve_requests_total{outcome="rejected",tenant="q"} 1.0' in metrics

    run(llama_dir, engine_config, body, tenant_limits={"q": TenantLimits(tokens_per_minute=300)})


def test_a_failed_engine_step_fails_its_requests_and_the_loop_goes_on(llama_dir: Path,
                                                                      engine_config: EngineConfig) -> None:
    async def body(gateway: SchedulerFrontend) -> None:
        engine = gateway.client.engine.engine
        real_step, calls = engine.step, []

        def failing_once(plan: IterationPlan) -> IterationResult:
            calls.append(plan.step_id)
            if len(calls) == 1:
                raise RuntimeError("device lost")
            return real_step(plan)

        engine.step = failing_once  # type: ignore[method-assign]
        assert (await gateway.submit(submission("doomed", max_tokens=4))).rejection is None
        _, last = await collect(gateway.stream("doomed"))
        # Not told apart (a plain error, not a `PlanFault`): a generic error, never the engine's text.
        assert last.done and last.error == GENERIC_MESSAGE and "device lost" not in last.error
        assert (await gateway.submit(submission("next", max_tokens=4))).rejection is None
        _, after = await collect(gateway.stream("next"))
        assert after.done and after.error is None and after.completion_tokens == 4
        assert 'coserve_requests_total{outcome="error",tenant="t"} 1.0' in await gateway.metrics_text()

    run(llama_dir, engine_config, body)


def test_an_engine_whose_steps_keep_failing_whole_is_given_up(llama_dir: Path, engine_config: EngineConfig) -> None:
    """Steps that fail whole `ENGINE_BROKEN_AFTER` times in a row (a GPU context lost to a device-side assert
    fails every step so, the plans that only free the failed requests' state too): the engine goes to the
    engine-lost path, new requests are a 503."""
    async def body(gateway: SchedulerFrontend) -> None:
        engine = gateway.client.engine.engine
        steps: list[int] = []

        def broken(plan: IterationPlan) -> IterationResult:
            steps.append(plan.step_id)
            raise RuntimeError("CUDA error: device-side assert triggered")

        engine.step = broken  # type: ignore[method-assign]
        for i in range(ENGINE_BROKEN_AFTER + 1):
            admission = await gateway.submit(submission(f"r{i}", max_tokens=4))
            if admission.rejection is not None:
                break
            _, last = await collect(gateway.stream(f"r{i}"))
            assert last.error is not None and "CUDA" not in last.error, last.error
        assert admission.rejection is not None and admission.rejection.status == 503
        assert await gateway.client.health() is not None  # /health says so
        assert len(steps) == ENGINE_BROKEN_AFTER
        text = await gateway.metrics_text()
        assert f'coserve_engine_failed_steps_total{{engine="engine-0"}} {ENGINE_BROKEN_AFTER}.0' in text

    run(llama_dir, engine_config, body)


def test_a_stop_string_the_gateway_sees_stops_the_request_in_the_scheduler(llama_dir: Path,
                                                                          engine_config: EngineConfig) -> None:
    async def body(gateway: SchedulerFrontend) -> None:
        assert (await gateway.submit(submission("free", max_tokens=24))).rejection is None
        free, _ = await collect(gateway.stream("free"))
        text = free[0]
        stop = text[len(text) // 2:len(text) // 2 + 3]  # a piece of the greedy text, well before its end
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
        sub = ChatSubmission(request_id="cut", tenant="t", messages=HELLO, sampling=params)
        assert (await gateway.submit(sub)).rejection is None
        scheduler = gateway.client.scheduler
        child = scheduler._streams.get("cut").children[0]  # the scheduler's request, to see it stop
        batches = [batch async for batch in gateway.stream("cut")]
        last = batches[-1]
        assert "".join(d.text for b in batches for d in b.deltas) == text[:text.index(stop)]
        assert [d.finish_reason for b in batches for d in b.deltas if d.finish_reason] == ["stop"]
        assert last.done and last.error is None and last.completion_tokens < 24
        # The scheduler stopped generating it: no more than the engine made before the stop arrived.
        assert child.finish_reason == "stop" and child.num_output_tokens <= last.completion_tokens + 2
        assert await scheduler.stop("cut", 0) is False and await scheduler.stop("never-submitted", 0) is False
        assert 'coserve_requests_total{outcome="stop",tenant="t"} 1.0' in await gateway.metrics_text()

    run(llama_dir, engine_config, body)
