"""The structured-output spec: a plain value, bounded when made (tests/structured/test_schema_limits.py),
checked against the grammar library where the request is made, refusing what it cannot enforce with a
message that names it. `compile_error` runs llguidance in this process: these specs are small."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.contract.sampling import SamplingParams
from coserve.contract.structured_output import OutputFormat, StructuredOutput, StructuredOutputError
from coserve.structured.guarded_check import GrammarCheck
from coserve.structured.llguidance_grammar import compile_error, grammar_text, lark_text


@pytest.fixture(scope="module")
def grammars() -> Iterator[GrammarCheck]:
    check = GrammarCheck()
    yield check
    check.close()


def test_equal_schemas_give_equal_hashable_specs_that_survive_pickling() -> None:
    a = StructuredOutput.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutput.json_schema('{"type": "object",  "properties": {"b": {}, "a": {}}}')
    assert a == b and hash(a) == hash(b)
    assert a.schema_json == '{"type":"object","properties":{"b":{},"a":{}}}'  # property order kept
    assert pickle.loads(pickle.dumps(a)) == a
    assert StructuredOutput.json_object().format is OutputFormat.JSON_OBJECT
    assert grammar_text(StructuredOutput.json_object())


@pytest.mark.parametrize("schema, named", [
    ({"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
    ({"if": {"type": "string"}, "then": {}}, "Unimplemented keys"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"type": "wat"}, "Invalid type: wat"),
    ({"$ref": "#/$defs/missing"}, "/$defs/missing"),
    ({"type": "string", "format": "no-such-format"}, "Unknown format: no-such-format"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}},
      "required": ["a"]}, "Unsatisfiable"),
])
def test_unsupported_or_invalid_schemas_are_refused_naming_the_feature(schema: dict, named: str,
                                                                      grammars: GrammarCheck) -> None:
    spec = StructuredOutput.json_schema(schema)
    with pytest.raises(StructuredOutputError, match="schema") as info:
        grammars.check(spec)
    assert named in str(info.value)
    assert named in compile_error(spec)


@pytest.mark.parametrize("schema", ["not json", "[1, 2]", "true"])
def test_a_schema_that_is_not_a_json_object_is_refused(schema: str) -> None:
    with pytest.raises(StructuredOutputError):
        StructuredOutput.json_schema(schema)


def test_supported_features_pass(grammars: GrammarCheck) -> None:
    grammars.check(StructuredOutput.json_schema({
        "type": "object", "additionalProperties": False, "required": ["a", "b", "c"],
        "$defs": {"item": {"type": "object", "properties": {"x": {"type": "number"}}}},
        "properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
                       "b": {"anyOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"type": "null"}]},
                       "c": {"enum": ["x", "y"]}, "d": {"type": "string", "format": "date-time"}},
    }))


def test_options_the_grammar_cannot_honour_are_refused() -> None:
    spec = StructuredOutput.json_object()
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_output=spec, ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(structured_output=spec, min_tokens=3)


def test_a_panic_inside_the_grammar_library_is_a_refusal() -> None:
    # Found by the fuzz below: llguidance panicked (pyo3's PanicException, a BaseException) while
    # cutting an error message inside a multi-byte character. It must be a refusal, never a 500.
    schema = ('{"minimum":{"minLength":{},"$ref":{"prefixItems":[6333069285652632,1501556]},'
              r'"\ud828\uded5\udad2\ude25\u000f":[{"\uda84\uded0\u00f9":"7\u00ed\ud986\udd93",'
              r'"enum":"\u00c2\udb1f\udd4f\u00afS\u00d9\u00c4\u00fd\udacb\udea5"},{},'
              r'"\u00a6\u0085\ud99f\udfa6\u00cc\u00bfX\u0005\u0081"],"enum":{}},"anyOf":-52396}')
    assert "failed on it" in compile_error(StructuredOutput.json_schema(schema))


_KEYS = st.sampled_from(["type", "properties", "items", "required", "enum", "const", "anyOf", "oneOf",
                         "allOf", "$ref", "$defs", "pattern", "minLength", "maxLength", "minimum", "maximum",
                         "format", "additionalProperties", "minItems", "maxItems", "prefixItems", "not",
                         "multipleOf"])
_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=False),
                  st.text(max_size=8), st.sampled_from(["string", "object", "array", "integer", "number",
                                                        "null", "#/$defs/a", "#", "^a+$", "date-time",
                                                        "(?=a)"]))
_VALUES = st.recursive(_LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(_KEYS, st.text(max_size=3)), inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(schema=st.dictionaries(_KEYS, _VALUES, max_size=5))
def test_any_schema_is_either_accepted_or_refused_cleanly(schema: dict, grammars: GrammarCheck) -> None:
    """Whatever the draw, a refusal or an answer: never an exception of another kind, never a dead
    checker. (Drawn unseeded, this once found `{"minItems": 167966261}`, which took 23 GB in-process
    before the limits existed; CI runs it derandomized: tests/conftest.py.)"""
    try:
        grammars.check(StructuredOutput.json_schema(schema))
    except StructuredOutputError:
        pass


def test_lark_grammars_are_checked_like_schemas(grammars: GrammarCheck) -> None:
    good = StructuredOutput.lark('start: "<a>" body\nbody: %json {"type": "object"}\n')
    assert good.format is OutputFormat.LARK and grammar_text(good)
    assert pickle.loads(pickle.dumps(good)) == good
    grammars.check(good)
    for bad in ("start: undefined_rule\n", 'start: "a" (\n', 'start: %json {"not": {}}\n'):
        with pytest.raises(StructuredOutputError):
            grammars.check(StructuredOutput.lark(bad))


_SAME_LANGUAGE = [
    (StructuredOutput.json_schema({
        "type": "object", "additionalProperties": False, "required": ["a", "c"],
        "$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"enum": ["x", "y"]},
                       "c": {"type": "array", "items": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}}}}),
     {'{"a": 5, "c": [null, true]}': "complete", '{"a": 5, "b": "x", "c": []}': "complete",
      '{"a":5,"c":[]}': "refused", '{"a": 500, "c": []}': "refused", '{"a": 5}': "refused", '{"a": 5, ': "prefix",
      '{"a": 5, "c": [], "d": 1}': "refused", '{"a": 5, "c": [nu': "prefix"}),
    (StructuredOutput.json_object(),
     {"{}": "complete", '{"k": [1, {"j": "v"}]}': "complete", '{"k":1}': "refused", "[]": "refused"}),
    # The schema's own layout settings give way to the fixed layout, in both forms.
    (StructuredOutput.json_schema({"type": "object", "x-guidance": {"item_separator": ",", "lenient": True}}),
     {'{"a": 1, "b": 2}': "complete", '{"a": 1,"b": 2}': "refused"}),
]


def _outcome(tokenizer: object, grammar: str, text: str) -> str:
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if not matcher.consume_tokens(tokenizer.tokenize_str(text)):
        return "refused"
    return "complete" if matcher.is_accepting() else "prefix"


@pytest.mark.parametrize(("spec", "texts"), _SAME_LANGUAGE, ids=["schema", "json_object", "own_layout"])
def test_the_lark_form_derives_what_the_grammar_derives(spec: StructuredOutput, texts: dict[str, str],
                                                        llama_dir: Path) -> None:
    """vLLM's guidance backend takes Lark: `lark_text` must accept exactly what `grammar_text` does."""
    import llguidance

    tokenizer = llguidance.LLTokenizer(str(llama_dir / "tokenizer.json"))
    assert lark_text(spec).startswith("start: %json {")
    for text, expected in texts.items():
        assert [_outcome(tokenizer, g, text) for g in (grammar_text(spec), lark_text(spec))] == [expected] * 2, text


def test_a_lark_spec_is_its_own_lark_form() -> None:
    text = 'start: "<a>" body\nbody: %json {"type": "object"}\n'
    assert lark_text(StructuredOutput.lark(text)) == text
