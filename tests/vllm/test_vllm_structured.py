"""Structured output on the vLLM engine (vLLM's guidance backend, fed coserve's grammars), offline on the
tiny random llama, whose weights are noise: only the grammar can make its output valid. Greedy outputs
equal coserve's engine's token for token (the same llguidance masks); after coserve preempts a sequence
(a KV cache of 5 blocks), its grammar goes on from the output so far; a grammar that cannot go on ends
its own sequence with `grammar_error`, as on coserve's engine.

A module of its own: one vLLM engine per module (test_vllm_models.py says why)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest

from vllm_support import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from coserve import LLM, SamplingParams  # noqa: E402
from coserve.contract.structured_output import JSON_LAYOUT, OutputFormat, StructuredOutput  # noqa: E402
from coserve.vllm.backend import VllmRuntime  # noqa: E402

# Bounded values, so that noise cannot run past max_tokens inside one (see test_structured_output.py).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "size": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]},
    },
    "required": ["name", "age", "color", "tags", "size"],
    "additionalProperties": False,
}
SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["n"], "additionalProperties": False}
NOTE = {**SMALL, "properties": {**SMALL["properties"], "note": {"type": "string", "minLength": 24, "maxLength": 40}},
        "required": ["n", "note"]}
# A forced tool call's shape (coserve.tools.call_grammar): text around a JSON schema in the fixed layout.
LARK = 'start: "<call>" body "</call>"\nbody: %json ' + json.dumps(
    {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"], "additionalProperties": False,
     "x-guidance": JSON_LAYOUT}) + "\n"
SIZES = {"dtype": "float32", "max_num_seqs": 8, "max_batch_tokens": 48}
# vLLM's CPU blocks hold 128 positions; a block of the tiny llama's K/V is 64 KiB. 6 blocks, one of them
# vLLM's null block: five 128-token sequences at most, so longer ones preempt each other.
TIGHT_KV_GB = 6 * 2**16 / 2**30


def _prompts(count: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": [5 + (31 * i + 7 * j) % 1900 for j in range(length)]} for i in range(count)]


def _constrained(spec: StructuredOutput, max_tokens: int = 120) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=spec)] + [
        SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=max_tokens, structured_output=spec)
        for t, p, s in [(1.0, 1.0, 1), (1.5, 1.0, 2), (1.0, 0.9, 3)]]


@pytest.fixture(scope="module")
def vllm_llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), engine="vllm", kv_cache_memory_gb=TIGHT_KV_GB, max_model_len=256, **SIZES)


@pytest.fixture(scope="module")
def native_llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), **SIZES)


def test_outputs_follow_the_grammar_and_greedy_ones_are_coserves(vllm_llm: LLM, native_llm: LLM) -> None:
    specs = [StructuredOutput.json_schema(SCHEMA), StructuredOutput.json_object(), StructuredOutput.lark(LARK)]
    params = [p for spec in specs for p in _constrained(spec, 60 if spec.format is OutputFormat.LARK else 120)]
    params.append(SamplingParams(temperature=0.0, max_tokens=16))  # unconstrained, in the same batch
    prompts = _prompts(2, 6)[1:] * len(params)
    theirs = vllm_llm.generate(prompts, params)
    ours = native_llm.generate(prompts, params)
    closed_objects = 0
    for param, out, reference in zip(params, theirs, ours):
        completion, spec = out.outputs[0], param.structured_output
        if spec is None or param.temperature == 0.0:  # vLLM's masks are coserve's: the same greedy tokens
            assert completion.token_ids == reference.outputs[0].token_ids
        if spec is None:
            continue
        if spec.format is OutputFormat.JSON_OBJECT:
            # Keys are unbounded strings, which noise may write until max_tokens.
            assert completion.text.startswith("{")
            if completion.finish_reason == "length":
                continue
            closed_objects += 1
        assert completion.finish_reason == "stop", completion.text
        if spec.format is OutputFormat.LARK:
            assert completion.text.startswith("<call>") and completion.text.endswith("</call>")
            assert json.loads(completion.text[6:-7])["k"] in ("a", "b")
        elif spec.format is OutputFormat.JSON_SCHEMA:
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        else:
            assert isinstance(json.loads(completion.text), dict)
    assert closed_objects > 0
    assert not theirs[-1].outputs[0].text.startswith("{")  # the noise model alone writes no JSON
    assert vllm_llm.engine.num_sequences == 0


def test_preempted_sequences_go_on_from_their_output(vllm_llm: LLM, native_llm: LLM,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """8 sequences of 120 prompt tokens and 10-60 outputs need two 128-token blocks each; 5 blocks
    hold 5 sequences of one block: coserve preempts, re-adds them to vLLM with their outputs as prompt,
    and vLLM's matcher is advanced through those outputs, so the greedy outputs are exactly those of
    coserve's engine, which never preempts here."""
    spec = StructuredOutput.json_schema(NOTE)
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_output=spec),
              SamplingParams(temperature=1.0, seed=7, max_tokens=60, structured_output=spec)] * 4
    prompts = _prompts(8, 120)
    replays = []
    add = VllmRuntime.add

    def counting_add(runtime: VllmRuntime, request_id: str, token_ids: list[int], sampling: SamplingParams,
                     num_outputs: int, lora: object) -> None:
        replays.append(num_outputs)
        add(runtime, request_id, token_ids, sampling, num_outputs, lora)

    monkeypatch.setattr(VllmRuntime, "add", counting_add)
    theirs = vllm_llm.generate(prompts, params)
    assert max(replays) > 0  # sequences came back after a preemption with outputs to replay
    ours = native_llm.generate(prompts, params)
    for param, out, reference in zip(params, theirs, ours):
        if param.temperature == 0.0:
            assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), NOTE)


