"""`POST /v1/completions` and `GET /v1/models/{id}` through the real `--local` server on the tiny llama,
driven by the official `openai` client: each prompt form, indices with n and several prompts, echo,
logprobs, stop, streaming with usage, a fine-tuned model, and the 400s."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from coserve import LLM, SamplingParams
from local_server import local_app, scrape
from uvicorn_thread import serve_in_thread

ACME_KEY = "sk-acme-0123456789"
GLOBEX_KEY = "sk-globex-0123456789"
SLOW_KEY = "sk-slow-0123456789"
PROMPT = "The quick brown fox"


@dataclass
class Server:
    url: str
    base: str
    ft: str  # acme's fine-tuned model
    ckpt: str  # a checkpoint of it

    def client(self, key: str = ACME_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from coserve.model.tiny_model import create_random_adapter

    root = tmp_path_factory.mktemp("completions")
    app, opts = local_app(llama_dir, root, {
        "acme": {"api_keys": [ACME_KEY]}, "globex": {"api_keys": [GLOBEX_KEY]},
        "slow": {"api_keys": [SLOW_KEY], "limits": {"requests_per_minute": 2}},
    }, max_batch_tokens=1024)
    adapter = create_random_adapter(llama_dir, root / "data" / "adapters" / "acme-ft", seed=3, b_std=0.05,
                                    r=8, lora_alpha=16, target_modules="all-linear")
    ft = f"ft:{opts.base_model_id}:acme:demo:ab12cd34"
    models = app.state.gateway.store.models
    models.register(ft, tenant="acme", base_model=opts.base_model_id,
                    adapter_path=str(adapter.relative_to(root / "data")))
    models.register(f"{ft}:ckpt-step-2", tenant="acme", base_model=opts.base_model_id,
                    adapter_path=str(adapter.relative_to(root / "data")))
    with serve_in_thread(app) as url:
        yield Server(url=url, base=opts.base_model_id, ft=ft, ckpt=f"{ft}:ckpt-step-2")


@pytest.fixture(scope="module")
def offline(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(llama_dir)


def test_text_prompt_matches_offline_greedy_without_chat_template(server: Server, offline: LLM,
                                                                  tokenizer: object) -> None:
    out = server.client().completions.create(model=server.base, prompt=PROMPT, max_tokens=10, temperature=0,
                                             user="u1")
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10))[0]
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == server.base
    assert [c.index for c in out.choices] == [0]
    assert out.choices[0].text == ref.outputs[0].text and out.choices[0].finish_reason == "length"
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    assert out.usage.prompt_tokens == len(prompt_ids) == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == 10 and out.usage.total_tokens == len(prompt_ids) + 10


def test_default_max_tokens_is_16(server: Server) -> None:
    out = server.client().completions.create(model=server.base, prompt=PROMPT, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_token_id_prompts_equal_their_text(server: Server, tokenizer: object) -> None:
    oa = server.client()
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    by_text = oa.completions.create(model=server.base, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = oa.completions.create(model=server.base, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + by_text.choices[0].text
    assert by_ids.usage == by_text.usage
    many = oa.completions.create(model=server.base, prompt=[ids, ids[:2]], max_tokens=8, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text
    assert many.usage.prompt_tokens == len(ids) + 2


def test_several_prompts_with_n_have_openai_indices(server: Server) -> None:
    oa = server.client()
    prompts = ["Hello there", PROMPT, "One two three"]
    alone = [oa.completions.create(model=server.base, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    out = oa.completions.create(model=server.base, prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [t for t in alone for _ in range(2)]
    seeded = oa.completions.create(model=server.base, prompt=prompts[:2], n=3, max_tokens=6, seed=7)
    assert [c.index for c in seeded.choices] == list(range(6))
    again = oa.completions.create(model=server.base, prompt=prompts[1], n=3, max_tokens=6, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in seeded.choices[3:]]  # seed + i per prompt


def test_echo_prepends_the_prompt(server: Server) -> None:
    oa = server.client()
    plain = oa.completions.create(model=server.base, prompt=[PROMPT, "Hi"], max_tokens=5, temperature=0)
    echoed = oa.completions.create(model=server.base, prompt=[PROMPT, "Hi"], max_tokens=5, temperature=0, echo=True)
    assert [c.text for c in echoed.choices] == [PROMPT + plain.choices[0].text, "Hi" + plain.choices[1].text]


def test_logprobs_have_the_legacy_shape(server: Server, tokenizer: object) -> None:
    out = server.client().completions.create(model=server.base, prompt=PROMPT, max_tokens=6, temperature=0,
                                             logprobs=3, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and top[token] == logprob
        assert 3 <= len(top) <= 4
        assert logprob == max(top.values())  # greedy: the sampled token is the most likely
    zero = server.client().completions.create(model=server.base, prompt=PROMPT, max_tokens=3, temperature=0,
                                              logprobs=0)
    assert all(len(top) == 1 for top in zero.choices[0].logprobs.top_logprobs)
    assert zero.choices[0].logprobs.tokens == lp.tokens[:len(zero.choices[0].logprobs.tokens)]
    none = server.client().completions.create(model=server.base, prompt=PROMPT, max_tokens=3, temperature=0)
    assert none.choices[0].logprobs is None


def test_stop_ends_the_text_before_the_stop_string(server: Server) -> None:
    oa = server.client()
    full = oa.completions.create(model=server.base, prompt=PROMPT, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:5]
    out = oa.completions.create(model=server.base, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == full[:full.index(stop)]


def test_stream_equals_non_stream_with_usage(server: Server) -> None:
    oa = server.client()
    prompts = [PROMPT, "Hello there"]
    plain = oa.completions.create(model=server.base, prompt=prompts, n=2, max_tokens=7, temperature=0, echo=True,
                                  stop=["zz"])
    chunks = list(oa.completions.create(model=server.base, prompt=prompts, n=2, max_tokens=7, temperature=0,
                                        echo=True, stop=["zz"], stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {c.index: c.text for c in plain.choices}
    assert finishes == {c.index: [c.finish_reason] for c in plain.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    logprob_chunks = list(oa.completions.create(model=server.base, prompt=PROMPT, max_tokens=4, temperature=0,
                                                logprobs=1, stream=True))
    tokens = [t for c in logprob_chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert len(tokens) == 4 and all(c.usage is None for c in logprob_chunks)


def test_fine_tuned_model_and_checkpoint_complete(server: Server) -> None:
    oa = server.client()
    kwargs = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    base = oa.completions.create(model=server.base, **kwargs).choices[0].text
    tuned = oa.completions.create(model=server.ft, **kwargs)
    assert tuned.model == server.ft and tuned.choices[0].text != base
    assert oa.completions.create(model=server.ckpt, **kwargs).choices[0].text == tuned.choices[0].text
    with pytest.raises(openai.NotFoundError) as info:
        server.client(GLOBEX_KEY).completions.create(model=server.ft, **kwargs)
    assert info.value.body["code"] == "model_not_found"


def test_model_details(server: Server) -> None:
    oa = server.client()
    base = oa.models.retrieve(server.base)
    assert (base.id, base.object, base.owned_by) == (server.base, "model", "system")
    assert base.model_extra["root"] == server.base and base.model_extra["parent"] is None
    for model_id in (server.ft, server.ckpt):
        tuned = oa.models.retrieve(model_id)
        assert (tuned.id, tuned.owned_by) == (model_id, "acme") and tuned.created > 0
        assert tuned.model_extra["parent"] == server.base and tuned.model_extra["root"] == server.base
    with pytest.raises(openai.NotFoundError):
        server.client(GLOBEX_KEY).models.retrieve(server.ft)
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("no-such-model")


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"suffix": " jumps"}, "suffix", "unsupported_parameter"),
    ({"best_of": 3}, "best_of", "invalid_value"),
    ({"echo": True, "logprobs": 1}, "echo", "invalid_value"),
    ({"logprobs": 6}, "logprobs", "invalid_value"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": [[]]}, "prompt[0]", "invalid_value"),
    ({"prompt": [1, "a"]}, "prompt", "invalid_value"),
    ({"prompt": [True]}, "prompt", "invalid_value"),
    ({"prompt": 5}, "prompt", "invalid_type"),
    ({"prompt": [10**9]}, "prompt", "invalid_value"),
    ({"prompt": [-1]}, "prompt[0]", "invalid_value"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"max_tokens": "4"}, "max_tokens", "invalid_type"),
    ({"n": 5, "prompt": ["a", "b", "c", "d"]}, "n", "invalid_value"),
    ({"max_tokens": 100000}, "prompt", "context_length_exceeded"),
    ({"prompt": ["Hi", "word " * 5000]}, "prompt", "context_length_exceeded"),
    ({"prompt": [[5] * 3000]}, "prompt", "context_length_exceeded"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
])
def test_bad_requests_are_400s_naming_the_param(server: Server, extra: dict, param: str | None,
                                                code: str) -> None:
    body = {"model": server.base, "prompt": PROMPT, "max_tokens": 4, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {ACME_KEY}"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and (param is None or error["param"] == param), error
    if param in ("suffix", "best_of", "echo"):
        assert param in error["message"]


def test_best_of_equal_to_n_is_accepted(server: Server) -> None:
    out = server.client().completions.create(model=server.base, prompt=PROMPT, n=2, best_of=2, max_tokens=2)
    assert len(out.choices) == 2


def _metric(srv: Server, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (0 when absent)."""
    for line in scrape(srv.url).splitlines():
        match = re.fullmatch(rf"{name}(?:{{(.*)}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    return 0.0


def test_client_disconnect_aborts_every_prompt(server: Server) -> None:
    before = _metric(server, "coserve_requests_total", tenant="globex", outcome="abort")
    body = {"model": server.base, "prompt": ["Hello", "there"], "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {GLOBEX_KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as response:
        assert next(response.iter_lines()).startswith("data: ")
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=0.5)
    deadline = time.monotonic() + 10
    while _metric(server, "coserve_requests_total", tenant="globex", outcome="abort") < before + 4:
        assert time.monotonic() < deadline, "the disconnected prompts were not all aborted"
        time.sleep(0.05)
    assert _metric(server, "coserve_queue_requests", state="running") == 0


def test_a_request_of_several_prompts_counts_once_against_requests_per_minute(server: Server) -> None:
    oa = server.client(SLOW_KEY)
    out = oa.completions.create(model=server.base, prompt=["a", "b", "c"], max_tokens=1)
    assert len(out.choices) == 3
    oa.completions.create(model=server.base, prompt="a", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        oa.completions.create(model=server.base, prompt=["a", "b"], max_tokens=1)
    assert int(info.value.response.headers["retry-after"]) >= 1
