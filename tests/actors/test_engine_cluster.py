"""A SchedulerActor driving two in-process engines through its `EngineCluster` (no Ray, no HTTP): one plan in
flight per engine, and what losing an engine does to its requests (the real-Ray version, with a job and a
killed actor, is tests/actors/test_engines_on_ray.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from coserve.actors.engine_actor import EngineActor, LocalLink
from coserve.actors.scheduler_actor import SchedulerActor, SchedulerSettings
from coserve.contract.engine_config import EngineConfig
from coserve.contract.messages import TokenBatch, TokenSubmission
from coserve.contract.sampling import EosIds, SamplingParams
from coserve.server.options import ServeOptions

PROMPT = [5, 17, 33, 8, 21, 40, 2, 9]


def submission(request_id: str, max_tokens: int) -> TokenSubmission:
    return TokenSubmission(request_id=request_id, tenant="t", prompt_token_ids=PROMPT, origin="gw",
                           sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           eos=EosIds(eos=None, extra=()))


async def outcome(scheduler: SchedulerActor, request_id: str) -> tuple[int, str | None]:
    """(tokens received, the stream's error) once the stream is done."""
    tokens, last = 0, TokenBatch()
    async for batch in scheduler.stream(request_id):
        last = batch
        tokens += sum(len(delta.token_ids) for delta in batch.deltas)
    assert last.done
    return tokens, last.error


def run_two(llama_dir: Path, tmp_path: Path, body: Callable[[SchedulerActor, list[EngineActor]], Awaitable[None]],
            start: tuple[str, ...] = ("engine-0", "engine-1")) -> None:
    """A scheduler of two engines (the co-serving policy, as `coserve serve --engines 2` builds it), the
    loops of `start` running; `body` runs on the event loop, then everything stops."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"t": {"api_keys": ["sk-cluster-test-0123"]}}}))
    opts = ServeOptions(model=str(llama_dir), tenants=str(tenants), dtype="float32")

    async def main() -> None:
        scheduler = SchedulerActor(SchedulerSettings(model=str(llama_dir), max_num_seqs=4),
                                   opts.policy_factory(opts.load_tenants()))
        engines = [EngineActor(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=160), engine_id)
                   for engine_id in ("engine-0", "engine-1")]
        for engine in engines:
            scheduler.register_engine(engine.engine_id, engine.layout())
            if engine.engine_id in start:
                engine.start(LocalLink(scheduler, asyncio.get_running_loop()))
        try:
            await body(scheduler, engines)
        finally:
            await scheduler.shutdown()
            for engine in engines:
                engine.close()
                await asyncio.to_thread(engine.join, 30.0)
    asyncio.run(main())


def test_each_engine_runs_its_own_plans(llama_dir: Path, tmp_path: Path) -> None:
    async def body(scheduler: SchedulerActor, engines: list[EngineActor]) -> None:
        for i in range(6):
            assert (await scheduler.submit(submission(f"r{i}", 12))).rejection is None
        assert await asyncio.gather(*(outcome(scheduler, f"r{i}") for i in range(6))) == [(12, None)] * 6
        assert all(engine.stats()["iterations"] > 0 for engine in engines)  # both engines stepped
        assert scheduler.engines() == ["engine-0", "engine-1"]
        text = await scheduler.metrics_text()
        for engine_id in ("engine-0", "engine-1"):
            assert f'coserve_kv_blocks_total{{engine="{engine_id}"}} 160.0' in text

    run_two(llama_dir, tmp_path, body)


def test_a_lost_engines_streams_with_tokens_end_with_an_error_the_others_complete(llama_dir: Path,
                                                                                 tmp_path: Path) -> None:
    async def body(scheduler: SchedulerActor, engines: list[EngineActor]) -> None:
        for i in range(4):  # two on each engine (least loaded first)
            assert (await scheduler.submit(submission(f"long{i}", 300))).rejection is None
        streams = [asyncio.create_task(outcome(scheduler, f"long{i}")) for i in range(4)]
        while min(engine.stats()["iterations"] for engine in engines) < 3:  # every stream has tokens
            await asyncio.sleep(0.01)
        scheduler.engine_lost("engine-0", "killed in a test")
        assert scheduler.engines() == ["engine-1"]
        results = await asyncio.gather(*streams)
        ended = [error for _, error in results if error is not None]
        assert len(ended) == 2 and all("engine stopped" in e and "killed in a test" in e for e in ended), results
        assert sorted(tokens for tokens, error in results if error is None) == [300, 300]
        # The server answers on the other engine.
        assert (await scheduler.submit(submission("after", 5))).rejection is None
        assert await outcome(scheduler, "after") == (5, None)

    run_two(llama_dir, tmp_path, body)


def test_a_lost_engines_requests_without_a_token_start_over_on_another(
        llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body(scheduler: SchedulerActor, engines: list[EngineActor]) -> None:
        # engine-0's loop never runs: what is routed there has no token when it is lost (at once, before
        # engine-1's loop could take it over).
        for i in range(2):
            assert (await scheduler.submit(submission(f"r{i}", 7))).rejection is None
        with caplog.at_level(logging.WARNING, logger="coserve.actors.scheduler_actor"):
            scheduler.engine_lost("engine-0", "never started")
        assert "1 request(s) re-routed, 0 held, 0 ended" in caplog.text
        assert await asyncio.gather(outcome(scheduler, "r0"), outcome(scheduler, "r1")) == [(7, None), (7, None)]
        assert engines[0].stats()["iterations"] == 0
        text = await scheduler.metrics_text()
        assert 'coserve_tokens_total{engine="engine-1",kind="completion",tenant="t"} 14.0' in text

    run_two(llama_dir, tmp_path, body, start=("engine-1",))
