"""Protocol models: the official `openai` package parses our responses, its requests validate, and bad
input becomes a 400 OpenAI error body naming the offending param."""

from __future__ import annotations

import json
from typing import Any

import openai.types as oa
import openai.types.chat as oa_chat
import openai.types.fine_tuning as oa_ft
import pytest
from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint as OAFineTuningJobCheckpoint

from coserve.api.protocol.base import ErrorResponse, ProtocolError, UsageInfo, validate_request
from coserve.api.protocol.chat import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionTokenLogprob,
    ChoiceDelta,
    ChoiceLogprobs,
    TopLogprob,
)
from coserve.api.protocol.files import (
    FileDeleted,
    FileList,
    FileObject,
    validate_finetune_jsonl,
)
from coserve.api.protocol.fine_tuning import (
    CheckpointMetrics,
    FineTuningJob,
    FineTuningJobCheckpoint,
    FineTuningJobCreate,
    FineTuningJobError,
    FineTuningJobEvent,
    Hyperparameters,
    MetricsData,
)
from coserve.api.protocol.models import Model, ModelDeleted, ModelList
from coserve.contract.training_jsonl import read_rows
from coserve.contract.training_rows import TrainingFileKind

USER = {"role": "user", "content": "hi"}


def _wire(obj: Any) -> Any:
    """What a client receives: the JSON text of the dump, parsed back."""
    return json.loads(obj.model_dump_json())


def _chat_completion() -> ChatCompletion:
    lp = ChatCompletionTokenLogprob(token="He", logprob=-0.1, bytes=[72, 101],
                                    top_logprobs=[TopLogprob(token="He", logprob=-0.1, bytes=[72, 101])])
    choice = ChatCompletionChoice(index=0, message=ChatCompletionMessage(content="Hello"),
                                  finish_reason="stop", logprobs=ChoiceLogprobs(content=[lp]))
    return ChatCompletion(model="tiny", choices=[choice],
                          usage=UsageInfo(prompt_tokens=3, completion_tokens=1, total_tokens=4))


def test_openai_parses_chat_completion() -> None:
    ours = _chat_completion()
    theirs = oa_chat.ChatCompletion.model_validate(_wire(ours))
    assert theirs.id.startswith("chatcmpl-") and theirs.object == "chat.completion"
    assert theirs.choices[0].message.content == "Hello"
    assert theirs.choices[0].logprobs.content[0].top_logprobs[0].bytes == [72, 101]
    assert theirs.usage.total_tokens == 4


def test_openai_parses_chunks() -> None:
    first = ChatCompletionChunk(model="m", choices=[ChatCompletionChunkChoice(
        index=0, delta=ChoiceDelta(role="assistant", content=""))])
    last = ChatCompletionChunk(id=first.id, model="m", choices=[ChatCompletionChunkChoice(
        index=0, delta=ChoiceDelta(), finish_reason="length")])
    usage = ChatCompletionChunk(id=first.id, model="m", choices=[],
                                usage=UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3))
    parsed = [oa_chat.ChatCompletionChunk.model_validate(_wire(c)) for c in (first, last, usage)]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[1].choices[0].finish_reason == "length"
    assert parsed[2].choices == [] and parsed[2].usage.completion_tokens == 2
    assert _wire(first)["usage"] is None  # include_usage: every other chunk carries usage: null


def test_openai_parses_files_models_and_jobs() -> None:
    f = FileObject(id="file-abc", bytes=12, filename="train.jsonl", purpose="fine-tune")
    assert oa.FileObject.model_validate(_wire(f)).status == "processed"
    assert oa.FileDeleted.model_validate(_wire(FileDeleted(id="file-abc", deleted=True))).deleted
    assert FileList(data=[f], has_more=False).model_dump()["data"][0]["id"] == "file-abc"
    m = Model(id="ft:tiny:acme:sfx:ab12cd34", owned_by="acme", parent="tiny")
    assert oa.Model.model_validate(_wire(m)).owned_by == "acme"
    assert oa.ModelDeleted.model_validate(_wire(ModelDeleted(id=m.id, deleted=True))).deleted
    assert ModelList(data=[m]).model_dump()["object"] == "list"
    job = FineTuningJob(id="ftjob-1", hyperparameters=Hyperparameters(n_epochs=3, batch_size=1,
                        learning_rate_multiplier=1.0), model="tiny", organization_id="acme", seed=7,
                        status="failed", training_file="file-abc",
                        error=FineTuningJobError(code="invalid_n_examples", message="too few",
                                                 param="training_file"))
    theirs = oa_ft.FineTuningJob.model_validate(_wire(job))
    assert theirs.error.code == "invalid_n_examples" and theirs.hyperparameters.n_epochs == 3


