"""The torch-free `Tokenizer` against transformers' AutoTokenizer (the reference): rebuilt from the engine's
`TokenizerSpec`, the same prompt text, ids, offsets, decoded text and special tokens on every tiny
architecture (transformers gives qwen2 its own pre-tokenizer) and on SmolLM2; a folder read as it is
where transformers keeps it; no torch imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from coserve.frontend.tokenizer import Tokenizer
from coserve.model.tokenizer_spec import read_tokenizer_spec

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Café, naïve, 東京 and 🙂?"},
     {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "  spaces\n\nand lines  "}],
]
TEXTS = ["Hello world", "  leading spaces and <|im_end|> a special token", "東京 🙂 naïve\n\ttabs", "",
         "at 10:00, 2024 or 1234567 <tool_call>{\"a\": 12}</tool_call>"]


def _check_same(ours: Tokenizer, folder: Path) -> None:
    ref = AutoTokenizer.from_pretrained(folder)
    assert (ours.eos_token, ours.eos_token_id, ours.bos_token_id) == (ref.eos_token, ref.eos_token_id,
                                                                      ref.bos_token_id)
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
        mine = ours(text, add_special_tokens=False, return_offsets_mapping=True)
        theirs = ref(text, add_special_tokens=False, return_offsets_mapping=True)
        assert mine["input_ids"] == theirs["input_ids"]
        assert [tuple(o) for o in mine["offset_mapping"]] == [tuple(o) for o in theirs["offset_mapping"]]
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            kwargs: dict[str, Any] = {"add_generation_prompt": prompt}
            assert (ours.apply_chat_template(messages, tokenize=False, **kwargs)
                    == ref.apply_chat_template(messages, tokenize=False, **kwargs))
            assert (ours.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
                    == ref.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))
    tools_text = ours.apply_chat_template(CONVERSATIONS[0], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert tools_text == ref.apply_chat_template(CONVERSATIONS[0], tools=TOOLS, tokenize=False,
                                                 add_generation_prompt=True)
    assert ours.get_chat_template(tools=TOOLS) == ref.get_chat_template(tools=TOOLS)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_same_as_autotokenizer_on_the_tiny_models(model_dirs: dict[str, Path], arch: str) -> None:
    _check_same(Tokenizer.from_spec(read_tokenizer_spec(model_dirs[arch])), model_dirs[arch])


@pytest.mark.parametrize("name", ["llama3.2", "mistral"])
def test_same_as_autotokenizer_with_the_real_llama_and_mistral_templates(tool_model_dirs: dict[str, Path],
                                                                         name: str) -> None:
    _check_same(Tokenizer.from_spec(read_tokenizer_spec(tool_model_dirs[name])), tool_model_dirs[name])


@pytest.mark.real_model
def test_same_as_autotokenizer_on_smollm2(smollm2_dir: Path) -> None:
    _check_same(Tokenizer.from_spec(read_tokenizer_spec(smollm2_dir)), smollm2_dir)
    _check_same(Tokenizer.from_pretrained(smollm2_dir), smollm2_dir)  # transformers keeps its files


def test_a_folder_read_as_it_is_where_transformers_keeps_it(llama_dir: Path) -> None:
    _check_same(Tokenizer.from_pretrained(llama_dir), llama_dir)


def test_add_bos_token_read_as_transformers_reads_it(llama_dir: Path, tmp_path: Path) -> None:
    """`add_bos_token` in tokenizer_config.json: the same ids as AutoTokenizer's (transformers 5 keeps
    tokenizer.json's post-processor for a generic fast tokenizer folder)."""
    import json
    import shutil

    folder = tmp_path / "with-bos"
    shutil.copytree(llama_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    ours, ref = Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert ours.encode("Hello") == ref.encode("Hello")
    assert ours.encode("Hello", add_special_tokens=False) == ref.encode("Hello", add_special_tokens=False)


def test_a_folder_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_loading_and_rendering_import_no_torch(llama_dir: Path) -> None:
    code = ("import sys\nfrom coserve.frontend.tokenizer import Tokenizer\n"
            f"t = Tokenizer.from_pretrained({str(llama_dir)!r})\n"
            "text = t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False, "
            "add_generation_prompt=True)\n"
            "assert t.decode(t.encode(text, add_special_tokens=False)) == text\n"
            "print(sorted({'torch', 'transformers.modeling_utils'} & set(sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
