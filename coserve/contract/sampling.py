"""How a request is to be sampled, as it crosses from the client to the engine: `SamplingParams`
(vLLM's shape), the adapter it runs through (`AdapterRef`) and the model's end-of-sequence ids
(`EosIds`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from coserve.contract.structured_output import StructuredOutput


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's output, shaped like vLLM's `SamplingParams`.

    Args:
        n: number of completions (the offline API expands n > 1 into n requests).
        temperature: 0 means greedy.
        top_p: nucleus mass kept, in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) turns it off.
        seed: per-request seed; the same seed gives the same tokens whatever else is batched.
        max_tokens: output tokens at most; None means up to the context length.
        min_tokens: EOS and stop token ids are ignored before this many output tokens.
        stop: strings that end the output (not included in the text).
        stop_token_ids: token ids that end the output (besides EOS).
        ignore_eos: keep generating after EOS.
        logprobs: number of top logprobs per output token (None: none; 0: only the sampled token's).
        skip_special_tokens: drop special tokens from the detokenized text.
        include_stop_str_in_output: keep the matched stop string in the text.
        frequency_penalty / presence_penalty: OpenAI's penalties on output tokens, in [-2, 2].
        repetition_penalty: vLLM's penalty on prompt and output tokens, > 0 (1: off).
        min_p: drop tokens less likely than `min_p` x the most likely one, in [0, 1].
        logit_bias: token id -> bias added to its logit, in [-100, 100].
        (Exact definitions: `coserve.torch_engine.logits_processors`.)
        structured_output: a grammar every output token must follow (JSON object or JSON Schema;
            bounded when it was made, checked against the grammar library where the request is made:
            the gateway, `LLM.generate`); it cannot be combined with `ignore_eos` or `min_tokens` (the
            grammar ends the output with EOS once the JSON is complete).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        checks = [
            (self.n >= 1, "n", f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0.0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", f"top_k must be -1 or >= 1, got {self.top_k}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs",
             f"logprobs must be >= 0, got {self.logprobs}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty), "repetition_penalty",
             f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (all(-100.0 <= v <= 100.0 for v in (self.logit_bias or {}).values()), "logit_bias",
             "logit_bias values must be in [-100, 100]"),
        ]
        for ok, _param, message in checks:
            if not ok:
                raise ValueError(message)
        if self.structured_output is not None:
            self._check_structured_output()

    def _check_structured_output(self) -> None:
        if self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured_output: the grammar ends the "
                             "output with EOS once it is complete")
        if self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_output: EOS is the only token "
                             "the grammar allows once the output is complete")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError (naming `logit_bias`) when a biased token id is not in the vocabulary."""
        bad = sorted(t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size)
        if bad:
            raise ValueError(f"logit_bias: token id(s) {bad[:5]} are not in the model's vocabulary "
                             f"(ids 0..{vocab_size - 1})")


@dataclass(slots=True)
class AdapterRef:
    """A LoRA adapter a request runs through: unique int id, display name, PEFT folder, and the version of
    its weights: an adapter trained in place (a reinforcement job's, sampled between its steps) has a new
    version after each step, and the prefix cache never gives one version's K/V to another."""

    adapter_id: int
    name: str
    path: str
    version: int = 0


@dataclass(frozen=True, slots=True)
class EosIds:
    """The EOS id the scheduler stops on, and the model's other end-of-turn ids (stop tokens)."""

    eos: int | None
    extra: tuple[int, ...]

    @classmethod
    def resolve(cls, tokenizer: object, model_eos_ids: Sequence[int]) -> EosIds:
        """The tokenizer's EOS (else the model's first), the model's other EOS ids as extras."""
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None and model_eos_ids:
            eos = model_eos_ids[0]
        return cls(eos=eos, extra=tuple(t for t in model_eos_ids if t != eos))
