"""What each chat template can do with tools, as the gateway probes it: the tiny qwen2/qwen3 models
(Qwen's tool template) take tools and calls in the hermes format, the tiny models with the real Llama 3.2
and Mistral Nemo templates in theirs; ChatML and SmolLM2's template render neither, so `auto`/`none`
tools and tool-call history are refused rather than rendered without them, while a forced call is
served with the tools described in a system message."""

from __future__ import annotations

from pathlib import Path

import pytest

from coserve.contract.messages import Rejection
from coserve.contract.sampling import SamplingParams
from coserve.contract.structured_output import OutputFormat
from coserve.frontend.messages import ChatSubmission
from coserve.frontend.tokenizer import Tokenizer
from coserve.frontend.tool_admission import PreparedChat, ToolSupport
from coserve.tools.call_ids import nine_char_id
from coserve.tools.family import HERMES, LLAMA3_JSON, MISTRAL
from coserve.tools.spec import ToolChoiceMode, ToolSpec
from coserve.tools.system_prompt import tools_description

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}}
HISTORY = [{"role": "user", "content": "hi"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "2"}]


def _submission(tools: ToolSpec | None, messages: list[dict] | None = None, **sampling: object) -> ChatSubmission:
    return ChatSubmission("r", "t", messages or [{"role": "user", "content": "hi"}],
                          SamplingParams(max_tokens=8, **sampling), tools=tools)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_templates_take_tools_and_force_calls(model_dirs: dict[str, Path], arch: str) -> None:
    support = ToolSupport(Tokenizer.from_pretrained(model_dirs[arch]))
    assert support.renders_calls and support.renders_tools and support.family is HERMES
    prepared = support.prepare(_submission(ToolSpec([TOOL], ToolChoiceMode.REQUIRED), HISTORY))
    assert isinstance(prepared, PreparedChat) and prepared.family is HERMES and prepared.tools == [TOOL]
    assert prepared.sampling.structured_output.format is OutputFormat.LARK
    assert prepared.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # as templates take it
    auto = support.prepare(_submission(ToolSpec([TOOL], ToolChoiceMode.AUTO)))
    assert auto.family is HERMES and auto.sampling.structured_output is None
    assert support.prepare(_submission(ToolSpec([TOOL], ToolChoiceMode.NONE))).family is None
    refused = support.prepare(_submission(ToolSpec([TOOL], ToolChoiceMode.REQUIRED), min_tokens=2))
    assert isinstance(refused, Rejection) and refused.param == "tool_choice" and "min_tokens" in refused.message


@pytest.mark.parametrize(("name", "family"), [("llama3.2", LLAMA3_JSON), ("mistral", MISTRAL)])
def test_llama_and_mistral_templates_take_tools_and_force_calls(tool_model_dirs: dict[str, Path], name: str,
                                                                family: object) -> None:
    support = ToolSupport(Tokenizer.from_pretrained(tool_model_dirs[name]))
    assert support.renders_calls and support.renders_tools and support.family is family
    prepared = support.prepare(_submission(ToolSpec([TOOL], ToolChoiceMode.REQUIRED), HISTORY))
    assert isinstance(prepared, PreparedChat) and prepared.family is family and prepared.tools == [TOOL]
    assert prepared.sampling.structured_output.format is OutputFormat.LARK
    call, result = prepared.messages[1]["tool_calls"][0], prepared.messages[2]
    assert call["function"]["arguments"] == {"x": 1}
    # Mistral's templates take 9-character ids only: the call and its result keep matching.
    assert call["id"] == result["tool_call_id"] == (nine_char_id("call_1") if family is MISTRAL else "call_1")
    assert support.prepare(_submission(ToolSpec([TOOL], ToolChoiceMode.AUTO))).family is family


def _refuses_tools(tokenizer: object) -> None:
    support = ToolSupport(tokenizer)
    assert not support.renders_calls and not support.renders_tools and support.family is None
    for mode in (ToolChoiceMode.AUTO, ToolChoiceMode.NONE):
        refused = support.prepare(_submission(ToolSpec([TOOL], mode)))
        assert isinstance(refused, Rejection) and refused.status == 400 and refused.param == "tools"
        assert "does not render tools" in refused.message and "'required'" in refused.message
    refused = support.prepare(_submission(None, HISTORY))
    assert isinstance(refused, Rejection) and refused.param == "messages"
    assert isinstance(support.prepare(_submission(None)), PreparedChat)  # no tools: served as before
    # A forced call: the tools in a system message, the hermes call it describes forced and read back.
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    forced = support.prepare(_submission(ToolSpec([TOOL], ToolChoiceMode.FUNCTION, "f"), conversation))
    assert isinstance(forced, PreparedChat) and forced.tools is None and forced.family is HERMES
    assert forced.messages[0] == {"role": "system", "content": "Be brief.\n\n" + tools_description([TOOL])}
    assert forced.sampling.structured_output.format is OutputFormat.LARK


def test_chatml_refuses_tools(model_dirs: dict[str, Path]) -> None:
    _refuses_tools(Tokenizer.from_pretrained(model_dirs["llama"]))


@pytest.mark.real_model
def test_smollm2_refuses_tools(smollm2_dir: Path) -> None:
    _refuses_tools(Tokenizer.from_pretrained(smollm2_dir))


def test_an_engine_without_grammars_refuses_forced_calls_and_json(model_dirs: dict[str, Path]) -> None:
    """An engine that enforces no grammar (`RuntimeLayout.structured_output` false; both of coserve's do):
    a forced `tool_choice` or a JSON `response_format` is a 400 naming it, before anything is queued;
    `auto` tools and plain text still pass."""
    import asyncio

    from coserve.contract.structured_output import StructuredOutput
    from coserve.frontend.intake import Intake, PromptIntake
    from coserve.model.config import ModelConfig

    intake = PromptIntake(Tokenizer.from_pretrained(model_dirs["qwen2"]),
                          ModelConfig.from_pretrained(model_dirs["qwen2"]))
    intake.attach(max_model_len=512, max_lora_rank=16, structured_output=False)
    try:
        forced = asyncio.run(intake.prepare(_submission(ToolSpec([TOOL], ToolChoiceMode.REQUIRED))))
        assert isinstance(forced, Rejection) and forced.param == "tool_choice"
        assert "enforces no grammar" in forced.message
        json_out = asyncio.run(intake.prepare(_submission(None, structured_output=StructuredOutput.json_object())))
        assert isinstance(json_out, Rejection) and json_out.param == "response_format"
        assert isinstance(asyncio.run(intake.prepare(_submission(ToolSpec([TOOL], ToolChoiceMode.AUTO)))), Intake)
    finally:
        intake.close()
