"""`response_format` through the real `--local` server and the official client, on the tiny random
model (its weights are noise: only the grammar makes the replies JSON): replies and streams follow the
schema, on the base model and a fine-tuned adapter; what cannot be enforced is a 400 naming the param."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from local_server import LocalServer, local_app
from uvicorn_thread import serve_in_thread

KEY = "sk-shapes-0123456789"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "count", "label"],
          "properties": {"kind": {"enum": ["cat", "dog"]}, "count": {"type": "integer", "minimum": 0,
                                                                      "maximum": 99},
                         "label": {"type": "string", "maxLength": 6}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "A pet, please"}]


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, str]]:
    from coserve.model.tiny_model import create_random_adapter

    root = tmp_path_factory.mktemp("response_format")
    app, opts = local_app(llama_dir, root, {"shapes": {"api_keys": [KEY]}})
    adapter = create_random_adapter(llama_dir, root / "data" / "adapters" / "pet", seed=5, b_std=0.05)
    ft = f"ft:{opts.base_model_id}:shapes:pet:ab12cd34"
    app.state.gateway.store.models.register(ft, tenant="shapes", base_model=opts.base_model_id,
                                            adapter_path=str(adapter))
    with serve_in_thread(app) as url:
        yield LocalServer(url, opts.base_model_id), ft


def test_replies_and_streams_follow_the_schema_on_base_and_adapter(server: tuple[LocalServer, str]) -> None:
    srv, ft = server
    oa = srv.client(KEY)
    for model in (srv.base, ft):
        reply = oa.chat.completions.create(model=model, messages=MESSAGES, response_format=FORMAT, n=3,
                                           temperature=1.2, seed=4, max_completion_tokens=60)
        for choice in reply.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        chunks = list(oa.chat.completions.create(model=model, messages=MESSAGES, response_format=FORMAT, n=3,
                                                 temperature=1.2, seed=4, max_completion_tokens=60, stream=True))
        streamed = ["", "", ""]
        for chunk in chunks:
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
        assert streamed == [c.message.content for c in reply.choices]  # same seeds, same replies
    plain = oa.chat.completions.create(model=srv.base, messages=MESSAGES, max_completion_tokens=20, temperature=0)
    assert not plain.choices[0].message.content.startswith("{")  # without the grammar: noise


@pytest.mark.parametrize(("response_format", "param", "says"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}},
     "response_format.json_schema.schema", 'Unimplemented keys: ["not"]'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}},
     "response_format.json_schema.schema", "look-around"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}},
     "response_format.json_schema.schema", "Invalid type: wat"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "needs"),
    ({"type": "json_schema"}, "response_format.json_schema", "needs"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "response_format.json_schema",
     "only allowed"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
     "response_format.json_schema.name", "pattern"),
    ({"type": "yaml"}, "response_format.type", "json_schema"),
])
def test_what_cannot_be_enforced_is_a_400_naming_it(server: tuple[LocalServer, str], response_format: dict,
                                                     param: str, says: str) -> None:
    srv, _ = server
    with pytest.raises(openai.BadRequestError) as info:
        srv.client(KEY).chat.completions.create(model=srv.base, messages=MESSAGES, response_format=response_format)
    assert info.value.param == param and says in info.value.message
    assert info.value.body["type"] == "invalid_request_error"


def test_options_the_grammar_cannot_honour_are_refused(server: tuple[LocalServer, str]) -> None:
    srv, _ = server
    for extra in ({"ignore_eos": True}, {"min_tokens": 2}):
        response = httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                              json={"model": srv.base, "messages": MESSAGES,
                                    "response_format": {"type": "json_object"}, **extra}, timeout=30)
        assert response.status_code == 400, response.text
        assert next(iter(extra)) in response.json()["error"]["message"]
