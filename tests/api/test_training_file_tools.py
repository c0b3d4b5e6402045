"""Fine-tuning rows in OpenAI's function-calling format (issue 20 item 5): the upload check accepts
them and refuses each malformed shape with the line and the field, and a job on them trains through
the real `--local` server with the official client: on a tiny qwen2 model (Qwen's tool format) it
succeeds with the trained token count of the mask; on a template without tool support (ChatML) it
fails with invalid_training_file naming the example."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessage
from transformers import AutoTokenizer

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.files import validate_finetune_jsonl
from coserve.model.chat_templates import CHATML_TEMPLATE
from local_server import LocalServer, local_server, poll_job, upload_jsonl
from trainer_data import encode_example

KEY = "sk-tools-0123456789"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get-time_2"}}]


def _call(call_id: str, arguments: str = '{"city": "Paris"}', name: str = "get_weather") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _row(i: int = 0) -> dict[str, Any]:
    """A row with parallel calls (no content), their answers, a weight-0 call turn and a final answer."""
    return {"messages": [
        {"role": "user", "content": f"Weather in Paris, and the time? ({i})"},
        {"role": "assistant", "tool_calls": [_call("c1"), _call("c2", "{}", "get-time_2")]},
        {"role": "tool", "tool_call_id": "c2", "content": "10:00"},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "assistant", "content": None, "weight": 0, "tool_calls": [_call("c3", '{"city": "Rome"}')]},
        {"role": "tool", "tool_call_id": "c3", "content": "Rain"},
        {"role": "assistant", "content": f"Sunny at 10:00 ({i})."}],
        "tools": TOOLS, "parallel_tool_calls": True}


def _line(row: dict[str, Any]) -> bytes:
    return json.dumps(row).encode()


def test_tool_rows_are_accepted() -> None:
    ends_on_call = {"messages": [{"role": "user", "content": "Time?"},
                                 {"role": "assistant", "content": "Checking.",
                                  "tool_calls": [_call("x", "{}", "get-time_2")]}],
                    "tools": TOOLS, "parallel_tool_calls": False}
    no_tools = {"messages": _row()["messages"][:4] + [{"role": "assistant", "content": "ok"}]}
    # Null optional keys are absent (the official client's `message.model_dump()` writes them).
    reply = ChatCompletionMessage(role="assistant", content="Hello").model_dump()
    assert {"tool_calls", "function_call", "refusal", "annotations", "audio"} <= set(reply)
    dumped = {"messages": [{"role": "user", "content": "Hi", "name": None}, reply]}
    rows = (_row(), ends_on_call, no_tools, dumped)
    assert validate_finetune_jsonl(b"\n".join(_line(r) for r in rows)).num_examples == 4


def _edit(path: str, value: Any) -> dict[str, Any]:
    """`_row()` with the value at `path` ("messages.1.tool_calls.0.id") replaced, or removed (DELETE)."""
    row = copy.deepcopy(_row())
    *parents, last = path.split(".")
    node: Any = row
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    key = int(last) if isinstance(node, list) else last
    if value is DELETE:
        del node[key]
    else:
        node[key] = value
    return row


class _Delete:
    def __repr__(self) -> str:  # readable, stable test ids
        return "DELETE"


DELETE = _Delete()
BAD_ROWS = [
    ("tools", [], "'tools' must be a non-empty list"),
    ("tools", {"type": "function"}, "'tools' must be a non-empty list"),
    ("tools.0", "get_weather", "tools[0] is not a JSON object"),
    ("tools.0.type", "retrieval", "tools[0] needs 'type': 'function'"),
    ("tools.0.function", DELETE, "tools[0] needs a 'function' object"),
    ("tools.0.extra", 1, "tools[0] has unrecognized keys ['extra']"),
    ("tools.0.function.name", "get weather", "tools[0].function has an invalid name 'get weather'"),
    ("tools.0.function.name", "x" * 65, "tools[0].function has an invalid name"),
    ("tools.0.function.name", "", "tools[0].function has an invalid name ''"),
    ("tools.0.function.name", DELETE, "tools[0].function has an invalid name None"),
    ("tools.0.function.parameters", "object", "tools[0].function.parameters must be a JSON Schema object"),
    ("tools.0.function.description", 3, "tools[0].function.description must be a string"),
    ("tools.0.function.examples", [], "tools[0].function has unrecognized keys ['examples']"),
    ("tools.1.function.name", "get_weather", "tools[1] repeats the function name 'get_weather'"),
    ("parallel_tool_calls", "yes", "'parallel_tool_calls' must be true or false"),
    ("parallel_tool_calls", False, "message 2 has 2 tool calls but the row sets 'parallel_tool_calls': false"),
    ("functions", [], "the row has the deprecated 'functions'; use 'tools'"),
    ("metadata", {}, "the row has unrecognized keys ['metadata']"),
    ("messages.1.tool_calls", [], "message 2 has 'tool_calls' that is not a non-empty list"),
    ("messages.1.tool_calls", {"id": "c1"}, "message 2 has 'tool_calls' that is not a non-empty list"),
    ("messages.1.tool_calls.0", "call", "message 2 tool_calls[0] is not a JSON object"),
    ("messages.1.tool_calls.0.id", DELETE, "message 2 tool_calls[0] needs a non-empty string 'id'"),
    ("messages.1.tool_calls.0.id", 7, "message 2 tool_calls[0] needs a non-empty string 'id'"),
    ("messages.1.tool_calls.0.type", DELETE, "message 2 tool_calls[0] needs 'type': 'function'"),
    ("messages.1.tool_calls.0.function", DELETE, "message 2 tool_calls[0] needs a 'function' object"),
    ("messages.1.tool_calls.0.index", 0, "message 2 tool_calls[0] has unrecognized keys ['index']"),
    ("messages.1.tool_calls.0.function.name", "a.b", "message 2 tool_calls[0].function has an invalid name"),
    ("messages.1.tool_calls.0.function.name", "unknown_fn",
     "message 2 tool_calls[0] calls 'unknown_fn', which is not in the row's 'tools'"),
    ("messages.1.tool_calls.0.function.arguments", {"city": "Paris"},
     "message 2 tool_calls[0].function.arguments must be a string holding a JSON object"),
    ("messages.1.tool_calls.0.function.arguments", "{city: Paris}",
     "message 2 tool_calls[0].function.arguments: not valid JSON"),
    ("messages.1.tool_calls.0.function.arguments", "[1, 2]",
     "message 2 tool_calls[0].function.arguments must be a JSON object, not list"),
    ("messages.1.tool_calls.1.id", "c1", "message 2 tool_calls[1] repeats the id 'c1'"),
    ("messages.1.content", 5, "message 2 needs a string 'content' or null"),
    ("messages.1.function_call", {"name": "f", "arguments": "{}"},
     "message 2 has the deprecated 'function_call'; use 'tool_calls'"),
    ("messages.0.tool_calls", [_call("u")], "message 1 has 'tool_calls' but only assistant messages may"),
    ("messages.2.tool_call_id", DELETE, "message 3 is a 'tool' message and needs a string 'tool_call_id'"),
    ("messages.2.tool_call_id", 2, "message 3 is a 'tool' message and needs a string 'tool_call_id'"),
    ("messages.2.tool_call_id", "c9", "message 3 has 'tool_call_id' 'c9' that answers no earlier tool call"),
    ("messages.3.tool_call_id", "c2", "message 4 has 'tool_call_id' 'c2' that was already answered"),
    ("messages.2.content", None, "message 3 needs a string 'content'"),
    ("messages.0.tool_call_id", "c1", "message 1 has a 'tool_call_id' but only 'tool' messages may"),
    ("messages.3", {"role": "user", "content": "and?"},
     "message 4 comes before the tool call(s) ['c1'] are answered"),
    ("messages.0", {"role": "tool", "tool_call_id": "c1", "content": "early"},
     "message 1 has 'tool_call_id' 'c1' that answers no earlier tool call"),
    ("messages.6.content", None, "message 7 needs a string 'content'"),  # no tool_calls: content required
]


@pytest.mark.parametrize(("path", "value", "reason"), BAD_ROWS, ids=[f"{p}={v!r}"[:60] for p, v, _ in BAD_ROWS])
def test_malformed_tool_rows_name_the_line_and_field(path: str, value: Any, reason: str) -> None:
    data = b"\n".join([_line(_row()), b"", _line(_edit(path, value)), b"{oops"])
    with pytest.raises(ProtocolError) as info:
        validate_finetune_jsonl(data)
    err = info.value
    assert (err.status, err.code, err.param) == (400, "invalid_file_format", "file")
    assert err.message.startswith("Invalid file format. Line 3: ") and reason in err.message, err.message


# ----------------------------------------------------------------------------- through the server


# ChatML that refuses two messages of one role in a row, as Mistral's and Llama 2's templates do.
ALTERNATING_TEMPLATE = CHATML_TEMPLATE.replace(
    "{%- for message in messages %}",
    "{%- for message in messages %}{%- if not loop.first and message['role'] == messages[loop.index0 - 1]"
    "['role'] %}{{- raise_exception('Conversation roles must alternate') }}{%- endif %}")


@pytest.fixture(scope="module")
def servers(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, LocalServer]]:
    tenants = {"acme": {"api_keys": [KEY]}}
    strict = tmp_path_factory.mktemp("alternating") / "llama"
    shutil.copytree(model_dirs["llama"], strict)
    config = json.loads((strict / "tokenizer_config.json").read_text())
    (strict / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": ALTERNATING_TEMPLATE}))
    with local_server(model_dirs["qwen2"], tmp_path_factory.mktemp("tools-qwen2"), tenants) as qwen, \
            local_server(model_dirs["llama"], tmp_path_factory.mktemp("tools-llama"), tenants) as llama, \
            local_server(strict, tmp_path_factory.mktemp("tools-strict"), tenants) as alternating:
        yield {"qwen2": qwen, "llama": llama, "alternating": alternating}


def test_a_tools_job_trains_the_masked_tokens(servers: dict[str, LocalServer],
                                              model_dirs: dict[str, Path]) -> None:
    rows = [_row(i) for i in range(10)]
    oa = servers["qwen2"].client(KEY)
    job = oa.fine_tuning.jobs.create(model=servers["qwen2"].base, training_file=upload_jsonl(oa, rows),
                                     hyperparameters={"n_epochs": 2, "batch_size": 5})
    job = poll_job(oa, job.id, timeout=120)
    assert job.status == "succeeded", job.error
    # Per row: the two parallel calls + <|im_end|>, and the final answer + <|im_end|> (not the weight-0
    # call, the tool results, the tools prompt or the headers); the mask says the same.
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["qwen2"])
    calls = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get-time_2", "arguments": {}}\n</tool_call><|im_end|>')
    per_row = [len(tokenizer(calls)["input_ids"]) + len(tokenizer(f"Sunny at 10:00 ({i}).<|im_end|>")["input_ids"])
               for i in range(10)]
    assert [encode_example(tokenizer, r["messages"], 4000, r["tools"]).num_trained for r in rows] == per_row
    assert job.trained_tokens == 2 * sum(per_row)


def test_a_tools_job_on_a_template_without_tool_support_fails_clearly(servers: dict[str, LocalServer]) -> None:
    oa = servers["llama"].client(KEY)
    plain = [{"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello"}]}
             for i in range(10)]
    job = oa.fine_tuning.jobs.create(model=servers["llama"].base,
                                     training_file=upload_jsonl(oa, plain[:3] + [_row()] + plain[3:]))
    job = poll_job(oa, job.id, timeout=60)
    assert job.status == "failed" and job.error is not None
    assert (job.error.code, job.error.param) == ("invalid_training_file", "training_file")
    assert job.error.message.startswith("training example 4: the base model's chat template does not render")
    assert job.trained_tokens is None or job.trained_tokens == 0

    # The same row in the validation file fails the job naming that file.
    job = oa.fine_tuning.jobs.create(model=servers["llama"].base, training_file=upload_jsonl(oa, plain),
                                     validation_file=upload_jsonl(oa, [_row()]))
    job = poll_job(oa, job.id, timeout=60)
    assert job.status == "failed" and job.error is not None
    assert (job.error.code, job.error.param) == ("invalid_validation_file", "validation_file")
    assert job.error.message.startswith("validation example 1: the base model's chat template does not")


def test_a_template_that_raises_fails_the_job_and_not_the_job_loop(servers: dict[str, LocalServer]) -> None:
    """A template's own exception (a jinja error, not a ValueError) used to escape the job manager:
    every reconcile failed on it, the job stayed in validating_files and no other job started."""
    oa = servers["alternating"].client(KEY)
    rows = [{"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello"}]}
            for i in range(10)]
    twice = {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"},
                          {"role": "assistant", "content": "Hello"}]}
    bad = oa.fine_tuning.jobs.create(model=servers["alternating"].base,
                                     training_file=upload_jsonl(oa, rows[:5] + [twice] + rows[5:]))
    good = oa.fine_tuning.jobs.create(model=servers["alternating"].base, training_file=upload_jsonl(oa, rows),
                                      hyperparameters={"n_epochs": 1})
    bad = poll_job(oa, bad.id, timeout=30)
    assert bad.status == "failed" and bad.error is not None
    assert (bad.error.code, bad.error.param) == ("invalid_training_file", "training_file")
    assert bad.error.message == ("training example 6: the chat template cannot render this conversation: "
                                 "Conversation roles must alternate")
    assert poll_job(oa, good.id, timeout=60).status == "succeeded"


def test_a_malformed_tool_row_is_refused_at_upload(servers: dict[str, LocalServer]) -> None:
    oa = servers["qwen2"].client(KEY)
    before = [f.id for f in oa.files.list()]
    bad = _edit("messages.1.tool_calls.0.function.arguments", "{not json")
    with pytest.raises(openai.BadRequestError) as info:
        oa.files.create(file=("t.jsonl", _line(_row()) + b"\n" + _line(bad)), purpose="fine-tune")
    assert info.value.code == "invalid_file_format" and info.value.param == "file"
    assert "Line 2: message 2 tool_calls[0].function.arguments: not valid JSON" in info.value.message
    assert [f.id for f in oa.files.list()] == before  # nothing stored
