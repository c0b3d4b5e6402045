"""The sizes a structured-output spec may have: each limit holds at its value and refuses one past it,
naming the keyword's path, before llguidance ever sees the schema."""

from __future__ import annotations

import pytest

from coserve.contract import schema_limits as limits
from coserve.contract.schema_limits import pattern_size, schema_violation, schemas_violation
from coserve.contract.structured_output import StructuredOutput, StructuredOutputError
from coserve.tools.call_grammar import tool_call_grammar
from coserve.tools.family import HERMES
from coserve.tools.spec import ToolChoiceMode, ToolSpec


def _refusal(schema: dict) -> StructuredOutputError:
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutput.json_schema(schema)
    return info.value


def test_the_schema_that_took_servers_down_is_refused_before_any_library_sees_it() -> None:
    error = _refusal({"minItems": 167966261})
    assert error.path == ("minItems",)
    assert "167966261" in str(error) and str(limits.MAX_ITEMS) in str(error)


@pytest.mark.parametrize(("keyword", "limit"), [
    ("minItems", limits.MAX_ITEMS), ("maxItems", limits.MAX_ITEMS), ("minContains", limits.MAX_ITEMS),
    ("maxContains", limits.MAX_ITEMS), ("minLength", limits.MAX_LENGTH), ("maxLength", limits.MAX_LENGTH),
    ("minProperties", limits.MAX_PROPERTIES), ("maxProperties", limits.MAX_PROPERTIES),
])
def test_each_count_holds_at_its_limit_and_is_refused_past_it_with_its_path(keyword: str, limit: int) -> None:
    def schema(value: float) -> dict:
        return {"type": "object", "properties": {"a": {"type": "array", "items": {keyword: value}}}}

    StructuredOutput.json_schema(schema(limit))
    for over in (limit + 1, float(limit) + 0.5, 1e300):
        error = _refusal(schema(over))
        assert error.path == ("properties", "a", "items", keyword)
        assert f"the limit is {limit}" in str(error)


def test_counts_that_are_not_numbers_are_left_to_the_grammar_library() -> None:
    for value in ("10000000", True, None, [1], float("nan")):
        StructuredOutput.json_schema({"type": "array", "maxItems": value})


def test_item_counts_add_up_over_the_schema() -> None:
    half = {"type": "array", "maxItems": limits.MAX_ITEMS}
    StructuredOutput.json_schema({"type": "object", "properties": {"a": half, "b": half}})
    error = _refusal({"type": "object", "properties": {"a": half, "b": half, "c": {"type": "array", "minItems": 1}}})
    assert error.path == ("properties", "c", "minItems") and "add up" in str(error)


def test_properties_of_one_object_and_of_the_whole_schema() -> None:
    def obj(n: int) -> dict:
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}

    StructuredOutput.json_schema(obj(limits.MAX_OBJECT_PROPERTIES))
    assert _refusal(obj(limits.MAX_OBJECT_PROPERTIES + 1)).path == ("properties",)
    five = {"type": "object", "properties": {f"o{j}": obj(1000) for j in range(4)} | {"last": obj(995)}}
    StructuredOutput.json_schema(five)  # 4 x 1000 + 995 + the 5 holders = 5000
    five["properties"]["last"] = obj(996)
    assert "more than 5000 properties" in str(_refusal(five))


def test_enum_values_prefix_items_and_subschemas() -> None:
    StructuredOutput.json_schema({"enum": list(range(limits.MAX_ENUM_VALUES))})
    split = {"anyOf": [{"enum": list(range(600))}, {"enum": list(range(401))}]}
    assert _refusal(split).path == ("anyOf", 1, "enum")
    StructuredOutput.json_schema({"type": "array", "prefixItems": [{}] * limits.MAX_PREFIX_ITEMS})
    assert _refusal({"type": "array", "prefixItems": [{}] * (limits.MAX_PREFIX_ITEMS + 1)}).path == ("prefixItems",)
    many = {"anyOf": [{"anyOf": [{"type": "null"}] * 1000} for _ in range(10)]}  # 10,011 subschemas
    assert "more than 10000 subschemas" in str(_refusal(many))


def test_nesting_of_subschemas_and_of_plain_json() -> None:
    def nested(levels: int) -> dict:
        schema: dict = {"type": "string"}
        for _ in range(levels - 1):
            schema = {"type": "array", "items": schema}
        return schema

    StructuredOutput.json_schema(nested(limits.MAX_NESTING))
    error = _refusal(nested(limits.MAX_NESTING + 1))
    assert error.path == ("items",) * limits.MAX_NESTING and "32 levels" in str(error)
    deep: list = []
    for _ in range(limits.MAX_JSON_DEPTH):
        deep = [deep]
    assert "64 levels" in str(_refusal({"enum": [deep]}))  # an enum value is not a subschema, but nests
    very_deep: list = []
    for _ in range(100_000):  # deeper than Python's recursion: refused, never a RecursionError
        very_deep = [very_deep]
    _refusal({"const": very_deep})


def test_patterns_written_out() -> None:
    assert [pattern_size(p) for p in ("a{3}", "(ab){2}c", "(a{10}){10}", r"\d{4}-\d{2}", "[a-z]{1,1000}",
                                      r"\p{L}{20}", "(?:ab|cd){3}", "a{0}b", "(?i)abc", "[]a]{5}")] == [
        3, 5, 100, 7, 1000, 20, 12, 1, 3, 5]
    assert pattern_size("((a{100}){100}){100}") == limits.MAX_PATTERN_SIZE + 1  # saturates
    assert pattern_size("x{99999999999999999999999}") == limits.MAX_PATTERN_SIZE + 1
    StructuredOutput.json_schema({"type": "string", "pattern": "^(a{100}){100}$"})
    assert _refusal({"type": "string", "pattern": "^(a{100}){101}$"}).path == ("pattern",)
    error = _refusal({"type": "object", "patternProperties": {"^x{20000}$": {"type": "string"}}})
    assert error.path == ("patternProperties", "^x{20000}$")


def test_text_and_lark_sizes() -> None:
    big = {"type": "object", "description": "x" * limits.MAX_SCHEMA_BYTES}
    assert "bytes" in str(_refusal(big))
    with pytest.raises(StructuredOutputError, match="bytes"):
        StructuredOutput.json_schema('{"description": "' + "x" * limits.MAX_SCHEMA_BYTES + '"}')
    StructuredOutput.lark("start: " + '"a"' * 1000 + "\n")
    with pytest.raises(StructuredOutputError, match="bytes"):
        StructuredOutput.lark("start: " + '"a" ' * (limits.MAX_LARK_BYTES // 4) + "\n")


def test_a_forced_call_counts_every_function_schema_together() -> None:
    wide = {"type": "object", "properties": {"xs": {"type": "array", "maxItems": limits.MAX_ITEMS}}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": wide}} for i in range(3)]
    assert schema_violation(wide) is None
    over = schemas_violation([wide] * 3)
    assert over is not None and over.path == (2, "properties", "xs", "maxItems")
    tool_call_grammar(HERMES, ToolSpec(tools[:2], ToolChoiceMode.REQUIRED, None, True))
    with pytest.raises(StructuredOutputError, match="together"):
        tool_call_grammar(HERMES, ToolSpec(tools, ToolChoiceMode.REQUIRED, None, True))
    # a named function embeds its own schema only
    tool_call_grammar(HERMES, ToolSpec(tools, ToolChoiceMode.FUNCTION, "f0", True))