def test_openai_parses_events_and_checkpoints() -> None:
    ev = FineTuningJobEvent.metrics_event("ftevent-1", MetricsData(step=3, train_loss=0.5, total_steps=10))
    theirs = oa_ft.FineTuningJobEvent.model_validate(_wire(ev))
    assert theirs.type == "metrics" and theirs.message.startswith("Step 3/10: training loss=0.5")
    assert theirs.data == {"step": 3, "train_loss": 0.5, "total_steps": 10}
    msg = oa_ft.FineTuningJobEvent.model_validate(_wire(FineTuningJobEvent(id="e2", message="started")))
    assert msg.type == "message" and msg.data is None
    ck = FineTuningJobCheckpoint(id="ftckpt_1", fine_tuned_model_checkpoint="ft:tiny:a:s:x:ckpt-step-2",
                                 fine_tuning_job_id="ftjob-1", step_number=2,
                                 metrics=CheckpointMetrics(step=2, train_loss=0.4))
    assert OAFineTuningJobCheckpoint.model_validate(_wire(ck)).metrics.train_loss == 0.4


def test_request_as_the_openai_client_sends_it() -> None:
    # The body the client posts for chat.completions.create(..., stream=True, extra_body={"top_k": 5}).
    body = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}, USER],
            "model": "tiny", "max_completion_tokens": 8, "max_tokens": 99, "stop": "\n", "seed": 3,
            "logprobs": True, "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.0, "top_k": 5, "store": False}
    req = validate_request(ChatCompletionRequest, body)
    assert req.include_usage and req.messages[0].text() == "be brief"
    sp = req.to_sampling_params(default_max_tokens=100)
    assert (sp.max_tokens, sp.stop, sp.logprobs, sp.top_k, sp.seed, sp.greedy) == (8, ["\n"], 2, 5, 3, True)
    plain = validate_request(ChatCompletionRequest, {"messages": [USER], "model": "m", "top_p": 0})
    sp = plain.to_sampling_params(default_max_tokens=50)
    assert (sp.max_tokens, sp.logprobs, sp.top_k, sp.top_p) == (50, None, 1, 1.0)
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty, sp.min_p, sp.logit_bias) == \
        (0.0, 0.0, 1.0, 0.0, None)


def test_sampling_controls_reach_the_sampling_params() -> None:
    # What the client posts for create(..., frequency_penalty=0.5, presence_penalty=-1, logit_bias={"7": -100},
    # extra_body={"repetition_penalty": 1.2, "min_p": 0.05}).
    body = {"messages": [USER], "model": "m", "frequency_penalty": 0.5, "presence_penalty": -1,
            "logit_bias": {"7": -100, "12": 3}, "repetition_penalty": 1.2, "min_p": 0.05}
    sp = validate_request(ChatCompletionRequest, body).to_sampling_params(default_max_tokens=8)
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty, sp.min_p) == (0.5, -1.0, 1.2, 0.05)
    assert sp.logit_bias == {7: -100.0, 12: 3.0}


