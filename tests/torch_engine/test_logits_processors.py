"""Logit bias, repetition/frequency/presence penalties and min-p in the batched sampler: each changes the
logits exactly as defined (checked against a direct computation), seeded sampling draws from exactly the
processed distribution, a batch mixing rows with and without them gives each the result it gets alone,
logprobs stay raw; and end to end, greedy decoding with a repetition penalty matches `transformers`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from coserve import LLM, SamplingParams
from coserve.torch_engine.logits_processors import mask_min_p, process_logits
from coserve.torch_engine.sampler import RowSampling, Sampler
from reference import random_prompts

V = 50


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_frequency_and_presence_penalties_as_defined() -> None:
    x = _logits(1)
    outputs = [3, 3, 3, 7, 11, 11]
    row = RowSampling(frequency_penalty=0.7, presence_penalty=-0.4, output_ids=outputs, prompt_ids=[5, 9])
    expected = x.clone()
    for token in set(outputs):
        expected[0, token] -= 0.7 * outputs.count(token) + (-0.4)
    assert torch.allclose(process_logits(x, [row]), expected)


def test_repetition_penalty_as_defined() -> None:
    x = _logits(1, seed=1)
    row = RowSampling(repetition_penalty=1.8, prompt_ids=[1, 2, 2, 30], output_ids=[4, 30])
    expected = x.clone()
    for token in {1, 2, 30, 4}:
        value = x[0, token]
        expected[0, token] = value / 1.8 if value > 0 else value * 1.8
    assert torch.allclose(process_logits(x, [row]), expected)


def test_logit_bias_adds_bans_and_forces() -> None:
    x = _logits(1, seed=2)
    top = int(x.argmax())
    row = RowSampling(temperature=0.0, logit_bias={top: -100.0, 17: 2.5})
    expected = x.clone()
    expected[0, top] -= 100.0
    expected[0, 17] += 2.5
    assert torch.allclose(process_logits(x, [row]), expected)
    assert Sampler()(x, [row])[0][0] == int(expected.argmax())
    forced = RowSampling(temperature=1.0, seed=3, logit_bias={42: 100.0})
    assert {Sampler()(x, [RowSampling(**{**_fields(forced), "output_index": i})])[0][0] for i in range(20)} == {42}


def test_min_p_keeps_tokens_at_least_min_p_of_the_top() -> None:
    scaled = _logits(1, seed=3)
    probs = torch.softmax(scaled, dim=-1)
    keep = probs >= 0.2 * probs.max()
    masked = mask_min_p(scaled.clone(), [RowSampling(min_p=0.2)])
    assert torch.equal(torch.isfinite(masked), keep)
    assert torch.equal(masked[keep], scaled[keep])


def _fields(row: RowSampling) -> dict[str, object]:
    return {name: getattr(row, name) for name in row.__slots__}


@pytest.mark.parametrize("settings", [
    {"frequency_penalty": 1.5, "presence_penalty": 0.5, "output_ids": [0, 1, 1, 2, 2, 2]},
    {"repetition_penalty": 1.3, "prompt_ids": [0, 1, 2, 3], "output_ids": [4, 5]},
    {"logit_bias": {0: 5.0, 1: -100.0, 9: 1.5}},
])
def test_seeded_sampling_draws_from_the_processed_distribution(settings: dict[str, object]) -> None:
    """With the same seed, sampling with a processor gives the token that sampling the processed logits
    without one gives: the distribution is exactly the processed one."""
    x = _logits(1, seed=4)
    sampler = Sampler()
    for index in range(30):
        row = RowSampling(temperature=0.9, top_p=0.95, seed=11, output_index=index, **settings)  # type: ignore[arg-type]
        plain = RowSampling(temperature=0.9, top_p=0.95, seed=11, output_index=index)
        assert sampler(x, [row])[0] == sampler(process_logits(x, [row]), [plain])[0]


def test_min_p_sampling_matches_masked_logits() -> None:
    x = _logits(1, seed=5)
    sampler = Sampler()
    scaled = x / 0.7
    masked = mask_min_p(scaled.clone(), [RowSampling(min_p=0.1)]) * 0.7  # back to logit scale
    for index in range(30):
        row = RowSampling(temperature=0.7, min_p=0.1, seed=5, output_index=index)
        plain = RowSampling(temperature=0.7, seed=5, output_index=index)
        assert sampler(x, [row])[0] == sampler(masked, [plain])[0]


def test_mixed_batch_gives_each_row_its_result_alone_and_raw_logprobs() -> None:
    x = _logits(4, seed=6)
    rows = [RowSampling(temperature=0.0, frequency_penalty=2.0, output_ids=[int(x[0].argmax())] * 3,
                        num_logprobs=2),
            RowSampling(temperature=1.0, seed=1, num_logprobs=0),
            RowSampling(temperature=0.8, seed=2, repetition_penalty=2.0, prompt_ids=list(range(25)), min_p=0.05),
            RowSampling(temperature=0.0, logit_bias={3: 50.0})]
    sampler = Sampler()
    tokens, logprobs = sampler(x, rows)
    alone = [sampler(x[i:i + 1], [row])[0][0] for i, row in enumerate(rows)]
    assert tokens == alone
    assert tokens[0] != int(x[0].argmax()) and tokens[3] == 3
    raw = torch.log_softmax(x[0], dim=-1)
    # one log-softmax of the same logits, batched against alone: (4 + log2 V) u of |logits| <~ 10
    assert logprobs[0] is not None and logprobs[0].logprob == pytest.approx(float(raw[tokens[0]]), abs=1e-5)


@pytest.mark.parametrize(("field", "value"), [("frequency_penalty", 2.5), ("presence_penalty", -2.1),
                                              ("repetition_penalty", 0.0), ("min_p", 1.5),
                                              ("logit_bias", {3: 101.0})])
def test_sampling_params_refuse_out_of_range(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_greedy_repetition_penalty_matches_transformers(llama_dir: Path) -> None:
    """The engine's greedy decode with a repetition penalty equals `transformers`' `generate` with
    `repetition_penalty` (the same definition: prompt and output tokens), token for token."""
    llm = LLM(str(llama_dir), dtype="float32", max_num_seqs=4, max_batch_tokens=512)
    vocab = llm.engine.model_config.vocab_size
    # Long prompts: the penalty only matters when a seen token would win, and a random model rarely
    # repeats its own output.
    prompts = random_prompts(vocab, [300, 250, 200], seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.7)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          repetition_penalty=1.7, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
    assert any(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outputs, plain))


def test_logit_bias_outside_the_vocabulary_is_refused(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_num_seqs=2)
    vocab = llm.engine.layout.vocab_size
    with pytest.raises(ValueError, match=r"logit_bias: token id\(s\) \[" + str(vocab) + r"\]"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    out = llm.generate({"prompt_token_ids": [5, 6]},
                       SamplingParams(temperature=0, max_tokens=3, logit_bias={vocab - 1: 100.0}))
    assert out[0].outputs[0].token_ids == [vocab - 1] * 3
