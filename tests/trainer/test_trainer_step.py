"""The optimizer step and checkpoints of the token-level trainer (fp32, CPU, tiny llama).

* Whole optimizer steps over batches of chat-like sequences with different lengths and windowings
  equal peft + `torch.optim.AdamW` (labels -100 outside the answers, loss = mean over the batch's
  trained tokens, `clip_grad_norm_(1.0)`), with clipping idle and with clipping active. Adam is
  nearly invariant to a gradient's scale on its first step, so each case takes two steps: the second
  step is where a missing or wrong clip shows, and a control proves the test would see it. The
  few elements (< 0.5%) whose gradient is ~0 are held only to Adam's step bound (`check_weights`).
* The step itself is bit for bit `clip_grad_norm_` + `torch.optim.AdamW` (weight decay included).
* Checkpoint after step 1, restore into fresh objects, two more steps: bit-identical to three
  uninterrupted steps (and a restore without the optimizer state is not).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from coserve.contract.training_settings import LoRASettings, OptimizerSettings
from coserve.forward.transformer import Transformer
from coserve.model.config import ModelConfig
from coserve.model.weights import load_weights
from coserve.trainer import (
    DataPosition,
    LoRAOptimizer,
    NonFiniteGradientError,
    TrainableLoRA,
    TrainingSequence,
    WindowedTrainer,
    load_checkpoint,
    save_checkpoint,
    train_batch,
)
from coserve.trainer import checkpoint as checkpoint_module
from train_reference import MAX_REL_ERR, check_weights, peft_adamw_run, rel_errs, worst

LORA = LoRASettings(r=4, lora_alpha=8)
Segments = list[tuple[int, bool]]  # (tokens, trained) runs: prompt, answer, user turn, answer...
# (segments, forward windows, backward windows): lengths 48, 24, 37 | 35, 32.
BATCHES: list[list[tuple[Segments, list[int] | None, list[int] | None]]] = [
    [([(12, False), (20, True), (6, False), (10, True)], [7, 13, 28], None),
     ([(9, False), (15, True)], None, None),  # one window
     ([(20, False), (17, True)], [20, 17], [5, 31, 1])],  # window edge at the answer; backward differs
    [([(5, False), (30, True)], [16, 16, 3], None),
     ([(14, False), (8, True), (4, False), (6, True)], [11, 21], [32])],
]
# The LoRA scale (alpha / r) sets the gradient norm: ~0.3 (clip idle) or ~20 (clip active). B is
# small so that a step of lr = 1e-4 (the default rule) moves every tensor by ~1e-3 of its largest
# value, ten times the tolerance. Weight decay is too small to see here; the exact AdamW test sees it.
CASES = {
    "clip_idle": dict(lora=LoRASettings(r=4, lora_alpha=0.1), b_scale=0.01, expect_clipped=False,
                      config=OptimizerSettings()),
    "clip_active": dict(lora=LORA, b_scale=0.01, expect_clipped=True,
                        config=OptimizerSettings(weight_decay=0.01)),
}
NOISY_GRAD = 1e-4  # |g| below this fraction of its tensor's largest: see _check_weights


@pytest.fixture(scope="module")
def model(llama_dir: Path) -> Transformer:
    cfg = ModelConfig.from_pretrained(llama_dir)
    weights = load_weights(llama_dir, cfg, torch.float32, torch.device("cpu"))
    return Transformer(cfg, weights, torch.float32, torch.device("cpu"))


def _sequence(segments: Segments, vocab: int, seed: int, forward: list[int] | None = None,
              backward: list[int] | None = None) -> TrainingSequence:
    g = torch.Generator().manual_seed(seed)
    trained = torch.cat([torch.full((n,), flag) for n, flag in segments])
    ids = torch.randint(8, vocab, (trained.numel(),), generator=g)
    return TrainingSequence(ids, trained, forward, backward)


def _batches(vocab: int) -> list[list[TrainingSequence]]:
    return [[_sequence(seg, vocab, seed=100 * b + i, forward=fwd, backward=bwd)
             for i, (seg, fwd, bwd) in enumerate(batch)] for b, batch in enumerate(BATCHES)]


def _lora(cfg: ModelConfig, lora_cfg: LoRASettings, b_scale: float, seed: int = 3
          ) -> TrainableLoRA:
    lora = TrainableLoRA.init(cfg, lora_cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in lora.b.values():  # B starts at zero: randomise it so that d/dA is nonzero
            b.copy_(torch.randn(b.shape, generator=g) * b_scale)
    return lora


def _snapshot(lora: TrainableLoRA) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in lora.named_parameters().items()}


@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_steps_equal_peft_adamw(model: Transformer, llama_dir: Path, case: str) -> None:
    """Two batch steps of the windowed trainer + LoRAOptimizer equal peft + AdamW's."""
    lora_cfg, b_scale, expect_clipped, config = (
        CASES[case][k] for k in ("lora", "b_scale", "expect_clipped", "config"))
    batches = _batches(model.cfg.vocab_size)
    lora = _lora(model.cfg, lora_cfg, b_scale)
    init = _snapshot(lora)
    reference = peft_adamw_run(llama_dir, lora_cfg, init, batches, config)
    assert all((ref.norm > 1.0) == expect_clipped for ref in reference), [r.norm for r in reference]

    trainer, optimizer = WindowedTrainer(model, lora, vocab_chunk=500), LoRAOptimizer(lora, config)
    noisy = {name: torch.zeros_like(t, dtype=torch.bool) for name, t in init.items()}
    for step, (batch, ref) in enumerate(zip(batches, reference), start=1):
        stats = train_batch(trainer, optimizer, batch)
        assert (stats.step, stats.clipped) == (step, expect_clipped)
        assert stats.grad_norm == pytest.approx(ref.norm, rel=1e-4)  # GRAD_REL_ERR, in the 2-norm (numerics)
        assert stats.num_tokens == sum(seq.num_trained for seq in batch)
        for name, g in ref.grads.items():
            noisy[name] |= g.abs() < NOISY_GRAD * g.abs().max()
        fraction = sum(int(m.sum()) for m in noisy.values()) / sum(m.numel() for m in noisy.values())
        assert fraction < 0.005, "too many excluded elements: the comparison would be weak"
        check_weights(_snapshot(lora), ref.weights, noisy, bound=3 * step * config.learning_rate)
        # Every tensor must move well past the tolerance, or equality would prove nothing.
        assert min(rel_errs(init, ref.weights).values()) > 5 * MAX_REL_ERR

    if expect_clipped:  # control: without clipping the second step lands elsewhere
        unclipped = OptimizerSettings(learning_rate_multiplier=config.learning_rate_multiplier,
                                    weight_decay=config.weight_decay, max_grad_norm=math.inf)
        free = peft_adamw_run(llama_dir, lora_cfg, init, batches, unclipped)
        with pytest.raises(AssertionError, match="relative error"):
            check_weights(free[-1].weights, reference[-1].weights, noisy, bound=math.inf)


