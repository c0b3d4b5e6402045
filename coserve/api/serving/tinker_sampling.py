"""The Tinker API's sampling: `create_sampling_session` and `asample`, as inference requests.

A sample is a request of the tenant like a chat completion: admitted under its quotas, ordered by its
virtual token counter, batched with every other request, through the base model or a sampler's saved
weights (`tinker://<run>/sampler_weights/<name>`, the model `tinker:<run>:<name>` of the OpenAI API).
It runs as a task of this gateway; its future's outcome is a `SampleResponse` (protobuf, as the SDK
reads it) with every sampled token's log-prob.
"""

from __future__ import annotations

import asyncio
import re
import uuid

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.tinker import CreateSamplingSessionRequest, SampleRequest
from coserve.api.protocol.tinker_wire import sample_response
from coserve.api.serving.generation import Generation
from coserve.api.serving.tinker_futures import SampleFuture, SamplingSession
from coserve.api.state import GatewayState
from coserve.contract.messages import AdapterSpec
from coserve.contract.sampling import SamplingParams

_SAMPLER_PATH = re.compile(r"tinker://(session-[0-9a-f]{24}:train:[0-9]{1,9})/sampler_weights/"
                           r"([A-Za-z0-9][A-Za-z0-9._-]{0,127})")  # matched whole: no trailing newline
# What a sample request may ask that coserve does not compute: refused unless left at its default.
_UNSUPPORTED = ("prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs",
                "prompt_alt_tokens_k", "prompt_logprobs_last_n")


class TinkerSampling:
    def __init__(self, state: GatewayState) -> None:
        self._generation = Generation(state)
        self._state, self._futures = state, state.tinker

    def adapter(self, tenant: str, base_model: str | None, model_path: str | None) -> AdapterSpec | None:
        """The weights to sample: a sampler's saved weights of the tenant's runs, or a served base model."""
        if model_path is not None:
            match = _SAMPLER_PATH.fullmatch(model_path)
            if match is None:
                raise ProtocolError(f"model_path must be tinker://<run id>/sampler_weights/<name> "
                                    f"(save_weights_for_sampler's path), got {model_path!r}.", param="model_path")
            spec = self._generation.resolve_model(tenant, f"tinker:{match.group(1)}:{match.group(2)}")
            assert spec is not None  # a tinker: model id is never a base model
            return spec
        if base_model is None:
            raise ProtocolError("Give base_model or model_path.", param="base_model")
        return self._generation.resolve_model(tenant, base_model)

    def open_session(self, tenant: str, request: CreateSamplingSessionRequest) -> str:
        if not self._futures.has_session(tenant, request.session_id):
            raise ProtocolError(f"No session {request.session_id!r}.", status=404, param="session_id",
                                code="session_not_found")
        adapter = self.adapter(tenant, request.base_model, request.model_path)
        base = self._state.base_models[0] if request.base_model is None else request.base_model
        return self._futures.open_sampling(SamplingSession(tenant, adapter, base, request.model_path))

    async def sample(self, tenant: str, request: SampleRequest) -> tuple[str, list[str]]:
        """Queue the sample (a 4xx now if it is refused); its future's id and its sequences' ids."""
        asked = [name for name in _UNSUPPORTED if getattr(request, name) not in (None, 0, False)]
        if asked:
            raise ProtocolError(f"coserve does not compute {asked[0]} for Tinker samples.", param=asked[0],
                                code="unsupported_parameter")
        if request.sampling_session_id is not None:
            session = self._futures.sampling(tenant, request.sampling_session_id)
            if session is None:
                raise ProtocolError(f"No sampling session {request.sampling_session_id!r}.", status=404,
                                    param="sampling_session_id", code="session_not_found")
            adapter = session.adapter
        else:
            adapter = self.adapter(tenant, request.base_model, request.model_path)
        self._generation.check_n(request.num_samples)
        prompt = [t for chunk in request.prompt.chunks for t in chunk.tokens]
        params = request.sampling_params
        stop = params.stop if isinstance(params.stop, list) else [] if params.stop is None else [params.stop]
        if any(isinstance(s, str) for s in stop):
            raise ProtocolError("coserve's Tinker sampling stops on token ids, not strings: pass "
                                "stop=[token ids] (the renderers' stop sequences).", param="sampling_params.stop")
        sampling = self._generation.sampling(lambda: SamplingParams(
            n=request.num_samples, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            seed=params.seed, max_tokens=params.max_tokens, stop_token_ids=[int(s) for s in stop] or None,
            logprobs=0))
        request_id = f"sample-{uuid.uuid4().hex}"
        self._futures.check_room(tenant)
        admission = await self._generation.scheduler.submit_tokens(request_id, tenant, prompt, sampling, adapter)
        if admission.rejection is not None:
            raise ProtocolError(admission.rejection.message, status=admission.rejection.status,
                                param=admission.rejection.param, code=admission.rejection.code)
        task = asyncio.get_running_loop().create_task(self._collect(request_id, request.num_samples))
        return self._futures.add(tenant, SampleFuture(task)), [f"{request_id}:{i}" for i in range(request.num_samples)]

    async def _collect(self, request_id: str, n: int) -> bytes:
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        length = [False] * n
        async for batch in self._generation.scheduler.stream_tokens(request_id):
            for delta in batch.deltas:
                tokens[delta.index].extend(delta.token_ids)
                logprobs[delta.index].extend(lp.logprob for lp in delta.logprobs or [])
                length[delta.index] = length[delta.index] or delta.finish_reason == "length"
            if batch.error is not None:
                raise RuntimeError(batch.error)
            if batch.done:
                break
        return sample_response([(tokens[i], logprobs[i], length[i]) for i in range(n)])
