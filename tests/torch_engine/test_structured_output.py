"""Structured output offline, on a tiny random model: its weights are noise, so only the grammar can
make its output valid JSON that follows the schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from coserve import LLM, SamplingParams
from coserve.contract.structured_output import OutputFormat, StructuredOutput

# Every value is bounded (string lengths, item counts, integer ranges; a `number` could take digits
# forever), so a random model cannot run past max_tokens inside a value: each output must close.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "size": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]},
    },
    "required": ["name", "age", "color", "ok", "tags", "size"],
    "additionalProperties": False,
}
OTHER_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"], "additionalProperties": False}
PROMPTS = ["Hello there", "Describe a person", "x", "JSON please"]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", max_num_seqs=32)


def _constrained(spec: StructuredOutput) -> list[SamplingParams]:
    greedy = [SamplingParams(temperature=0.0, max_tokens=120, structured_output=spec)]
    hot = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=120, structured_output=spec)
           for t, p, s in [(1.0, 1.0, 1), (1.5, 1.0, 2), (1.0, 0.9, 3), (2.0, 1.0, 4)]]
    return greedy + hot


def test_every_output_parses_and_follows_the_schema(llm: LLM) -> None:
    spec = StructuredOutput.json_schema(SCHEMA)
    params = _constrained(spec) + [SamplingParams(temperature=0.0, max_tokens=24)]  # one unconstrained
    prompts = [p for p in PROMPTS for _ in params]
    outs = llm.generate(prompts, params * len(PROMPTS))
    free = []
    for i, out in enumerate(outs):
        completion = out.outputs[0]
        if params[i % len(params)].structured_output is None:
            free.append(completion.token_ids)
            continue
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    # Unconstrained rows batched with constrained ones get the tokens they get alone.
    alone = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert free == [o.outputs[0].token_ids for o in alone]
    assert not all(o.outputs[0].text.startswith("{") for o in alone)  # the noise model alone is no JSON
    assert llm.engine.grammars.num_cached == 1  # compiled once for the 20 sequences


def test_each_spec_is_compiled_once_and_the_cache_is_bounded(llm: LLM) -> None:
    small = StructuredOutput.json_schema(OTHER_SCHEMA)
    before = llm.engine.grammars.num_cached
    for _ in range(2):
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, structured_output=small))
        assert [json.loads(o.outputs[0].text)["n"] in range(10) for o in outs] == [True] * len(PROMPTS)
    assert llm.engine.grammars.num_cached == before + 1
    grammars = llm.engine.grammars
    cache_size, grammars._cache_size = grammars._cache_size, 1
    try:
        third = StructuredOutput.json_schema({**OTHER_SCHEMA, "required": []})
        for spec in (third, small):  # each evicts the other, and is compiled again when it comes back
            out = llm.generate("x", SamplingParams(temperature=0.0, max_tokens=20, structured_output=spec))
            assert json.loads(out[0].outputs[0].text).get("n", 0) in range(10)
            assert grammars.num_cached == 1
    finally:
        grammars._cache_size = cache_size


def test_preempted_sequences_replay_their_outputs_into_a_new_matcher(llama_dir: Path) -> None:
    spec = StructuredOutput.json_schema(SCHEMA)
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_output=spec),
              SamplingParams(temperature=1.0, seed=7, max_tokens=120, structured_output=spec)]
    prompts = [p for p in PROMPTS for _ in params]
    roomy = LLM(model=str(llama_dir), dtype="float32")
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params * len(PROMPTS))]
    # 8 sequences of ~60 tokens in 16 blocks of 16 positions: they preempt each other.
    tight = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=16, max_model_len=256,
                enable_prefix_caching=False)
    replays: list[int] = []
    matcher = tight.engine.grammars.matcher
    tight.engine.grammars.matcher = lambda s, replay=(): (replays.append(len(replay)), matcher(s, replay))[1]
    outs = tight.generate(prompts, params * len(PROMPTS))
    assert max(replays) > 0  # some sequence came back after a preemption with outputs to replay
    assert [o.outputs[0].token_ids for o in outs] == expected
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_a_grammar_that_cannot_go_on_ends_its_sequence_only(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # A spec the engine cannot compile, let through by turning the admission check off: only its own
    # sequence may end (with grammar_error, at once), never the batch.
    monkeypatch.setattr(llm._grammars, "check", lambda spec: None)
    broken = SamplingParams(temperature=0.0, max_tokens=50, structured_output=StructuredOutput(
        OutputFormat.JSON_SCHEMA, '{"not": {"type": "string"}}'))
    good = SamplingParams(temperature=0.0, max_tokens=20,
                          structured_output=StructuredOutput.json_schema(OTHER_SCHEMA))
    outs = llm.generate(["a", "b", "c"], [broken, good, SamplingParams(temperature=0.0, max_tokens=5)])
    stuck = outs[0].outputs[0]
    assert stuck.finish_reason == "grammar_error"
    assert len(stuck.token_ids) == 1 and stuck.text == ""  # ended at once, with EOS
    assert outs[1].outputs[0].finish_reason == "stop"
    assert json.loads(outs[1].outputs[0].text)["n"] in range(10)
    assert len(outs[2].outputs[0].token_ids) == 5