@pytest.mark.parametrize(("patch", "param", "code"), [
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [USER, {"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[1].content[0].type", "invalid_value"),
    ({"messages": [USER, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "invalid_value"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"model": None}, "model", "invalid_type"),
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_value"),
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"presence_penalty": 3}, "presence_penalty", "invalid_value"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty", "invalid_value"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty", "invalid_value"),
    ({"repetition_penalty": -1}, "repetition_penalty", "invalid_value"),
    ({"min_p": -0.1}, "min_p", "invalid_value"),
    ({"logit_bias": {"5 ": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": -101}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": 1.5}}, "logit_bias", "invalid_type"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"max_tokens": True}, "max_tokens", "invalid_type"),
    # Unknown fields: OpenAI's `Unrecognized request argument supplied`, named whatever their spelling.
    ({"max_token": 4}, "max_token", "unknown_parameter"),
    ({"maxTokens": 4}, "maxTokens", "unknown_parameter"),
    ({"messages": [USER, {**USER, "str": 1}]}, "messages[1].str", "unknown_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}]},
     "messages[0].content[0].cache", "unknown_parameter"),
    ({"tool_choice": {"type": "function", "function": {"name": "f", "strict": True}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice.function.strict",
     "unknown_parameter"),
    # An image part is a wrong `type`, not an unknown `image_url` key.
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "invalid_value"),
    ({"messages": [{"role": "assistant", "content": "a", "audio": {"id": "x"}}]}, "messages[0].audio",
     "unsupported_parameter"),
])
def test_bad_chat_request_names_param(patch: dict[str, Any], param: str, code: str) -> None:
    body = {"messages": [USER], "model": "m", **patch}
    with pytest.raises(ProtocolError) as info:
        validate_request(ChatCompletionRequest, body)
    err = info.value
    assert (err.status, err.type, err.param, err.code) == (400, "invalid_request_error", param, code)
    wire = err.to_response().model_dump()
    assert set(wire["error"]) == {"message", "type", "param", "code"} and param in wire["error"]["message"]


def test_missing_param_and_error_body_parse() -> None:
    with pytest.raises(ProtocolError) as info:
        validate_request(ChatCompletionRequest, {"model": "m"})
    assert (info.value.param, info.value.code) == ("messages", "missing_required_parameter")
    body = ErrorResponse.model_validate(_wire(info.value.to_response()))
    assert body.error.param == "messages"


def test_finetune_create_accepts_client_body_and_resolves() -> None:
    body = {"model": "tiny", "training_file": "file-1", "suffix": "my-model_2", "seed": 1,
            "metadata": {"team": "x"},
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}},
            "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ["q_proj"]}}
    job = validate_request(FineTuningJobCreate, body)
    hp = job.requested_hyperparameters()
    assert (hp.n_epochs, hp.batch_size, hp.learning_rate_multiplier) == (2, "auto", "auto")
    assert job.lora is not None and job.lora.target_modules == ["q_proj"]
    dpo = validate_request(FineTuningJobCreate, {"model": "m", "training_file": "f", "method": {
        "type": "dpo", "dpo": {"hyperparameters": {"beta": 0.25, "n_epochs": 1}}}})
    assert dpo.requested_hyperparameters().model_dump() == {
        "batch_size": "auto", "learning_rate_multiplier": "auto", "n_epochs": 1, "beta": 0.25}
    legacy_body = {"model": "m", "training_file": "f", "hyperparameters": {"batch_size": "auto", "n_epochs": 50}}
    legacy = validate_request(FineTuningJobCreate, legacy_body)
    assert legacy.requested_hyperparameters().n_epochs == 50


def test_a_reinforcement_body_keeps_its_grader_and_hyperparameters() -> None:
    grader = {"type": "string_check", "name": "g", "input": "{{ sample.output_text }}",
              "reference": "{{ item.answer }}", "operation": "eq"}
    body = {"model": "m", "training_file": "f", "method": {"type": "reinforcement", "reinforcement": {
        "grader": grader, "max_completion_tokens": 64,
        "hyperparameters": {"n_epochs": 1, "compute_multiplier": 2, "eval_samples": 0}}}}
    job = validate_request(FineTuningJobCreate, body)
    assert job.method is not None and job.method.reinforcement is not None
    assert job.method.reinforcement.grader == grader and job.method.reinforcement.max_completion_tokens == 64
    # The shape only: 0 reaches `ReinforcementRequest`, which refuses it (not "auto").
    assert job.requested_hyperparameters().model_dump() == {
        "batch_size": "auto", "learning_rate_multiplier": "auto", "n_epochs": 1, "compute_multiplier": 2.0,
        "eval_interval": "auto", "eval_samples": 0, "reasoning_effort": "default"}
    legacy = validate_request(FineTuningJobCreate, {**body, "hyperparameters": {"n_epochs": 3}, "method": {
        "type": "reinforcement", "reinforcement": {"grader": grader}}})
    assert legacy.requested_hyperparameters().model_dump() == {
        "batch_size": "auto", "learning_rate_multiplier": "auto", "n_epochs": 3}


