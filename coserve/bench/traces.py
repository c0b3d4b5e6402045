"""Workloads of the co-serving benchmark: inference arrivals, request lengths, a fine-tuning dataset.

Everything is generated from a seed (numpy's PCG64), so a trace is a pure function of its arguments.

Arrivals
    * `poisson_arrivals`: exponential inter-arrival times at `rate` requests/s (CV = 1).
    * `bursty_arrivals`: an on/off process shaped like the Azure ChatGPT / BurstGPT traces. BurstGPT
      (Wang et al., "BurstGPT: A Real-World Workload Dataset to Optimize LLM Serving Systems",
      arXiv:2401.17644) fits the inter-arrival times of ChatGPT conversation traffic with a Gamma
      distribution whose shape is below 1, i.e. a coefficient of variation CV = 1/sqrt(shape) > 1;
      FlexLLM Figure 12 (Azure trace) shows the same thing at the scale of tens of seconds: the rate
      climbs to a peak, falls, and spikes again. We model both scales: phases alternate between
      "on" (rate `rate * peak_factor`) and "off" (what is left of the mean rate), with exponential
      phase lengths of mean `mean_phase_s`, and within a phase the gaps are Gamma with shape
      `gamma_shape` (default 0.25, CV 2). The mean rate over a long trace is `rate`.

Lengths (`sharegpt_lengths`)
    ShareGPT conversations have a mean prompt of 161 tokens and a mean output of 338 tokens (Kwon et
    al., "Efficient Memory Management for LLM Serving with PagedAttention", SOSP'23, Figure 11, Llama
    tokenizer), with long right tails in the published histograms. We draw lognormal lengths with those
    means and sigma 1.0 (prompt) and 0.8 (output), which puts the medians at 98 and 245 tokens; these
    sigmas are eyeballed from the published histograms, not fitted to the raw dataset. To fit what 2
    CPU cores can serve with the `small` preset, every length is divided by `scale` (default 4) and
    clipped to [min, max] (default prompt [4, 512], output [2, 192]), which keeps the shape (the
    relative spread and the tail) and shrinks the work about 4x. Say so when you quote results.

Fine-tuning data (`synthetic_chat_dataset`)
    Chat conversations (OpenAI fine-tuning lines: a user question, an assistant answer) made of
    sentences from coserve's packaged tokenizer corpus, whose templated token length is drawn uniformly
    in [min_tokens, max_tokens] (default 256-1024) with the benchmark model's tokenizer. Deterministic
    from the seed and the tokenizer. `synthetic_preference_rows` pairs two such answers to one question
    for a DPO job (the benchmark's `--method dpo`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from coserve.contract.training_plan import TrainingExample

# ShareGPT means (vLLM paper, Figure 11) and the sigmas of our lognormal fits; see the module docstring.
SHAREGPT_PROMPT_MEAN = 161.0
SHAREGPT_OUTPUT_MEAN = 338.0
PROMPT_SIGMA = 1.0
OUTPUT_SIGMA = 0.8


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One inference request of a trace: when it arrives (seconds from the start) and its lengths."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    tenant: str = "default"
    adapter: str | None = None  # the LoRA adapter it runs through (`replay.adapter_ref`); None: the base
    prefix_group: str | None = None  # requests of one group share their first `prefix_len` prompt tokens
    prefix_len: int = 0  # (a system prompt: what a prefix cache reuses)


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Lognormal token lengths: ``clip(round(exp(N(mu, sigma)) / scale), low, high)``."""

    mu: float
    sigma: float
    scale: float
    low: int
    high: int

    @classmethod
    def from_mean(cls, mean: float, sigma: float, scale: float, low: int, high: int) -> LengthDistribution:
        """The lognormal with this mean (before scaling): mu = ln(mean) - sigma^2 / 2."""
        if mean <= 0 or sigma < 0 or scale <= 0 or not 1 <= low <= high:
            raise ValueError(f"bad length distribution: mean={mean}, sigma={sigma}, scale={scale}, "
                             f"low={low}, high={high}")
        return cls(math.log(mean) - sigma * sigma / 2.0, sigma, scale, low, high)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(self.mu, self.sigma, size=n) / self.scale
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)


def sharegpt_lengths(scale: float = 4.0, prompt_range: tuple[int, int] = (4, 512),
                     output_range: tuple[int, int] = (2, 192)) -> tuple[LengthDistribution, LengthDistribution]:
    """(prompt, output) length distributions shaped like ShareGPT, divided by `scale` for a CPU."""
    return (LengthDistribution.from_mean(SHAREGPT_PROMPT_MEAN, PROMPT_SIGMA, scale, *prompt_range),
            LengthDistribution.from_mean(SHAREGPT_OUTPUT_MEAN, OUTPUT_SIGMA, scale, *output_range))


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """Arrival times in [0, duration_s) of a Poisson process at `rate` requests/s."""
    _check_rate(rate, duration_s)
    rng = np.random.default_rng(seed)
    # Draw enough gaps for the whole window at once (mean + 10 sigma), then cut.
    n = int(rate * duration_s + 10 * math.sqrt(rate * duration_s) + 10)
    times = np.cumsum(rng.exponential(1.0 / rate, size=n))
    while times[-1] < duration_s:  # astronomically rare; keep the contract anyway
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=n))])
    return times[times < duration_s]


