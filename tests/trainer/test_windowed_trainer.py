"""Exactness of the token-window trainer against peft's one full-sequence backward (fp32, CPU).

A LoRA with randomised B (so d/dA is nonzero) is trained on one chat-like sequence (prompt, answer,
user turn, answer) under several window schedules. The LoRA gradients must equal peft's with the
HF labels masked to -100 outside the answers (loss = mean over trained tokens), within 1e-4 of each
tensor's largest gradient, and the loss must match. A FlexLLM-style label shift inside each window
must be caught. Also: PEFT save/load, init, the chunked cross-entropy, the batch normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM

from coserve.contract.training_settings import LoRASettings
from coserve.forward.lora import load_peft_adapter
from coserve.forward.transformer import Transformer
from coserve.model.config import ModelConfig
from coserve.model.weights import load_weights
from coserve.trainer import (
    IGNORE_INDEX,
    TrainableLoRA,
    WindowedTrainer,
    chunked_cross_entropy,
    full_cross_entropy,
    run_schedule,
    train_sequence,
    window_loss,
)
from coserve.trainer import loss as loss_module
from numerics import GRAD_REL_ERR as MAX_REL_ERR
from numerics import sum_rel

# prompt 0..19, answer 20..39, user turn 40..47, answer 48..63 (trained = the token is learned)
SEGMENTS = [(20, False), (20, True), (8, False), (16, True)]
LENGTH = sum(n for n, _ in SEGMENTS)
LORAS = {  # all seven projections on llama; a subset (k and gate/up missing) on qwen3
    "llama": LoRASettings(r=4, lora_alpha=8),
    "qwen3": LoRASettings(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj", "o_proj",
                                                                 "down_proj")),
}
SCHEDULES = {  # (forward window sizes, backward window sizes from the end; None = forward reversed)
    "one_window": ([64], None),
    "uniform_16": ([16] * 4, None),
    "random_uneven": ([7, 1, 13, 22, 21], None),
    "answer_edge": ([20, 44], None),  # position 19 predicts the first answer token from window 2
    "bwd_differs": ([16] * 4, [5, 30, 1, 28]),
}


@dataclass
class Case:
    model_dir: Path
    model: Transformer
    adapter_dir: Path
    token_ids: torch.Tensor
    trained: torch.Tensor
    ref_loss: float
    ref_grads: dict[str, torch.Tensor]


def _trained_mask() -> torch.Tensor:
    return torch.cat([torch.full((n, ), flag) for n, flag in SEGMENTS])


def _random_lora(cfg: ModelConfig, lora_cfg: LoRASettings, seed: int) -> TrainableLoRA:
    lora = TrainableLoRA.init(cfg, lora_cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in lora.b.values():  # B starts at zero: randomise it so that d/dA is nonzero
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return lora


def _peft_grads(model_dir: Path, adapter_dir: Path, sequences: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[float, dict[str, torch.Tensor]]:
    """peft's gradient of (sum of token losses) / (trained tokens) over the sequences."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, adapter_dir, is_trainable=True)
    total = sum(int(t[1:].sum()) for _, t in sequences)
    loss_sum = 0.0
    for ids, trained in sequences:
        labels = torch.where(trained, ids, torch.full_like(ids, IGNORE_INDEX))
        loss = model(input_ids=ids[None], labels=labels[None]).loss  # mean over trained tokens
        count = int(trained[1:].sum())
        (loss * count / total).backward()
        loss_sum += loss.item() * count
    grads = {name.replace(".default.weight", ".weight"): p.grad.clone()
             for name, p in model.named_parameters() if "lora_" in name}
    return loss_sum / total, grads


