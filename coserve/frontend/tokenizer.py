"""`Tokenizer`: the model's tokenizer and chat template, without loading torch.

`transformers.AutoTokenizer` imports torch in transformers 5 (its config module does), and the gateway's
and the scheduler's processes must not (they hold no tensors; on Ray they run beside the engine's
process, not in it). The engine's process loads the tokenizer with transformers and reports it in its
layout (`TokenizerSpec`: the serialized `tokenizers` tokenizer, the named special tokens, the chat
template); `Tokenizer.from_spec` rebuilds it here. Encoding, decoding and offsets are then the
`tokenizers` library's (the Rust tokenizer AutoTokenizer wraps) on the very tokenizer transformers
built (its class may change the folder's `tokenizer.json`: transformers 5 gives qwen2 models Qwen's
digit-splitting pre-tokenizer whatever the file says), and chat templates are rendered by transformers'
own renderer (`render_jinja_template`, a torch-free module) with the special tokens as template
variables. A test checks prompts, ids, offsets and decoded text against AutoTokenizer on every tiny
architecture and on SmolLM2.

`Tokenizer.from_pretrained` reads a folder's files as they are (no engine needed), for tools and tests
of folders transformers loads unchanged. Only what coserve calls is here: the subset of the Hugging Face
tokenizer API that `PromptEncoder`, the chat-template and training-data code, the detokenizer and
`EosIds` use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from transformers.utils.chat_template_utils import render_jinja_template

from coserve.contract.engine import TokenizerSpec

# The named special tokens a chat template sees as variables (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(folder: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The folder's chat template(s): `chat_template.jinja`, else `chat_template.json`, else the config's."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    json_file = folder / "chat_template.json"
    template = (json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
                if json_file.is_file() else config.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        return {item["name"]: item["template"] for item in template}
    return template


class Tokenizer:
    """A `tokenizer.json` tokenizer with its special tokens and chat template.

    Args:
        backend: the `tokenizers.Tokenizer`.
        special_tokens: the named special tokens (`bos_token`, `eos_token`, ...) as strings.
        chat_template: one template, or templates by name, or None.
    """

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: Mapping[str, str],
                 chat_template: str | dict[str, str] | None = None) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.special_tokens_map = {name: special_tokens[name] for name in SPECIAL_TOKENS if name in special_tokens}
        known = set(backend.get_vocab(with_added_tokens=True))
        missing = [text for text in self.special_tokens_map.values() if text not in known]
        if missing:  # as transformers does: a named special token the vocabulary lacks is added
            backend.add_special_tokens([tokenizers.AddedToken(text, special=True) for text in dict.fromkeys(missing)])

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> Tokenizer:
        """The engine's tokenizer (`RuntimeLayout.tokenizer`)."""
        return cls(tokenizers.Tokenizer.from_str(spec.tokenizer_json), spec.special_tokens, spec.chat_template)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """The tokenizer files of an HF-format model folder, as they are.

        Raises:
            ValueError: the folder has no `tokenizer.json`.
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder}: no tokenizer.json (coserve serves models with a fast tokenizer file)")
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        special = {name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
        return cls(tokenizers.Tokenizer.from_file(str(path)), special, _read_chat_template(folder, config))

    # ------------------------------------------------------------------------ special tokens

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        """The vocabulary's size, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------------ text <-> ids

    def _encoding(self, text: str, add_special_tokens: bool) -> tokenizers.Encoding:
        # encode_batch, as transformers calls it: it releases the GIL while it encodes (a long prompt
        # encoded on a worker thread leaves the event loop running; `encode` would hold the GIL).
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encoding(text, add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True,
                 return_offsets_mapping: bool = False) -> dict[str, list[int] | list[tuple[int, int]]]:
        """`{"input_ids": [...]}`, with `"offset_mapping"` (character spans) when asked."""
        encoding = self._encoding(text, add_special_tokens)
        out: dict[str, list[int] | list[tuple[int, int]]] = {"input_ids": encoding.ids}
        if return_offsets_mapping:
            out["offset_mapping"] = list(encoding.offsets)
        return out

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------------ chat templates

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The template a conversation is rendered with (transformers' rules for named templates).

        Raises:
            ValueError: the tokenizer has no chat template, or several and none is the default.
        """
        if isinstance(self.chat_template, dict):
            named = self.chat_template
            if chat_template is not None:  # a name, else the template itself
                return named[chat_template] if chat_template in named else chat_template
            if tools is not None and "tool_use" in named:
                return named["tool_use"]
            if "default" in named:
                return named["default"]
            raise ValueError(f"This model has several chat templates and no default: {sorted(named)}.")
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError("Cannot use chat template functions because the tokenizer has no chat template.")
        return self.chat_template

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True,
                            **kwargs: Any) -> str | list[int] | dict[str, list[int]]:
        """The conversation rendered with the chat template: its text, or its ids (`tokenize`), as
        transformers' `apply_chat_template` for one conversation.

        Raises:
            ValueError: an empty conversation; whatever the template raises (jinja2 errors).
        """
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        template = self.get_chat_template(chat_template, tools)
        # render_jinja_template returns the renderings and the generation indices (mypy reads transformers as
        # Any: pyproject.toml).
        rendered, _ = render_jinja_template(
            conversations=[_without_nulls(conversation)], tools=tools,
            documents=None, chat_template=template, return_assistant_tokens_mask=False, continue_final_message=False,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return str(rendered[0])
        ids = self.encode(rendered[0], add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids


def _without_nulls(conversation: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages without their None-valued keys, as transformers normalizes them (`content: None`
    next to tool calls would render as "None" in some templates)."""
    return [{key: value for key, value in message.items() if value is not None} for message in conversation]
