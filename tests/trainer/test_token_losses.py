"""The loss layer against full-sequence references written plainly in torch (fp32, CPU).

For every supported family (the tiny llama, qwen2, qwen3 and mistral models), a LoRA with random A and B
is trained on chat-like sequences under several window schedules. The reference is transformers + peft
with one full-sequence forward: the target tokens' log-probs from `log_softmax` of the logits, the loss
written out from its formula (Tinker's for the per-token losses, TRL's sigmoid loss for DPO, whose
reference log-probs come from peft's `disable_adapter()`), one `backward()`. The windowed trainer's LoRA
gradients must equal the reference's within 1e-4 of each tensor's largest gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM

from coserve.contract.loss_spec import LossKind, LossSpec, TokenInputs
from coserve.contract.preference import PairLogprobs, dpo_metrics, dpo_pair
from coserve.contract.training_settings import LoRASettings, SettingsError
from coserve.forward.transformer import Transformer
from coserve.model.config import ModelConfig
from coserve.model.weights import load_weights
from coserve.trainer import TrainableLoRA, WindowedTrainer, run_schedule
from coserve.trainer.token_losses import SequenceLogprob, token_loss
from numerics import GRAD_REL_ERR as MAX_REL_ERR
from numerics import dpo_loss_bound, dpo_margin_bound, sum_bound

LENGTH = 48
# prompt 0..15, answer 16..31, user turn 32..39, answer 40..47
TRAINED = torch.tensor([False] * 16 + [True] * 16 + [False] * 8 + [True] * 8)
SCHEDULES = {"one_window": [LENGTH], "uneven": [7, 1, 19, 21], "answer_edge": [16, 32]}
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class Family:
    hf: PeftModel
    model: Transformer
    adapter_dir: Path


@pytest.fixture(scope="module")
def families(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    out = {}
    for arch in FAMILIES:
        cfg = ModelConfig.from_pretrained(model_dirs[arch])
        lora = TrainableLoRA.init(cfg, LoRASettings(r=4, lora_alpha=8), seed=3)
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for b in lora.b.values():  # B starts at zero: randomise it so that the adapter matters
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
        adapter_dir = lora.save_pretrained(tmp_path_factory.mktemp(f"adapter-{arch}"))
        hf = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32)
        weights = load_weights(model_dirs[arch], cfg, torch.float32, torch.device("cpu"))
        out[arch] = Family(PeftModel.from_pretrained(hf, adapter_dir, is_trainable=True),
                           Transformer(cfg, weights, torch.float32, torch.device("cpu")), adapter_dir)
    return out


def _sequence(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(8, vocab, (LENGTH,), generator=torch.Generator().manual_seed(seed))


def _reference_logprobs(hf: PeftModel, ids: torch.Tensor) -> torch.Tensor:
    """[L] log-prob of token t given tokens < t (entry 0 unused: 0)."""
    logits = hf(input_ids=ids[None]).logits[0].float()
    picked = F.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None]).squeeze(1)
    return torch.cat([torch.zeros(1), picked])


def _reference_grads(family: Family, loss_of: Callable[[list[torch.Tensor]], torch.Tensor],
                     sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    family.hf.zero_grad(set_to_none=True)
    loss_of([_reference_logprobs(family.hf, ids) for ids in sequences]).backward()
    return {name.replace(".default.weight", ".weight"): p.grad.clone()
            for name, p in family.hf.named_parameters() if "lora_" in name}


def _assert_grads_match(lora: TrainableLoRA, ref: dict[str, torch.Tensor]) -> None:
    assert set(lora.named_parameters()) == set(ref), "the trainer and peft disagree on which tensors train"
    for name, param in lora.named_parameters().items():
        scale = float(ref[name].abs().max())
        assert scale > 0, f"{name}: the reference gradient is zero, the test would prove nothing"
        error = float((param.grad - ref[name]).abs().max()) / scale
        assert error <= MAX_REL_ERR, f"{name}: relative error {error:.2e}"


def _trainer(family: Family) -> WindowedTrainer:
    return WindowedTrainer(family.model, TrainableLoRA.from_pretrained(family.adapter_dir, family.model.cfg),
                           vocab_chunk=500)


def _rl_inputs(family: Family, ids: torch.Tensor) -> TokenInputs:
    """Sampling log-probs near the policy's (ratios spread over ~[0.5, 2], so PPO clips some tokens) and
    advantages of both signs."""
    with torch.no_grad():
        policy = _reference_logprobs(family.hf, ids)
    g = torch.Generator().manual_seed(int(ids[0]))
    sampling = policy + (torch.rand(LENGTH, generator=g) - 0.5) * 1.4
    advantages = torch.randn(LENGTH, generator=g)
    return TokenInputs(weights=(TRAINED.float() * 0.5 + 0.25).tolist(), sampling_logprobs=sampling.tolist(),
                       advantages=advantages.tolist())


def _plain_loss(spec: LossSpec, inputs: TokenInputs, logprobs: torch.Tensor) -> torch.Tensor:
    """The loss written from its formula over the trained tokens (`loss_spec`'s docstring)."""
    mask = TRAINED.float()
    if spec.kind == LossKind.CROSS_ENTROPY:
        return -(torch.tensor(inputs.weights) * mask * logprobs).sum()
    ratio = torch.exp(logprobs - torch.tensor(inputs.sampling_logprobs))
    advantages = torch.tensor(inputs.advantages) * mask
    if spec.kind == LossKind.IMPORTANCE_SAMPLING:
        return -(ratio * advantages).sum()
    clipped = ratio.clamp(spec.clip_low, spec.clip_high)
    if spec.kind == LossKind.PPO:
        return -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return -(clipped.detach() * advantages * logprobs).sum()  # cispo


PER_TOKEN = [LossSpec(LossKind.CROSS_ENTROPY), LossSpec(LossKind.IMPORTANCE_SAMPLING),
             LossSpec(LossKind.PPO), LossSpec(LossKind.PPO, clip_low=0.9, clip_high=1.05),
             LossSpec(LossKind.CISPO)]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("spec", PER_TOKEN, ids=lambda s: f"{s.kind.value}-{s.clip_low}")
@pytest.mark.parametrize("arch", FAMILIES)
def test_per_token_losses_match_the_full_sequence_reference(families: dict[str, Family], arch: str,
                                                            spec: LossSpec, schedule: str) -> None:
    family = families[arch]
    ids = _sequence(family.model.cfg.vocab_size, seed=11)
    inputs = _rl_inputs(family, ids)
    inputs.check(spec.kind, LENGTH)
    ref = _reference_grads(family, lambda lps: _plain_loss(spec, inputs, lps[0]), [ids])
    with torch.no_grad():
        ref_loss = float(_plain_loss(spec, inputs, _reference_logprobs(family.hf, ids)))
    trainer = _trainer(family)
    state = trainer.start_sequence(ids, TRAINED, loss_normalizer=1,
                                   loss=token_loss(spec, inputs, torch.device("cpu")))
    run_schedule(trainer, state, SCHEDULES[schedule])
    # A sum of terms of both signs (numerics.sum_bound); each term's log-prob error moves an IS/PPO ratio
    # exp(lp - s) by the same relative amount, so |coefficient x log p| bounds each term's sensitivity.
    with torch.no_grad():
        scale = (_reference_logprobs(family.hf, ids) * TRAINED).abs() * (
            torch.tensor(inputs.advantages).abs() * 4 + torch.tensor(inputs.weights))
    assert state.loss_sum == pytest.approx(ref_loss, abs=sum_bound(scale.tolist()))
    _assert_grads_match(trainer.lora, ref)


def test_ppo_clips_some_tokens_of_the_test_sequence(families: dict[str, Family]) -> None:
    """The PPO cases above exercise both sides of the clip: some ratios leave the range with an
    advantage that makes the clipped term the smaller (no gradient there), others do not."""
    family = families["llama"]
    ids = _sequence(family.model.cfg.vocab_size, seed=11)
    inputs = _rl_inputs(family, ids)
    with torch.no_grad():
        ratio = torch.exp(_reference_logprobs(family.hf, ids) - torch.tensor(inputs.sampling_logprobs))
    advantages = torch.tensor(inputs.advantages)
    frozen = TRAINED & (((ratio > 1.2) & (advantages > 0)) | ((ratio < 0.8) & (advantages < 0)))
    assert 0 < int(frozen.sum()) < int(TRAINED.sum())


def _dpo_reference(family: Family, chosen: torch.Tensor, rejected: torch.Tensor, beta: float,
                   chosen_mask: torch.Tensor, rejected_mask: torch.Tensor
                   ) -> tuple[float, dict[str, torch.Tensor]]:
    """TRL's sigmoid loss, written out: reference log-probs with peft's adapter disabled."""
    with torch.no_grad(), family.hf.disable_adapter():
        ref_c = float((_reference_logprobs(family.hf, chosen) * chosen_mask).sum())
        ref_r = float((_reference_logprobs(family.hf, rejected) * rejected_mask).sum())
    holder: list[float] = []

    def loss_of(lps: list[torch.Tensor]) -> torch.Tensor:
        pi_c, pi_r = (lps[0] * chosen_mask).sum(), (lps[1] * rejected_mask).sum()
        loss = -F.logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))
        holder.append(float(loss))
        return loss

    grads = _reference_grads(family, loss_of, [chosen, rejected])
    return holder[0], grads


