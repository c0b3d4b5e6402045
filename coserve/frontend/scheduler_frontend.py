"""`SchedulerFrontend`: the gateway's side of generation. Prompts in, text out; the scheduler between
sees token ids only.

A submission is prepared here (`PromptIntake`: chat template or raw prompt, tools, tokenization off
the event loop, the context and adapter checks), sent to the scheduler as a `TokenSubmission`, and its
token stream comes back through a `TextStream` (incremental detokenization, stop strings, decoded
logprobs). A stop string found in a choice stops that choice in the scheduler (`stop`). With `--local`
this runs on the same event loop as the scheduler; on Ray it runs in the gateway's Serve replica, so
the per-stream text work is spread over the gateway replicas instead of the central scheduler. This
process imports no torch (`Tokenizer` is rebuilt from the engine's `TokenizerSpec`).

It has the surface the endpoints call (`GatewayState.scheduler`): `start`, `close`, `submit`, `stream`,
`abort`, `metrics_text`, `health`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Protocol

from coserve.contract.engine import RuntimeLayout
from coserve.contract.messages import AdapterSpec, Admission, Rejection, TokenBatch, TokenSubmission
from coserve.contract.sampling import EosIds, SamplingParams
from coserve.contract.training_calls import RunAnswer, RunQuery
from coserve.frontend.intake import PromptIntake
from coserve.frontend.messages import ChatAdmission, ChatSubmission, StreamBatch
from coserve.frontend.text_stream import TextStream
from coserve.frontend.tokenizer import Tokenizer
from coserve.model.config import ModelConfig


class SchedulerClient(Protocol):
    """The scheduler as the gateway reaches it (`coserve.actors.client`: in-process or over Ray)."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def submit(self, sub: TokenSubmission) -> Admission: ...
    def stream(self, request_id: str) -> AsyncIterator[TokenBatch]: ...
    async def stop(self, request_id: str, index: int) -> bool: ...
    async def abort(self, request_id: str) -> bool: ...
    async def metrics_text(self) -> str: ...
    async def health(self) -> str | None: ...
    async def training(self, query: RunQuery) -> RunAnswer: ...


class SchedulerFrontend:
    """The tokenizer side of one gateway in front of the scheduler.

    Args:
        scheduler: the scheduler client.
        tokenizer: the model's tokenizer (chat template included).
        model_config: the model's config (vocabulary size, EOS ids, shapes for the adapter check).
        max_model_len / max_lora_rank: the engine's context length and adapter rank limit.
        structured_output: the engine enforces grammars (requests that need one are refused if not).
    """

    def __init__(self, scheduler: SchedulerClient, tokenizer: Any, model_config: ModelConfig,
                 max_model_len: int, max_lora_rank: int, structured_output: bool = True) -> None:
        self.client = scheduler
        self._tokenizer = tokenizer
        self._intake = PromptIntake(tokenizer, model_config)
        self._intake.attach(max_model_len, max_lora_rank, structured_output)
        self._eos = EosIds.resolve(tokenizer, model_config.eos_token_ids)
        self._texts: dict[str, TextStream] = {}  # admitted, stream not read yet

    @classmethod
    def for_engine(cls, model: str, scheduler: SchedulerClient, layout: RuntimeLayout,
                   chat_template: str | None = None) -> SchedulerFrontend:
        """The frontend of the engine serving the model folder `model`: the engine's tokenizer (its
        layout's `TokenizerSpec`; `chat_template` replaces its template: `--chat-template`), the folder's
        config (read torch-free), the engine's limits.

        Raises:
            ValueError: the engine reported no tokenizer.
        """
        if layout.tokenizer is None:
            raise ValueError("the engine reported no tokenizer; the gateway needs it")
        spec = layout.tokenizer if chat_template is None else replace(layout.tokenizer, chat_template=chat_template)
        return cls(scheduler, Tokenizer.from_spec(spec), ModelConfig.from_pretrained(model),
                   layout.max_model_len, layout.max_lora_rank, layout.structured_output)

    async def start(self) -> None:
        await self.client.start()

    async def close(self) -> None:
        await self.client.close()
        self._intake.close()

    async def submit(self, sub: ChatSubmission) -> ChatAdmission:
        """Prepare the prompt, then queue it in the scheduler (which checks the quota)."""
        intake = await self._intake.prepare(sub)
        if isinstance(intake, Rejection):
            return ChatAdmission(rejection=intake)
        admission = await self.client.submit(TokenSubmission(
            request_id=sub.request_id, tenant=sub.tenant, prompt_token_ids=intake.prompt, sampling=intake.sampling,
            eos=self._eos, adapter=intake.adapter, client_max_tokens=sub.sampling.max_tokens,
            counts_request=sub.counts_request, retain_kv_s=sub.retain_kv_s))
        if admission.rejection is not None:
            return ChatAdmission(rejection=admission.rejection)
        self._texts[sub.request_id] = TextStream(intake.sampling, self._tokenizer, admission.prompt_tokens)
        return ChatAdmission(prompt_tokens=admission.prompt_tokens, tool_family=intake.tool_family,
                             prompt_text=intake.prompt_text)

    @property
    def max_model_len(self) -> int:
        return self._intake.max_model_len

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size: token ids a client gives are in 0..vocab_size - 1."""
        return self._intake.vocab_size

    async def submit_tokens(self, request_id: str, tenant: str, prompt: list[int], sampling: SamplingParams,
                            adapter: AdapterSpec | None) -> Admission:
        """Queue a prompt given as token ids (the Tinker API's `sample`) once it fits the context and the
        adapter checks out; its output is read as token ids with `stream_tokens`."""
        checked = self._intake.check_tokens(prompt, sampling, adapter)
        if isinstance(checked, Rejection):
            return Admission(rejection=checked)
        return await self.client.submit(TokenSubmission(
            request_id=request_id, tenant=tenant, prompt_token_ids=prompt, sampling=checked, eos=self._eos,
            adapter=adapter, client_max_tokens=sampling.max_tokens))

    def stream_tokens(self, request_id: str) -> AsyncIterator[TokenBatch]:
        """The output of a request queued with `submit_tokens`, as token ids, batch by batch."""
        return self.client.stream(request_id)

    async def training(self, query: RunQuery) -> RunAnswer:
        """A training run's call or query (the Tinker API), answered by the scheduler."""
        return await self.client.training(query)

    async def stream(self, request_id: str) -> AsyncIterator[StreamBatch]:
        """The request's output as text, batch by batch, until a batch with `done`."""
        text = self._texts.pop(request_id, None)
        if text is None:
            yield StreamBatch(done=True, error=f"unknown request {request_id!r}")
            return
        async for batch in self.client.stream(request_id):
            out, stopped = text.apply(batch)
            for index in stopped:
                await self.client.stop(request_id, index)
            yield out
            if out.done:
                return

    async def abort(self, request_id: str) -> bool:
        """Stop a request (its client went away). False when the scheduler no longer has it."""
        self._texts.pop(request_id, None)
        return await self.client.abort(request_id)

    async def metrics_text(self) -> str:
        return await self.client.metrics_text()

    async def health(self) -> str | None:
        return await self.client.health()
