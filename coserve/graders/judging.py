"""Model graders' judgements as plain values: the JSON schema a judge's reply is held to, reading the
reward from that reply, and the `Judgement` the grading takes (`grading.grade`'s `judged`). The judge
itself is a chat completion the gateway runs (`api/serving/model_judge.py`).

- `score_model`: the reply is `{"result": "<number>"}`, the number written as a string of at most six
  digits and four decimals (a JSON number's grammar has no end: a judge that keeps writing digits would
  never close its reply); the reward is that number, which must lie in the grader's `range`.
- `label_model`: the reply is `{"result": <one of the labels>}`; the reward is 1 for a passing label, 0
  for another.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from coserve.contract.grader import Grader, ModelGrader, MultiGrader

SCORE_PATTERN = r"^-?[0-9]{1,6}(\.[0-9]{1,4})?$"


@dataclass(frozen=True, slots=True)
class Judgement:
    """One model grader's verdict on one sample: a reward, or why there is none."""

    reward: float | None
    tokens: int = 0  # the judge's prompt and reply tokens
    parse_error: bool = False  # the reply was not the schema's JSON, or its number was out of range
    server_error: str | None = None  # the judge could not be asked (quota, an unknown model, ...)


def judge_schema(grader: ModelGrader) -> dict[str, Any]:
    """The JSON schema of the judge's reply (enforced token by token by structured output)."""
    result: dict[str, Any] = {"type": "string", "enum": list(grader.labels)} if grader.labels else \
        {"type": "string", "pattern": SCORE_PATTERN}
    return {"type": "object", "properties": {"result": result}, "required": ["result"],
            "additionalProperties": False}


def read_judgement(grader: ModelGrader, reply: str, tokens: int) -> Judgement:
    """The reward in the judge's `reply`; a parse error when it is not `{"result": ...}` as the schema says
    (a reply cut at `max_completions_tokens`, a score outside the range)."""
    try:
        value = json.loads(reply)["result"]
    except (ValueError, TypeError, KeyError):
        return Judgement(None, tokens, parse_error=True)
    if grader.labels:
        if value not in grader.labels:
            return Judgement(None, tokens, parse_error=True)
        return Judgement(1.0 if value in grader.passing_labels else 0.0, tokens)
    try:
        score = float(value) if isinstance(value, str) and re.fullmatch(SCORE_PATTERN, value) else math.nan
    except ValueError:
        score = math.nan
    low, high = grader.score_range
    if not low <= score <= high:  # nan too
        return Judgement(None, tokens, parse_error=True)
    return Judgement(score, tokens)


def model_graders(grader: Grader, param: str = "grader") -> list[tuple[ModelGrader, str]]:
    """Every model grader in the tree, with its field path."""
    if isinstance(grader, ModelGrader):
        return [(grader, param)]
    if isinstance(grader, MultiGrader):
        return [found for name, sub in grader.graders for found in model_graders(sub, f"{param}.graders.{name}")]
    return []