@pytest.mark.parametrize("arch", FAMILIES)
def test_dpo_matches_trls_loss_with_the_adapter_off_as_reference(families: dict[str, Family],
                                                                 arch: str) -> None:
    """Two passes: the reference (base model, no gradient, nothing kept) and the policy forwards give
    the sums; the coefficient scales each sequence's gradient before its backward windows run."""
    family = families[arch]
    prompt = _sequence(family.model.cfg.vocab_size, seed=21)[:16]
    chosen = torch.cat([prompt, _sequence(family.model.cfg.vocab_size, seed=22)[:32]])
    rejected = torch.cat([prompt, _sequence(family.model.cfg.vocab_size, seed=23)[:20]])
    chosen_mask = torch.tensor([False] * 16 + [True] * 32)
    rejected_mask = torch.tensor([False] * 16 + [True] * 20)
    # beta puts z = beta * margin at -2 or 2: where the sigmoid saturates, its coefficient e^-|z|
    # carries the fp32 rounding of the sums (~1e-4 of z) into every gradient, and tests little else.
    with torch.no_grad():
        policy_sums = [float((_reference_logprobs(family.hf, ids) * mask).sum())
                       for ids, mask in ((chosen, chosen_mask), (rejected, rejected_mask))]
        with family.hf.disable_adapter():
            base_sums = [float((_reference_logprobs(family.hf, ids) * mask).sum())
                         for ids, mask in ((chosen, chosen_mask), (rejected, rejected_mask))]
    beta = 2.0 / abs((policy_sums[0] - base_sums[0]) - (policy_sums[1] - base_sums[1]))
    rounding = ([*policy_sums, *base_sums], [32, 20, 32, 20])  # the four sums and their token counts
    ref_loss, ref_grads = _dpo_reference(family, chosen, rejected, beta, chosen_mask.float(),
                                         rejected_mask.float())
    trainer = _trainer(family)
    sums = []
    for ids, mask in ((chosen, chosen_mask), (rejected, rejected_mask)):
        reference = trainer.start_sequence(ids, mask, loss_normalizer=1, keep_inputs=False,
                                           loss=SequenceLogprob(), adapter=False)
        for size in (9, len(ids) - 9):
            trainer.forward_window(reference, size)
        sums.append(reference.loss_sum)
    policies = []
    for ids, mask in ((chosen, chosen_mask), (rejected, rejected_mask)):
        state = trainer.start_sequence(ids, mask, loss_normalizer=1, loss=SequenceLogprob())
        for size in (13, len(ids) - 13):
            trainer.forward_window(state, size)
        policies.append(state)
    logprobs = PairLogprobs(policies[0].loss_sum, policies[1].loss_sum, sums[0], sums[1])
    pair = dpo_pair(logprobs, beta, pairs_in_batch=1)
    assert pair.loss == pytest.approx(ref_loss, abs=dpo_loss_bound([rounding], beta, 1))  # numerics
    assert abs(pair.margin) == pytest.approx(2.0, abs=dpo_margin_bound(*rounding, beta))  # numerics
    policies[0].scale_gradient(pair.chosen_coefficient)
    policies[1].scale_gradient(pair.rejected_coefficient)
    for state in policies:
        for layer in reversed(range(family.model.cfg.num_layers)):
            for size in (5, state.length - 5):
                trainer.backward_tasklet(state, layer, size)
    _assert_grads_match(trainer.lora, ref_grads)


