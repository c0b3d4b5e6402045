"""The same Responses API cases against coserve and against vLLM's own OpenAI server, on SmolLM2 with the
hermes tools template (`deploy/chat-templates/smollm2-tools.jinja`), through the official `openai` client
and the Agents SDK. Each case passes or fails with what went wrong; the table goes to RESULTS.md.

coserve runs in this process (`coserve serve --local`, in a thread); vLLM as
`python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 --chat-template T
--enable-auto-tool-choice --tool-call-parser hermes` with `VLLM_ENABLE_RESPONSES_API_STORE=1` (its store is
off by default), started here unless `--vllm-url` names one running.

usage (from the repository root)::

    .venv/bin/python benchmarks/responses_compare.py --json benchmarks/out/responses_compare.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pydantic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from local_server import free_port, local_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "deploy" / "chat-templates" / "smollm2-tools.jinja"
KEY = "sk-compare-0123456789"
WEATHER: dict[str, Any] = {"type": "function", "name": "get_weather", "description": "Get the weather in a city",
                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}, "strict": True}


class Report(pydantic.BaseModel):
    city: str
    weather: str


def case_text(oa: openai.OpenAI, model: str) -> str:
    reply = oa.responses.create(model=model, input="Say hello.", max_output_tokens=16, temperature=0)
    assert reply.output_text and reply.usage and reply.usage.input_tokens > 0
    return f"{reply.status}, {reply.usage.output_tokens} tokens"


def case_items_second_turn(oa: openai.OpenAI, model: str) -> str:
    first = oa.responses.create(model=model, input="Name a fruit.", max_output_tokens=8, temperature=0)
    items = [{"role": "user", "content": "Name a fruit."}, *[o.model_dump(exclude_none=True) for o in first.output],
             {"role": "user", "content": "Another one?"}]
    second = oa.responses.create(model=model, input=items, max_output_tokens=8, temperature=0)
    assert second.output_text
    return "the client's output items sent back as input"


def case_stream(oa: openai.OpenAI, model: str) -> str:
    with oa.responses.stream(model=model, input="What is the capital of France?", max_output_tokens=64,
                             temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    numbers = [event.sequence_number for event in events]
    assert numbers == sorted(numbers) and final.output_text
    return f"{len(numbers)} events in order, get_final_response()"


def case_parse(oa: openai.OpenAI, model: str) -> str:
    parsed = oa.responses.parse(model=model, input="Weather in Paris as JSON.", text_format=Report,
                                max_output_tokens=200, temperature=0)
    assert isinstance(parsed.output_parsed, Report)
    return f"{parsed.output_parsed}"


def case_forced_call(oa: openai.OpenAI, model: str) -> str:
    reply = oa.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    calls = [o for o in reply.output if o.type == "function_call"]
    assert calls and json.loads(calls[0].arguments), [o.type for o in reply.output]
    return f"{calls[0].name}({calls[0].arguments})"


def case_streamed_call(oa: openai.OpenAI, model: str) -> str:
    with oa.responses.stream(model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=40, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and final.output[0].type == "function_call", \
        [o.type for o in final.output]
    assert not any(o.type == "message" and "<tool_call>" in o.content[0].text for o in final.output)
    return "function_call item events"


def case_chain_with_tools(oa: openai.OpenAI, model: str) -> str:
    first = oa.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    call = next(o for o in first.output if o.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = oa.responses.create(model=model, input=[output], previous_response_id=first.id, tools=[WEATHER],
                                 max_output_tokens=8, temperature=0)
    whole = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), output]
    same = oa.responses.create(model=model, input=whole, tools=[WEATHER], max_output_tokens=8, temperature=0,
                               store=False)
    assert second.usage.input_tokens == same.usage.input_tokens, (second.usage.input_tokens, same.usage.input_tokens)
    return f"replayed {second.usage.input_tokens} prompt tokens, the call included"


def case_retrieve_delete(oa: openai.OpenAI, model: str) -> str:
    reply = oa.responses.create(model=model, input="Hi", max_output_tokens=4)
    assert oa.responses.retrieve(reply.id).id == reply.id and oa.responses.input_items.list(reply.id).data
    oa.responses.delete(reply.id)
    try:
        oa.responses.retrieve(reply.id)
    except openai.NotFoundError as error:
        return f"404 after delete: {str(error.message)[:60]}"
    raise AssertionError("a deleted response was still retrieved")


def case_background_cancel(oa: openai.OpenAI, model: str) -> str:
    queued = oa.responses.create(model=model, input="Write a long story.", background=True, max_output_tokens=400)
    time.sleep(0.5)
    cancelled = oa.responses.cancel(queued.id)
    assert cancelled.status == "cancelled", cancelled.status
    return "queued -> cancelled"


def case_agents_sdk(url: str, model: str) -> str:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool(is_enabled=lambda ctx, agent: not called)
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        called.append("get_weather")
        return f"It is sunny and 21 C in {city}."

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=600)
        agent = Agent(name="w", instructions="Answer about the weather. Use the tools.", tools=[get_weather],
                      output_type=Report, model=OpenAIResponsesModel(model=model, openai_client=client),
                      model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=100))
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    assert isinstance(result.final_output, Report) and called
    return f"{result.final_output}"


CASES: list[tuple[str, Callable[..., str]]] = [
    ("create, string input", case_text), ("item input, second turn", case_items_second_turn),
    ("stream + get_final_response", case_stream), ("parse (pydantic text_format)", case_parse),
    ("forced function call", case_forced_call), ("streamed function call", case_streamed_call),
    ("previous_response_id with a tool call", case_chain_with_tools),
    ("retrieve, input_items, delete", case_retrieve_delete),
    ("background + cancel", case_background_cancel)]


def run_cases(url: str, model: str) -> list[dict[str, Any]]:
    oa = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=300)
    rows = []
    for name, case in [*CASES, ("Agents SDK Runner.run (tools + output_type)", None)]:
        started = time.perf_counter()
        try:
            detail = case_agents_sdk(url, model) if case is None else case(oa, model)
            ok = True
        except Exception as error:  # noqa: BLE001 - a failing case is a result
            ok, detail = False, f"{type(error).__name__}: {str(error)[:200]}"
            traceback.print_exc()
        rows.append({"case": name, "ok": ok, "detail": detail, "seconds": round(time.perf_counter() - started, 1)})
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return rows


@contextmanager
def vllm_server(model: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "VLLM_ENABLE_RESPONSES_API_STORE": "1", "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
           "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
           "--max-model-len", "2048", "--kv-cache-memory-bytes", str(2**30), "--port", str(port), "--api-key", KEY,
           "--served-model-name", model.name]
    log = open(Path(tempfile.gettempdir()) / f"vllm-compare-{port}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=10)
        deadline = time.monotonic() + 600
        while True:
            try:
                oa.models.list()
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM did not start; see {log.name}") from None
                time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache/coserve/models/smollm2-135m-instruct")
    parser.add_argument("--servers", default="coserve,vllm", help="which to run (default both)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    if "coserve" in args.servers:
        with tempfile.TemporaryDirectory() as root, \
                local_server(args.model, Path(root), {"c": {"api_keys": [KEY]}}, chat_template=str(TEMPLATE),
                             max_batch_tokens=1024, kv_cache_memory_gb=0.5) as srv:
            results["coserve"] = run_cases(f"{srv.url}/v1", srv.base)
    if "vllm" in args.servers:
        try:
            with vllm_server(args.model) as url:
                results["vllm"] = run_cases(url, args.model.name)
        except RuntimeError as error:
            results["vllm"] = [{"case": "server start", "ok": False, "detail": str(error), "seconds": 0}]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
