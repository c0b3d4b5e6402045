"""A conversation far longer than the context is cut before it is tokenized (`training_data.cut_past_context`):
what it trains (the first `max_len` tokens and their mask) is exactly what tokenizing all of it gives, on
each tokenizer family, wherever the cut falls (a long prompt, a long answer, the budget used up across
turns); and a 2 MB row costs milliseconds, not seconds and hundreds of MB (issue 45)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from coserve.frontend.prompt_encoder import longest_token_chars
from coserve.frontend.tokenizer import Tokenizer
from coserve.jobs.training_data import _encode, cut_past_context, encode_conversation

MAX_LEN = 64
WORDS = ["alpha", "beta", "gamma", "δέλτα", "epsilon", "\u00e9t\u00e9", "42", "x" * 30, "\n", "!?", "日本語"]


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_the_cut_trains_what_the_whole_conversation_does(model_dirs: dict[str, Path], family: str) -> None:
    tokenizer = Tokenizer.from_pretrained(model_dirs[family])
    budget = (MAX_LEN + 64) * longest_token_chars(tokenizer)
    rng = random.Random(family)
    conversations: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": _text(rng, 3 * budget)}, {"role": "assistant", "content": "ok"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": _text(rng, 2 * budget)}],
        [*({"role": role, "content": _text(rng, budget // 3)} for role in ["user", "assistant"] * 3),
         {"role": "user", "content": "last"}, {"role": "assistant", "content": "never reached"}],
    ]
    for messages in conversations:
        assert cut_past_context(messages, MAX_LEN, longest_token_chars(tokenizer)) is not None
        whole, cut = _encode(tokenizer, messages, MAX_LEN, None), encode_conversation(tokenizer, messages, MAX_LEN)
        assert (cut.token_ids, cut.trained, cut.truncated) == (whole.token_ids, whole.trained, True)
        assert MAX_LEN < cut.full_length < whole.full_length  # the cut was taken: less was tokenized


def test_a_2_mb_row_is_cheap(model_dirs: dict[str, Path]) -> None:
    tokenizer = Tokenizer.from_pretrained(model_dirs["llama"])
    messages = [{"role": "user", "content": "the quick brown fox " * 100_000}, {"role": "assistant", "content": "ok"}]
    started = time.perf_counter()
    encoded = encode_conversation(tokenizer, messages, 256)
    assert encoded.truncated and time.perf_counter() - started < 1.0  # the whole row: 16 s and 800 MB
