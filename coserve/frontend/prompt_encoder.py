"""Chat templating and tokenization off the scheduler's event loop, with a cheap context check first.

Completions prompts (`RawPrompt`) take the same path without the template: text is encoded as is
(with the tokenizer's special tokens, as vLLM's completions endpoint does), token ids are checked
against the vocabulary.

Rendering and encoding a prompt costs time linear in its length (about 3 s for 4 MB of text on a
2-core CPU). On the scheduler's event loop (the gateway's loop with `--local`) that time would stall
every other request and `/health`; here it runs in a small thread pool, so a big request costs its
sender. Only the pure render and encode run in a thread: the scheduler's state stays on its loop.

Before encoding, a prompt that certainly does not fit the context is refused from its length alone:
every token of the vocabulary stands for at most `longest_token_chars` characters of text (the longest
token string: byte-level BPE strings have one character per byte, which covers at most one character of
text; SentencePiece's `▁` stands for one space; a byte-fallback token `<0x41>` for less than its 6
characters), so a text of c characters needs at least ceil(c / longest) tokens. The tokenizer's
normalizer (when it has one) runs first, since it may shorten the text.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from coserve.frontend.messages import RawPrompt

# Prompts rendered and encoded at once: more threads than cores would only slow each other down, but
# one slow prompt must not hold up every other tenant's.
ENCODE_THREADS = 4


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    """A rendered prompt: its token ids, or (`ids` None) a lower bound on their number that already
    exceeds the room the caller allowed, so it was not encoded."""

    ids: list[int] | None
    min_tokens: int
    text: str | None = None  # a raw prompt with `echo`: its text (token ids decoded)


class PromptRefused(ValueError):
    """A raw prompt the model cannot take (empty, or token ids outside its vocabulary): the message
    is written for the client and names `prompt`."""


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of `tokenizer` stands for, at most (see the module doc)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


class PromptEncoder:
    """Renders and encodes chat prompts in a thread pool.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (fast ones release the GIL to encode).
        threads: the pool's size.
    """

    def __init__(self, tokenizer: Any, threads: int = ENCODE_THREADS) -> None:
        self._tokenizer = tokenizer
        self._longest = longest_token_chars(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._normalizer = None if backend is None else backend.normalizer
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="coserve-encode")

    @property
    def longest_token_chars(self) -> int:
        return self._longest

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens `text` encodes to (no encoding done)."""
        if self._normalizer is not None:
            text = self._normalizer.normalize_str(text)
        return math.ceil(len(text) / self._longest)

    async def encode(self, messages: list[dict[str, Any]], max_prompt_tokens: int,
                     tools: list[dict[str, Any]] | None = None) -> EncodedPrompt:
        """Render `messages` with the chat template and encode them, in the pool.

        Args:
            messages: the conversation.
            tools: the request's tools, which the template shows the model (None: none).
            max_prompt_tokens: the most prompt tokens the caller can take: a prompt certainly longer is
                not encoded (`ids` None, `min_tokens` > `max_prompt_tokens`).

        Raises:
            whatever the template raises for messages it does not accept (see `encode_chat`).
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._encode, messages, max_prompt_tokens, tools)

    def _encode(self, messages: list[dict[str, Any]], max_prompt_tokens: int,
                tools: list[dict[str, Any]] | None) -> EncodedPrompt:
        text = self._tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                   add_generation_prompt=True)
        bound = self.min_tokens(text)
        if bound > max_prompt_tokens:
            return EncodedPrompt(ids=None, min_tokens=bound)
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return EncodedPrompt(ids=ids, min_tokens=len(ids))

    async def encode_raw(self, prompt: RawPrompt, max_prompt_tokens: int, vocab_size: int) -> EncodedPrompt:
        """Encode a completions prompt (no chat template), in the pool; see `encode` for the bound.

        Raises:
            PromptRefused: an empty prompt, or token ids outside `0..vocab_size - 1`.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._encode_raw, prompt, max_prompt_tokens, vocab_size)

    def _encode_raw(self, prompt: RawPrompt, max_prompt_tokens: int, vocab_size: int) -> EncodedPrompt:
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            bad = [token for token in ids if not 0 <= token < vocab_size]
            if bad:
                raise PromptRefused(f"Invalid 'prompt': token id(s) {bad[:5]} are not in the model's "
                                    f"vocabulary (ids 0..{vocab_size - 1}).")
            # The exact prompt, special tokens included: it is what the model read.
            text = self._tokenizer.decode(ids, skip_special_tokens=False) if prompt.echo else None
        else:
            text = prompt.text or ""
            bound = self.min_tokens(text)
            if bound > max_prompt_tokens:
                return EncodedPrompt(ids=None, min_tokens=bound)
            ids = self._tokenizer.encode(text, add_special_tokens=True)
        if not ids:
            raise PromptRefused("Invalid 'prompt': it encodes to no tokens; the model needs at least one "
                                "prompt token.")
        return EncodedPrompt(ids=ids, min_tokens=len(ids), text=text if prompt.echo else None)

    def close(self) -> None:
        """Stop the pool; prompts queued and not started are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