@pytest.mark.parametrize(("patch", "param"), [
    ({"hyperparameters": {"n_epochs": 51}}, "hyperparameters.n_epochs"),
    ({"hyperparameters": {"batch_size": 0}}, "hyperparameters.batch_size"),
    ({"hyperparameters": {"learning_rate_multiplier": 0}}, "hyperparameters.learning_rate_multiplier"),
    ({"hyperparameters": {"learning_rate_multiplier": "fast"}}, "hyperparameters.learning_rate_multiplier"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 257}}}},
     "method.supervised.hyperparameters.batch_size"),
    ({"method": {"type": "reinforcement"}}, "method.reinforcement"),
    ({"method": {"type": "reinforcement", "reinforcement": {"grader": {}, "beta": 1}}}, "method.reinforcement.beta"),
    ({"method": {"type": "reinforcement", "reinforcement": {"grader": {}, "hyperparameters": {
        "reasoning_effort": "max"}}}}, "method.reinforcement.hyperparameters.reasoning_effort"),
    ({"method": {"type": "supervised", "reinforcement": {"grader": {}}}}, "method.reinforcement"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}}}, "method.dpo.hyperparameters.beta"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 10.5}}}},
     "method.dpo.hyperparameters.beta"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}}},
     "method.supervised.hyperparameters.beta"),
    ({"method": {"type": "dpo", "supervised": {}}}, "method.supervised"),
    ({"method": {"type": "supervised", "grader": {}}}, "method.grader"),
    ({"hyperparameters": {"n_epoch": 2}}, "hyperparameters.n_epoch"),
    ({"hyperparameters": {"n_epochs": 2}, "method": {"type": "supervised", "supervised": {
        "hyperparameters": {"n_epochs": 3}}}}, "hyperparameters"),
    ({"suffix": "a" * 65}, "suffix"),
    ({"suffix": "bad:name"}, "suffix"),
    ({"seed": -1}, "seed"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"lora": {"lora_dropout": 1.0}}, "lora.lora_dropout"),
    ({"training_file": None}, "training_file"),
])
def test_bad_finetune_request_names_param(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(ProtocolError) as info:
        validate_request(FineTuningJobCreate, {"model": "m", "training_file": "f", **patch})
    assert (info.value.status, info.value.param) == (400, param)


def _line(*messages: dict[str, Any]) -> bytes:
    return json.dumps({"messages": list(messages)}).encode()


GOOD = _line({"role": "system", "content": "s"}, USER, {"role": "assistant", "content": "a", "weight": 1})


def test_jsonl_counts_examples() -> None:
    assert validate_finetune_jsonl(b"\xef\xbb\xbf" + b"\n".join([GOOD] * 3) + b"\n\n").num_examples == 3


@pytest.mark.parametrize(("bad", "reason"), [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"prompt": "p", "completion": "c"}', "'messages'"),
    (_line(USER), "a reinforcement row in a file of chat rows"),
    (_line({"role": "system", "content": "s"}), "no assistant message"),
    (_line({"role": "bot", "content": "x"}, {"role": "assistant", "content": "a"}), "message 1"),
    (_line(USER, {"role": "assistant", "content": None}), "message 2 needs a string"),
    (_line(USER, {"role": "assistant", "content": "a", "weight": 2}), "'weight'"),
    (_line(USER, {"role": "assistant", "content": "a", "weight": True}), "'weight'"),
    (_line({"role": "user", "content": "q", "weight": 1}, {"role": "assistant", "content": "a"}),
     "only assistant"),
    (_line(USER, {"role": "assistant", "content": "a", "extra": 1}), "unrecognized"),
    (b"\xff\xfe", "UTF-8"),
])
def test_jsonl_reports_first_bad_line(bad: bytes, reason: str) -> None:
    # Line 3 is bad, line 5 is bad too: only the first one is reported.
    data = b"\n".join([GOOD, b"", bad, GOOD, b"{oops"])
    with pytest.raises(ProtocolError) as info:
        validate_finetune_jsonl(data)
    err = info.value
    assert (err.status, err.code, err.param) == (400, "invalid_file_format", "file")
    assert "Line 3:" in err.message and reason in err.message and "Line 5" not in err.message


