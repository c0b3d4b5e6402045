"""Tests of the token sampler: greedy, seeds, top-k, top-p, the sampled distribution and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from coserve.torch_engine.sampler import RowSampling, Sampler, mix_seed


def _rows(n: int, **kwargs: object) -> list[RowSampling]:
    return [RowSampling(**kwargs) for _ in range(n)]  # type: ignore[arg-type]


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).float()
    return counts / counts.sum()


@pytest.fixture(autouse=True)
def _fixed_default_seed() -> None:
    # The statistical tests use the default generator; fixing it keeps them deterministic.
    torch.manual_seed(1234)


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = torch.randn(16, 100)
    logits[3, 7] = logits[3, 42] = logits[3].max() + 1.0  # tie: the lowest index wins
    tokens, logprobs = Sampler()(logits, _rows(16, temperature=0.0))
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[3] == 7
    assert logprobs == [None] * 16


def test_accepts_half_precision_and_does_not_modify_logits() -> None:
    logits = torch.randn(8, 64).to(torch.bfloat16)
    before = logits.clone()
    tokens, _ = Sampler()(logits, _rows(4, temperature=0.0) + _rows(4, temperature=1.0, top_p=0.5))
    assert tokens[:4] == logits[:4].float().argmax(dim=-1).tolist()
    assert torch.equal(logits, before)


def test_mixed_greedy_and_random_rows_keep_their_positions() -> None:
    logits = torch.full((6, 10), -10.0)
    for i in range(6):
        logits[i, i] = 10.0  # each row is (almost) a point mass on token i
    rows = [RowSampling(temperature=0.0 if i % 2 else 0.7, top_k=3 if i == 4 else -1) for i in range(6)]
    tokens, _ = Sampler()(logits, rows)
    assert tokens == list(range(6))


def test_seeded_row_is_independent_of_batch_composition_and_position() -> None:
    vocab = 500
    sampler = Sampler()
    for seed in range(30):
        target_logits = torch.randn(vocab)
        target = RowSampling(temperature=1.0, top_p=0.9, seed=seed, output_index=seed % 4)
        alone, _ = sampler(target_logits.unsqueeze(0), [target])
        others = [
            RowSampling(temperature=1.0),
            RowSampling(temperature=0.0),
            RowSampling(temperature=0.8, seed=seed + 1000),
            RowSampling(temperature=1.3, top_k=5),
        ]
        position = seed % (len(others) + 1)
        rows = others[:position] + [target] + others[position:]
        logits = torch.randn(len(rows), vocab)
        logits[position] = target_logits
        batched, _ = sampler(logits, rows)
        # A fresh sampler stands for the engine after a preemption and recompute.
        recomputed, _ = Sampler()(target_logits.unsqueeze(0), [target])
        assert batched[position] == alone[0] == recomputed[0], seed


def test_different_seeds_and_output_indices_give_different_tokens() -> None:
    vocab, n = 1000, 200
    logits = torch.zeros(n, vocab)  # uniform: any repeated stream shows up as equal tokens
    by_seed, _ = Sampler()(logits, [RowSampling(seed=s, output_index=0) for s in range(n)])
    by_index, _ = Sampler()(logits, [RowSampling(seed=7, output_index=i) for i in range(n)])
    # 200 uniform draws from 1000 values have ~181 distinct values; a shared stream gives 1.
    assert len(set(by_seed)) > 150
    assert len(set(by_index)) > 150
    assert mix_seed(1, 0) != mix_seed(0, 1)
    assert all(0 <= mix_seed(s, i) < 2**63 for s in (-1, 0, 2**70) for i in (0, 5))


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(64, 300)
    tokens, _ = Sampler()(logits, _rows(64, temperature=1.5, top_k=1))
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_restricts_support() -> None:
    vocab, k, n = 50, 5, 4000
    base = torch.randn(vocab)
    tokens, _ = Sampler()(base.expand(n, vocab), _rows(n, temperature=2.0, top_k=k))
    allowed = set(base.topk(k).indices.tolist())
    assert set(tokens) == allowed  # inside the top-k, and (with 4000 draws) every one of them seen


def test_top_p_keeps_smallest_prefix_reaching_top_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    perm = torch.tensor([2, 0, 3, 1])  # shuffled so the sort really matters
    logits = probs.log()[perm]  # token perm^-1: token 1 has p=.5, token 3 has p=.3
    n = 4000
    expected = {
        0.8: {1, 3},  # 0.5 + 0.3 reaches 0.8 exactly: the third token is not needed
        0.81: {1, 3, 0},
        0.5: {1},  # the first token alone reaches 0.5
        0.3: {1},
        1e-9: {1},  # tiny top_p still keeps the most likely token
        1.0: {0, 1, 2, 3},
    }
    for top_p, support in expected.items():
        tokens, _ = Sampler()(logits.expand(n, 4), _rows(n, temperature=1.0, top_p=top_p))
        assert set(tokens) == support, top_p


def test_top_p_tolerates_float32_rounding_at_the_boundary() -> None:
    # In float32, softmax(log([.45, .35, .2])) sums its first two to 0.79999995 < float32(0.8): the
    # exact rule says two tokens reach 0.8, so rounding must not pull in the third.
    logits = torch.tensor([0.45, 0.35, 0.2]).log()
    tokens, _ = Sampler()(logits.expand(4000, 3), _rows(4000, top_p=0.8))
    assert set(tokens) == {0, 1}


def test_top_k_then_top_p_renormalises() -> None:
    # top_k=2 leaves [0.5, 0.3] renormalised to [0.625, 0.375]; top_p=0.6 then keeps only the first.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    tokens, _ = Sampler()(logits.expand(2000, 4), _rows(2000, top_k=2, top_p=0.6))
    assert set(tokens) == {0}


def test_empirical_distribution_matches_softmax() -> None:
    vocab, n, temperature = 8, 20_000, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    tokens, _ = Sampler()(logits.expand(n, vocab), _rows(n, temperature=temperature))
    expected = torch.softmax(logits / temperature, dim=-1)
    # Binomial std of a frequency is <= sqrt(0.25 / 20000) ~ 0.0035; 0.012 is > 3 sigma.
    assert (_frequencies(tokens, vocab) - expected).abs().max() < 0.012


def test_empirical_distribution_with_top_k_and_seeds_matches_renormalised_softmax() -> None:
    vocab, n, k = 8, 20_000, 3
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    rows = [RowSampling(top_k=k, seed=s, output_index=s % 3) for s in range(n)]
    tokens, _ = Sampler()(logits.expand(n, vocab), rows)
    expected = torch.zeros(vocab)
    top = logits.topk(k)
    expected[top.indices] = torch.softmax(top.values, dim=-1)
    assert (_frequencies(tokens, vocab) - expected).abs().max() < 0.012


def test_tiny_temperature_and_huge_top_k_are_safe() -> None:
    logits = torch.randn(32, 200) * 50
    # ~100 / 1e-37 overflows float32: without the clamp softmax sees inf - inf = NaN.
    tokens, _ = Sampler()(logits, _rows(32, temperature=1e-37))
    assert tokens == logits.argmax(dim=-1).tolist()
    tokens, _ = Sampler()(logits, _rows(32, temperature=1.0, top_k=10**9, top_p=0.999))
    assert all(0 <= t < 200 for t in tokens)


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_lists() -> None:
    vocab = 40
    logits = torch.randn(5, vocab) * 3
    rows = [
        RowSampling(temperature=0.0, num_logprobs=3),
        RowSampling(temperature=1.0, num_logprobs=None),
        RowSampling(temperature=2.0, top_k=10, num_logprobs=5),
        RowSampling(temperature=0.5, num_logprobs=0),
        RowSampling(temperature=1.0, num_logprobs=vocab + 10),  # more than V: all of them
    ]
    tokens, logprobs = Sampler()(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert logprobs[1] is None
    for i in (0, 2, 3, 4):
        lp = logprobs[i]
        assert lp is not None and lp.token_id == tokens[i]
        # the sampler's log-softmax of the same logits against torch's: (4 + log2 V) u of |logits| <~ 10
        assert math.isclose(lp.logprob, reference[i, tokens[i]].item(), abs_tol=1e-5)
        order = reference[i].argsort(descending=True).tolist()  # distinct values: ranks are unique
        assert lp.rank == order.index(tokens[i]) + 1
        want = min(rows[i].num_logprobs, vocab)
        assert lp.top_token_ids == order[:want]
        assert lp.top_logprobs == pytest.approx(reference[i, order[:want]].tolist(), abs=1e-5)
    assert logprobs[0].rank == 1  # greedy picks the most likely token
    assert logprobs[3].top_token_ids == [] and logprobs[3].top_logprobs == []


def test_rank_counts_strictly_larger_logprobs() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    _, logprobs = Sampler()(logits, [RowSampling(temperature=0.0, num_logprobs=2)])
    assert logprobs[0].token_id == 1 and logprobs[0].rank == 1
    _, logprobs = Sampler()(logits, [RowSampling(top_k=1, num_logprobs=0)])
    assert logprobs[0].rank == 1  # tied with token 2, which does not count as strictly larger


def test_shape_mismatch_and_empty_batch() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), _rows(3))
    assert Sampler()(torch.zeros(0, 5), []) == ([], [])
