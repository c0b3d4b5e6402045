"""Structured output on the engine: compiled grammars, one matcher per sequence, the batch's token mask.

The grammar library is llguidance (why: docs/libraries.md). Per engine:

- the llguidance tokenizer is built once, on the first structured request, from the model folder's
  tokenizer (about 0.5 s for a 49k vocabulary), sized to the model's logits and told every id that
  ends the output (the tokenizer's EOS and the model's end-of-turn ids), which are the only tokens a
  complete grammar allows, so the scheduler's normal EOS stop ends the sequence;
- a grammar is compiled once per distinct `StructuredOutput` (LRU-bounded cache); each sequence gets a
  copy of the compiled matcher (microseconds) and advances it with its sampled tokens. A sequence sent
  again after a preemption rebuilds its matcher by replaying its output tokens;
- `fill_masks` computes the next-token bitmask of every constrained row of the batch in one call to
  llguidance's thread pool; a row whose matcher failed (a parser limit, a replay that does not parse)
  or that allows no token is reported as stuck, and its mask allows only EOS so the sampler stays sane.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import torch

from coserve.contract.structured_output import StructuredOutput, StructuredOutputError
from coserve.structured.llguidance_grammar import grammar_text, parser_limits
from coserve.torch_engine.token_mask import BITS, TokenMask, words_for

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 64


@dataclass(slots=True)
class MaskFill:
    """`fill_masks`' result: the mask of the rows, and which of them are stuck (see the module doc)."""

    mask: TokenMask
    stuck: list[bool]


class GrammarCompiler:
    """Compiles structured-output specs for one engine and hands out per-sequence matchers.

    Args:
        model_dir: the model folder (its tokenizer files are read on first use).
        vocab_size: width of the model's logits (the bitmask covers every logit).
        eos_ids: the model's end-of-turn ids (besides the tokenizer's EOS).
        cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, model_dir: str, vocab_size: int, eos_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._model_dir = model_dir
        self.vocab_size = vocab_size
        self._model_eos = list(eos_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.eos_id = -1  # set with the tokenizer

    def tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer, built on first use."""
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            hf = AutoTokenizer.from_pretrained(self._model_dir)
            eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
            eos += [t for t in self._model_eos if t not in eos]
            if not eos:
                raise ValueError(f"{self._model_dir}: no EOS token id, so a grammar cannot end the output")
            if not isinstance(hf, PreTrainedTokenizerFast):  # llguidance's own check, made before its call
                raise ValueError("Only fast tokenizers are supported")
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
            self.eos_id = eos[0]
        return self._tokenizer

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def matcher(self, spec: StructuredOutput, replay: Sequence[int] = ()) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`, advanced through `replay` (outputs generated before a preemption).

        Never raises for a grammar or replay problem: the matcher is then in its error state and the
        sequence ends with `grammar_error` at its next token (other sequences are not affected).
        """
        template = self._cache.get(spec)
        if template is None:
            template = self._compile(spec)
        else:
            self._cache.move_to_end(spec)
        matcher = template.deep_copy()
        if replay and not matcher.consume_tokens(list(replay)):
            logger.warning("structured output: replaying %d tokens failed: %s", len(replay),
                           matcher.get_error())
        return matcher

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        tokenizer = self.tokenizer()
        try:
            grammar = grammar_text(spec)
        except StructuredOutputError:
            # Refused at admission; a spec that skipped the check gets a matcher in its error state
            # (llguidance's constructor does not raise), so only its own sequence ends.
            grammar = ""
        # The spec's sizes were bounded when it was made (`schema_limits`); the parser limits bound
        # what the matcher may build while it runs (a grammar past them ends with `grammar_error`).
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if template.is_error():
            logger.warning("structured output: grammar failed to compile: %s", template.get_error())
        self._cache[spec] = template
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return template

    def fill_masks(self, rows: list[int], matchers: list[llguidance.LLMatcher]) -> MaskFill:
        """The next-token bitmask of each matcher (for batch rows `rows`), computed in parallel."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = words_for(self.vocab_size)
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, j) for j, m in enumerate(matchers)],
                                               bitmask.data_ptr(), words * 4, len(rows))
        empty = (bitmask == 0).all(dim=1).tolist()
        stuck = [e or m.is_error() for e, m in zip(empty, matchers)]
        for j, is_stuck in enumerate(stuck):
            if is_stuck:
                logger.warning("structured output: the grammar cannot go on (%s); ending the sequence",
                               matchers[j].get_error() or "no token allowed")
                bitmask[j] = 0
                bitmask[j, self.eos_id // BITS] = _bit(self.eos_id % BITS)
        return MaskFill(TokenMask(rows, bitmask), stuck)


def _bit(k: int) -> int:
    """The int32 word with only bit k set (bit 31 is the sign bit)."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k
