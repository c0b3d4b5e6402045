"""The sampler under a token mask (structured output): only allowed ids are sampled, whatever the
sampling settings; unmasked rows are untouched; logprobs stay those of the raw distribution."""

from __future__ import annotations

import pytest
import torch

from coserve.torch_engine.sampler import RowSampling, Sampler
from coserve.torch_engine.token_mask import TokenMask, bitmask_from_allowed, unpack_bitmask

VOCAB = 301  # not a multiple of 32: the last word is partial


@pytest.fixture(autouse=True)
def _fixed_default_seed() -> None:
    torch.manual_seed(99)


def test_bitmask_round_trip_includes_the_sign_bit_and_the_partial_last_word() -> None:
    allowed = [[0, 31, 32, 63, 300], [5], list(range(VOCAB))]
    dense = unpack_bitmask(bitmask_from_allowed(allowed, VOCAB), VOCAB)
    assert dense.shape == (3, VOCAB)
    for row, ids in zip(dense, allowed):
        assert row.nonzero().flatten().tolist() == ids


def _settings() -> list[RowSampling]:
    """Greedy, plain random, seeded, and random with every truncation and penalty."""
    return [RowSampling(temperature=0.0), RowSampling(temperature=1.0), RowSampling(temperature=0.8, seed=3),
            RowSampling(temperature=1.3, top_k=5, top_p=0.7, min_p=0.1, seed=4),
            RowSampling(temperature=1.0, logit_bias={7: 100.0}, frequency_penalty=1.0,
                        repetition_penalty=1.5, output_ids=[8, 9], prompt_ids=[1])]


def test_sampled_ids_are_always_allowed() -> None:
    sampler = Sampler()
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        rows = _settings()
        for row in rows:
            row.output_index = trial
        allowed = [torch.randperm(VOCAB, generator=generator)[: 1 + trial % 7].tolist() for _ in rows]
        # The allowed ids are the unlikely ones, so an unmasked sampler would almost never pick them.
        logits = torch.randn(len(rows), VOCAB) * 3
        for i, ids in enumerate(allowed):
            logits[i, ids] -= 20.0
        mask = TokenMask(list(range(len(rows))), bitmask_from_allowed(allowed, VOCAB))
        tokens, _ = sampler(logits, rows, mask)
        for token, ids in zip(tokens, allowed):
            assert token in ids


def test_unmasked_rows_sample_as_alone_and_logprobs_stay_raw() -> None:
    sampler = Sampler()
    logits = torch.randn(6, VOCAB)
    greedy, seeded = RowSampling(temperature=0.0, num_logprobs=3), RowSampling(temperature=0.9, seed=11)
    rows = [greedy, RowSampling(temperature=0.0, num_logprobs=3), seeded,
            RowSampling(temperature=0.9, seed=12), greedy, seeded]
    masked_rows = [1, 3]  # rows 0, 2, 4, 5 are unconstrained
    mask = TokenMask(masked_rows, bitmask_from_allowed([[4, 5], [6]], VOCAB))
    before = logits.clone()
    tokens, logprobs = sampler(logits, rows, mask)
    assert torch.equal(logits, before)
    assert tokens[1] in (4, 5) and tokens[3] == 6
    for i in (0, 2, 4, 5):
        alone, _ = sampler(logits[i: i + 1], [rows[i]])
        assert tokens[i] == alone[0]
    unmasked, raw = sampler(logits, rows)
    # Row 1 is greedy under a mask: the reported logprobs are the model's own (raw) distribution.
    assert logprobs[1].top_token_ids == raw[1].top_token_ids
    assert logprobs[1].top_logprobs == pytest.approx(raw[1].top_logprobs)  # the same kernel on the same row
    expected = torch.log_softmax(logits[1], dim=-1)[tokens[1]].item()
    assert logprobs[1].logprob == pytest.approx(expected, abs=1e-5)  # (4 + log2 V) u of |logits| <~ 10
    assert logprobs[1].rank == int((torch.log_softmax(logits[1], -1) > expected).sum()) + 1


def test_a_row_allowing_one_token_gets_it_even_against_a_huge_bias() -> None:
    logits = torch.zeros(2, VOCAB)
    rows = [RowSampling(temperature=0.0, logit_bias={1: 100.0}),
            RowSampling(temperature=2.0, top_k=1, logit_bias={1: 100.0})]
    mask = TokenMask([0, 1], bitmask_from_allowed([[200], [299]], VOCAB))
    tokens, _ = Sampler()(logits, rows, mask)
    assert tokens == [200, 299]
