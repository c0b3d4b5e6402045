"""Train and save the byte-level BPE tokenizer of coserve's tiny test models.

There is no model hub on the machines coserve is tested on, so the tokenizer is trained at model
creation time from `data/corpus.txt` (shipped in the package) with the `tokenizers` library and saved
in the files `transformers.AutoTokenizer` reads: `tokenizer.json`, `tokenizer_config.json` (with a
chat template from `chat_templates.py`) and `special_tokens_map.json`.

Conventions (shared with `tiny_model.py`, which writes the same ids into config.json):
- the special tokens take ids 0..4 in the order of `SPECIAL_TOKENS`;
- `<|im_end|>` is the eos token, because it ends every assistant turn of the chat template, so chat
  generation stops by itself; `<|end_of_text|>` stays a special token that can end raw text;
- encoding adds no special tokens (like Qwen): `decode(encode(text)) == text` for any text;
- a chat format (`chat_formats.py`: the real Llama 3.2 and Mistral Nemo templates) adds the special
  tokens its template writes after the trained ones, and may name another BOS and EOS (`<|eot_id|>`,
  `</s>`), which `save_tokenizer` writes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from coserve.model.chat_templates import CHATML_TEMPLATE

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = IM_END_TOKEN
# Order fixes the ids: BpeTrainer assigns special tokens the first ids.
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

# The llama/mistral tiny models' template (qwen2/qwen3 get Qwen's tool format: chat_templates.py).
CHAT_TEMPLATE = CHATML_TEMPLATE


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens (fixed by their order in `SPECIAL_TOKENS`)."""
    return {token: index for index, token in enumerate(SPECIAL_TOKENS)}


def corpus_lines() -> list[str]:
    """Non-empty lines of the packaged corpus, without its '#' header comment lines."""
    text = resources.files("coserve.model").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train once per vocabulary size and process; cached as JSON so callers get independent copies."""
    tokenizer = Tokenizer(models.BPE())
    # GPT-2/Llama-3 style byte level: every byte string is encodable, no unknown token is needed.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets byte-exact; the processor adds no special tokens.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # The corpus is small: frequency-1 merges are what let the small preset reach 8192 tokens.
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, even those absent from the corpus, so no input is ever unencodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    return tokenizer.to_str()


def train_tokenizer(vocab_size: int, added_specials: Sequence[str] = ()) -> Tokenizer:
    """A byte-level BPE tokenizer with at most `vocab_size` tokens (fewer if the corpus runs out of merges).

    `added_specials` (a chat format's tokens, `chat_formats.ChatFormat`) are added as special tokens
    after the trained ones, within `vocab_size`; those already in `SPECIAL_TOKENS` keep their ids.
    """
    added = [token for token in dict.fromkeys(added_specials) if token not in SPECIAL_TOKENS]
    if vocab_size - len(added) < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must cover the 256 bytes and the special tokens, got {vocab_size}")
    tokenizer = Tokenizer.from_str(_trained_tokenizer_json(vocab_size - len(added)))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in added])
    return tokenizer


def _token_entry(token: str) -> dict[str, object]:
    """The `added_tokens_decoder` entry transformers writes for a special token."""
    return {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def save_tokenizer(tokenizer: Tokenizer, path: str | Path, model_max_length: int,
                   chat_template: str = CHATML_TEMPLATE, bos: str = BOS_TOKEN, eos: str = EOS_TOKEN) -> None:
    """Write the tokenizer files of an HF model folder (`AutoTokenizer.from_pretrained(path)` loads them).
    `bos` and `eos` are special tokens of `tokenizer`; every other special token is an additional one."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    added = {index: token.content for index, token in sorted(tokenizer.get_added_tokens_decoder().items())}
    extra = [token for token in added.values() if token not in (bos, eos, PAD_TOKEN)]
    special_map = {"bos_token": bos, "eos_token": eos, "pad_token": PAD_TOKEN,
                   "additional_special_tokens": extra}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "unk_token": None,
        "model_max_length": model_max_length,
        # False keeps decode exact: the cleanup would eat spaces before punctuation.
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "padding_side": "left",
        "chat_template": chat_template,
        "added_tokens_decoder": {str(i): _token_entry(t) for i, t in added.items()},
    }
    _write_json(path / "tokenizer_config.json", config)
    _write_json(path / "special_tokens_map.json", special_map)


def _write_json(path: Path, payload: Mapping[str, object]) -> None:
    """Write pretty JSON with a trailing newline, as transformers does."""
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
