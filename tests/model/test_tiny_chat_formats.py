"""Tiny models with a chat format (`coserve model create-tiny --chat-format`): the real Llama 3.2 and
Mistral Nemo templates with their special tokens, BOS and EOS in the tokenizer files and config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coserve.cli import TINY_CHAT_FORMATS, main
from coserve.model.chat_formats import CHAT_FORMATS


def test_the_cli_offers_every_chat_format() -> None:
    assert TINY_CHAT_FORMATS == tuple(CHAT_FORMATS)


@pytest.mark.parametrize(("name", "arch", "bos", "eos", "marker"), [
    ("llama-3.2", "llama", "<|begin_of_text|>", "<|eot_id|>", "<|python_tag|>"),
    ("mistral-nemo", "mistral", "<s>", "</s>", "[TOOL_CALLS]"),
])
def test_a_tiny_model_carries_its_formats_template_and_tokens(tmp_path: Path, name: str, arch: str, bos: str,
                                                               eos: str, marker: str) -> None:
    assert main(["model", "create-tiny", str(tmp_path), "--arch", arch, "--chat-format", name]) == 0
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_FORMATS[name].template
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == (bos, eos)
    assert marker in tokenizer_config["additional_special_tokens"]
    ids = {entry["content"]: int(index) for index, entry in tokenizer_config["added_tokens_decoder"].items()}
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (ids[bos], ids[eos])
    assert config["vocab_size"] == 2048 and max(ids.values()) < 2048  # the tokens fit the preset's vocabulary
    tokens = json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]
    assert all(token["special"] for token in tokens)
