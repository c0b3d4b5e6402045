"""A failed step on the vLLM engine does not wedge the server (issue 45): the scheduler actor and an engine
actor over `VllmEngine` (tiny llama, CPU).

* A request vLLM cannot take (ids past the vocabulary, below the gateway's checks) fails alone with its own
  error where the engine adds it; the request beside it completes.
* A failure inside vLLM's own step cannot be told apart by request: that plan's requests end with a
  generic error (never vLLM's text), and the engine serves the next requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_support import TEST_KV_GB, require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from coserve.actors.client import LocalSchedulerClient  # noqa: E402
from coserve.actors.engine_actor import EngineActor  # noqa: E402
from coserve.actors.scheduler_actor import SchedulerActor, SchedulerSettings  # noqa: E402
from coserve.actors.step_faults import GENERIC_MESSAGE  # noqa: E402
from coserve.cluster.policy_factory import CoServingPolicyFactory  # noqa: E402
from coserve.contract.engine import EngineKind  # noqa: E402
from coserve.contract.engine_config import EngineConfig  # noqa: E402
from coserve.contract.messages import TokenBatch, TokenSubmission  # noqa: E402
from coserve.contract.sampling import EosIds, SamplingParams  # noqa: E402
from coserve.planner.latency import ModelFingerprint  # noqa: E402
from coserve.planner.share_kinds import ShareKind  # noqa: E402

INFERENCE_ONLY = CoServingPolicyFactory(ModelFingerprint("tiny-llama", "cpu", "float32"), share=ShareKind.NONE)


def submission(request_id: str, prompt: list[int], tenant: str) -> TokenSubmission:
    return TokenSubmission(request_id=request_id, tenant=tenant, prompt_token_ids=prompt, origin="test",
                           sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           eos=EosIds(eos=None, extra=()))


async def outcome(client: LocalSchedulerClient, sub: TokenSubmission) -> tuple[str | None, int]:
    """Submit and read to the end: the stream's error and the tokens it gave."""
    admission = await client.submit(sub)
    assert admission.rejection is None, admission.rejection
    last, tokens = TokenBatch(), 0
    stream: AsyncIterator[TokenBatch] = client.stream(sub.request_id)
    async for batch in stream:
        tokens += sum(len(d.token_ids) for d in batch.deltas)
        last = batch
    assert last.done
    return last.error, tokens


def run(llama_dir: Path, body: Callable[[LocalSchedulerClient, Any], Awaitable[None]]) -> None:
    async def main() -> None:
        config = EngineConfig(model=str(llama_dir), dtype="float32", engine=EngineKind.VLLM,
                              kv_cache_memory_gb=TEST_KV_GB, max_num_seqs=8, max_batch_tokens=64)
        actor = EngineActor(config)
        client = LocalSchedulerClient(SchedulerActor(SchedulerSettings(model=str(llama_dir)), INFERENCE_ONLY), actor)
        await client.start()
        try:
            await body(client, actor.engine)
        finally:
            await client.close()
    asyncio.run(main())


def test_a_failed_vllm_step_fails_its_own_work_and_the_engine_goes_on(llama_dir: Path) -> None:
    async def body(client: LocalSchedulerClient, engine: Any) -> None:
        vocab = engine.model_config.vocab_size
        # Ids past the vocabulary: refused where the engine adds the request; its neighbour completes.
        bad, good = await asyncio.gather(outcome(client, submission("bad", [5, vocab + 4, 6], "attacker")),
                                         outcome(client, submission("good", list(range(5, 20)), "victim")))
        assert bad == (f"The engine could not run this request: ValueError: token id {vocab + 4} is outside "
                       f"the model's vocabulary (0..{vocab - 1})", 0)
        assert good == (None, 8)

        # vLLM's own step fails (once): not told apart, so a generic error for that plan's requests.
        real, calls = engine.runtime.run, []

        def failing_once(targets: dict[str, int]) -> Any:
            calls.append(sorted(targets))
            if len(calls) == 1:
                raise RuntimeError("vLLM internal failure at /opt/vllm/worker.py")
            return real(targets)

        engine.runtime.run = failing_once
        first = await outcome(client, submission("first", list(range(7, 19)), "victim"))
        assert first == (GENERIC_MESSAGE, 0) and "vLLM" not in GENERIC_MESSAGE
        after = await asyncio.gather(*(outcome(client, submission(f"next{i}", list(range(5 + i, 17 + i)), "victim"))
                                       for i in range(3)))
        assert after == [(None, 8)] * 3
        assert not engine.runtime.has("first") and not engine.runtime.has("bad")  # freed in vLLM too
        metrics = await client.metrics_text()
        assert 'coserve_engine_failed_steps_total{engine="engine-0"} 1.0' in metrics
        assert 'coserve_engine_step_faults_total{engine="engine-0",work="request"} 1.0' in metrics

    run(llama_dir, body)
