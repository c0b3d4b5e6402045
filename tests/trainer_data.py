"""Training data in the trainer's form, for tests: the torch-free loss-masked encoding
(`coserve.jobs.training_data`, where the mask rules are written) as tensors and `TrainingSequence`s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from coserve.frontend.chat_render import TemplateError, Tools
from coserve.jobs.training_data import (
    EncodedConversation,
    Example,
    TrainingData,
    encode_conversation,
    prepare_training_data,
)
from coserve.trainer.optimizer import TrainingSequence

__all__ = ["EncodedExample", "PreparedDataset", "TemplateError", "encode_example", "prepare_dataset"]


@dataclass(frozen=True, slots=True)
class EncodedExample:
    """An `EncodedConversation` with its ids and its mask as tensors."""

    token_ids: torch.Tensor  # [L] int64, L <= max_len
    trained: torch.Tensor  # [L] bool: token p is an assistant token (the target of position p - 1)
    conversation: EncodedConversation

    @property
    def truncated(self) -> bool:
        return self.conversation.truncated

    @property
    def full_length(self) -> int:
        return self.conversation.full_length

    @property
    def num_trained(self) -> int:
        return self.conversation.num_trained

    @property
    def skipped(self) -> bool:
        return self.conversation.skipped

    def to_sequence(self) -> TrainingSequence:
        """The trainer's form: one forward window, backward in reverse (the scheduler may re-window)."""
        return TrainingSequence(self.token_ids, self.trained)


def encode_example(tokenizer: Any, messages: Sequence[Mapping[str, Any]], max_len: int,
                   tools: Tools | None = None) -> EncodedExample:
    """`coserve.jobs.training_data.encode_conversation` as tensors (same errors)."""
    encoded = encode_conversation(tokenizer, messages, max_len, tools)
    return EncodedExample(token_ids=torch.tensor(encoded.token_ids, dtype=torch.long),
                          trained=torch.tensor(encoded.trained, dtype=torch.bool), conversation=encoded)


@dataclass(slots=True)
class PreparedDataset:
    """`TrainingData` with its examples as the trainer's `TrainingSequence`s; its counts and warnings
    (`num_examples`, `trained_tokens`, `warnings`, ...) are read through from `data`."""

    sequences: list[TrainingSequence]
    data: TrainingData

    def __getattr__(self, name: str) -> Any:
        return getattr(self.data, name)


def prepare_dataset(tokenizer: Any, examples: Sequence[Example], max_len: int,
                    what: str = "training example") -> PreparedDataset:
    """`coserve.jobs.training_data.prepare_training_data` as `TrainingSequence`s (same errors)."""
    data = prepare_training_data(tokenizer, examples, max_len, what)
    sequences = [TrainingSequence(torch.tensor(e.token_ids, dtype=torch.long),
                                  torch.tensor(e.trained, dtype=torch.bool)) for e in data.examples]
    return PreparedDataset(sequences=sequences, data=data)
