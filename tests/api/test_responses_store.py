"""The Responses API's store through the real `--local` server and the official client (tiny qwen2 model):
a 5-turn `previous_response_id` chain whose function calls and outputs are replayed into each prompt,
`retrieve`, `input_items.list`, `delete` and the 404 that says why, `store: false`, background responses
(retrieved while running, streamed from `starting_after`, cancelled with their KV freed at once), and the
store surviving a restart."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from local_server import LocalServer, local_server, scrape
from tool_cases import WEATHER_SCHEMA

KEY = "sk-respstore-0123456789"
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
                     "parameters": WEATHER_SCHEMA, "strict": True}]
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def qwen(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(model_dirs["qwen2"], tmp_path_factory.mktemp("respstore"), {"s": {"api_keys": [KEY]}},
                      max_batch_tokens=512) as srv:
        yield srv


def test_a_five_turn_chain_replays_calls_and_outputs(qwen: LocalServer) -> None:
    """Each turn continues the last: a forced call, its output, and the next call; the prompt of turn k
    holds every earlier item (its input tokens grow by what was added) and the earlier turns' prefix is
    reused from the cache."""
    oa = qwen.client(KEY)
    previous, inputs = None, []
    pending: Any = "What is the weather in Paris?"
    for turn in range(5):
        reply = oa.responses.create(model=qwen.base, input=pending, previous_response_id=previous, tools=TOOLS,
                                    tool_choice=NAMED, parallel_tool_calls=False, max_output_tokens=100,
                                    extra_body={"seed": turn})
        assert reply.status == "completed" and reply.previous_response_id == previous
        [call] = reply.output
        assert call.type == "function_call" and call.name == "get_weather"
        inputs.append(reply.usage.input_tokens)
        if turn > 0:
            assert reply.usage.input_tokens_details.cached_tokens > 0
        previous = reply.id
        pending = [{"type": "function_call_output", "call_id": call.call_id, "output": f"{18 + turn} degrees"}]
    assert all(later > earlier for earlier, later in zip(inputs, inputs[1:]))
    # The replayed conversation is exactly the one sent whole: same prompt length.
    items: list[Any] = []
    chain = [oa.responses.retrieve(previous)]
    while chain[-1].previous_response_id:
        chain.append(oa.responses.retrieve(chain[-1].previous_response_id))
    for response in reversed(chain[1:]):
        items += [i.model_dump(exclude_none=True) for i in oa.responses.input_items.list(response.id, order="asc")]
        items += [o.model_dump(exclude_none=True) for o in response.output]
    items += [i.model_dump(exclude_none=True) for i in oa.responses.input_items.list(previous, order="asc")]
    whole = oa.responses.create(model=qwen.base, input=items, tools=TOOLS, tool_choice=NAMED,
                                parallel_tool_calls=False, max_output_tokens=1, store=False)
    assert whole.usage.input_tokens == inputs[-1]


def test_instructions_are_not_carried_over(qwen: LocalServer) -> None:
    oa = qwen.client(KEY)
    first = oa.responses.create(model=qwen.base, input="Hi", instructions="Speak like a pirate.", max_output_tokens=2)
    second = oa.responses.create(model=qwen.base, input="More", previous_response_id=first.id, max_output_tokens=1)
    assert second.instructions is None
    whole = [{"role": "user", "content": "Hi"}, first.output[0].model_dump(exclude_none=True),
             {"role": "user", "content": "More"}]
    same = oa.responses.create(model=qwen.base, input=whole, max_output_tokens=1, store=False)
    assert same.usage.input_tokens == second.usage.input_tokens


def test_retrieve_input_items_delete_and_store_false(qwen: LocalServer) -> None:
    oa = qwen.client(KEY)
    items = [{"role": "user", "content": f"message {n}"} for n in range(5)]
    reply = oa.responses.create(model=qwen.base, input=items, max_output_tokens=2)
    stored = oa.responses.retrieve(reply.id)
    assert stored.id == reply.id and stored.output_text == reply.output_text and stored.usage == reply.usage
    page = oa.responses.input_items.list(reply.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["message 0", "message 1"] and page.has_more
    rest = oa.responses.input_items.list(reply.id, after=page.last_id, order="asc")
    assert [i.content[0].text for i in rest.data] == [f"message {n}" for n in (2, 3, 4)] and not rest.has_more
    newest = oa.responses.input_items.list(reply.id)
    assert newest.data[0].content[0].text == "message 4" and all(i.id.startswith("msg_") for i in newest.data)
    oa.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError, match="was deleted"):
        oa.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError, match="was deleted") as info:
        oa.responses.create(model=qwen.base, input="more", previous_response_id=reply.id)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        oa.responses.delete(reply.id)
    unstored = oa.responses.create(model=qwen.base, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError, match="No response found"):
        oa.responses.retrieve(unstored.id)


def _kv_in_use(srv: LocalServer) -> int:
    found = re.search(r'^coserve_kv_blocks_in_use\{engine="[^"]*"\} (\S+)$', scrape(srv.url), re.M)
    assert found is not None
    return int(float(found.group(1)))


def test_background_retrieve_stream_resume_and_cancel(qwen: LocalServer) -> None:
    oa = qwen.client(KEY)
    queued = oa.responses.create(model=qwen.base, input="Write a long story", background=True,
                                 max_output_tokens=2000, extra_body={"seed": 1})
    assert queued.status in ("queued", "in_progress") and queued.background
    deadline = time.monotonic() + 30
    while not (running := oa.responses.retrieve(queued.id)).output or not running.output[0].content[0].text:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert running.status == "in_progress" and _kv_in_use(qwen) > 0
    cancelled = oa.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and _kv_in_use(qwen) == 0  # its blocks are freed at once
    assert oa.responses.retrieve(queued.id).status == "cancelled"
    assert oa.responses.cancel(queued.id).status == "cancelled"  # a second cancel changes nothing

    short = oa.responses.create(model=qwen.base, input="Short", background=True, max_output_tokens=12,
                                extra_body={"seed": 2})
    events = list(oa.responses.retrieve(short.id, stream=True, starting_after=-1))
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(numbers))) and events[0].type == "response.created"
    assert events[1].type == "response.queued" and events[-1].type == "response.incomplete"
    resumed = list(oa.responses.retrieve(short.id, stream=True, starting_after=4))
    assert [e.sequence_number for e in resumed] == numbers[5:]
    assert [e.type for e in resumed] == [e.type for e in events[5:]]
    final = oa.responses.retrieve(short.id)
    assert final.status == "incomplete" and final.output_text == events[-1].response.output_text


def test_background_stream_at_creation_and_not_background_is_not_cancellable(qwen: LocalServer) -> None:
    oa = qwen.client(KEY)
    with oa.responses.stream(model=qwen.base, input="Hi", background=True, max_output_tokens=200,
                             text={"format": {"type": "json_object"}}, extra_body={"seed": 3}) as stream:
        kinds = [event.type for event in stream]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    plain = oa.responses.create(model=qwen.base, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Only a background response"):
        oa.responses.cancel(plain.id)


def test_the_store_survives_a_restart(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    tenants = {"s": {"api_keys": [KEY]}}
    with local_server(model_dirs["qwen2"], tmp_path, tenants) as srv:
        first = srv.client(KEY).responses.create(model=srv.base, input="Remember me", max_output_tokens=3)
    with local_server(model_dirs["qwen2"], tmp_path, tenants) as srv:
        oa = srv.client(KEY)
        assert oa.responses.retrieve(first.id).output_text == first.output_text
        second = oa.responses.create(model=srv.base, input="Again", previous_response_id=first.id,
                                     max_output_tokens=2)
        assert second.usage.input_tokens > first.usage.input_tokens


@pytest.fixture(scope="module")
def small(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """A KV cache of 2,048 tokens (2 MiB of the tiny qwen2's 1 KiB a token), so other traffic churns it."""
    with local_server(model_dirs["qwen2"], tmp_path_factory.mktemp("retention"),
                      {"s": {"api_keys": [KEY]}, "o": {"api_keys": ["sk-other-0123456789"]}},
                      max_model_len=512, kv_cache_memory_gb=2 / 1024, max_batch_tokens=512) as srv:
        yield srv


def _words(seed: int, count: int) -> str:
    return " ".join(f"w{seed}x{n}" for n in range(count))


def test_a_stored_responses_kv_outlives_the_churn(small: LocalServer) -> None:
    """Turn 2 of a stored response reuses turn 1's prompt and output from the cache although other tenants'
    traffic went through the whole KV cache meanwhile; the same conversation sent statelessly (nothing
    stored, so nothing retained) after the same traffic computes it all again."""
    oa = small.client(KEY)
    turn1 = oa.responses.create(model=small.base, input=_words(1, 15), max_output_tokens=24, temperature=0)
    stateless = oa.responses.create(model=small.base, input=_words(2, 15), max_output_tokens=24, temperature=0,
                                    store=False)
    other = small.client("sk-other-0123456789")
    for n in range(8):  # 8 x ~320 tokens through a 2,048-token cache
        other.chat.completions.create(model=small.base, messages=[{"role": "user", "content": _words(10 + n, 50)}],
                                      max_completion_tokens=8, temperature=0)
    turn2 = oa.responses.create(model=small.base, input="And then?", previous_response_id=turn1.id,
                                max_output_tokens=2)
    earlier = turn1.usage.input_tokens + turn1.usage.output_tokens
    assert turn2.usage.input_tokens_details.cached_tokens >= earlier - 2 * 16, (turn2.usage, earlier)
    items = [{"role": "user", "content": _words(2, 15)}, stateless.output[0].model_dump(exclude_none=True),
             {"role": "user", "content": "And then?"}]
    again = oa.responses.create(model=small.base, input=items, max_output_tokens=2, store=False)
    assert again.usage.input_tokens_details.cached_tokens == 0, again.usage
