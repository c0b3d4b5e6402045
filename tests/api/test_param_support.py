"""The OpenAI parameter tables (`coserve.api.protocol.param_support`) against the official client's request
types, docs/openai-parameters.md, and the server: every field is listed, the docs page's table is the module's, and what
is refused is a 400 naming it through the real `--local` server (what "not used" means is accepted). A field listed
nowhere, at the top level or nested, is OpenAI's 400 `Unrecognized request argument supplied` naming its path, unless
the server runs with `--lenient-params`."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params, file_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.fine_tuning import job_create_params
from openai.types.responses import response_create_params

from coserve.api.protocol import param_support
from coserve.api.protocol.chat import ChatCompletionRequest
from coserve.api.protocol.completions import CompletionRequest
from coserve.api.protocol.param_support import EndpointParams, Support
from coserve.api.protocol.responses import ResponseCreateRequest
from local_server import LocalServer, local_server

KEY = "sk-params-0123456789"
PARAMS_DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-parameters.md"
BEGIN, END = "<!-- param-support:begin -->", "<!-- param-support:end -->"
# A value no restricted parameter takes: not null, not false, not a listed literal.
UNTAKEN = {"type": "not-taken"}

# The official client's request types of each endpoint (a streaming variant adds `stream`).
CLIENT_TYPES: list[tuple[EndpointParams, tuple[type, ...]]] = [
    (param_support.CHAT_COMPLETIONS, (chat_create_params.CompletionCreateParamsBase,
                                      chat_create_params.CompletionCreateParamsStreaming)),
    (param_support.COMPLETIONS, (completion_create_params.CompletionCreateParamsBase,
                                 completion_create_params.CompletionCreateParamsStreaming)),
    (param_support.RESPONSES, (response_create_params.ResponseCreateParamsBase,
                               response_create_params.ResponseCreateParamsStreaming)),
    (param_support.FILES, (file_create_params.FileCreateParams,)),
    (param_support.FINE_TUNING_JOBS, (job_create_params.JobCreateParams,)),
]


@pytest.mark.parametrize(("endpoint", "types"), CLIENT_TYPES, ids=lambda v: getattr(v, "title", ""))
def test_every_client_field_is_listed_and_nothing_else(endpoint: EndpointParams, types: tuple[type, ...]) -> None:
    fields = set().union(*(t.__annotations__ for t in types))
    assert fields - set(endpoint.params) == set(), "fields of the official client missing from the table"
    assert set(endpoint.params) - fields == set(), "listed parameters the official client does not have"
    for name, param in endpoint.params.items():
        assert isinstance(param.support, Support)
        if param.support is not Support.SUPPORTED:
            assert param.note, f"{name}: say what differs or why it is refused"
        if param.support is Support.REFUSED:
            assert param.accepts is not None and param.accepts(None), f"{name}: refused, but null must mean unset"


def test_docs_table_is_the_modules() -> None:
    text = PARAMS_DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    table = text.split(BEGIN)[1].split(END)[0].strip()
    assert table == param_support.markdown(), (
        "docs/openai-parameters.md's parameter table is stale; regenerate it with "
        "python -c 'from coserve.api.protocol import param_support; print(param_support.markdown())'")


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(llama_dir, tmp_path_factory.mktemp("params"), {"p": {"api_keys": [KEY]}}) as srv:
        yield srv


def _post(srv: LocalServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _restricted(endpoint: EndpointParams) -> list[str]:
    return [name for name, param in endpoint.params.items() if param.accepts is not None]


@pytest.mark.parametrize(("path", "endpoint", "base"), [
    ("chat/completions", param_support.CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "Hi"}]}),
    ("completions", param_support.COMPLETIONS, {"prompt": "Hi"}),
    ("responses", param_support.RESPONSES, {"input": "Hi"}),
    ("fine_tuning/jobs", param_support.FINE_TUNING_JOBS, {"training_file": "file-x"}),
], ids=["chat", "completions", "responses", "fine_tuning"])
def test_each_refused_value_is_a_400_naming_it(server: LocalServer, path: str, endpoint: EndpointParams,
                                               base: dict[str, Any]) -> None:
    names = _restricted(endpoint)
    assert names
    for name in names:
        response = _post(server, path, {"model": server.base, **base, name: UNTAKEN})
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["param"] == name and name in error["message"], error
        assert error["code"] == ("unsupported_parameter" if endpoint.params[name].support is Support.REFUSED
                                 else "unsupported_value")


def test_values_that_mean_unused_are_accepted(server: LocalServer) -> None:
    body = {"model": server.base, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "store": False, "modalities": ["text"], "service_tier": "auto", "tools": None,
            "metadata": {"k": "v"}, "prompt_cache_key": "abc", "user": "u", "safety_identifier": "s"}
    response = _post(server, "chat/completions", body)
    assert response.status_code == 200, response.text
    response = _post(server, "completions", {"model": server.base, "prompt": "Hi", "max_tokens": 1,
                                             "suffix": None, "best_of": 1, "user": "u"})
    assert response.status_code == 200, response.text


def test_official_client_refusals(server: LocalServer) -> None:
    import openai

    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=server.base, messages=[{"role": "user", "content": "Hi"}], tools=tools)
    assert info.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=server.base, messages=[{"role": "user", "content": "Hi"}], store=True)
    assert info.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model=server.base, prompt="Hi", suffix="!")
    assert info.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as info:
        oa.files.create(file=("t.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune",
                        expires_after={"anchor": "created_at", "seconds": 3600})
    assert info.value.body["param"] == "expires_after" and info.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as info:
        oa.fine_tuning.jobs.create(model=server.base, training_file="file-x",
                                   integrations=[{"type": "wandb", "wandb": {"project": "p"}}])
    assert info.value.body["param"] == "integrations"
    with pytest.raises(openai.BadRequestError) as info:
        oa.fine_tuning.jobs.create(model=server.base, training_file="file-x", method={"type": "reinforcement"})
    assert info.value.body["param"] == "method.reinforcement"  # its grader is missing


HI = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
GRADER = {"type": "string_check", "name": "g", "input": "{{ sample.output_text }}", "reference": "x", "operation": "eq"}


def _client(srv: LocalServer) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _unknown(error: Any, param: str) -> None:
    """OpenAI's answer to a field it does not know."""
    assert error.status_code == 400
    assert error.body == {"message": f"Unrecognized request argument supplied: {param}",
                          "type": "invalid_request_error", "param": param, "code": "unknown_parameter"}


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"extra_body": {"max_token": 5}}, "max_token"),
    ({"extra_body": {"guided_json": SCHEMA}}, "guided_json"),
    ({"messages": [{"role": "user", "content": "Hi", "nmae": "bob"}]}, "messages[0].nmae"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True,
                                                                 "additional": 1}}},
     "response_format.json_schema.additional"),
    ({"stream": True, "stream_options": {"include_usage": True, "include_usgae": True}},
     "stream_options.include_usgae"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": SCHEMA}}]}, "tools[0].function.params"),
], ids=["typo", "vllm-guided-json", "message", "json-schema", "stream-options", "tool-function"])
def test_unknown_fields_are_refused_by_name(server: LocalServer, kwargs: dict[str, Any], param: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        _client(server).chat.completions.create(**{"model": server.base, "messages": HI, "max_tokens": 1, **kwargs})
    _unknown(info.value, param)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("completions", {"prompt": "Hi", "max_token": 1}, "max_token"),
    ("fine_tuning/jobs", {"training_file": "file-x", "hyperparameters": {"n_epoch": 2}}, "hyperparameters.n_epoch"),
    ("fine_tuning/jobs", {"training_file": "file-x", "method": {"type": "supervised", "supervised": {
        "hyperparameters": {"batch_size": 1}, "epochs": 2}}}, "method.supervised.epochs"),
    ("fine_tuning/jobs", {"training_file": "file-x", "method": {"type": "reinforcement", "reinforcement": {
        "grader": {**GRADER, "refrence": "x"}}}}, "method.reinforcement.grader.refrence"),
    ("fine_tuning/alpha/graders/validate", {"grader": {"type": "multi", "name": "m", "calculate_output": "g",
                                                       "graders": {"g": {**GRADER, "opperation": "eq"}}}},
     "grader.graders.g.opperation"),
    ("fine_tuning/alpha/graders/run", {"grader": GRADER, "model_sample": "x", "items": {}}, "items"),
], ids=["completions", "hyperparameters", "method", "rl-grader", "grader-validate", "grader-run"])
def test_unknown_fields_are_refused_on_every_json_endpoint(server: LocalServer, path: str, body: dict[str, Any],
                                                           param: str) -> None:
    model = {} if "graders" in path else {"model": server.base}
    response = _post(server, path, {**model, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {"message": f"Unrecognized request argument supplied: {param}",
                                        "type": "invalid_request_error", "param": param,
                                        "code": "unknown_parameter"}


def test_known_fields_coserve_does_not_use_and_extensions_are_accepted(server: LocalServer) -> None:
    oa = _client(server)
    reply = oa.chat.completions.create(model=server.base, messages=HI, max_tokens=2, store=False,
                                       metadata={"k": "v"}, user="u", prompt_cache_key="c", stream=False,
                                       extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                                                   "min_tokens": 1, "ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 2
    # The client's own reply object, appended to the conversation as is (`refusal`, `annotations`, `audio`,
    # `function_call`: null), and OpenAI's `include_obfuscation`.
    history = [*HI, reply.choices[0].message.model_dump(), {"role": "user", "content": "More"}]
    chunks = list(oa.chat.completions.create(model=server.base, messages=history, max_tokens=1, stream=True,
                                             stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage is not None
    text = oa.completions.create(model=server.base, prompt="Hi", max_tokens=2,
                                 extra_body={"top_k": 1, "ignore_eos": True})
    assert text.usage.completion_tokens == 2


def test_a_refused_message_field_is_named_with_its_message(server: LocalServer) -> None:
    messages = [*HI, {"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}, *HI]
    response = _post(server, "chat/completions", {"model": server.base, "messages": messages, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("messages[1].function_call", "unsupported_parameter"), error
    assert error["message"].startswith("Unsupported parameter: 'messages[1].function_call' is not supported"), error


def test_lenient_params_drop_unknown_fields(llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with local_server(llama_dir, tmp_path, {"p": {"api_keys": [KEY]}}, lenient_params=True) as srv:
        oa = _client(srv)
        reply = oa.chat.completions.create(model=srv.base, messages=[{**HI[0], "nmae": "bob"}], max_tokens=1,
                                           extra_body={"max_token": 5, "lenient_probe": 1})
        assert reply.choices[0].finish_reason == "length"
        graded = _post(srv, "fine_tuning/alpha/graders/run", {"grader": {**GRADER, "refrence": "y"},
                                                              "model_sample": "x"})
        assert graded.status_code == 200 and graded.json()["reward"] == 1.0, graded.text
        checked = _post(srv, "fine_tuning/alpha/graders/validate", {"grader": GRADER, "extra": 1})  # a `def` route
        assert checked.status_code == 200, checked.text
        # What coserve refuses by name is still refused.
        response = _post(srv, "chat/completions", {"model": srv.base, "messages": HI, "store": True})
        assert response.status_code == 400 and response.json()["error"]["param"] == "store"
    assert "ignoring unsupported fields ['lenient_probe', 'max_token']" in caplog.text


def test_the_docs_name_every_extension_and_message_field() -> None:
    """The extensions (request fields beyond OpenAI's) are listed in the docs' paragraph on unknown fields, and
    the `messages` row names every message field coserve knows without reading."""
    text = PARAMS_DOC.read_text().split(BEGIN)[0]
    for model, endpoint in ((ChatCompletionRequest, param_support.CHAT_COMPLETIONS),
                            (CompletionRequest, param_support.COMPLETIONS),
                            (ResponseCreateRequest, param_support.RESPONSES)):
        for name in set(model.model_fields) - set(endpoint.params):
            assert f"`{name}`" in text, name
    for name in param_support.CHAT_MESSAGE.params:
        assert f"`{name}`" in param_support.CHAT_COMPLETIONS.params["messages"].note, name