def test_dpo_pair_math_and_metrics() -> None:
    """The closed form against torch autograd, stable at large margins; TRL's metric names."""
    pi_c, pi_r = torch.tensor(-40.0, requires_grad=True), torch.tensor(-55.0, requires_grad=True)
    for beta in (0.1, 2.0, 10.0):
        z = beta * ((pi_c - (-50.0)) - (pi_r - (-45.0)))
        loss = -F.logsigmoid(z) / 4
        grad_c, grad_r = torch.autograd.grad(loss, [pi_c, pi_r])
        pair = dpo_pair(PairLogprobs(-40.0, -55.0, -50.0, -45.0), beta, pairs_in_batch=4)
        # float64 closed form against float32 autograd of a few operations on values ~1e2: fp32's rounding
        # (~1e-7 relative) scaled by beta's condition number; abs for the saturated (near-zero) cases
        assert pair.loss / 4 == pytest.approx(float(loss), rel=1e-6, abs=1e-12)
        assert pair.chosen_coefficient == pytest.approx(float(grad_c), rel=1e-6, abs=1e-12)
        assert pair.rejected_coefficient == pytest.approx(float(grad_r), rel=1e-6, abs=1e-12)
    far = dpo_pair(PairLogprobs(0.0, -5000.0, 0.0, 0.0), 10.0, 1)  # z = 50000: no overflow
    assert far.loss == 0.0 and far.correct and math.isfinite(far.chosen_coefficient)
    wrong = dpo_pair(PairLogprobs(-5000.0, 0.0, 0.0, 0.0), 10.0, 1)
    assert wrong.loss == pytest.approx(50000.0) and not wrong.correct
    records = [PairLogprobs(-1.0, -3.0, -2.0, -2.0), PairLogprobs(-4.0, -1.0, -2.0, -2.0)]
    metrics = dpo_metrics([dpo_pair(r, 1.0, 2) for r in records], records).as_dict()
    assert metrics["rewards/accuracies"] == 0.5
    assert metrics["rewards/chosen"] == pytest.approx((1.0 - 2.0) / 2)
    assert metrics["rewards/margins"] == pytest.approx((2.0 + -3.0) / 2)
    assert set(metrics) >= {"train_loss", "rewards/rejected", "logps/chosen", "logps/rejected"}