def bursty_arrivals(rate: float, duration_s: float, seed: int, *, peak_factor: float = 3.0,
                    on_fraction: float = 0.3, mean_phase_s: float = 4.0,
                    gamma_shape: float = 0.25) -> np.ndarray:
    """Arrival times of an on/off process with Gamma gaps (see the module docstring).

    Args:
        rate: mean requests/s over the trace.
        peak_factor: the "on" rate is `peak_factor * rate`; requires peak_factor * on_fraction <= 1
            so the "off" rate ``rate * (1 - peak_factor * on_fraction) / (1 - on_fraction)`` is >= 0.
        on_fraction: long-run share of time in "on" phases.
        mean_phase_s: mean length of one on+off cycle's phases (exponential lengths, on and off
            scaled by their shares).
        gamma_shape: shape k of the Gamma inter-arrival gaps inside a phase (CV = 1/sqrt(k)).
    """
    _check_rate(rate, duration_s)
    if not (0 < on_fraction < 1 and peak_factor >= 1 and peak_factor * on_fraction <= 1
            and gamma_shape > 0 and mean_phase_s > 0):
        raise ValueError(f"bad burst settings: peak_factor={peak_factor}, on_fraction={on_fraction}, "
                         f"gamma_shape={gamma_shape}, mean_phase_s={mean_phase_s}")
    rng = np.random.default_rng(seed)
    on_rate = rate * peak_factor
    off_rate = rate * (1 - peak_factor * on_fraction) / (1 - on_fraction)
    times: list[float] = []
    t, on = 0.0, bool(rng.random() < on_fraction)
    while t < duration_s:
        share = on_fraction if on else 1 - on_fraction
        end = min(duration_s, t + rng.exponential(2 * mean_phase_s * share))
        phase_rate = on_rate if on else off_rate
        if phase_rate > 0:
            # Gamma(k, 1/(k * rate)) has mean 1/rate: the phase keeps its rate, only burstier.
            s = t + rng.gamma(gamma_shape, 1.0 / (gamma_shape * phase_rate))
            while s < end:
                times.append(s)
                s += rng.gamma(gamma_shape, 1.0 / (gamma_shape * phase_rate))
        t, on = end, not on
    return np.array(times)


def _check_rate(rate: float, duration_s: float) -> None:
    if not (rate > 0 and duration_s > 0 and math.isfinite(rate) and math.isfinite(duration_s)):
        raise ValueError(f"rate and duration_s must be finite and > 0, got {rate}, {duration_s}")


def make_trace(arrivals: np.ndarray, seed: int, lengths: tuple[LengthDistribution, LengthDistribution]
               | None = None, tenants: Sequence[str] = ("default",), prefix: str = "r") -> list[RequestSpec]:
    """Requests at the given arrival times with ShareGPT-like lengths; tenants drawn uniformly."""
    prompt_dist, output_dist = lengths or sharegpt_lengths()
    rng = np.random.default_rng(seed + 1_000_003)  # independent of the arrival stream of the same seed
    n = len(arrivals)
    prompts, outputs = prompt_dist.sample(rng, n), output_dist.sample(rng, n)
    owners = rng.integers(0, len(tenants), size=n)
    return [RequestSpec(f"{prefix}{i}", float(arrivals[i]), int(prompts[i]), int(outputs[i]),
                        tenants[int(owners[i])]) for i in range(n)]


def prompt_token_ids(spec: RequestSpec, vocab_size: int, first_id: int = 16) -> list[int]:
    """A deterministic random prompt for `spec`: ids in [first_id, vocab_size), so special tokens
    (which tiny-model tokenizers put first) are avoided; distinct requests share no prefix, except the
    first `prefix_len` tokens of a `prefix_group`'s requests."""
    rng = np.random.default_rng([_digest(spec.request_id), spec.prompt_len])
    ids: list[int] = rng.integers(first_id, vocab_size, size=spec.prompt_len).tolist()
    shared = min(spec.prefix_len, spec.prompt_len - 1) if spec.prefix_group is not None else 0
    if shared > 0:
        group = np.random.default_rng([_digest(spec.prefix_group or ""), 7])
        ids[:shared] = group.integers(first_id, vocab_size, size=shared).tolist()
    return ids


def _digest(text: str) -> int:
    """A stable digest of a name (str hash() is salted per process)."""
    return sum((i + 1) * ord(c) for i, c in enumerate(text))


