"""Fine-tuning rows with tool calls on the real Llama 3.2 and Mistral Nemo templates (tiny models that
carry them): each assistant call is trained as the template writes it, in the family's format and up
to its eos, with Mistral's call ids as its template takes them; tool definitions, headers and tool
results are not trained. Checked by decoding each run of trained tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coserve.frontend.chat_render import TemplateError
from coserve.frontend.tokenizer import Tokenizer
from coserve.jobs.training_data import encode_conversation, prepare_training_data
from coserve.tools.call_ids import nine_char_id

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _call(call_id: str, city: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city":"{city}"}}'}}


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "Paris")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21C"},
    {"role": "assistant", "content": "Paris: sunny, 21C."},
]


def _trained_runs(tokenizer: Tokenizer, ids: list[int], trained: list[bool]) -> list[str]:
    runs: list[list[int]] = [[]]
    for token, flag in zip(ids, trained, strict=True):
        if flag:
            runs[-1].append(token)
        elif runs[-1]:
            runs.append([])
    return [tokenizer.decode(run) for run in runs if run]


def test_llama_rows_train_the_json_call_and_the_answer(tool_model_dirs: dict[str, Path]) -> None:
    tokenizer = Tokenizer.from_pretrained(tool_model_dirs["llama3.2"])
    encoded = encode_conversation(tokenizer, CONVERSATION, max_len=1024, tools=TOOLS)
    assert _trained_runs(tokenizer, encoded.token_ids, encoded.trained) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "Paris: sunny, 21C.<|eot_id|>"]
    text = tokenizer.decode(encoded.token_ids)
    assert '"name": "get_weather"' in text.split("Weather in Paris?")[0]  # the tools, in the first user turn
    assert "<|start_header_id|>ipython<|end_header_id|>" in text  # the result, untrained
    # Llama's templates render one call per assistant message: two are refused, not trained wrongly.
    two = [CONVERSATION[0], {"role": "assistant", "tool_calls": [_call("call_1", "Paris"), _call("call_2", "Rome")]}]
    with pytest.raises(TemplateError):
        encode_conversation(tokenizer, two, max_len=1024, tools=TOOLS)


def test_mistral_rows_train_the_marked_array_with_nine_character_ids(tool_model_dirs: dict[str, Path]) -> None:
    tokenizer = Tokenizer.from_pretrained(tool_model_dirs["mistral"])
    two = [CONVERSATION[0], {"role": "assistant", "tool_calls": [_call("call_1", "Paris"), _call("call_2", "Rome")]},
           {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "Rain"}, {"role": "assistant", "content": "Done."}]
    data = prepare_training_data(tokenizer, [{"messages": CONVERSATION, "tools": TOOLS},
                                             {"messages": two, "tools": TOOLS}], max_len=1024)
    assert data.num_skipped == 0 and len(data.examples) == 2
    first, second = (encode_conversation(tokenizer, row, 1024, TOOLS) for row in (CONVERSATION, two))
    one, rome = nine_char_id("call_1"), nine_char_id("call_2")
    assert _trained_runs(tokenizer, first.token_ids, first.trained) == [
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{one}"}}]</s>',
        "Paris: sunny, 21C.</s>"]
    assert _trained_runs(tokenizer, second.token_ids, second.trained)[0] == (
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{one}"}}, '
        f'{{"name": "get_weather", "arguments": {{"city": "Rome"}}, "id": "{rome}"}}]</s>')
    text = tokenizer.decode(second.token_ids)
    assert f'[TOOL_RESULTS]{{"content": Sunny, "call_id": "{one}"}}[/TOOL_RESULTS]' in text  # the ids match
    assert text.index("[AVAILABLE_TOOLS]") < text.index("[INST]Weather in Paris?")
