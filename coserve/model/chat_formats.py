"""Chat formats a tiny test model can be given: a chat template with the special tokens it writes.

A tiny model's tokenizer is trained from the packaged corpus (`tokenizer_train.py`); its chat format
decides the chat template in `tokenizer_config.json`, the special tokens added for that template, and
which of them are BOS and EOS (in `config.json` too). The real templates are kept byte for byte in
`data/templates/`, so tool calling and tool fine-tuning are tested on the formats those models use:

* `CHATML`: plain ChatML, the default of the llama and mistral tiny models (renders no tools).
* `QWEN_TOOLS`: Qwen's tool format (hermes), the default of the qwen2 and qwen3 tiny models.
* `LLAMA_3_2`: the chat template of meta-llama/Llama-3.2-1B-Instruct and -3B-Instruct as their
  `tokenizer_config.json` publishes it (the same text TRL and llama.cpp ship): tools in the first user
  message, calls as `{"name": ..., "parameters": ...}`, results as `ipython` turns; EOS `<|eot_id|>`.
* `MISTRAL_NEMO`: the chat template of mistralai/Mistral-Nemo-Instruct-2407 (llama.cpp's copy of its
  `tokenizer_config.json` template): `[AVAILABLE_TOOLS]`, `[TOOL_CALLS][...]`, `[TOOL_RESULTS]`, no
  generation prompt; BOS `<s>`, EOS `</s>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from coserve.model.chat_templates import CHATML_TEMPLATE, QWEN_TOOLS_TEMPLATE
from coserve.model.tokenizer_train import BOS_TOKEN, EOS_TOKEN


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """A chat template and its tokens: `added_specials` are added to the trained tokenizer as special
    tokens (beyond `tokenizer_train.SPECIAL_TOKENS`); `bos` and `eos` name the model's BOS and EOS."""

    name: str
    template: str
    bos: str = BOS_TOKEN
    eos: str = EOS_TOKEN
    added_specials: tuple[str, ...] = ()


def _packaged_template(name: str) -> str:
    return resources.files("coserve.model").joinpath(f"data/templates/{name}").read_text(encoding="utf-8")


CHATML = ChatFormat(name="chatml", template=CHATML_TEMPLATE)
QWEN_TOOLS = ChatFormat(name="qwen-tools", template=QWEN_TOOLS_TEMPLATE)
LLAMA_3_2 = ChatFormat(
    name="llama-3.2", template=_packaged_template("llama-3.2-instruct.jinja"), eos="<|eot_id|>",
    added_specials=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"))
MISTRAL_NEMO = ChatFormat(
    name="mistral-nemo", template=_packaged_template("mistral-nemo-instruct-2407.jinja"), bos="<s>", eos="</s>",
    added_specials=("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"))

CHAT_FORMATS: dict[str, ChatFormat] = {fmt.name: fmt for fmt in (CHATML, QWEN_TOOLS, LLAMA_3_2, MISTRAL_NEMO)}


def default_chat_format(arch: str) -> ChatFormat:
    """A tiny `arch` model's format unless one is asked for: Qwen's tools for qwen2/qwen3, ChatML otherwise."""
    return QWEN_TOOLS if arch in ("qwen2", "qwen3") else CHATML
