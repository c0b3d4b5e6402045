"""Grader templates: `{{ item.field }}`, `{{ item.a.b[0] }}`, `{{ sample.output_text }}` and
`{{ sample.output_json.key }}`, OpenAI's two namespaces.

`check_template` refuses, before anything runs, a namespace other than `item` and `sample`, a `sample`
variable other than `output_text` and `output_json`, and a malformed path. `render` substitutes the
values: text as it is, anything else as JSON (`5`, `true`, `{"a": 1}`). A path the item or the sample
lacks raises `VariableError`; `output_json` of a sample that is not JSON raises `SampleParseError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coserve.contract.training_settings import SettingsError

_TAG = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_\-]*)|\[(\d+)\]")
_HEAD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)")
SAMPLE_VARIABLES = ("output_text", "output_json")


class VariableError(LookupError):
    """A template names a value the item or the sample does not have."""


class SampleParseError(ValueError):
    """A template reads `sample.output_json` of a sample that is not JSON."""


@dataclass(frozen=True, slots=True)
class Sample:
    """A model's answer, as graders see it."""

    output_text: str

    @property
    def output_json(self) -> Any:
        """The answer parsed as JSON; SampleParseError when it is not JSON."""
        try:
            return json.loads(self.output_text)
        except ValueError as err:
            raise SampleParseError(f"the sample is not JSON ({err.args[0]}), so sample.output_json has no "
                                   "value") from None


def _path(expression: str) -> tuple[str, list[str | int]] | None:
    """(namespace, steps) of `namespace.a.b[0]`; None when it is not such a path."""
    head = _HEAD.match(expression)
    if head is None:
        return None
    steps: list[str | int] = []
    rest, position = expression.rstrip(), head.end()
    while position < len(rest):
        step = _STEP.match(rest, position)
        if step is None:
            return None
        steps.append(step.group(1) if step.group(1) is not None else int(step.group(2)))
        position = step.end()
    return head.group(1), steps


def check_template(template: str, param: str) -> list[tuple[str, list[str | int]]]:
    """The template's variables as (namespace, steps); SettingsError (`param`) for a bad one."""
    variables = []
    for match in _TAG.finditer(template):
        parsed = _path(match.group(1))
        if parsed is None or not parsed[1]:
            raise SettingsError(param, f"{param}: {match.group(0)!r} is not a template variable; write "
                                "{{ item.<field> }} or {{ sample.output_text }}")
        namespace, steps = parsed
        if namespace not in ("item", "sample"):
            raise SettingsError(param, f"{param}: {match.group(0)!r} uses the namespace {namespace!r}; "
                                "the namespaces are 'item' and 'sample'")
        if namespace == "sample" and steps[0] not in SAMPLE_VARIABLES:
            raise SettingsError(param, f"{param}: {match.group(0)!r}: a sample has "
                                f"{' and '.join(SAMPLE_VARIABLES)}")
        if namespace == "sample" and steps[0] == "output_text" and len(steps) > 1:
            raise SettingsError(param, f"{param}: {match.group(0)!r}: sample.output_text is text; it has no "
                                "fields")
        variables.append((namespace, steps))
    if "{{" in _TAG.sub("", template):
        raise SettingsError(param, f"{param}: a '{{{{' is not closed by '}}}}'")
    return variables


def _lookup(value: Any, steps: list[str | int], shown: str) -> Any:
    for step in steps:
        if isinstance(step, int) and isinstance(value, list) and step < len(value):
            value = value[step]
        elif isinstance(step, str) and isinstance(value, Mapping) and step in value:
            value = value[step]
        else:
            raise VariableError(f"{shown} has no value here")
    return value


def has_value(value: Any, steps: Sequence[str | int]) -> bool:
    """Whether `value` has the path `steps` (what `render` would find for `{{ item.<steps> }}`)."""
    try:
        _lookup(value, list(steps), "")
    except VariableError:
        return False
    return True


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render(template: str, item: Mapping[str, Any], sample: Sample) -> str:
    """`template` with its variables substituted (module docstring); checked with `check_template` first."""

    def substitute(match: re.Match[str]) -> str:
        parsed = _path(match.group(1))
        assert parsed is not None  # check_template accepted it
        namespace, steps = parsed
        if namespace == "item":
            return _text(_lookup(item, steps, match.group(0)))
        if steps[0] == "output_text":
            return sample.output_text
        return _text(_lookup(sample.output_json, steps[1:], match.group(0)))

    return _TAG.sub(substitute, template)
