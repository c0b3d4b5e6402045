"""The judges of model graders (`score_model`) in reinforcement jobs, asked by the scheduler itself.

A judgement is one chat completion of the judge model (this server's base model, or one of the tenant's
fine-tuned models), submitted to this scheduler (`SchedulerActor.submit`, then `stream`) **as the job's
tenant**: it is that tenant's inference, under its quotas and its virtual token counter, admitted like any
of its requests. Its reply is held to `graders.judging.judge_schema` by structured output, token by token
(the schema is coserve's own and bounded, so it skips the gateway's grammar check), and read with
`judging.read_judgement`. `judge` blocks: it runs on a grading worker thread while the scheduler's event
loop serves the judge's request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from coserve.contract.grader import ModelGrader
from coserve.contract.messages import AdapterSpec, Admission, TokenBatch, TokenSubmission
from coserve.contract.sampling import EosIds, SamplingParams
from coserve.contract.structured_output import StructuredOutput
from coserve.graders.judging import Judgement, judge_schema, read_judgement
from coserve.graders.templates import Sample, SampleParseError, VariableError, render

JUDGE_TIMEOUT_S = 600.0  # a judgement queued behind this long is reported as failed, never waited on forever

# (tenant, model id) -> the model's adapter (None: the base model); LookupError when it is not one
ResolveModel = Callable[[str, str], AdapterSpec | None]
# the judge's messages -> its prompt's token ids (the chat template, with the generation prompt)
EncodeChat = Callable[[list[dict[str, Any]]], list[int]]
# the judge's reply's token ids -> its text (special tokens skipped)
Decode = Callable[[Sequence[int]], str]


class RolloutJudges:
    """Asks judges for the scheduler's reinforcement jobs (module docstring).

    Args:
        submit / stream: the scheduler's own (`SchedulerActor.submit`, `.stream`).
        encode / decode: the judge's messages to its prompt's ids (the chat template), its reply's ids to text.
        eos: the ids the judge's reply ends at.
        resolve: a model id to its adapter, for the tenant.
        loop: the scheduler's event loop, once it runs (the judge's request runs there).
    """

    def __init__(self, submit: Callable[[TokenSubmission], Awaitable[Admission]],
                 stream: Callable[[str], AsyncIterator[TokenBatch]], encode: EncodeChat, decode: Decode,
                 eos: EosIds, resolve: ResolveModel, loop: Callable[[], asyncio.AbstractEventLoop | None]) -> None:
        self._submit, self._stream, self._encode, self._decode, self._eos = submit, stream, encode, decode, eos
        self._resolve, self._loop = resolve, loop
        self._ids = itertools.count()

    def judge(self, tenant: str, grader: ModelGrader, item: Mapping[str, Any], text: str) -> Judgement | None:
        """The judge's verdict on `text` for row `item`; None when a template cannot be rendered (the
        grading flags it). Blocks: call it off the scheduler's loop."""
        try:
            messages = [{"role": role, "content": render(content, item, Sample(text))}
                        for role, content in grader.messages]
        except (VariableError, SampleParseError):
            return None
        try:
            adapter = self._resolve(tenant, grader.model)
        except LookupError as err:
            return Judgement(None, server_error=str(err))
        prompt = self._encode(messages)
        sampling = SamplingParams(
            temperature=1.0 if grader.sampling.temperature is None else grader.sampling.temperature,
            top_p=1.0 if grader.sampling.top_p is None else grader.sampling.top_p, seed=grader.sampling.seed,
            max_tokens=grader.sampling.max_completion_tokens,
            structured_output=StructuredOutput.json_schema(judge_schema(grader)))
        submission = TokenSubmission(f"judge-{tenant}-{next(self._ids)}", tenant, list(prompt), sampling, self._eos,
                                     adapter, client_max_tokens=sampling.max_tokens)
        loop = self._loop()
        if loop is None:
            return Judgement(None, server_error="the scheduler is not running")
        future = asyncio.run_coroutine_threadsafe(self._ask(submission), loop)
        try:
            reply, error = future.result(JUDGE_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            return Judgement(None, len(prompt), server_error=f"no judgement within {JUDGE_TIMEOUT_S:.0f} s")
        if error is not None:
            return Judgement(None, len(prompt), server_error=error)
        return read_judgement(grader, self._decode(reply),
                              len(prompt) + len(reply))

    async def _ask(self, submission: TokenSubmission) -> tuple[list[int], str | None]:
        admission = await self._submit(submission)
        if admission.rejection is not None:
            return [], f"{admission.rejection.status} {admission.rejection.message}"
        tokens: list[int] = []
        async for batch in self._stream(submission.request_id):
            for delta in batch.deltas:
                tokens.extend(delta.token_ids)
            if batch.error is not None:
                return tokens, batch.error
        return tokens, None
