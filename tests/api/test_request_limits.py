"""Request size limits through the real `--local` server: the JSON body cap (`--max-request-bytes`, 413,
declared or chunked; uploads keep their own cap), and a prompt certainly over the context refused as
`context_length_exceeded` from its length alone, without being encoded (the bound itself:
tests/frontend/test_prompt_encoder.py)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from local_server import LocalServer, local_app
from uvicorn_thread import serve_in_thread

KEY = "sk-acme-limits-0123"
CAP = 64 * 1024  # the server's --max-request-bytes here
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def served(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, Any]]:
    app, opts = local_app(llama_dir, tmp_path_factory.mktemp("limits"), {"acme": {"api_keys": [KEY]}},
                          max_request_bytes=CAP)
    with serve_in_thread(app) as url:
        yield LocalServer(url, opts.base_model_id), app


@pytest.fixture
def server(served: tuple[LocalServer, Any]) -> LocalServer:
    return served[0]


def chat_body(base: str, content: str) -> bytes:
    return json.dumps({"model": base, "messages": [{"role": "user", "content": content}],
                       "max_tokens": 2}).encode()


def test_json_body_over_the_cap_is_413_declared_or_chunked(server: LocalServer) -> None:
    url = f"{server.url}/v1/chat/completions"
    small = httpx.post(url, content=chat_body(server.base, "hi"), headers=HEADERS, timeout=60)
    assert small.status_code == 200, small.text
    big = chat_body(server.base, "x" * CAP)
    declared = httpx.post(url, content=big, headers=HEADERS, timeout=60)
    assert declared.status_code == 413
    error = declared.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert f"the limit is {CAP} bytes" in error["message"]

    def chunks() -> Iterator[bytes]:  # a generator body goes out chunked, without Content-Length
        for start in range(0, len(big), 8 * 1024):
            yield big[start:start + 8 * 1024]

    chunked = httpx.post(url, content=chunks(), headers=HEADERS, timeout=60)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as info:  # the official client sees the same
        server.client(KEY).chat.completions.create(model=server.base, max_tokens=2,
                                                   messages=[{"role": "user", "content": "y" * CAP}])
    assert info.value.status_code == 413 and info.value.code == "request_too_large"


def test_uploads_keep_their_own_larger_cap(server: LocalServer) -> None:
    line = json.dumps({"messages": [{"role": "user", "content": "q" * 500},
                                    {"role": "assistant", "content": "a"}]}) + "\n"
    data = (line * (2 * CAP // len(line) + 1)).encode()  # twice the JSON cap
    uploaded = server.client(KEY).files.create(file=("big.jsonl", io.BytesIO(data)), purpose="fine-tune")
    assert uploaded.bytes == len(data)


def test_a_prompt_certainly_over_the_context_is_refused_before_encoding(
        served: tuple[LocalServer, Any]) -> None:
    server, app = served
    frontend = app.state.gateway.scheduler
    encoded: list[int] = []
    tokenizer = frontend._tokenizer  # noqa: SLF001 - count what the real tokenizer is asked to encode
    real_encode = tokenizer.encode
    tokenizer.encode = lambda text, **kw: encoded.append(len(text)) or real_encode(text, **kw)
    try:
        content = "word " * (CAP // 6)  # under the body cap; by the bound >= 3200 tokens, over 2048
        with pytest.raises(openai.BadRequestError) as info:
            server.client(KEY).chat.completions.create(model=server.base, max_tokens=2,
                                                       messages=[{"role": "user", "content": content}])
        assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
        assert "at least" in info.value.message and "maximum context length is" in info.value.message
        assert encoded == []  # refused from the length alone
        reply = server.client(KEY).chat.completions.create(model=server.base, max_tokens=2,
                                                           messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.prompt_tokens > 0 and len(encoded) == 1
    finally:
        tokenizer.encode = real_encode


def test_max_request_bytes_is_a_serve_flag(llama_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from coserve.cli import build_parser, main

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"acme": {"api_keys": [KEY]}}}))
    args = ["serve", "--model", str(llama_dir), "--tenants", str(tenants), "--local"]
    assert build_parser().parse_args(args).max_request_bytes == 4 * 1024 * 1024
    assert build_parser().parse_args([*args, "--max-request-bytes", "1000"]).max_request_bytes == 1000
    assert main([*args, "--max-request-bytes", "0"]) == 2
    assert "--max-request-bytes must be >= 1" in capsys.readouterr().err
