"""A training file's parsed form (`contract.training_rows`) reads back exactly what was stored, whatever text
its rows hold, and refuses what is not one."""

from __future__ import annotations

import json

import pytest

from coserve.contract.training_rows import ParsedTrainingFile, TrainingFileKind


def test_the_parsed_form_round_trips_any_text_exactly_in_about_its_size() -> None:
    rows = [{"messages": [{"role": "user", "content": "caf\u00e9 \u4e2d\u6587 \U0001f600 \u2028 \"q\" \\ \ud800"},
                          {"role": "assistant", "content": "ok", "weight": 0}], "n": [1, 2.5, None, True]},
            {"input": {"messages": []}, "preferred_output": [], "big": 10**30}]
    parsed = ParsedTrainingFile(TrainingFileKind.PREFERENCE, rows)
    stored = parsed.to_bytes()
    assert len(stored) < 2 * len(json.dumps(rows, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    back = ParsedTrainingFile.from_bytes(stored)
    assert back == parsed and back.num_examples == 2 and back.kind is TrainingFileKind.PREFERENCE


@pytest.mark.parametrize("data", [b"[]", json.dumps({"format": 2, "kind": "chat", "rows": []}).encode(),
                                  json.dumps({"format": 1, "kind": "chat", "rows": {}}).encode(),
                                  json.dumps({"format": 1, "kind": "poetry", "rows": []}).encode()])
def test_what_is_not_a_parsed_file_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        ParsedTrainingFile.from_bytes(data)