def test_a_replayed_prefix_is_continued_and_one_that_does_not_parse_is_a_grammar_error(vllm_llm: LLM) -> None:
    """The runtime itself: a sequence added with outputs (as after a preemption) continues them under its
    grammar; outputs the grammar rejects leave it in its error state: vLLM's mask allows only EOS, and
    that token says `grammar_error`, as on coserve's engine."""
    runtime, tokenizer = vllm_llm.engine.runtime, vllm_llm.tokenizer
    sampling = SamplingParams(temperature=0.0, max_tokens=30, structured_output=StructuredOutput.json_schema(SMALL))
    prompt = _prompts(1, 5)[0]["prompt_token_ids"]
    for name, text in (("good", '{"n": '), ("bad", '["n"')):
        outputs = tokenizer.encode(text, add_special_tokens=False)
        tokens = prompt + outputs
        runtime.add(name, tokens, sampling, len(outputs), None)
        generated, errors = [], []
        while not generated or generated[-1] != tokenizer.eos_token_id:
            (sampled,) = runtime.run({name: len(tokens)})
            tokens.append(sampled.token_id)
            generated.append(sampled.token_id)
            errors.append(sampled.grammar_error)
        runtime.abort([name])
        if name == "good":
            assert json.loads(text + tokenizer.decode(generated[:-1]))["n"] in range(10)
            assert not any(errors)
        else:
            assert generated == [tokenizer.eos_token_id] and errors == [True]
    assert runtime.num_sequences == 0


def test_a_grammar_that_cannot_go_on_ends_its_sequence_only(vllm_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # A spec no grammar can be built for, let through by turning the admission check off: only its own
    # sequence ends (with grammar_error, at once, on EOS), never the batch.
    monkeypatch.setattr(vllm_llm._grammars, "check", lambda spec: None)
    broken = SamplingParams(temperature=0.0, max_tokens=50, structured_output=StructuredOutput(
        OutputFormat.JSON_SCHEMA, '{"not": {"type": "string"}}'))
    good = SamplingParams(temperature=0.0, max_tokens=20, structured_output=StructuredOutput.json_schema(SMALL))
    outs = vllm_llm.generate(["a", "b", "c"], [broken, good, SamplingParams(temperature=0.0, max_tokens=5)])
    stuck = outs[0].outputs[0]
    assert stuck.finish_reason == "grammar_error"
    assert stuck.token_ids == [vllm_llm.tokenizer.eos_token_id] and stuck.text == ""
    assert outs[1].outputs[0].finish_reason == "stop" and json.loads(outs[1].outputs[0].text)["n"] in range(10)
    assert len(outs[2].outputs[0].token_ids) == 5


def test_logprobs_under_a_grammar_are_after_its_mask(vllm_llm: LLM) -> None:
    """vLLM applies the grammar's mask before it computes logprobs: the top entries are tokens the grammar
    allows (the forbidden ones, at -inf, are left out), with finite logprobs."""
    spec = StructuredOutput.json_schema(SCHEMA)
    out = vllm_llm.generate(_prompts(1, 6), SamplingParams(temperature=0.0, max_tokens=40, logprobs=3,
                                                          structured_output=spec))[0].outputs[0]
    assert out.text.startswith('{"name": "')
    first = out.logprobs[0]  # only "{" can start the object: the log-softmax of one allowed logit, 0 to ~u
    assert list(first) == [out.token_ids[0]] and first[out.token_ids[0]].logprob == pytest.approx(0.0, abs=1e-6)
    assert all(math.isfinite(lp.logprob) for step in out.logprobs for lp in step.values())
    assert any(len(step) > 1 for step in out.logprobs)  # where the grammar allows several tokens
