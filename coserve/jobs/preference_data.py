"""DPO's training data: each preference row becomes two loss-masked sequences, torch-free.

A row's chosen sequence is its `input.messages` followed by the `preferred_output` message, its
rejected sequence the same input followed by `non_preferred_output`, both rendered with the chat
template as supervised examples are (`training_data.encode_conversation`: the same mask rules). Only
the final answer is trained: assistant turns inside the input are context (weight 0). DPO sums the
answer's log-probs, so the trained tokens are exactly the answer's and its end-of-turn marker.

A pair is kept only when both sides keep a trained token after truncation to `max_len` (a side cut
off entirely leaves a pair with nothing to compare); dropped pairs are counted and warned about.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coserve.contract.job_spec import trained_tokens
from coserve.contract.training_plan import TrainingExample
from coserve.frontend.chat_render import TemplateError
from coserve.frontend.prompt_encoder import longest_token_chars
from coserve.jobs.training_data import TrainingData, encode_conversation, indices_text, unencodable


@dataclass(slots=True)
class PreferenceData:
    """The kept pairs: `chosen.examples[i]` and `rejected[i]` are pair i; `chosen` carries the counts,
    with `trained_tokens` the trained targets of both sides."""

    chosen: TrainingData
    rejected: list[TrainingExample]


def _answer(row: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    context = [{**m, "weight": 0} if m.get("role") == "assistant" else m for m in row["input"]["messages"]]
    return [*context, {**row[key][0], "weight": 1}]


def prepare_preference_data(tokenizer: Any, rows: Sequence[Mapping[str, Any]], max_len: int,
                            what: str = "training pair") -> PreferenceData:
    """Encode every preference row (checked at upload: `api/protocol/preference_rows.py`).

    Raises:
        TemplateError: as `encode_conversation`, or text the tokenizer cannot encode, its message naming
            `what` and the row's 1-based index.
        ValueError: as `encode_conversation`.
    """
    chosen: list[TrainingExample] = []
    rejected: list[TrainingExample] = []
    kept: list[int] = []
    truncated: list[int] = []
    dropped: list[int] = []
    longest = longest_token_chars(tokenizer)
    for index, row in enumerate(rows):
        tools = row["input"].get("tools")
        try:
            sides = [encode_conversation(tokenizer, _answer(row, key), max_len, tools, longest)
                     for key in ("preferred_output", "non_preferred_output")]
        except TemplateError as err:
            raise TemplateError(f"{what} {index + 1}: {err}") from err
        except TypeError as err:
            raise TemplateError(f"{what} {index + 1}: {unencodable(err)}") from err
        if any(side.truncated for side in sides):
            truncated.append(index)
        if any(side.skipped for side in sides):
            dropped.append(index)
            continue
        chosen.append(TrainingExample(sides[0].token_ids, sides[0].trained))
        rejected.append(TrainingExample(sides[1].token_ids, sides[1].trained))
        kept.append(index)
    warnings = []
    if truncated:
        warnings.append(f"{len(truncated)} pair(s) with a side longer than {max_len} tokens were "
                        f"truncated to {max_len}: index {indices_text(truncated)}")
    if dropped:
        warnings.append(f"{len(dropped)} pair(s) lost every trained token of a side to truncation and "
                        f"were skipped: index {indices_text(dropped)}")
    trained = sum(trained_tokens(e) for e in [*chosen, *rejected])
    data = TrainingData(examples=chosen, num_examples=len(rows), num_skipped=len(dropped),
                        num_truncated=len(truncated), trained_tokens=trained, example_indices=kept,
                        warnings=warnings)
    return PreferenceData(data, rejected)
