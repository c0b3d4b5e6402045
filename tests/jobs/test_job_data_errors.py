"""A job's rows that pass upload but cannot be prepared fail with a `ValueError` naming the row, never
another exception (the job manager reports a `ValueError` as the job's own input, anything else as an
internal error): a template's own `raise_exception` on a reinforcement prompt, and text the tokenizer
cannot encode (a lone surrogate inside tool-call arguments, a JSON string inside the row's JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coserve.contract.reinforcement import ReinforcementRequest
from coserve.contract.training_settings import SettingsError
from coserve.frontend.chat_render import TemplateError
from coserve.frontend.tokenizer import Tokenizer
from coserve.jobs.reinforcement_data import prepare_reinforcement_job
from coserve.jobs.training_data import prepare_training_data

GRADER = {"type": "string_check", "name": "s", "input": "{{ sample.output_text }}", "reference": "4",
          "operation": "eq"}


def test_a_prompt_the_template_refuses_names_its_row(tool_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(tool_model_dirs["mistral"])  # its template raises on this order
    rows = [{"messages": [{"role": "user", "content": f"{i} + 2?"}]} for i in range(12)]
    rows[5] = {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "2 + 2?"}]}
    with pytest.raises(SettingsError) as err:
        prepare_reinforcement_job(tokenizer, rows, ReinforcementRequest(GRADER), job_id="j", tenant="t",
                                  adapter_id=1, num_layers=2, max_len=1024, output_dir=tmp_path)
    assert err.value.param == "training_file" and "row 6: The model's chat template" in err.value.message


def test_text_the_tokenizer_cannot_encode_names_its_example(model_dirs: dict[str, Path]) -> None:
    tokenizer = Tokenizer.from_pretrained(model_dirs["qwen2"])  # renders tool calls (hermes)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": "x\ud800"})}}
    rows = [{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}] * 3
    rows.append({"messages": [{"role": "user", "content": "u"},
                              {"role": "assistant", "content": None, "tool_calls": [call]}],
                 "tools": [{"type": "function", "function": {"name": "f"}}]})
    with pytest.raises(TemplateError, match="training example 4: the tokenizer cannot encode its text"):
        prepare_training_data(tokenizer, rows, 256)
