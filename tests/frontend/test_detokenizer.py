"""Incremental detokenization: token by token, the text equals one `decode` of the whole output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from coserve.contract.sampling import SamplingParams
from coserve.frontend.detokenizer import TextTracker


@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_text_equals_full_decode(model_dirs: dict[str, Path], skip_special: bool) -> None:
    from transformers import AutoTokenizer

    for arch in ("llama", "qwen3"):
        tokenizer = AutoTokenizer.from_pretrained(model_dirs[arch])
        rng = random.Random(arch)
        multibyte = tokenizer.encode("naïve café — 世界 🙂 ok", add_special_tokens=False)
        sequences = [multibyte] + [[rng.randrange(len(tokenizer)) for _ in range(60)] for _ in range(20)]
        for ids in sequences:
            tracker = TextTracker(tokenizer, SamplingParams(skip_special_tokens=skip_special))
            pieces = [tracker.update(ids[:i + 1]) for i in range(len(ids))]
            assert "".join(pieces) == tracker.text  # text held back only at an unfinished character
            final = tracker.final_text()
            assert final == tokenizer.decode(ids, skip_special_tokens=skip_special)
            assert final.startswith("".join(pieces))


def test_stream_text_holds_back_possible_stop_prefix(llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    tracker = TextTracker(tokenizer, SamplingParams(stop=["gam", "zzzz"]))
    streamed = ""
    for i in range(len(ids)):
        if tracker.check_stop(ids[:i + 1]):
            break
        safe = tracker.stream_text(finished=False)
        assert safe.startswith(streamed) and len(tracker.text) - len(safe) <= 3
        streamed = safe
    assert "gam" not in streamed
    assert tracker.stream_text(finished=True) == "alpha beta "
