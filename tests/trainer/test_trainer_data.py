"""Fine-tuning data: chat-template loss masks, dataset preparation, "auto" hyperparameters.

The masks are checked by decoding: every run of trained tokens must decode to exactly one trained
assistant message's content followed by `<|im_end|>`, in order, and the whole sequence must decode
to the template's rendering, so nothing else (system, user, headers, weight-0 answers) is trained.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from coserve.contract.training_settings import LoRASettings, resolve_hyperparameters
from coserve.forward.transformer import Transformer
from coserve.model.config import ModelConfig
from coserve.model.tiny_model import create_tiny_model
from coserve.model.tokenizer_train import IM_END_TOKEN
from coserve.model.weights import load_weights
from coserve.trainer import (
    IGNORE_INDEX,
    LoRAOptimizer,
    TrainableLoRA,
    WindowedTrainer,
    train_batch,
)
from numerics import sum_rel
from trainer_data import TemplateError, encode_example, prepare_dataset

Messages = list[dict[str, Any]]

MULTI_TURN: Messages = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Naples, I think.", "weight": 0},  # a wrong answer: not learned
    {"role": "user", "content": "Are you sure?"},
    {"role": "assistant", "content": "Sorry: Rome.", "weight": 1},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("data") / "m", arch="llama", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


def _trained_runs(tokenizer: Any, ids: torch.Tensor, trained: torch.Tensor) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs, current = [], []
    for token, flag in zip(ids.tolist(), trained.tolist()):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def _expected_runs(messages: Messages) -> list[str]:
    return [m["content"] + IM_END_TOKEN for m in messages
            if m["role"] == "assistant" and m.get("weight", 1) == 1]


@pytest.mark.parametrize("messages", [
    MULTI_TURN,
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " spaced\n\n  out \n"}],
    [{"role": "user", "content": "Empty?"}, {"role": "assistant", "content": ""}],
    [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"},
     {"role": "assistant", "content": "Ünïcode ✓ 你好"}],
], ids=["multi_turn_weights", "whitespace", "empty_answer", "assistant_first_unicode"])
def test_mask_is_exactly_assistant_content_and_end_of_turn(tokenizer: Any, messages: Messages) -> None:
    encoded = encode_example(tokenizer, messages, max_len=1000)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(encoded.token_ids) == rendered  # the sequence is the template's text
    assert _trained_runs(tokenizer, encoded.token_ids, encoded.trained) == _expected_runs(messages)
    assert not encoded.truncated and not encoded.skipped
    assert encoded.full_length == encoded.token_ids.numel()


def test_system_user_and_weight_zero_tokens_are_untrained(tokenizer: Any) -> None:
    encoded = encode_example(tokenizer, MULTI_TURN, max_len=1000)
    untrained = tokenizer.decode(encoded.token_ids[~encoded.trained])
    for message in MULTI_TURN:
        trained_answer = message["role"] == "assistant" and message.get("weight", 1) == 1
        assert (message["content"] in untrained) != trained_answer, message
    # Headers are untrained: the model never generates `<|im_start|>assistant\n` itself.
    assert untrained.count("<|im_start|>assistant\n") == 3
    assert encoded.num_trained == int(encoded.trained.sum())  # token 0 (a header) is untrained


def test_truncation_keeps_the_prefix_and_its_mask(tokenizer: Any) -> None:
    full = encode_example(tokenizer, MULTI_TURN, max_len=1000)
    cut = full.full_length - 6  # inside the last answer
    encoded = encode_example(tokenizer, MULTI_TURN, max_len=cut)
    assert encoded.truncated and encoded.full_length == full.full_length
    assert encoded.token_ids.numel() == cut
    assert torch.equal(encoded.token_ids, full.token_ids[:cut])
    assert torch.equal(encoded.trained, full.trained[:cut])
    assert 0 < encoded.num_trained < full.num_trained


def test_examples_without_trainable_token_are_skipped(tokenizer: Any) -> None:
    all_weight_zero = [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello", "weight": 0}]
    assert encode_example(tokenizer, all_weight_zero, max_len=100).skipped
    answer_cut_off = encode_example(tokenizer, MULTI_TURN, max_len=8)  # inside the system prompt
    assert answer_cut_off.skipped and answer_cut_off.truncated
    with pytest.raises(ValueError, match="'weight' must be 0 or 1"):
        encode_example(tokenizer, [{"role": "assistant", "content": "x", "weight": 2}], max_len=100)


def test_prepare_dataset_counts_and_warnings(tokenizer: Any) -> None:
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    silent = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "No", "weight": 0}]
    long = [{"role": "user", "content": "Talk."}, {"role": "assistant", "content": "ok " * 80}]
    examples = [{"messages": short}, {"messages": long}, silent, {"messages": MULTI_TURN}, silent]
    data = prepare_dataset(tokenizer, examples, max_len=64)
    assert (data.num_examples, data.num_skipped, data.num_truncated) == (5, 2, 2)
    assert data.example_indices == [0, 1, 3]
    assert all(seq.token_ids.numel() <= 64 for seq in data.sequences)
    assert data.trained_tokens == sum(seq.num_trained for seq in data.sequences) > 0
    assert len(data.warnings) == 2
    assert "truncated" in data.warnings[0] and "index 1, 3" in data.warnings[0]
    assert "skipped" in data.warnings[1] and "index 2, 4" in data.warnings[1]
    assert prepare_dataset(tokenizer, [{"messages": short}], max_len=64).warnings == []


def test_templates_without_an_exact_mask_are_refused(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Marks the last message: earlier renderings are then not prefixes of later ones.
    tokenizer.chat_template = ("{%- for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                               "{%- if loop.last %} [last]{% endif %}\n{%- endfor %}"
                               "{%- if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(TemplateError, match="prefix-stable"):
        encode_example(tokenizer, MULTI_TURN, max_len=1000)
    # Rewrites the assistant content: the mask cannot be found verbatim.
    tokenizer.chat_template = ("{%- for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n"
                               "{%- endfor %}{%- if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(TemplateError, match="verbatim"):
        encode_example(tokenizer, MULTI_TURN, max_len=1000)


@pytest.mark.parametrize(("num_examples", "n_epochs", "batch_size"), [
    (10, 10, 1), (20, 5, 1), (33, 4, 1), (34, 3, 1), (1_000, 3, 2), (10_000, 2, 20),
    (50_000, 1, 100), (1_000_000, 1, 256),
])
def test_auto_hyperparameters(num_examples: int, n_epochs: int, batch_size: int) -> None:
    resolved = resolve_hyperparameters({"n_epochs": "auto", "batch_size": None}, num_examples, 500)
    assert (resolved.n_epochs, resolved.batch_size) == (n_epochs, batch_size)
    assert resolved.learning_rate_multiplier == 1.0 and resolved.learning_rate == 1e-4
    assert resolved.steps_per_epoch == math.ceil(num_examples / batch_size)
    assert resolved.total_steps == resolved.steps_per_epoch * n_epochs
    assert resolved.total_trained_tokens == 500 * n_epochs


def test_explicit_hyperparameters_are_kept() -> None:
    resolved = resolve_hyperparameters({"n_epochs": 7, "batch_size": 4, "learning_rate_multiplier": 2},
                                       num_examples=10, num_trained_tokens=100)
    assert (resolved.n_epochs, resolved.batch_size, resolved.steps_per_epoch) == (7, 4, 3)
    assert resolved.learning_rate == pytest.approx(2e-4)
    assert resolved.optimizer_settings().learning_rate == pytest.approx(2e-4)


@pytest.mark.parametrize(("param", "value"), [
    ("n_epochs", 0), ("n_epochs", 51), ("n_epochs", 2.0), ("n_epochs", True), ("batch_size", 0),
    ("batch_size", 257), ("batch_size", "8"), ("learning_rate_multiplier", 0),
    ("learning_rate_multiplier", -1.0), ("learning_rate_multiplier", 10.5),
    ("learning_rate_multiplier", float("nan")), ("learning_rate_multiplier", "fast"),
])
def test_out_of_bounds_hyperparameters_name_the_parameter(param: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"'{param}'"):
        resolve_hyperparameters({param: value}, num_examples=100, num_trained_tokens=1000)


def test_bad_datasets_are_refused() -> None:
    with pytest.raises(ValueError, match="has 9 example.*at least 10 examples"):
        resolve_hyperparameters({}, num_examples=9, num_trained_tokens=1000)
    with pytest.raises(ValueError, match="no trainable"):
        resolve_hyperparameters({}, num_examples=10, num_trained_tokens=0)
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        resolve_hyperparameters({"epochs": 3}, num_examples=10, num_trained_tokens=10)


def test_prepared_sequences_train_one_step(model_dir: Path, tokenizer: Any) -> None:
    """One optimizer step on prepared data: its loss is the base model's masked loss (B starts at 0)."""
    examples = [{"messages": MULTI_TURN},
                {"messages": [{"role": "user", "content": "Count to three."},
                              {"role": "assistant", "content": "One, two, three."}]}]
    data = prepare_dataset(tokenizer, examples, max_len=128)
    cfg = ModelConfig.from_pretrained(model_dir)
    model = Transformer(cfg, load_weights(model_dir, cfg, torch.float32, torch.device("cpu")),
                        torch.float32, torch.device("cpu"))
    lora = TrainableLoRA.init(cfg, LoRASettings(r=4, lora_alpha=8), seed=0)
    before = {name: t.detach().clone() for name, t in lora.named_parameters().items()}
    stats = train_batch(WindowedTrainer(model, lora), LoRAOptimizer(lora), data.sequences)
    assert stats.loss is not None and math.isfinite(stats.loss)
    assert stats.num_tokens == data.trained_tokens

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss_sum = 0.0
    for seq in data.sequences:  # HF shifts labels itself; its loss is the sequence's masked mean
        labels = torch.where(seq.trained, seq.token_ids, torch.full_like(seq.token_ids, IGNORE_INDEX))
        with torch.no_grad():
            loss_sum += float(hf(input_ids=seq.token_ids[None], labels=labels[None]).loss) * seq.num_trained
    # a mean of same-sign cross-entropy terms over the batch's tokens (numerics.sum_rel)
    assert stats.loss == pytest.approx(loss_sum / data.trained_tokens, rel=sum_rel(data.trained_tokens))
    after = lora.named_parameters()
    assert any(not torch.equal(before[name], after[name]) for name in before), "the step moved nothing"