def test_loss_settings_and_inputs_are_checked() -> None:
    with pytest.raises(SettingsError, match="beta"):
        LossSpec(LossKind.DPO, beta=0.0)
    with pytest.raises(SettingsError, match="beta"):
        LossSpec(LossKind.DPO, beta=10.5)
    with pytest.raises(SettingsError, match="clip"):
        LossSpec(LossKind.PPO, clip_low=1.1)
    with pytest.raises(SettingsError, match="advantages"):
        TokenInputs(sampling_logprobs=[0.0] * 4).check(LossKind.PPO, 4)
    with pytest.raises(SettingsError, match="3 entries for 4 tokens"):
        TokenInputs(weights=[1.0] * 3).check(LossKind.CROSS_ENTROPY, 4)
    with pytest.raises(SettingsError, match="finite"):
        TokenInputs(weights=[1.0, float("nan"), 1.0, 1.0]).check(LossKind.CROSS_ENTROPY, 4)


def test_gradient_scaling_is_refused_once_the_backward_started(families: dict[str, Family]) -> None:
    family = families["llama"]
    trainer = _trainer(family)
    ids = _sequence(family.model.cfg.vocab_size, seed=5)
    state = trainer.start_sequence(ids, TRAINED, loss=SequenceLogprob())
    with pytest.raises(RuntimeError, match="between its forward and its backward"):
        state.scale_gradient(2.0)
    trainer.forward_window(state, LENGTH)
    trainer.backward_tasklet(state, family.model.cfg.num_layers - 1, 8)
    with pytest.raises(RuntimeError, match="between its forward and its backward"):
        state.scale_gradient(2.0)
    with pytest.raises(ValueError, match="keep_inputs=False"):
        trainer.start_sequence(ids, TRAINED, adapter=False)
