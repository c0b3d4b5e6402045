"""The judges of model graders in `graders/run`: each `score_model` / `label_model` grader of a grader's tree
is one chat completion of the model it names (the base model or a fine-tuned one this server serves),
submitted as the calling tenant, so a judgement is that tenant's inference: its quotas, its virtual token
counter, its place in the queue. The judge's reply is held to `graders.judging.judge_schema` by
structured output, token by token, and read with `judging.read_judgement`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.chat import ChatCompletionRequest
from coserve.api.serving.chat import ChatService
from coserve.contract.grader import Grader, ModelGrader
from coserve.contract.training_settings import SettingsError
from coserve.graders.judging import Judgement, judge_schema, model_graders, read_judgement
from coserve.graders.templates import Sample, SampleParseError, VariableError, render


def check_models(grader: Grader, tenant: str, chat: ChatService) -> None:
    """SettingsError naming `...model` when a model grader's judge is not a model this tenant may use."""
    for judge, param in model_graders(grader):
        try:
            chat.generation.resolve_model(tenant, judge.model)
        except ProtocolError:
            raise SettingsError(f"{param}.model", f"{param}.model: {judge.model!r} is not a model this server "
                                "serves to you (GET /v1/models lists them)") from None


def _request(judge: ModelGrader, messages: list[dict[str, str]]) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": judge.model, "messages": messages, "max_completion_tokens": judge.sampling.max_completion_tokens,
        "response_format": {"type": "json_schema", "json_schema": {"name": "judgement", "strict": True,
                                                                   "schema": judge_schema(judge)}}}
    for key in ("temperature", "top_p", "seed"):
        value = getattr(judge.sampling, key)
        if value is not None:
            body[key] = value
    return ChatCompletionRequest.model_validate(body)


async def _judge(judge: ModelGrader, item: Mapping[str, Any], sample: Sample, tenant: str,
                 chat: ChatService) -> Judgement | None:
    """The judge's verdict; None when a template cannot be rendered (the grading flags it)."""
    try:
        messages = [{"role": role, "content": render(content, item, sample)} for role, content in judge.messages]
    except (VariableError, SampleParseError):
        return None
    request = _request(judge, messages)
    try:
        submitted = await chat.submit(tenant, request)
        completion = await chat.complete(submitted, request)
    except ProtocolError as err:  # a quota, the context length, ...: this sample's judgement failed
        return Judgement(None, server_error=f"{err.status} {err.message}")
    usage = completion.usage
    return read_judgement(judge, completion.choices[0].message.content or "",
                          usage.total_tokens if usage is not None else 0)


async def judge_all(judges: list[ModelGrader], item: Mapping[str, Any], model_sample: str, tenant: str,
                    chat: ChatService) -> dict[int, Judgement]:
    """The verdicts of `judges` (a grader's `model_graders`) on the sample, keyed by `id(judge)`
    (`grading.grade`'s `judged`)."""
    verdicts: dict[int, Judgement] = {}
    for judge in judges:
        verdict = await _judge(judge, item, Sample(model_sample), tenant, chat)
        if verdict is not None:
            verdicts[id(judge)] = verdict
    return verdicts
