"""The vLLM-shaped offline API: prompts, sampling, stops, n, chat, prefix caching."""

from __future__ import annotations

from pathlib import Path

import pytest

from coserve import LLM, SamplingParams
from reference import random_prompts


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=128,
               max_batch_tokens=64)


def _token_prompts(llm: LLM, lengths: list[int], seed: int) -> list[dict]:
    vocab = llm.engine.model_config.vocab_size
    return [{"prompt_token_ids": p} for p in random_prompts(vocab, lengths, seed)]


def test_string_prompts_round_trip_and_length_finish(llm: LLM) -> None:
    outs = llm.generate(["The quick brown fox", "Hello"], SamplingParams(temperature=0, max_tokens=6,
                                                                        ignore_eos=True))
    assert [o.prompt for o in outs] == ["The quick brown fox", "Hello"]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    prompt = _token_prompts(llm, [12], seed=4)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt, params)[0].outputs[0].token_ids
    others = _token_prompts(llm, [30, 5, 17], seed=5)
    batch = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=20)] * 2 + [params]
                         + [SamplingParams(temperature=0.7, max_tokens=3)])
    assert batch[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate(prompt, other_seed)[0].outputs[0].token_ids != alone


def test_n_completions_with_seed_differ_and_repeat(llm: LLM) -> None:
    prompt = _token_prompts(llm, [9], seed=6)[0]
    params = SamplingParams(n=3, temperature=2.0, seed=7, max_tokens=24, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    again = llm.generate(prompt, params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_stop_string_cuts_text_and_reports_it(llm: LLM) -> None:
    prompt = "Once upon a time"
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(prompt, greedy)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3 and stop in text
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                              stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    assert len(cut.token_ids) < len(full.token_ids)
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                               stop=stop, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    prompt = _token_prompts(llm, [10], seed=8)[0]
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens = full[0].outputs[0].token_ids
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    min_tokens = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                     stop_token_ids=[stop_id], min_tokens=first + 2))
    assert len(min_tokens[0].outputs[0].token_ids) > first + 1


def test_logprobs_shape(llm: LLM) -> None:
    out = llm.generate(_token_prompts(llm, [6], seed=9)[0],
                       SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True))
    completion = out[0].outputs[0]
    assert len(completion.logprobs) == 4
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert next(iter(entry)) == token_id and entry[token_id].rank == 1
        assert len(entry) == 5
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3, 4, 5]
    assert completion.cumulative_logprob == pytest.approx(  # the same 4 floats summed: approx's 1e-6
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)))


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5))
    expected = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out[0].prompt == expected
    assert out[0].prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    two = llm.chat([messages, [{"role": "user", "content": "Hello"}]], SamplingParams(max_tokens=3))
    assert len(two) == 2


def test_prefix_caching_reuses_blocks_and_keeps_outputs(llama_dir: Path) -> None:
    shared = random_prompts(2000, [48], seed=10)[0]
    prompts = [{"prompt_token_ids": shared + tail} for tail in random_prompts(2000, [5, 9], seed=11)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cached = LLM(model=str(llama_dir), dtype="float32", block_size=16, num_kv_blocks=64,
                 max_model_len=128)
    first = cached.generate(prompts[0], params)
    second = cached.generate(prompts[1], params)
    assert cached.policy.kv.stats.hit_tokens >= 48
    plain = LLM(model=str(llama_dir), dtype="float32", block_size=16, num_kv_blocks=64,
                max_model_len=128, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == \
        [first[0].outputs[0].token_ids, second[0].outputs[0].token_ids]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(llama_dir: Path, llm: LLM, dtype: str) -> None:
    """bf16/fp16 take the torch attention path; their first-token logprobs stay near fp32's."""
    half = LLM(model=str(llama_dir), dtype=dtype, max_model_len=256, num_kv_blocks=128)
    assert half.engine.dtype != llm.engine.dtype and half.engine._decode_kernel is None
    prompts = _token_prompts(llm, [7, 19, 33, 12], seed=12)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=4)
    full = llm.generate(prompts, params)
    low = half.generate(prompts, params)
    for a, b in zip(full, low):
        first_full, first_low = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        shared = set(first_full) & set(first_low)
        assert shared, "the top-4 candidates of the first token should overlap"
        for token_id in shared:
            # bf16 (u = 2^-8) / fp16 (2^-11) rounding of logits spanning ~+-100: up to ~0.4 per logit, both
            # sides of a log-prob (the logit and the log-sum-exp) plus the layers before: 1.5
            assert first_low[token_id].logprob == pytest.approx(first_full[token_id].logprob, abs=1.5)