DATASET: list[Segments] = [[(10, False), (14, True)], [(6, False), (9, True), (5, False), (8, True)],
                           [(17, False), (12, True)], [(4, False), (21, True)]]
WINDOWS = [[9, 15], [13, 15], None, [25]]
BATCH_SIZE = 3  # 4 examples: batches of 3, then 1 (end of epoch 0), then 3 of epoch 1's order


def _job_steps(trainer: WindowedTrainer, optimizer: LoRAOptimizer, position: DataPosition,
               dataset: list[TrainingSequence], steps: int) -> DataPosition:
    for _ in range(steps):
        indices, position = position.next_batch(len(dataset), BATCH_SIZE)
        train_batch(trainer, optimizer, [dataset[i] for i in indices])
    return position


def test_checkpoint_resume_equals_uninterrupted_run(model: Transformer, tmp_path: Path) -> None:
    dataset = [_sequence(seg, model.cfg.vocab_size, seed=i, forward=w)
               for i, (seg, w) in enumerate(zip(DATASET, WINDOWS))]
    config = OptimizerSettings(learning_rate_multiplier=10.0, weight_decay=0.01)
    start = DataPosition(seed=42)

    lora = TrainableLoRA.init(model.cfg, LORA, seed=5)  # PEFT's init: B = 0
    optimizer = LoRAOptimizer(lora, config)
    final = _job_steps(WindowedTrainer(model, lora), optimizer, start, dataset, 3)
    assert final == DataPosition(seed=42, epoch=1, index=3, step=3)
    expected, expected_state = _snapshot(lora), optimizer.state_dict()["adamw"]["state"]

    lora = TrainableLoRA.init(model.cfg, LORA, seed=5)
    optimizer = LoRAOptimizer(lora, config)
    position = _job_steps(WindowedTrainer(model, lora), optimizer, start, dataset, 1)
    save_checkpoint(tmp_path / "ckpt", lora, optimizer, position)
    del lora, optimizer

    lora, optimizer, position = load_checkpoint(tmp_path / "ckpt", model.cfg)
    assert position == DataPosition(seed=42, epoch=0, index=3, step=1) and optimizer.config == config
    assert _job_steps(WindowedTrainer(model, lora), optimizer, position, dataset, 2) == final
    for name, t in _snapshot(lora).items():
        assert torch.equal(t, expected[name]), name
    for index, moments in optimizer.state_dict()["adamw"]["state"].items():
        for key, t in moments.items():
            assert torch.equal(t, expected_state[index][key]), (index, key)

    # Control: the adapter alone (fresh AdamW moments) does not continue the same run.
    lora, _, position = load_checkpoint(tmp_path / "ckpt", model.cfg)
    fresh = LoRAOptimizer(lora, config)
    _job_steps(WindowedTrainer(model, lora), fresh, position, dataset, 2)
    assert worst(rel_errs(_snapshot(lora), expected))[1] > 100 * MAX_REL_ERR


def _fake_step(optimizer: LoRAOptimizer, seed: int) -> None:
    """One AdamW step on a random gradient: a cheap way to give the optimizer state."""
    g = torch.Generator().manual_seed(seed)
    for p in optimizer.params:
        p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()