# --------------------------------------------------------------------------- fine-tuning data

def _corpus_sentences() -> list[str]:
    """Prose lines of the packaged tokenizer corpus (its comment header left out)."""
    text = resources.files("coserve.model").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _grow(rng: np.random.Generator, sentences: list[str], tokenizer: Any, target: int) -> str:
    """Random sentences appended until the text has about `target` tokens (cut to fit)."""
    parts: list[str] = []
    count = 0
    while count < target:
        sentence = sentences[int(rng.integers(len(sentences)))]
        parts.append(sentence)
        count += len(tokenizer.encode(sentence, add_special_tokens=False))
    ids = tokenizer.encode(" ".join(parts), add_special_tokens=False)[:target]
    return str(tokenizer.decode(ids))


def synthetic_chat_dataset(tokenizer: Any, num_examples: int = 64, seed: int = 0,
                           min_tokens: int = 256, max_tokens: int = 1024) -> list[dict[str, Any]]:
    """OpenAI fine-tuning lines ``{"messages": [user, assistant]}`` of 256-1024 templated tokens.

    Each example's total length is drawn uniformly in [min_tokens, max_tokens]; about a third of it is
    the user's question, the rest the assistant's answer (the trained part), minus the template's
    own tokens. Lengths are exact to within a few tokens of the template (re-tokenizing decoded text
    at a message boundary can merge or split a token).
    """
    if not 16 <= min_tokens <= max_tokens or num_examples < 1:
        raise ValueError(f"need 16 <= min_tokens <= max_tokens and num_examples >= 1, got "
                         f"{min_tokens}, {max_tokens}, {num_examples}")
    rng = np.random.default_rng(seed)
    sentences = _corpus_sentences()
    overhead = _template_overhead(tokenizer)
    examples = []
    for _ in range(num_examples):
        total = int(rng.integers(min_tokens, max_tokens + 1)) - overhead
        question = max(4, total // 3)
        user = _grow(rng, sentences, tokenizer, question)
        assistant = _grow(rng, sentences, tokenizer, max(4, total - question))
        examples.append({"messages": [{"role": "user", "content": user},
                                      {"role": "assistant", "content": assistant}]})
    return examples


def synthetic_preference_rows(tokenizer: Any, num_pairs: int = 64, seed: int = 0,
                              min_tokens: int = 256, max_tokens: int = 1024) -> list[dict[str, Any]]:
    """OpenAI DPO lines (`input.messages`, `preferred_output`, `non_preferred_output`) from
    `synthetic_chat_dataset`'s conversations: pair i asks conversation i's question, prefers its answer
    and rejects conversation ``num_pairs + i``'s answer (another draw of the same length range)."""
    chats = synthetic_chat_dataset(tokenizer, 2 * num_pairs, seed, min_tokens, max_tokens)
    return [{"input": {"messages": [chat["messages"][0]]}, "preferred_output": [chat["messages"][1]],
             "non_preferred_output": [other["messages"][1]]}
            for chat, other in zip(chats[:num_pairs], chats[num_pairs:])]


def synthetic_reinforcement_rows(tokenizer: Any, num_rows: int = 64, seed: int = 0,
                                 min_tokens: int = 256, max_tokens: int = 1024) -> list[dict[str, Any]]:
    """OpenAI reinforcement lines from `synthetic_chat_dataset`'s conversations: the question as the prompt
    (about a third of the drawn length), the answer as the row's `answer` field (what a grader compares
    the rollouts with)."""
    return [{"messages": [chat["messages"][0]], "answer": chat["messages"][1]["content"]}
            for chat in synthetic_chat_dataset(tokenizer, num_rows, seed, min_tokens, max_tokens)]


def _template_overhead(tokenizer: Any) -> int:
    """Tokens the chat template adds around one user/assistant exchange."""
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return max(0, len(ids) - 2)


def synthetic_training_examples(num_examples: int, seed: int, vocab_size: int, min_tokens: int = 256,
                                max_tokens: int = 1024, prompt_fraction: float = 1 / 3) -> list[TrainingExample]:
    """Tokenized examples without a tokenizer (the simulator's jobs): random ids in [16, vocab_size),
    lengths uniform in [min_tokens, max_tokens], the first `prompt_fraction` untrained."""
    if not 2 <= min_tokens <= max_tokens or num_examples < 1 or not 0 <= prompt_fraction < 1:
        raise ValueError(f"bad example settings: {num_examples}, {min_tokens}, {max_tokens}, "
                         f"{prompt_fraction}")
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(num_examples):
        n = int(rng.integers(min_tokens, max_tokens + 1))
        prompt = max(1, int(n * prompt_fraction))
        ids = rng.integers(16, vocab_size, size=n).tolist()
        examples.append(TrainingExample(ids, [False] * prompt + [True] * (n - prompt)))
    return examples
