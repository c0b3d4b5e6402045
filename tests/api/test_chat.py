"""`POST /v1/chat/completions`, `/health` and `/metrics` in `--local` mode: the real app (scheduler on
uvicorn's loop, engine loop on its thread) served by uvicorn, driven by the official `openai` client."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from coserve import LLM, SamplingParams
from local_server import ADMIN_HEADERS, local_app, scrape
from uvicorn_thread import serve_in_thread

ACME_KEY = "sk-acme-0123456789"
GLOBEX_KEY = "sk-globex-0123456789"
SLOW_KEY = "sk-slow-0123456789"
HELLO = [{"role": "user", "content": "Hello there"}]


@dataclass
class Server:
    url: str
    app: object
    base: str  # the base model id
    ft: str  # acme's fine-tuned model id


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from coserve.model.tiny_model import create_random_adapter

    root = tmp_path_factory.mktemp("chat")
    app, opts = local_app(llama_dir, root, {
        "acme": {"api_keys": [ACME_KEY]},
        "globex": {"api_keys": [GLOBEX_KEY]},
        "slow": {"api_keys": [SLOW_KEY], "limits": {"requests_per_minute": 2, "tokens_per_minute": 400}},
    }, max_batch_tokens=2048)
    adapter = create_random_adapter(llama_dir, root / "data" / "adapters" / "acme-ft", seed=3, b_std=0.05,
                                    r=8, lora_alpha=16, target_modules="all-linear")
    ft = f"ft:{opts.base_model_id}:acme:demo:ab12cd34"
    # A relative adapter path resolves inside the data dir.
    app.state.gateway.store.models.register(ft, tenant="acme", base_model=opts.base_model_id,
                                            adapter_path=str(adapter.relative_to(root / "data")))
    with serve_in_thread(app) as url:
        yield Server(url=url, app=app, base=opts.base_model_id, ft=ft)


@pytest.fixture(scope="module")
def offline(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32")


def client(srv: Server, key: str = ACME_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60)


def stream_text(chunks: list) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts


def metric(srv: Server, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (0 when absent)."""
    text = scrape(srv.url)
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:{{(.*)}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    return 0.0


def test_completion_matches_offline_greedy(server: Server, offline: LLM) -> None:
    out = client(server).chat.completions.create(model=server.base, messages=HELLO, max_tokens=12, temperature=0,
                                                 user="user-1")
    ref = offline.chat(HELLO, SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == server.base
    assert len(out.choices) == 1 and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_stream_equals_non_stream_with_usage(server: Server) -> None:
    oa = client(server)
    plain = oa.chat.completions.create(model=server.base, messages=HELLO, max_completion_tokens=20, temperature=0)
    chunks = list(oa.chat.completions.create(model=server.base, messages=HELLO, max_completion_tokens=20,
                                             temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert stream_text(chunks) == {0: plain.choices[0].message.content}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in chunks[:-1])
    no_usage = list(oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=5, stream=True))
    assert all(c.usage is None and c.choices for c in no_usage)


def test_n_and_seed(server: Server) -> None:
    oa = client(server)
    kwargs = dict(model=server.base, messages=HELLO, max_tokens=10, temperature=1.0, seed=11, n=3)
    first, second = oa.chat.completions.create(**kwargs), oa.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len({c.message.content for c in first.choices}) > 1  # child i samples with seed + i
    assert 3 <= first.usage.completion_tokens <= 30  # over all three choices
    streamed = list(oa.chat.completions.create(**kwargs, stream=True))
    assert stream_text(streamed) == {c.index: c.message.content for c in first.choices}


def test_stop_string_cuts_text(server: Server) -> None:
    oa = client(server)
    full = oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=24, temperature=0,
                                      logprobs=True)
    text = full.choices[0].message.content
    tokens = [t.token for t in full.choices[0].logprobs.content]
    # A stop string straddling two tokens: the stream must hold back the first token's tail.
    k = next(i for i in range(3, len(tokens) - 1) if len(tokens[i]) >= 2 and tokens[i + 1].strip()
             and "\ufffd" not in tokens[i] + tokens[i + 1])
    stop = tokens[k][-2:] + tokens[k + 1][0]
    expected = text[:text.index(stop)]
    cut = oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=24, temperature=0,
                                     stop=[stop, "never-in-text"])
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    streamed = list(oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=24, temperature=0,
                                               stop=stop, stream=True))
    assert stream_text(streamed) == {0: expected}


