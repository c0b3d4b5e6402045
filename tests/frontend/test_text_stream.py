"""`TextStream`: the gateway turns the scheduler's token batches into text. Streamed pieces add up to the
tokenizer's decoding, a stop string ends its choice (once, with `stop`, the tokens after it not
counted), a possible stop-string prefix waits until it is known, and logprobs are decoded."""

from __future__ import annotations

from pathlib import Path

import pytest

from coserve.contract.messages import TokenBatch, TokenDelta
from coserve.contract.plan import TokenLogprobs
from coserve.contract.sampling import SamplingParams
from coserve.frontend.messages import StreamBatch
from coserve.frontend.text_stream import TextStream
from coserve.frontend.tokenizer import Tokenizer

TEXT = "Hello world, naïve café 東京! Then STOP and more words after it."


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(llama_dir)


def _feed(stream: TextStream, ids: list[int], index: int = 0, finish: str | None = None,
          per_batch: int = 1) -> tuple[list[StreamBatch], list[int]]:
    """Send `ids` in batches of `per_batch` tokens (the last one with `finish`); the text batches and
    every choice named to stop."""
    out, stops = [], []
    for start in range(0, len(ids), per_batch):
        chunk = ids[start:start + per_batch]
        last = start + per_batch >= len(ids)
        batch, stopped = stream.apply(TokenBatch(deltas=[TokenDelta(index, chunk, finish_reason=finish if last
                                                                    else None)], done=last and finish is not None))
        out.append(batch)
        stops += stopped
    return out, stops


def _text(batches: list[StreamBatch], index: int = 0) -> str:
    return "".join(d.text for b in batches for d in b.deltas if d.index == index)


@pytest.mark.parametrize("per_batch", [1, 3, 50])
def test_pieces_add_up_to_the_decoded_text(tokenizer: Tokenizer, per_batch: int) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stream = TextStream(SamplingParams(max_tokens=100), tokenizer, prompt_tokens=7)
    batches, stops = _feed(stream, ids, finish="length", per_batch=per_batch)
    assert _text(batches) == tokenizer.decode(ids, skip_special_tokens=True) and stops == []
    last = batches[-1]
    assert last.done and (last.prompt_tokens, last.completion_tokens) == (7, len(ids))
    assert [d.finish_reason for b in batches for d in b.deltas if d.finish_reason] == ["length"]


@pytest.mark.parametrize("per_batch", [1, 4, 50])
def test_a_stop_string_ends_its_choice_once(tokenizer: Tokenizer, per_batch: int) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stream = TextStream(SamplingParams(max_tokens=100, stop=["STOP"]), tokenizer, prompt_tokens=1)
    batches, stops = _feed(stream, ids, per_batch=per_batch)
    assert _text(batches) == TEXT[:TEXT.index("STOP")] and stops == [0]
    assert [d.finish_reason for b in batches for d in b.deltas if d.finish_reason] == ["stop"]
    # Usage counts the tokens up to the one that completed the stop string, not the engine's extra ones.
    upto = next(i for i in range(1, len(ids) + 1) if "STOP" in tokenizer.decode(ids[:i]))
    assert batches[-1].completion_tokens == upto
    late, again = stream.apply(TokenBatch(deltas=[TokenDelta(0, ids[:2], finish_reason="stop")], done=True))
    assert late.deltas == [] and again == [] and late.done and late.completion_tokens == upto


def test_a_stop_string_on_the_engines_last_token_keeps_the_engines_reason(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two STOP", add_special_tokens=False)
    stream = TextStream(SamplingParams(max_tokens=len(ids), stop=["STOP"]), tokenizer, prompt_tokens=1)
    batches, stops = _feed(stream, ids, finish="length", per_batch=len(ids))
    assert stops == [] and batches[-1].deltas[-1].finish_reason == "length"
    assert _text(batches) == "one two "


def test_a_possible_stop_prefix_waits_until_it_is_known(tokenizer: Tokenizer) -> None:
    stream = TextStream(SamplingParams(max_tokens=100, stop=["<END>"]), tokenizer, prompt_tokens=1)
    ids = tokenizer.encode("abc <EN", add_special_tokens=False)
    batches, _ = _feed(stream, ids, per_batch=len(ids))
    assert not _text(batches).endswith("<EN")  # held back: it may become "<END>"
    more = tokenizer.encode("abc <ENX", add_special_tokens=False)[len(ids):] or tokenizer.encode("X")
    done, _ = _feed(stream, more, finish="length", per_batch=len(more))
    assert (_text(batches) + _text(done)).startswith("abc <EN")


def test_choices_are_independent(tokenizer: Tokenizer) -> None:
    stream = TextStream(SamplingParams(max_tokens=100, n=2, stop=["STOP"]), tokenizer, prompt_tokens=3)
    a = tokenizer.encode("first STOP x", add_special_tokens=False)
    b = tokenizer.encode("second one", add_special_tokens=False)
    batch, stops = stream.apply(TokenBatch(deltas=[TokenDelta(0, a), TokenDelta(1, b, finish_reason="length")],
                                           done=False))
    assert stops == [0]
    texts = {d.index: d.text for d in batch.deltas}
    finishes = {d.index: d.finish_reason for d in batch.deltas}
    assert texts == {0: "first ", 1: "second one"} and finishes == {0: "stop", 1: "length"}


def test_logprobs_are_decoded(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False)[:2]
    lps = [TokenLogprobs(token_id=t, logprob=-0.5 * (k + 1), rank=2, top_token_ids=[t + 1, t, t + 2],
                         top_logprobs=[-0.1, -0.5 * (k + 1), -3.0]) for k, t in enumerate(ids)]
    stream = TextStream(SamplingParams(max_tokens=5, logprobs=2), tokenizer, prompt_tokens=1)
    batch, _ = stream.apply(TokenBatch(deltas=[TokenDelta(0, ids, logprobs=lps)]))
    entries = batch.deltas[0].logprobs
    assert [e.token for e in entries] == [tokenizer.decode([t]) for t in ids]
    assert [e.logprob for e in entries] == [-0.5, -1.0]
    assert entries[0].top == [(tokenizer.decode([ids[0] + 1]), -0.1), (tokenizer.decode([ids[0]]), -0.5)]
