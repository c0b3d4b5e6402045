"""`missing_item_field`: whether a row holds the `{{ item.* }}` values a grader reads."""

from __future__ import annotations

from typing import Any

import pytest

from coserve.graders.item_fields import Variable, missing_item_field, variable_text
from coserve.graders.templates import check_template

ROW = {"messages": [{"role": "user", "content": "q"}], "answer": "4", "meta": {"tags": ["a", None], "n": 0},
       "empty": None}


def _variables(template: str) -> list[Variable]:
    return list(check_template(template, "grader.reference"))


@pytest.mark.parametrize("template", [
    "{{ item.answer }}", "{{ item.meta.tags[1] }}", "{{ item.meta.n }}", "{{ item.empty }}",
    "{{ item.messages[0].content }}", "{{ sample.output_text }} {{ sample.output_json.x }}", "no variables",
])
def test_a_row_with_every_value_misses_nothing(template: str) -> None:
    assert missing_item_field(_variables(template), ROW) is None


@pytest.mark.parametrize(("template", "missing"), [
    ("{{ item.question }}", "{{ item.question }}"),
    ("{{ item.answer }} {{ item.meta.tags[2] }}", "{{ item.meta.tags[2] }}"),
    ("{{item.meta.n.x}}", "{{ item.meta.n.x }}"),
    ("{{ item.answer[0] }}", "{{ item.answer[0] }}"),  # text is not a list
    ("{{ item.meta[0] }}", "{{ item.meta[0] }}"),
])
def test_the_first_missing_value_is_named_as_a_template_writes_it(template: str, missing: str) -> None:
    assert missing_item_field(_variables(template), ROW) == missing


@pytest.mark.parametrize("row", [None, [1], "text"])
def test_a_row_that_is_not_an_object_has_no_fields(row: Any) -> None:
    assert missing_item_field([("item", ["answer"])], row) == "{{ item.answer }}"


def test_variable_text() -> None:
    assert variable_text(("item", ["a", 0, "b"])) == "{{ item.a[0].b }}"
