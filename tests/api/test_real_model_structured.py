"""Structured output on the real SmolLM2 through the server and the official client's `parse`: every
reply parses into the pydantic model, streamed or not, on the base model and on a LoRA adapter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from local_server import LocalServer, local_app
from uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.real_model
KEY = "sk-json-0123456789"


class City(BaseModel):
    name: str
    country: str
    population_millions: float
    is_capital: bool


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    reasons: list[str]


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, str]]:
    from coserve.model.tiny_model import create_random_adapter

    root = tmp_path_factory.mktemp("structured")
    # The server's default cache: SmolLM2's 8192-token context needs more than the tiny model's test cache.
    app, opts = local_app(smollm2_dir, root, {"json": {"api_keys": [KEY]}}, kv_cache_memory_gb=None)
    adapter = create_random_adapter(smollm2_dir, root / "data" / "adapters" / "tuned", seed=2, b_std=0.02,
                                    r=8, lora_alpha=16)
    ft = f"ft:{opts.base_model_id}:json:tuned:0a1b2c3d"
    app.state.gateway.store.models.register(ft, tenant="json", base_model=opts.base_model_id,
                                            adapter_path=str(adapter))
    with serve_in_thread(app) as url:
        yield LocalServer(url, opts.base_model_id), ft


def test_parse_gives_the_model_every_time(server: tuple[LocalServer, str]) -> None:
    srv, ft = server
    oa = srv.client(KEY)
    cases = [(srv.base, "Describe the city of Tokyo.", City, 0.9), (ft, "What is Berlin like?", City, 0.7),
             (srv.base, "Is the sky blue? Answer in JSON.", Verdict, 0.9)]
    for model, question, shape, temperature in cases:
        reply = oa.chat.completions.parse(model=model, messages=[{"role": "user", "content": question}],
                                          response_format=shape, max_completion_tokens=120,
                                          temperature=temperature, seed=3)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, shape)
    paris = oa.chat.completions.parse(model=srv.base, response_format=City, max_completion_tokens=120,
                                      messages=[{"role": "user", "content": "Tell me about Paris."}],
                                      temperature=0)
    assert paris.choices[0].message.parsed.name == "Paris"  # the model still answers, inside the schema


def test_streamed_replies_parse_too(server: tuple[LocalServer, str]) -> None:
    srv, ft = server
    oa = srv.client(KEY)
    for model in (srv.base, ft):
        with oa.chat.completions.stream(model=model, response_format=City, max_completion_tokens=120,
                                        messages=[{"role": "user", "content": "Tell me about Rome."}],
                                        temperature=0.8, seed=5) as stream:
            deltas = [event.delta for event in stream if event.type == "content.delta"]
            final = stream.get_final_completion()
        assert len(deltas) > 3  # token by token, not one piece
        assert isinstance(final.choices[0].message.parsed, City)
        assert "".join(deltas) == final.choices[0].message.content


def test_json_object_replies_are_json_objects(server: tuple[LocalServer, str]) -> None:
    srv, _ = server
    oa = srv.client(KEY)
    for question in ("What is the capital of France? Reply with a JSON object.",
                     "Return a JSON object with keys city and country for Paris."):
        reply = oa.chat.completions.create(model=srv.base, messages=[{"role": "user", "content": question}],
                                           response_format={"type": "json_object"}, max_completion_tokens=60,
                                           temperature=0)
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        assert "Paris" in json.loads(reply.choices[0].message.content).values()
