"""The OpenAI parameter tables (`coserve.api.protocol.param_support`) against the official client's request
types, docs/openai-parameters.md, and the server: every field is listed, the docs page's table is the module's, and what
is refused is a 400 naming it through the real `--local` server (what "not used" means is accepted)."""

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

from coserve.api.protocol import param_support
from coserve.api.protocol.param_support import EndpointParams, Support
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
    ("fine_tuning/jobs", param_support.FINE_TUNING_JOBS, {"training_file": "file-x"}),
], ids=["chat", "completions", "fine_tuning"])
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