def test_jsonl_rejects_empty_file() -> None:
    with pytest.raises(ProtocolError, match="no examples"):
        validate_finetune_jsonl(b"\n \n")


def _pair(**patch: Any) -> dict[str, Any]:
    row = {"input": {"messages": [{"role": "system", "content": "be brief"}, USER]},
           "preferred_output": [{"role": "assistant", "content": "Short."}],
           "non_preferred_output": [{"role": "assistant", "content": "A long and rambling answer."}]}
    return {**row, **patch}


def test_preference_rows_are_counted_as_a_dpo_file() -> None:
    data = b"\n".join(json.dumps(_pair()).encode() for _ in range(3))
    summary = validate_finetune_jsonl(data)
    assert (summary.num_examples, summary.kind) == (3, TrainingFileKind.PREFERENCE)
    assert validate_finetune_jsonl(GOOD).kind == TrainingFileKind.CHAT


@pytest.mark.parametrize(("patch", "reason"), [
    ({"preferred_output": [{"role": "assistant", "content": " "}]}, "'preferred_output' has an empty answer"),
    ({"non_preferred_output": []}, "'non_preferred_output' must be a list of one assistant message"),
    ({"non_preferred_output": [{"role": "assistant", "content": "Short."}]}, "the same answer"),
    ({"input": {"messages": [USER, {"role": "assistant", "content": "a"}]}}, "must end with a user message"),
    ({"input": {"messages": []}}, "non-empty 'messages'"),
    ({"input": {"messages": [{"role": "bot", "content": "x"}]}}, "input message 1"),
    ({"preferred_output": [{"role": "user", "content": "x"}]}, "must be an assistant message"),
    ({"messages": [USER]}, "unrecognized keys ['messages']"),
])
def test_a_bad_preference_row_names_its_line(patch: dict[str, Any], reason: str) -> None:
    data = b"\n".join([json.dumps(_pair()).encode(), json.dumps(_pair(**patch)).encode()])
    with pytest.raises(ProtocolError) as info:
        validate_finetune_jsonl(data)
    assert "Line 2:" in info.value.message and reason in info.value.message


def test_a_file_holds_one_kind_of_row() -> None:
    with pytest.raises(ProtocolError, match="Line 2: a chat row in a file of preference rows"):
        validate_finetune_jsonl(b"\n".join([json.dumps(_pair()).encode(), GOOD]))
    with pytest.raises(ProtocolError, match="Line 2: a chat row in a file of reinforcement rows") as info:
        validate_finetune_jsonl(b"\n".join([_prompt(), GOOD]))
    assert "reinforcement rows, whose messages end with the user's prompt" in info.value.message


def _prompt(*messages: dict[str, Any], **fields: Any) -> bytes:
    return json.dumps({"messages": list(messages or [USER]), **fields}).encode()


def test_rows_ending_with_a_user_message_are_a_reinforcement_file() -> None:
    data = b"\n".join([_prompt(answer="4", meta={"tags": ["a"], "n": None}),
                       _prompt({"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                               {"role": "assistant", "content": "a"}, USER, tools=3), b""])
    summary = validate_finetune_jsonl(data)
    assert (summary.num_examples, summary.kind) == (2, TrainingFileKind.REINFORCEMENT)
    assert read_rows(b"\xef\xbb\xbf" + data)[0] == {"messages": [USER], "answer": "4",
                                                      "meta": {"tags": ["a"], "n": None}}


@pytest.mark.parametrize(("bad", "reason"), [
    (_prompt({"role": "bot", "content": "x"}, USER), "message 1 has an invalid 'role'"),
    (_prompt({"role": "user", "content": 3}), "message 1 needs a string 'content'"),
    (_prompt({"role": "user", "content": "q", "weight": 1}), "only assistant messages"),
    (_prompt({"role": "user", "content": "q", "extra": 1}), "unrecognized keys"),
    # Ending with the answer, it is a chat row, whose extra keys are refused as before.
    (json.dumps({"messages": [USER, {"role": "assistant", "content": "a"}], "answer": "4"}).encode(),
     "the row has unrecognized keys ['answer']"),
])
def test_a_bad_reinforcement_row_names_its_line(bad: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        validate_finetune_jsonl(b"\n".join([_prompt(), bad]))
    assert "Line 2:" in info.value.message and reason in info.value.message