def test_logprobs(server: Server) -> None:
    out = client(server).chat.completions.create(model=server.base, messages=HELLO, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.bytes == list(entry.token.encode("utf-8"))
    plain = client(server).chat.completions.create(model=server.base, messages=HELLO, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_fine_tuned_model_is_served_to_its_tenant_only(server: Server) -> None:
    base = client(server).chat.completions.create(model=server.base, messages=HELLO, max_tokens=16,
                                                  temperature=0)
    tuned = client(server).chat.completions.create(model=server.ft, messages=HELLO, max_tokens=16, temperature=0)
    assert tuned.model == server.ft and tuned.choices[0].message.content != base.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as info:
        client(server, GLOBEX_KEY).chat.completions.create(model=server.ft, messages=HELLO, max_tokens=2)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=2)


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 17}, "n"),  # over the server's --max-n (16 by default), under OpenAI's 128
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"abc": 5}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"2048": 1}}, "logit_bias"),  # the tiny model's vocabulary is 0..2047: the scheduler says so
])
def test_bad_parameters_are_400_naming_the_param(server: Server, body: dict, param: str) -> None:
    payload = {"model": server.base, "messages": HELLO, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=payload,
                          headers={"Authorization": f"Bearer {ACME_KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_n_is_capped_by_max_n(server: Server) -> None:
    oa = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=1, n=17)
    assert info.value.param == "n" and "at most 16" in info.value.message
    out = oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=1, n=16)
    assert len(out.choices) == 16


def test_logit_bias_forces_a_token(server: Server, offline: LLM) -> None:
    token = 300  # 'as' in the tiny model's vocabulary
    out = client(server).chat.completions.create(model=server.base, messages=HELLO, max_tokens=6, temperature=0,
                                                 logit_bias={str(token): 100}, logprobs=True)
    assert out.choices[0].message.content == offline.tokenizer.decode([token] * 6)
    assert [t.token for t in out.choices[0].logprobs.content] == ["as"] * 6
    banned = client(server).chat.completions.create(model=server.base, messages=HELLO, max_tokens=6,
                                                    temperature=0, logit_bias={str(token): -100})
    assert "as" not in banned.choices[0].message.content


@pytest.mark.parametrize("controls", [
    {"frequency_penalty": 2.0},
    {"presence_penalty": 2.0},
    {"repetition_penalty": 1.8},
])
def test_penalties_change_a_repeating_greedy_reply(server: Server, offline: LLM, controls: dict) -> None:
    oa = client(server)
    plain = oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True}, logprobs=True)
    tokens = [t.token for t in plain.choices[0].logprobs.content]
    assert len(set(tokens)) < len(tokens)  # the tiny model's greedy reply repeats itself
    # The two OpenAI penalties go in as arguments, repetition_penalty (vLLM's) through extra_body.
    openai_args = {k: v for k, v in controls.items() if k != "repetition_penalty"}
    extra = {"ignore_eos": True, **{k: v for k, v in controls.items() if k == "repetition_penalty"}}
    penalised = oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=40, temperature=0,
                                           extra_body=extra, **openai_args)
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    # Exactly the offline engine's answer with the same SamplingParams (whose sampler is checked
    # against a direct computation in tests/torch_engine/test_logits_processors.py).
    ref = offline.chat(HELLO, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **controls))[0]
    assert penalised.choices[0].message.content == ref.outputs[0].text


def test_min_p_with_a_seed_is_the_offline_answer(server: Server, offline: LLM) -> None:
    out = client(server).chat.completions.create(model=server.base, messages=HELLO, max_tokens=20, temperature=1.5,
                                                 seed=5, extra_body={"min_p": 0.3, "ignore_eos": True})
    ref = offline.chat(HELLO, SamplingParams(temperature=1.5, max_tokens=20, seed=5, min_p=0.3, ignore_eos=True))
    plain = offline.chat(HELLO, SamplingParams(temperature=1.5, max_tokens=20, seed=5, ignore_eos=True))
    assert out.choices[0].message.content == ref[0].outputs[0].text != plain[0].outputs[0].text