def test_checkpoint_replace_is_atomic(model: Transformer, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lora = TrainableLoRA.init(model.cfg, LORA, seed=1)
    optimizer = LoRAOptimizer(lora, OptimizerSettings())
    path = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="step"):  # position and optimizer must agree
        save_checkpoint(path, lora, optimizer, DataPosition(seed=0, step=1))
    _fake_step(optimizer, seed=0)
    save_checkpoint(path, lora, optimizer, DataPosition(seed=0, index=2, step=1))
    _fake_step(optimizer, seed=1)
    save_checkpoint(path, lora, optimizer, DataPosition(seed=0, index=4, step=2))  # replaces
    assert load_checkpoint(path, model.cfg)[2].step == 2

    def broken_save(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    _fake_step(optimizer, seed=2)
    monkeypatch.setattr(checkpoint_module.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, lora, optimizer, DataPosition(seed=0, index=6, step=3))
    monkeypatch.undo()
    restored, _, position = load_checkpoint(path, model.cfg)
    assert position.step == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert not torch.equal(restored.parameters()[0], lora.parameters()[0])  # step 3 never landed
    json_state = json.loads((path / checkpoint_module.STATE_FILE).read_text())
    assert json_state["position"]["index"] == 4

    (path / checkpoint_module.OPTIMIZER_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="optimizer.pt"):
        load_checkpoint(path, model.cfg)


def test_step_is_clip_grad_norm_then_adamw(model: Transformer) -> None:
    """Bit for bit `clip_grad_norm_` + `torch.optim.AdamW` over several steps, clipped or not.

    A large learning rate and weight decay make both visible in the weights at once.
    """
    config = OptimizerSettings(learning_rate_multiplier=100.0, weight_decay=0.5, betas=(0.8, 0.95))
    lora = TrainableLoRA.init(model.cfg, LORA, seed=4)
    ref = [p.detach().clone().requires_grad_() for p in lora.parameters()]
    adamw = torch.optim.AdamW(ref, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.5)
    optimizer = LoRAOptimizer(lora, config)
    g = torch.Generator().manual_seed(0)
    clipped = []
    for scale in (10.0, 1e-3, 3.0, 1e-2):  # total norms far above and below max_grad_norm = 1
        grads = [torch.randn(p.shape, generator=g) * scale / 30 for p in ref]
        for p, q, grad in zip(optimizer.params, ref, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        adamw.step()
        stats = optimizer.step()
        assert stats.grad_norm == float(norm) and stats.learning_rate == pytest.approx(1e-2)
        clipped.append(stats.clipped)
        assert all(torch.equal(p, q) for p, q in zip(optimizer.params, ref))
    assert clipped == [True, False, True, False]


def test_non_finite_gradient_fails_without_touching_weights(model: Transformer) -> None:
    lora = TrainableLoRA.init(model.cfg, LORA, seed=2)
    optimizer = LoRAOptimizer(lora, OptimizerSettings())
    before = _snapshot(lora)
    with pytest.raises(RuntimeError, match="without any accumulated gradient"):
        optimizer.step()
    for p in optimizer.params:
        p.grad = torch.ones_like(p)
    optimizer.params[3].grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="gradient norm=nan"):
        optimizer.step()
    assert optimizer.step_count == 0 and all(p.grad is None for p in optimizer.params)
    assert all(torch.equal(t, before[n]) for n, t in _snapshot(lora).items())
    _fake_step(optimizer, seed=0)  # the optimizer is still usable
    assert optimizer.step_count == 1


def test_data_position_walks_shuffled_epochs() -> None:
    position, seen = DataPosition(seed=7), []
    for _ in range(6):  # 5 examples, batches of 2: [2, 2, 1] per epoch
        batch, position = position.next_batch(5, 2)
        seen.append(batch)
    assert [len(b) for b in seen] == [2, 2, 1, 2, 2, 1]
    epoch0, epoch1 = sum(seen[:3], []), sum(seen[3:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(5))
    assert epoch0 == DataPosition(seed=7).order(5) and epoch0 != epoch1  # reshuffled per epoch
    assert DataPosition(seed=8).order(5) != epoch0 or DataPosition(seed=9).order(5) != epoch0
    assert position == DataPosition(seed=7, epoch=2, index=0, step=6)
    assert DataPosition.from_dict(json.loads(json.dumps(position.to_dict()))) == position


def test_optimizer_config_rules() -> None:
    assert OptimizerSettings().learning_rate == pytest.approx(1e-4)
    assert OptimizerSettings(learning_rate_multiplier=3).learning_rate == pytest.approx(3e-4)
    assert OptimizerSettings().weight_decay == 0.0 and OptimizerSettings().max_grad_norm == 1.0
    config = OptimizerSettings(max_grad_norm=math.inf, betas=[0.8, 0.99])
    assert OptimizerSettings.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    for bad in (dict(learning_rate_multiplier=0), dict(weight_decay=-1), dict(betas=(0.9, 1.0)),
                dict(eps=0), dict(max_grad_norm=float("nan"))):
        with pytest.raises(ValueError, match="bad optimizer settings"):
            OptimizerSettings(**bad)
