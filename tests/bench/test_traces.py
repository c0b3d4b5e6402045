"""Traces of the co-serving benchmark: seeded, shaped as documented (rates, burstiness, lengths)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coserve.bench.traces import (
    SHAREGPT_OUTPUT_MEAN,
    SHAREGPT_PROMPT_MEAN,
    LengthDistribution,
    bursty_arrivals,
    make_trace,
    poisson_arrivals,
    prompt_token_ids,
    sharegpt_lengths,
    synthetic_chat_dataset,
)


def test_poisson_rate_and_determinism() -> None:
    a = poisson_arrivals(5.0, 400.0, seed=3)
    assert np.array_equal(a, poisson_arrivals(5.0, 400.0, seed=3))
    assert not np.array_equal(a, poisson_arrivals(5.0, 400.0, seed=4))
    assert np.all(np.diff(a) > 0) and a[0] >= 0 and a[-1] < 400.0
    assert len(a) / 400.0 == pytest.approx(5.0, rel=0.05)  # 2000 arrivals: Poisson's sd 45 is 2.2%
    gaps = np.diff(a)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV 1 (sd ~ 1/sqrt(2000))


def test_bursty_keeps_the_mean_rate_and_is_burstier_than_poisson() -> None:
    a = bursty_arrivals(2.0, 4000.0, seed=1)
    assert np.array_equal(a, bursty_arrivals(2.0, 4000.0, seed=1))
    assert np.all(np.diff(a) >= 0) and a[-1] < 4000.0
    assert len(a) / 4000.0 == pytest.approx(2.0, rel=0.15)  # bursts: counts vary ~3x Poisson's (dispersion > 3)
    gaps = np.diff(a)
    assert gaps.std() / gaps.mean() > 1.5  # BurstGPT-like: CV well above Poisson's 1
    # On/off phases: per-10 s counts vary far more than a Poisson process's (index of dispersion 1).
    counts = np.histogram(a, bins=400, range=(0, 4000))[0]
    assert counts.var() / counts.mean() > 3.0


def test_bursty_rejects_an_off_rate_below_zero() -> None:
    with pytest.raises(ValueError, match="burst"):
        bursty_arrivals(1.0, 10.0, seed=0, peak_factor=4.0, on_fraction=0.5)


def test_lognormal_lengths_have_the_sharegpt_means_before_scaling() -> None:
    rng = np.random.default_rng(0)
    prompt = LengthDistribution.from_mean(SHAREGPT_PROMPT_MEAN, 1.0, 1.0, 1, 10**9)
    output = LengthDistribution.from_mean(SHAREGPT_OUTPUT_MEAN, 0.8, 1.0, 1, 10**9)
    # a lognormal of sigma 1 has CV 1.3: the mean of 400,000 draws is within 0.2% (sd); clipping moves it <2%
    assert prompt.sample(rng, 400_000).mean() == pytest.approx(SHAREGPT_PROMPT_MEAN, rel=0.03)
    assert output.sample(rng, 400_000).mean() == pytest.approx(SHAREGPT_OUTPUT_MEAN, rel=0.03)


def test_trace_lengths_are_scaled_and_clipped() -> None:
    prompt_dist, output_dist = sharegpt_lengths(scale=4.0, prompt_range=(4, 100), output_range=(2, 50))
    trace = make_trace(poisson_arrivals(10.0, 100.0, seed=0), seed=0, lengths=(prompt_dist, output_dist),
                       tenants=("a", "b"))
    prompts = np.array([r.prompt_len for r in trace])
    outputs = np.array([r.output_len for r in trace])
    assert prompts.min() >= 4 and prompts.max() == 100 and outputs.min() >= 2 and outputs.max() == 50
    assert {r.tenant for r in trace} == {"a", "b"}
    assert len({r.request_id for r in trace}) == len(trace)
    ids = prompt_token_ids(trace[0], vocab_size=64)
    assert len(ids) == trace[0].prompt_len and min(ids) >= 16 and max(ids) < 64
    assert ids == prompt_token_ids(trace[0], vocab_size=64)


def test_synthetic_chat_dataset_lengths_and_determinism(llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    examples = synthetic_chat_dataset(tokenizer, num_examples=12, seed=5, min_tokens=256, max_tokens=1024)
    assert examples == synthetic_chat_dataset(tokenizer, num_examples=12, seed=5)
    assert examples != synthetic_chat_dataset(tokenizer, num_examples=12, seed=6)
    lengths = []
    for example in examples:
        roles = [m["role"] for m in example["messages"]]
        assert roles == ["user", "assistant"]
        ids = tokenizer.apply_chat_template(example["messages"], tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        lengths.append(len(ids))
    # Re-tokenizing at message boundaries may shift a few tokens; the range holds within them.
    assert min(lengths) >= 256 - 8 and max(lengths) <= 1024 + 8
    assert max(lengths) - min(lengths) > 200  # drawn across the range, not one length