def test_context_length_and_auth_errors(server: Server) -> None:
    oa = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=server.base, messages=[{"role": "user", "content": "word " * 3000}])
    assert info.value.code == "context_length_exceeded" and "2048" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=2048)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-wrong-key-000").chat.completions.create(model=server.base, messages=HELLO)
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {ACME_KEY}", "content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_quota_429_with_retry_after(server: Server) -> None:
    oa = client(server, SLOW_KEY)
    with pytest.raises(openai.BadRequestError) as info:  # more than the bucket can ever hold
        oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=1000)
    assert info.value.code == "rate_limit_exceeded"
    # Without a client limit the estimate is capped to the bucket, not the room left in the context.
    oa.chat.completions.create(model=server.base, messages=HELLO, temperature=0, stop=[" ", "e", "a"])
    oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=2)
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": server.base, "messages": HELLO,
                                                                     "max_tokens": 2},
                          headers={"Authorization": f"Bearer {SLOW_KEY}"})
    assert response.status_code == 429
    assert 1 <= int(response.headers["retry-after"]) <= 60 and int(response.headers["retry-after-ms"]) > 0
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    # Another tenant's quota is untouched.
    client(server, GLOBEX_KEY).chat.completions.create(model=server.base, messages=HELLO, max_tokens=2)


def _engine(server: Server) -> object:
    return server.app.state.gateway.scheduler.client.engine.engine  # frontend -> LocalSchedulerClient -> actor


def test_engine_failure_mid_stream_sends_error_event(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(server)
    real_step, calls = engine.step, []

    def failing_step(plan: object) -> object:
        calls.append(plan)
        if len(calls) == 4:
            raise RuntimeError("injected device fault")
        return real_step(plan)

    monkeypatch.setattr(engine, "step", failing_step)
    stream = client(server).chat.completions.create(model=server.base, messages=HELLO, max_tokens=40,
                                                    stream=True, extra_body={"ignore_eos": True})
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            received.append(chunk)
    # A step that failed whole (not a `PlanFault`: its work not told apart): a generic error, not the engine's.
    assert "internal error" in info.value.message and "injected" not in info.value.message and len(received) >= 2
    monkeypatch.setattr(engine, "step", real_step)
    # The engine goes on serving.
    out = client(server).chat.completions.create(model=server.base, messages=HELLO, max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert metric(server, "coserve_requests_total", tenant="acme", outcome="error") >= 1


def test_client_disconnect_aborts(server: Server) -> None:
    before = metric(server, "coserve_requests_total", tenant="globex", outcome="abort")
    body = {"model": server.base, "messages": HELLO, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {GLOBEX_KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=0.5)
    deadline = time.monotonic() + 10
    while metric(server, "coserve_requests_total", tenant="globex", outcome="abort") < before + 2:
        assert time.monotonic() < deadline, "the disconnected requests were not aborted"
        time.sleep(0.05)
    assert metric(server, "coserve_queue_requests", state="running") == 0


def test_health_and_metrics(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    before = metric(server, "coserve_tokens_total", kind="completion", tenant="acme")
    client(server).chat.completions.create(model=server.base, messages=HELLO, max_tokens=5,
                                           extra_body={"ignore_eos": True})
    response = httpx.get(f"{server.url}/metrics", headers=ADMIN_HEADERS)
    assert response.headers["content-type"].startswith("text/plain")
    assert metric(server, "coserve_tokens_total", kind="completion", tenant="acme") == before + 5
    assert metric(server, "coserve_time_to_first_token_seconds_count", tenant="acme") >= 1
    assert metric(server, "coserve_time_per_output_token_seconds_count", tenant="acme") >= 1
    assert metric(server, "coserve_kv_blocks_total") > 0
    for name in ("coserve_queue_requests", "coserve_kv_blocks_in_use", "coserve_engine_iterations_total"):
        assert name in response.text
