"""Bad requests get a 400 that says what is wrong in the client's terms, through the real `--local` server:
strict JSON types on every endpoint (OpenAI's `invalid_type`), bodies that are empty or not a JSON
object, text that is not valid Unicode, and messages the model's chat template refuses.

The served model is the tiny Llama with a chat template that refuses two system messages in its own
words (`raise_exception`, as Llama-2 and Mistral templates do) and breaks on a `name` it reads wrongly
(a template bug a client can trigger: its internals must not reach the client)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coserve.store import MetadataStore
from local_server import LocalServer, local_server

KEY = "sk-strict-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "Hello there"}]
TEMPLATE = (
    "{% if messages|selectattr('role', 'equalto', 'system')|list|length > 1 %}"
    "{{ raise_exception('Only one system message is allowed.') }}{% endif %}"
    "{% for message in messages %}{% if message.name is defined %}{{ message.name.first.upper() }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("request-errors")


@pytest.fixture(scope="module")
def server(llama_dir: Path, root: Path) -> Iterator[LocalServer]:
    model = shutil.copytree(llama_dir, root / "tiny-strict")
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    with local_server(model, root, {"strict": {"api_keys": [KEY]}}) as srv:
        yield srv


def _post(srv: LocalServer, path: str, body: Any = None, *, content: bytes | None = None,
          content_type: str | None = "application/json") -> httpx.Response:
    headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
    data = content if content is not None else json.dumps(body).encode()
    return httpx.post(f"{srv.url}{path}", content=data, headers=headers, timeout=60)


def _error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(("patch", "param", "expected", "got"), [
    ({"stream": "yes"}, "stream", "a boolean", "a string"),
    ({"logprobs": 1}, "logprobs", "a boolean", "an integer"),
    ({"max_tokens": "4"}, "max_tokens", "an integer", "a string"),
    ({"max_tokens": True}, "max_tokens", "an integer", "a boolean"),
    ({"max_completion_tokens": 4.0}, "max_completion_tokens", "an integer", "a decimal number"),
    ({"n": "2"}, "n", "an integer", "a string"),
    ({"seed": 1.5}, "seed", "an integer", "a decimal number"),
    ({"temperature": "0.5"}, "temperature", "a number", "a string"),
    ({"top_p": False}, "top_p", "a number", "a boolean"),
    ({"frequency_penalty": "1"}, "frequency_penalty", "a number", "a string"),
    ({"logit_bias": {"5": True}}, "logit_bias", "an integer", "a boolean"),
    ({"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage",
     "a boolean", "a string"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "a string or an array",
     "an integer"),
    ({"messages": ["Hello"]}, "messages[0]", "an object", "a string"),
    ({"stop": 5}, "stop", "a string or an array", "an integer"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "a boolean", "a string"),
    ({"model": None}, "model", "a string", "null"),
    # coserve's extensions are as strict
    ({"top_k": "3"}, "top_k", "an integer", "a string"),
    ({"ignore_eos": 1}, "ignore_eos", "a boolean", "an integer"),
    ({"min_p": "0.1"}, "min_p", "a number", "a string"),
])
def test_chat_types_are_strict(server: LocalServer, patch: dict[str, Any], param: str, expected: str,
                               got: str) -> None:
    error = _error(_post(server, "/v1/chat/completions",
                         {"model": server.base, "messages": HELLO, "max_tokens": 2, **patch}))
    assert (error["param"], error["code"]) == (param, "invalid_type")
    assert error["message"] == f"Invalid type for '{param}': expected {expected}, but got {got} instead."


def test_integers_are_numbers(server: LocalServer) -> None:
    # A number field takes a JSON integer: `temperature: 0` is as good as `0.0`.
    response = _post(server, "/v1/chat/completions", {"model": server.base, "messages": HELLO, "max_tokens": 2,
                                                      "temperature": 0, "top_p": 1, "presence_penalty": 0})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("patch", "param", "expected", "got"), [
    ({"hyperparameters": {"n_epochs": "2"}}, "hyperparameters.n_epochs", "'auto' or an integer", "a string"),
    ({"hyperparameters": {"batch_size": 2.0}}, "hyperparameters.batch_size", "'auto' or an integer",
     "a decimal number"),
    ({"hyperparameters": {"learning_rate_multiplier": True}}, "hyperparameters.learning_rate_multiplier",
     "'auto' or a number", "a boolean"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": "3"}}}},
     "method.supervised.hyperparameters.n_epochs", "'auto' or an integer", "a string"),
    ({"seed": "7"}, "seed", "an integer", "a string"),
    ({"suffix": 12}, "suffix", "a string", "an integer"),
    ({"lora": {"r": "8"}}, "lora.r", "an integer", "a string"),
    ({"lora": {"r": 8.0}}, "lora.r", "an integer", "a decimal number"),
    ({"lora": {"lora_alpha": "16"}}, "lora.lora_alpha", "a number", "a string"),
    ({"lora": {"target_modules": "q_proj"}}, "lora.target_modules", "an array", "a string"),
    ({"metadata": {"team": 1}}, "metadata.team", "a string", "an integer"),
])
def test_fine_tuning_types_are_strict(server: LocalServer, patch: dict[str, Any], param: str, expected: str,
                                      got: str) -> None:
    # The training file does not exist: the type is refused before anything is looked up.
    error = _error(_post(server, "/v1/fine_tuning/jobs",
                         {"model": server.base, "training_file": "file-none", **patch}))
    assert (error["param"], error["code"]) == (param, "invalid_type")
    assert error["message"] == f"Invalid type for '{param}': expected {expected}, but got {got} instead."


def test_file_upload_form_types(server: LocalServer) -> None:
    as_field = httpx.post(f"{server.url}/v1/files", headers=AUTH, data={"purpose": "fine-tune", "file": "abc"})
    error = _error(as_field)
    assert (error["param"], error["code"]) == ("file", "invalid_type") and "UploadFile" not in error["message"]
    purpose_as_file = httpx.post(f"{server.url}/v1/files", headers=AUTH,
                                 files={"purpose": ("p.txt", b"fine-tune"), "file": ("t.jsonl", b"{}")})
    error = _error(purpose_as_file)
    assert (error["param"], error["code"]) == ("purpose", "invalid_type")
    assert error["message"] == "Invalid type for 'purpose': expected a string, but got a file instead."


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/fine_tuning/jobs"])
@pytest.mark.parametrize(("content", "content_type", "message", "code"), [
    (b"", "application/json", "The request body is empty; expected a JSON object.", "invalid_json"),
    (b"[1, 2]", "application/json", "The request body must be a JSON object, but got an array instead.",
     "invalid_type"),
    (b"42", "application/json", "The request body must be a JSON object, but got an integer instead.",
     "invalid_type"),
    (b'"hi"', "application/json", "The request body must be a JSON object, but got a string instead.",
     "invalid_type"),
    (b'{"model": "m"}', None,
     "The request body must be a JSON object sent with 'Content-Type: application/json'.", "invalid_json"),
    (b'{"model": "\xff\xfe"}', "application/json",
     "The request body is not valid UTF-8 text; send JSON encoded as UTF-8.", "invalid_json"),
])
def test_body_that_is_not_a_json_object(server: LocalServer, path: str, content: bytes,
                                        content_type: str | None, message: str, code: str) -> None:
    error = _error(_post(server, path, content=content, content_type=content_type))
    assert (error["message"], error["code"], error["param"]) == (message, code, None)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a \ud800 b"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]}]}, "messages[0].content[1].text"),
    ("/v1/chat/completions", {"messages": [HELLO[0], {"role": "user", "content": "x", "name": "\ud83d"}]},
     "messages[1].name"),
    ("/v1/chat/completions", {"model": "\ud800"}, "model"),  # before: SQLite's encoder raised, a 500
    ("/v1/chat/completions", {"stop": ["ok", "\ud800"]}, "stop[1]"),
    ("/v1/fine_tuning/jobs", {"training_file": "file-\udc00"}, "training_file"),
    ("/v1/fine_tuning/jobs", {"metadata": {"team": "\ud800"}}, "metadata.team"),
])
def test_lone_surrogate_is_not_valid_unicode(server: LocalServer, path: str, body: dict[str, Any],
                                             param: str) -> None:
    base = {"model": server.base, "messages": HELLO, "max_tokens": 2} if path.endswith("completions") \
        else {"model": server.base, "training_file": "file-none"}
    # json.dumps escapes the surrogate as `\ud800`: the body is ASCII, valid JSON, and holds no Unicode text.
    error = _error(_post(server, path, {**base, **body}))
    assert (error["param"], error["code"]) == (param, "invalid_value")
    assert error["message"].startswith(f"Invalid '{param}': the text is not valid Unicode")
    # A surrogate pair is one valid character (U+1F600) and is served.
    if path.endswith("completions"):
        ok = _post(server, path, {**base, "messages": [{"role": "user", "content": "\ud83d\ude00"}]})
        assert ok.status_code == 200, ok.text


def test_max_n_sets_the_cap_on_n(llama_dir: Path, tmp_path: Path) -> None:
    with local_server(llama_dir, tmp_path, {"strict": {"api_keys": [KEY]}}, max_n=3) as srv:
        oa = srv.client(KEY)
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(model=srv.base, messages=HELLO, max_tokens=1, n=4)
        assert info.value.param == "n" and info.value.body["message"] == (
            "Invalid 'n': this server generates at most 3 completions per request, got 4.")
        assert len(oa.chat.completions.create(model=srv.base, messages=HELLO, max_tokens=1, n=3).choices) == 3


def test_chat_template_refusals_in_the_clients_terms(server: LocalServer) -> None:
    oa = server.client(KEY)
    two_systems = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}, *HELLO]
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=server.base, messages=two_systems, max_tokens=2)
    assert info.value.param == "messages" and info.value.code == "invalid_value"
    assert info.value.body["message"] == ("The model's chat template does not accept these messages: Only one "
                                          "system message is allowed.")
    # The template reads `name.first` off a string: jinja's internals ("'str object' has no attribute")
    # stay in the server's log.
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=server.base, messages=[{**HELLO[0], "name": "ann"}], max_tokens=2)
    assert info.value.param == "messages" and "object" not in info.value.message
    assert info.value.body["message"].startswith("The model's chat template cannot render these messages")
    assert oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=2).choices


def test_unservable_adapter_does_not_show_server_paths(server: LocalServer, root: Path) -> None:
    model = f"ft:{server.base}:strict:gone:ab12cd34"
    # A fine-tuned model whose adapter folder is not there (deleted by hand, a disk not mounted).
    MetadataStore(root / "data").models.register(model, tenant="strict", base_model=server.base,
                                                 adapter_path="adapters/gone")
    with pytest.raises(openai.BadRequestError) as info:
        server.client(KEY).chat.completions.create(model=model, messages=HELLO, max_tokens=2)
    assert (info.value.param, info.value.code) == ("model", "model_not_available")
    assert str(root) not in info.value.message and "adapters/gone" not in info.value.message
    assert info.value.body["message"] == (f"The model `{model}` cannot be served: its adapter on this server is "
                                          "missing or does not fit the base model.")


@pytest.mark.parametrize("path", ["/v1/files?limit=ten", "/v1/fine_tuning/jobs?limit=2.5"])
def test_query_parameter_of_the_wrong_type(server: LocalServer, path: str) -> None:
    error = _error(httpx.get(f"{server.url}{path}", headers=AUTH))
    assert (error["param"], error["code"]) == ("limit", "invalid_type")
    assert error["message"] == "Invalid type for 'limit': expected an integer, but got a string instead."
