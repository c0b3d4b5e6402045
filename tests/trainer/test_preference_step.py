"""The dedicated run's DPO step (`trainer.preference_step`, one process) against peft + TRL's loss + AdamW:
the same reference as the co-served DPO job's test (`test_coserved_dpo._reference_run`), fp32, CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_coserved_dpo import BATCH, BETA, _pairs, _reference_run
from test_coserved_training import OPTIMIZER, _engine, _start_checkpoint

from coserve.contract.data_position import DataPosition
from coserve.contract.preference import PairLogprobs, validation_metrics
from coserve.trainer import TrainingSequence, WindowedTrainer
from coserve.trainer.checkpoint import load_checkpoint
from coserve.trainer.preference_step import (
    PreferencePair,
    fill_references,
    preference_validation,
    reference_sums,
    train_preference_batch,
)
from numerics import dpo_margin_bound, sum_rel
from train_reference import MAX_REL_ERR, check_weights, rel_errs


def _sequence(example) -> TrainingSequence:  # type: ignore[no-untyped-def]
    return TrainingSequence(torch.tensor(example.token_ids), torch.tensor(example.trained))


def _set_up(llama_dir: Path, tmp_path: Path) -> tuple[dict[str, torch.Tensor], Any, WindowedTrainer,
                                                      list[PreferencePair], Any, Any]:
    """The start weights, the optimizer, a trainer on them, the test's pairs (and their examples)."""
    engine = _engine(llama_dir)
    init = _start_checkpoint(engine, tmp_path / "start")
    lora, optimizer, _ = load_checkpoint(tmp_path / "start", engine.model_config, "cpu")
    chosen, rejected = _pairs(engine.model_config.vocab_size)
    pairs = [PreferencePair(_sequence(c), _sequence(r)) for c, r in zip(chosen, rejected)]
    return init, optimizer, WindowedTrainer(engine.model, lora), pairs, chosen, rejected


def test_dpo_steps_equal_peft_with_trls_loss(llama_dir: Path, tmp_path: Path) -> None:
    init, optimizer, trainer, pairs, _, _ = _set_up(llama_dir, tmp_path)
    lora = trainer.lora
    references: dict[int, tuple[float, float]] = {}
    position, events = DataPosition(seed=11), []
    for _ in range(2):
        indices, position = position.next_batch(len(pairs), BATCH)
        fill_references(trainer, pairs, indices, references)
        events.append(train_preference_batch(trainer, optimizer, [pairs[i] for i in indices],
                                             [references[i] for i in indices], BETA))
    weights, grads, losses, bounds = _reference_run(llama_dir, init, steps=2)
    for (stats, metrics), loss, bound in zip(events, losses, bounds):  # the sums' rounding through the loss
        assert stats.loss == pytest.approx(loss, abs=bound)
        assert metrics["train_loss"] == pytest.approx(loss, abs=bound)
    assert sorted(references) == [0, 1, 2, 3]  # 2 steps of 2 pairs: every pair's reference, once
    assert events[0][0].num_tokens == sum(p.num_trained for i, p in enumerate(pairs) if i in
                                          DataPosition(seed=11).next_batch(len(pairs), BATCH)[0])
    noisy = {k: g.abs() < 1e-4 * g.abs().max() for k, g in grads.items()}
    mine = {k: t.detach().clone() for k, t in lora.named_parameters().items()}
    check_weights(mine, weights, noisy, bound=6 * OPTIMIZER.learning_rate)
    assert min(rel_errs(init, weights).values()) > 5 * MAX_REL_ERR  # it did move


def test_reference_sums_and_validation_match_peft(llama_dir: Path, tmp_path: Path) -> None:
    """Reference sums: the base model's (peft's adapter disabled); validation: TRL's loss and rewards."""
    from peft import LoraConfig, get_peft_model
    from test_coserved_dpo import _logprob_sum
    from test_coserved_training import LORA
    from transformers import AutoModelForCausalLM

    init, _, trainer, pairs, chosen, rejected = _set_up(llama_dir, tmp_path)
    hf = get_peft_model(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32),
                        LoraConfig(r=LORA.r, lora_alpha=LORA.lora_alpha, lora_dropout=0.0,
                                   target_modules=list(LORA.target_modules)))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.requires_grad:
                param.copy_(init[name.replace(".default.weight", ".weight")])
        policy = [(float(_logprob_sum(hf, c)), float(_logprob_sum(hf, r))) for c, r in zip(chosen, rejected)]
        with hf.disable_adapter():
            base = [(float(_logprob_sum(hf, c)), float(_logprob_sum(hf, r))) for c, r in zip(chosen, rejected)]
    counts = [(sum(c.trained[1:]), sum(r.trained[1:])) for c, r in zip(chosen, rejected)]
    for pair, expected, (n_c, n_r) in zip(pairs, base, counts):
        got_c, got_r = reference_sums(trainer, pair)  # one sum each side (numerics.sum_rel)
        assert got_c == pytest.approx(expected[0], rel=sum_rel(n_c))
        assert got_r == pytest.approx(expected[1], rel=sum_rel(n_r))
    got = preference_validation(trainer, pairs, BETA)
    expected = validation_metrics([PairLogprobs(*p, *b) for p, b in zip(policy, base)], BETA)
    assert got.keys() == expected.keys() and got["valid_rewards/margins"] != 0  # B is random: it moved
    # Each metric is a mean over pairs of a loss, a reward (beta x a difference of sums), a margin or a sum, each
    # within a pair's four sums' rounding (beta < 1, sigmoid < 1): a difference of sums of hundreds carries it.
    slack = max(dpo_margin_bound([*p, *b], [*n, *n], 1.0) for p, b, n in zip(policy, base, counts))
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=slack), key
