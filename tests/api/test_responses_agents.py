"""The OpenAI Agents SDK (`openai-agents`) against coserve's Responses API on SmolLM2-135M-Instruct, served with
`--chat-template deploy/chat-templates/smollm2-tools.jinja` (SmolLM2's template with hermes tools): `Runner.run`
and `Runner.run_streamed` with two function tools and a pydantic `output_type`, tracing disabled. The first turn
forces a call (`tool_choice: required`: the SDK then resets it to auto); the tools switch themselves off once
one ran (the SDK's `is_enabled`), so the second turn's reply is the `Report` JSON that `text.format` enforces.
Also: with the template, `tool_choice: auto` is served (it is a 400 on SmolLM2's own template)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pydantic
import pytest

from local_server import LocalServer, local_server

pytestmark = pytest.mark.real_model
KEY = "sk-agents-0123456789"
TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "chat-templates" / "smollm2-tools.jinja"


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(smollm2_dir, tmp_path_factory.mktemp("agents"), {"g": {"api_keys": [KEY]}},
                      chat_template=str(TEMPLATE), max_batch_tokens=1024, kv_cache_memory_gb=0.5) as srv:
        yield srv


class Report(pydantic.BaseModel):
    city: str
    weather: str


class Capital(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)


def _agent(srv: LocalServer, called: list[str]) -> Any:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    def fresh(ctx: Any, agent: Any) -> bool:
        return not called

    @function_tool(is_enabled=fresh)
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        called.append("get_weather")
        return f"It is sunny and 21 C in {city}."

    @function_tool(is_enabled=fresh)
    def get_time(city: str) -> str:
        """Get the current time in a city."""
        called.append("get_time")
        return f"It is 14:05 in {city}."

    client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=600)
    return Agent(name="weather", instructions="You answer questions about the weather. Use the tools.",
                 tools=[get_weather, get_time], output_type=Report,
                 model=OpenAIResponsesModel(model=srv.base, openai_client=client),
                 model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=100))


def test_runner_run_calls_tools_and_returns_the_output_type(smol: LocalServer) -> None:
    from agents import Runner

    called: list[str] = []
    result = asyncio.run(Runner.run(_agent(smol, called), "What is the weather and the time in Paris?",
                                    max_turns=5))
    assert isinstance(result.final_output, Report) and result.final_output.city
    assert called and set(called) <= {"get_weather", "get_time"}
    kinds = [type(item).__name__ for item in result.new_items]
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds and kinds[-1] == "MessageOutputItem"
    assert len(result.raw_responses) == 2 and all(r.response_id.startswith("resp_") for r in result.raw_responses)


def test_runner_run_streamed(smol: LocalServer) -> None:
    from agents import Runner

    called: list[str] = []

    async def run() -> tuple[Any, list[str]]:
        streamed = Runner.run_streamed(_agent(smol, called), "What is the weather in Paris?", max_turns=5)
        kinds = [event.type async for event in streamed.stream_events()]
        return streamed.final_output, kinds

    output, kinds = asyncio.run(run())
    assert isinstance(output, Report) and called
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


def test_auto_tools_are_served_with_the_template(smol: LocalServer) -> None:
    oa = openai.OpenAI(base_url=f"{smol.url}/v1", api_key=KEY, max_retries=0, timeout=600)
    tools: list[Any] = [{"type": "function", "name": "get_weather", "description": "Get the weather in a city",
                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                        "required": ["city"], "additionalProperties": False}, "strict": True}]
    reply = oa.responses.create(model=smol.base, input="Say hello.", tools=tools, tool_choice="auto",
                                max_output_tokens=16, temperature=0)
    assert reply.status in ("completed", "incomplete") and reply.output
    assert all(item.type in ("message", "function_call") for item in reply.output)
    assert not any("<tool_call>" in item.content[0].text for item in reply.output if item.type == "message")


def test_the_official_clients_calls_on_smollm2(smol: LocalServer) -> None:
    """create, stream + get_final_response, parse, retrieve, input_items, a continuation, delete, and a
    background response cancelled, on the real model."""
    oa = openai.OpenAI(base_url=f"{smol.url}/v1", api_key=KEY, max_retries=0, timeout=600)
    first = oa.responses.create(model=smol.base, input="What is the capital of France?", max_output_tokens=12,
                                temperature=0)
    assert "Paris" in first.output_text
    with oa.responses.stream(model=smol.base, input="What is the capital of France?", max_output_tokens=12,
                             temperature=0) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == first.output_text
    parsed = oa.responses.parse(model=smol.base, input="The capital of France, as JSON.", text_format=Capital,
                                max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Capital) and parsed.output_parsed.city
    follow = oa.responses.create(model=smol.base, input="And of Italy?", previous_response_id=first.id,
                                 max_output_tokens=12, temperature=0)
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    assert oa.responses.retrieve(follow.id).output_text == follow.output_text
    assert [item.type for item in oa.responses.input_items.list(follow.id).data] == ["message"]
    oa.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError, match="was deleted"):
        oa.responses.retrieve(follow.id)
    queued = oa.responses.create(model=smol.base, input="Tell me a long story.", background=True,
                                 max_output_tokens=500)
    assert oa.responses.cancel(queued.id).status == "cancelled"