def _build_model(model_dir: Path) -> Transformer:
    cfg = ModelConfig.from_pretrained(model_dir)
    weights = load_weights(model_dir, cfg, torch.float32, torch.device("cpu"))
    return Transformer(cfg, weights, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def cases(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    out = {}
    for arch, lora_cfg in LORAS.items():
        model = _build_model(model_dirs[arch])
        adapter_dir = _random_lora(model.cfg, lora_cfg, seed=3).save_pretrained(
            tmp_path_factory.mktemp(f"adapter-{arch}"))
        g = torch.Generator().manual_seed(11)
        ids = torch.randint(8, model.cfg.vocab_size, (LENGTH,), generator=g)
        trained = _trained_mask()
        ref_loss, ref_grads = _peft_grads(model_dirs[arch], adapter_dir, [(ids, trained)])
        out[arch] = Case(model_dirs[arch], model, adapter_dir, ids, trained, ref_loss, ref_grads)
    return out


def _trainer(case: Case, vocab_chunk: int = 500) -> WindowedTrainer:
    # A vocabulary chunk that does not divide the vocabulary: the last chunk is ragged.
    lora = TrainableLoRA.from_pretrained(case.adapter_dir, case.model.cfg)
    return WindowedTrainer(case.model, lora, vocab_chunk=vocab_chunk)


def _max_rel_errors(lora: TrainableLoRA, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    errors = {}
    for name, param in lora.named_parameters().items():
        scale = float(ref[name].abs().max())
        assert scale > 0, f"{name}: the reference gradient is zero, the test would prove nothing"
        errors[name] = float((param.grad - ref[name]).abs().max()) / scale
    assert set(errors) == set(ref), "the trainer and peft disagree on which tensors train"
    return errors


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("arch", list(LORAS))
def test_gradients_equal_peft(cases: dict[str, Case], arch: str, schedule: str) -> None:
    case = cases[arch]
    trainer = _trainer(case)
    forward, backward = SCHEDULES[schedule]
    state = train_sequence(trainer, case.token_ids, case.trained, forward, backward)
    assert state.backward_done and state.kept_bytes() == 0, "a finished sequence keeps nothing"
    assert state.num_loss_tokens == int(case.trained[1:].sum())
    # a mean of same-sign cross-entropy terms (numerics.sum_rel)
    assert state.loss_sum / state.num_loss_tokens == pytest.approx(case.ref_loss, rel=sum_rel(LENGTH))
    errors = _max_rel_errors(trainer.lora, case.ref_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= MAX_REL_ERR, f"{worst}: relative error {errors[worst]:.2e}"


def test_window_edge_label_shift_is_caught(cases: dict[str, Case]) -> None:
    """FlexLLM shifts labels inside each window: a window's last position gets a stale label."""
    case = cases["llama"]
    trainer = _trainer(case)
    windows = [16] * 4
    state = trainer.start_sequence(case.token_ids, case.trained)
    edges = [sum(windows[: k + 1]) - 1 for k in range(len(windows) - 1)]
    stale = [e for e in edges if state.targets[e] != IGNORE_INDEX]
    assert stale, "some window edge must fall inside an answer"
    state.targets[stale] = case.token_ids[stale]  # a stale label instead of the next window's token
    run_schedule(trainer, state, windows)
    errors = _max_rel_errors(trainer.lora, case.ref_grads)
    assert max(errors.values()) > 1e-2, "a wrong window-edge label must change the gradient"


def test_batch_normalisation_over_two_sequences(cases: dict[str, Case]) -> None:
    """With loss_normalizer = the batch's trained tokens, summed grads are the batch-mean gradient."""
    case = cases["qwen3"]
    short_ids, short_trained = case.token_ids[:30], case.trained[:30]  # 10 trained tokens
    ref_loss, ref_grads = _peft_grads(case.model_dir, case.adapter_dir,
                                      [(case.token_ids, case.trained), (short_ids, short_trained)])
    trainer = _trainer(case)
    total = int(case.trained[1:].sum()) + int(short_trained[1:].sum())
    first = train_sequence(trainer, case.token_ids, case.trained, [16] * 4, loss_normalizer=total)
    second = train_sequence(trainer, short_ids, short_trained, [9, 21], loss_normalizer=total)
    errors = _max_rel_errors(trainer.lora, ref_grads)
    assert max(errors.values()) <= MAX_REL_ERR
    assert (first.loss_sum + second.loss_sum) / total == pytest.approx(ref_loss, rel=sum_rel(LENGTH + 30))


def test_tasklet_order_is_enforced(cases: dict[str, Case]) -> None:
    case = cases["llama"]
    trainer = _trainer(case)
    state = trainer.start_sequence(case.token_ids, case.trained)
    trainer.forward_window(state, 40)
    with pytest.raises(RuntimeError, match="forward"):
        trainer.backward_tasklet(state, 1, 8)
    trainer.forward_window(state, 24)
    cfg = case.model.cfg
    per_token = cfg.num_layers * (cfg.hidden_size + 2 * cfg.kv_size) * 4 + cfg.hidden_size * 4
    assert state.kept_bytes() == LENGTH * per_token  # inputs + K/V of every layer + one grad buffer
    with pytest.raises(ValueError, match="exceeds"):
        trainer.forward_window(state, 1)
    with pytest.raises(RuntimeError, match="layer 1"):  # layer 0 before layer 1 reached its tokens
        trainer.backward_tasklet(state, 0, 8)
    trainer.backward_tasklet(state, 1, 24)
    trainer.backward_tasklet(state, 0, 8)  # wavefront order: allowed once layer 1 covers them
    assert state.next_backward_layer() == 1


def test_chunked_cross_entropy_matches_full_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    normed = torch.randn(6, 16, generator=g, requires_grad=True)
    head = torch.randn(103, 16, generator=g) * 3
    targets = torch.tensor([0, 5, 102, 50, 99, 64])
    loss, grad = chunked_cross_entropy(normed.detach(), head, targets, chunk=10)
    ref = F.cross_entropy(normed @ head.T, targets, reduction="none")
    ref.sum().backward()
    # one log-softmax of 103 logits of |l| < 40 per row, summed in other chunks: (4 + 102) u = 6e-6 of
    # max(|l|, 1) for the loss; the gradient (softmax - onehot) @ head likewise, of |head| < 12
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, normed.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("logit_scale", [1.0, 40.0])
def test_one_pass_loss_matches_the_chunked_loss_and_torch(cases: dict[str, Case], logit_scale: float) -> None:
    """The one-pass loss (the model's own head kernels, oneDNN here) against chunks and F.cross_entropy;
    at scale 40 most probabilities underflow float32, where the exp floor applies."""
    model = cases["llama"].model
    g = torch.Generator().manual_seed(1)
    normed = (torch.randn(5, model.cfg.hidden_size, generator=g) * logit_scale).requires_grad_()
    targets = torch.tensor([0, 7, model.cfg.vocab_size - 1, 100, 8])
    loss, grad = full_cross_entropy(model, normed.detach(), targets)
    chunked_loss, chunked_grad = chunked_cross_entropy(normed.detach(), model.weights.lm_head, targets,
                                                       chunk=300)
    ref = F.cross_entropy(normed @ model.weights.lm_head.T, targets, reduction="none")
    ref.sum().backward()
    # logits of |l| ~ 40 x logit_scale from K = hidden products (oneDNN's blocking against torch's): 2 sqrt(K) u
    # of their scale each, carried into the loss and (through the softmax) the gradient: 1e-4 x logit_scale
    tolerance = dict(rtol=1e-4, atol=1e-4 * logit_scale)
    torch.testing.assert_close(loss, ref.detach(), **tolerance)
    torch.testing.assert_close(chunked_loss, ref.detach(), **tolerance)
    torch.testing.assert_close(grad, normed.grad, **tolerance)
    torch.testing.assert_close(chunked_grad, normed.grad, **tolerance)


def test_window_loss_walks_rows_in_bounded_blocks(cases: dict[str, Case], monkeypatch: pytest.MonkeyPatch) -> None:
    """A window with more trained rows than one block of logits holds (here 3 rows per block) gives the
    loss and gradient of one pass over all of them, and no block exceeds the bound."""
    model = cases["llama"].model
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(11, model.cfg.hidden_size, generator=g)
    targets = torch.randint(0, vocab, (11,), generator=g)
    targets[[0, 4]] = IGNORE_INDEX
    whole = window_loss(model, hidden, targets, scale=0.5)  # one block: every row fits
    sizes: list[int] = []
    one_pass = loss_module.full_cross_entropy

    def recording(model_: object, normed: torch.Tensor, targets_: torch.Tensor) -> object:
        sizes.append(normed.shape[0] * vocab)
        return one_pass(model_, normed, targets_)

    monkeypatch.setattr(loss_module, "FULL_LOGITS_MAX_ELEMENTS", 3 * vocab)
    monkeypatch.setattr(loss_module, "full_cross_entropy", recording)
    blocks = window_loss(model, hidden, targets, scale=0.5)
    assert len(sizes) == 3 and max(sizes) <= 3 * vocab  # 9 trained rows in blocks of 3
    assert blocks.num_tokens == whole.num_tokens == 9
    # the same rows in blocks of 3 against one block of 9: the 9-term loss sum's order (numerics.sum_rel), and
    # the head matmul's kernel may block its K = hidden reduction otherwise for another row count: 2 sqrt(K) u
    assert blocks.loss_sum == pytest.approx(whole.loss_sum, rel=sum_rel(9))
    torch.testing.assert_close(blocks.grad_hidden, whole.grad_hidden, rtol=1e-5, atol=1e-6)


def test_peft_init_and_round_trip(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = model_dirs["llama"]
    cfg = ModelConfig.from_pretrained(model_dir)
    lora_cfg = LoRASettings(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj", "up_proj"])
    assert lora_cfg.target_modules == ("q_proj", "v_proj", "up_proj")
    lora = TrainableLoRA.init(cfg, lora_cfg, seed=5)
    same = TrainableLoRA.init(cfg, lora_cfg, seed=5)
    other = TrainableLoRA.init(cfg, lora_cfg, seed=6)
    shapes = cfg.linear_shapes()
    for key, param in lora.a.items():
        a = param.detach()
        assert param.requires_grad and a.dtype == torch.float32
        assert float(a.abs().max()) <= shapes[key[1]][0] ** -0.5  # U(-1/sqrt(in), 1/sqrt(in))
        assert float(a.std()) > 0.4 * shapes[key[1]][0] ** -0.5
        assert torch.equal(a, same.a[key]) and not torch.equal(a, other.a[key])
        assert not lora.b[key].any()

    with torch.no_grad():
        for b in lora.b.values():
            b.normal_()
    path = lora.save_pretrained(tmp_path / "adapter", base_model_name_or_path=str(model_dir))
    back = TrainableLoRA.from_pretrained(path, cfg)
    assert back.config == lora_cfg
    for name, t in lora.named_parameters().items():
        assert torch.equal(back.named_parameters()[name], t)

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), path)
    loaded = {n.replace(".default.weight", ".weight"): p for n, p in peft_model.named_parameters()
              if "lora_" in n}
    assert set(loaded) == set(lora.named_parameters())
    for name, t in lora.named_parameters().items():
        assert torch.equal(loaded[name], t)
    # The engine's own loader serves it, with the same fused layout the trainer builds.
    served = load_peft_adapter(path, 1, cfg, 8, torch.float32, torch.device("cpu"))
    snapshot = lora.adapter_weights(1, torch.float32)
    for mine, theirs in zip(snapshot.layers, served.layers):
        for p, q in zip(mine, theirs):
            assert (p is None) == (q is None)
            if p is not None:
                torch.testing.assert_close(p.a_t, q.a_t)
                torch.testing.assert_close(p.b_t, q.b_t)


def test_rejects_unsupported_settings() -> None:
    with pytest.raises(ValueError, match="lora_dropout"):
        LoRASettings(lora_dropout=0.1)
    with pytest.raises(ValueError, match="target_modules"):
        LoRASettings(target_modules=("lm_head",))


def test_bf16_base_trains_fp32_master_weights(cases: dict[str, Case]) -> None:
    """A bf16 base model: gradients land on the fp32 master weights and point where fp32's do.

    Not an exactness test (bf16 rounding moves gradients by a few percent), a smoke test of the casts.
    """
    case = cases["llama"]
    weights = load_weights(case.model_dir, case.model.cfg, torch.bfloat16, torch.device("cpu"))
    model = Transformer(case.model.cfg, weights, torch.bfloat16, torch.device("cpu"))
    lora = TrainableLoRA.from_pretrained(case.adapter_dir, model.cfg)
    state = train_sequence(WindowedTrainer(model, lora), case.token_ids, case.trained, [16] * 4)
    # bf16's unit roundoff 2^-8 = 4e-3 on every weight and activation: a few of them through 2 layers
    assert state.loss_sum / state.num_loss_tokens == pytest.approx(case.ref_loss, rel=2e-2)
    for name, param in lora.named_parameters().items():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32
        ref = case.ref_grads[name].flatten()
        assert F.cosine_similarity(param.grad.flatten(), ref, dim=0) > 0.99, name
