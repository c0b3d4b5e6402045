"""`PromptEncoder`: the token lower bound never exceeds the real count (tiny model, and SmolLM2's long
whitespace tokens), and rendering and encoding run off the event loop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.frontend.prompt_encoder import PromptEncoder
from coserve.frontend.tokenizer import Tokenizer

TEXTS = st.lists(st.sampled_from(["a", "b", " ", "  ", "\n", "\t", "é", "漢", "😀", "ab", "the",
                                   "<|im_start|>", "<|im_end|>", "----", "0", "12"]),
                 max_size=400).map("".join) | st.text(max_size=200)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_the_token_bound_never_exceeds_the_real_count(llama_dir: Path, text: str) -> None:
    encoder, tokenizer = _tiny_encoder(llama_dir)
    assert encoder.min_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False))


def test_the_token_bound_holds_on_smollm2(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(smollm2_dir)
    encoder = PromptEncoder(tokenizer, threads=1)
    try:
        # Whitespace runs are SmolLM2's longest tokens (81 characters): the worst case of the bound.
        for text in (" " * 5000, "\n" + " " * 4000, "word " * 1000, "漢字😀" * 300, "<|im_start|>" * 50):
            assert encoder.min_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False))
    finally:
        encoder.close()


_TINY: dict[Path, tuple[PromptEncoder, Any]] = {}


def _tiny_encoder(model: Path) -> tuple[PromptEncoder, Any]:
    """The tiny model's encoder and tokenizer, loaded once (hypothesis calls the test many times)."""
    if model not in _TINY:
        tokenizer = Tokenizer.from_pretrained(model)
        _TINY[model] = PromptEncoder(tokenizer, threads=1), tokenizer
    return _TINY[model]


def test_encoding_runs_off_the_event_loop(llama_dir: Path) -> None:
    """A prompt that takes a second to encode leaves the loop free: a ticker keeps its 5 ms period."""
    encoder, _ = _tiny_encoder(llama_dir)
    text = "lorem ipsum dolor sit amet " * 80_000  # 2 MB: about a second to render and encode here
    lags: list[float] = []

    async def main() -> tuple[float, Any]:
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                start = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - start - 0.005)

        task = asyncio.create_task(ticker())
        start = time.perf_counter()
        encoded = await encoder.encode([{"role": "user", "content": text}], max_prompt_tokens=10**9)
        took = time.perf_counter() - start
        done.set()
        await task
        return took, encoded

    took, encoded = asyncio.run(main())
    assert encoded.ids is not None and len(encoded.ids) >= encoder.min_tokens(text)
    assert took > 0.2 and len(lags) >= took / 0.05, (took, len(lags))  # the loop kept ticking
    median = sorted(lags)[len(lags) // 2]  # on the loop, it would be the whole encoding
    assert median < took / 5, f"median loop lag {median:.3f} s while encoding took {took:.3f} s"


def test_a_prompt_over_the_room_is_not_encoded(llama_dir: Path) -> None:
    encoder, _ = _tiny_encoder(llama_dir)
    text = "word " * 20_000
    encoded = asyncio.run(encoder.encode([{"role": "user", "content": text}], max_prompt_tokens=100))
    assert encoded.ids is None and encoded.min_tokens > 100 and encoded.min_tokens >= encoder.min_tokens(text)


def test_raw_prompts_skip_the_template_and_are_checked(llama_dir: Path) -> None:
    """Text is encoded as is (special tokens added), token ids are taken as they are (decoded for echo),
    and what the model cannot take is refused naming `prompt`."""
    import pytest

    from coserve.frontend.messages import RawPrompt
    from coserve.frontend.prompt_encoder import PromptRefused

    encoder, tokenizer = _tiny_encoder(llama_dir)
    vocab = len(tokenizer)

    def run(prompt: RawPrompt, room: int = 1000) -> Any:
        return asyncio.run(encoder.encode_raw(prompt, room, vocab))

    text = "Hello there, no template"
    encoded = run(RawPrompt(text=text, echo=True))
    assert encoded.ids == tokenizer.encode(text, add_special_tokens=True) and encoded.text == text
    assert run(RawPrompt(text=text)).text is None
    by_ids = run(RawPrompt(token_ids=encoded.ids, echo=True))
    assert by_ids.ids == encoded.ids and by_ids.text == tokenizer.decode(encoded.ids)
    assert run(RawPrompt(text="word " * 500), room=10).ids is None  # certainly too long: not encoded
    for bad in (RawPrompt(token_ids=[1, vocab]), RawPrompt(text="")):
        with pytest.raises(PromptRefused, match="Invalid 'prompt'"):
            run(bad)
