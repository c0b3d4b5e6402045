"""The tenant boundary on the Responses API: an ATTACKER tenant against a real server (`coserve serve --local`
on the tiny qwen2 model, in a thread) while a VICTIM tenant stores, continues and runs background responses.
Another tenant's response ids are 404s that say nothing more than an unknown id (retrieve, delete, cancel,
input items, `previous_response_id`, a resumed stream); the attacker filling its store evicts only its own
responses; huge inputs and item lists, long chains and a background flood are refused with a 4xx naming what
is wrong. Each case: the victim's requests finish with no error within a bound, and `/health` answers within
1 s throughout (polled every 50 ms)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from local_server import LocalServer, local_server

ATTACKER, VICTIM = "sk-resp-attacker-0123456789", "sk-resp-victim-0123456789"
TINY_STORE = "sk-resp-tiny-0123456789"  # a tenant whose store holds 500 bytes: no response fits
HEALTH_BOUND_S = 1.0
VICTIM_BOUND_S = 20.0


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    tenants = {"attacker": {"api_keys": [ATTACKER], "limits": {"max_stored_responses": 4,
                                                              "max_stored_response_bytes": 200_000}},
               "victim": {"api_keys": [VICTIM]},
               "tiny": {"api_keys": [TINY_STORE], "limits": {"max_stored_response_bytes": 500}}}
    with local_server(model_dirs["qwen2"], tmp_path_factory.mktemp("resp-boundary"), tenants) as srv:
        yield srv


class Health:
    """`/health` polled every 50 ms in a thread; its slowest answer and any failure."""

    def __init__(self, url: str) -> None:
        self._url, self._stop = url, threading.Event()
        self.slowest, self.failures, self.polls = 0.0, [], 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while True:
                started = time.perf_counter()
                try:
                    status: Any = http.get(f"{self._url}/health").status_code
                except httpx.HTTPError as error:
                    status = type(error).__name__
                self.slowest = max(self.slowest, time.perf_counter() - started)
                self.polls += 1
                if status != 200:
                    self.failures.append(status)
                if self._stop.wait(0.05):
                    return

    def check(self) -> None:
        self._stop.set()
        self._thread.join()
        assert self.polls > 0 and not self.failures, self.failures
        assert self.slowest < HEALTH_BOUND_S, f"/health took {self.slowest:.2f} s"


@contextmanager
def watched(server: LocalServer) -> Iterator[None]:
    health = Health(server.url)
    yield
    health.check()


def victim_works(server: LocalServer, previous: str | None = None) -> str:
    """The victim creates (continuing `previous`) and retrieves a response: no error, within the bound."""
    oa = server.client(VICTIM)
    started = time.perf_counter()
    reply = oa.responses.create(model=server.base, input="Still there?", previous_response_id=previous,
                                max_output_tokens=4)
    assert reply.status == "incomplete" and oa.responses.retrieve(reply.id).id == reply.id
    assert time.perf_counter() - started < VICTIM_BOUND_S
    return reply.id


def _same_as_unknown(error: openai.NotFoundError, response_id: str) -> None:
    assert error.body["message"] == f"No response found with id '{response_id}'.", error.body


def _attacks(server: LocalServer, attacker: openai.OpenAI, response_id: str) -> list[Callable[[], Any]]:
    """Every call that names a response id, aimed at `response_id`."""
    return [lambda: attacker.responses.retrieve(response_id),
            lambda: attacker.responses.delete(response_id),
            lambda: attacker.responses.cancel(response_id),
            lambda: attacker.responses.input_items.list(response_id),
            lambda: list(attacker.responses.retrieve(response_id, stream=True)),
            lambda: attacker.responses.create(model=server.base, input="x", previous_response_id=response_id,
                                              max_output_tokens=1)]


def test_another_tenants_ids_are_unknown_ids(server: LocalServer) -> None:
    victim = server.client(VICTIM)
    theirs = victim.responses.create(model=server.base, input="secret plans", max_output_tokens=3)
    deleted = victim.responses.create(model=server.base, input="gone", max_output_tokens=2)
    victim.responses.delete(deleted.id)
    attacker = server.client(ATTACKER)
    with watched(server):
        for response_id in (theirs.id, deleted.id):  # a deleted one does not say so to another tenant
            for call in _attacks(server, attacker, response_id):
                with pytest.raises(openai.NotFoundError) as info:
                    call()
                _same_as_unknown(info.value, response_id)
        assert victim.responses.retrieve(theirs.id).output_text == theirs.output_text
        victim_works(server, theirs.id)


def test_a_tenant_filling_its_store_evicts_only_its_own(server: LocalServer) -> None:
    victim = server.client(VICTIM)
    kept = [victim.responses.create(model=server.base, input=f"keep {n}", max_output_tokens=2).id for n in range(3)]
    attacker = server.client(ATTACKER)
    with watched(server):
        ids = [attacker.responses.create(model=server.base, input=f"fill {n}", max_output_tokens=2).id
               for n in range(10)]
        for response_id in ids[:6]:
            with pytest.raises(openai.NotFoundError, match="was evicted"):
                attacker.responses.retrieve(response_id)
        assert [attacker.responses.retrieve(i).id for i in ids[6:]] == ids[6:]  # its 4 most recent
        tiny = server.client(TINY_STORE)
        reply = tiny.responses.create(model=server.base, input="too big for my store", max_output_tokens=2)
        assert reply.status == "incomplete"  # answered, and not stored
        with pytest.raises(openai.NotFoundError, match="was not stored"):
            tiny.responses.retrieve(reply.id)
        assert [victim.responses.retrieve(i).id for i in kept] == kept
        victim_works(server, kept[-1])


def test_huge_inputs_and_item_lists_are_bounded(server: LocalServer, monkeypatch: pytest.MonkeyPatch) -> None:
    http = httpx.Client(base_url=f"{server.url}/v1", headers={"Authorization": f"Bearer {ATTACKER}"}, timeout=60)
    with watched(server):
        items = [{"role": "user", "content": "x"}] * 10_001
        answer = http.post("/responses", json={"model": server.base, "input": items})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "input", answer.text
        answer = http.post("/responses", json={"model": server.base, "input": "z" * (5 * 2**20)})
        assert answer.status_code == 413, answer.text
        answer = http.post("/responses", json={"model": server.base, "input": "word " * 600_000})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
        answer = http.post("/responses", json={"model": server.base, "input": "x",
                                               "metadata": {f"k{n}": "v" for n in range(17)}})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "metadata", answer.text
        monkeypatch.setattr("coserve.api.serving.response_conversation.MAX_CHAIN_LINKS", 3)
        previous = None
        for _ in range(4):
            reply = http.post("/responses", json={"model": server.base, "input": "x", "max_output_tokens": 1,
                                                  "previous_response_id": previous}).json()
            previous = reply["id"]
        answer = http.post("/responses", json={"model": server.base, "input": "x", "previous_response_id": previous})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "previous_response_id"
        victim_works(server)


def test_a_background_flood_is_capped_and_the_victim_runs(server: LocalServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("coserve.api.serving.response_runs.MAX_BACKGROUND_PER_TENANT", 3)
    attacker = server.client(ATTACKER)
    with watched(server):
        running = [attacker.responses.create(model=server.base, input="go on", background=True,
                                             max_output_tokens=1900) for _ in range(3)]
        with pytest.raises(openai.RateLimitError) as info:
            attacker.responses.create(model=server.base, input="more", background=True, max_output_tokens=10)
        assert info.value.body["param"] == "background"
        victim = server.client(VICTIM)
        started = time.perf_counter()
        queued = victim.responses.create(model=server.base, input="mine", background=True, max_output_tokens=5)
        while (mine := victim.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
            assert time.perf_counter() - started < VICTIM_BOUND_S
            time.sleep(0.05)
        assert mine.status == "incomplete" and mine.usage.output_tokens == 5
        victim_works(server)
        for response in running:
            assert attacker.responses.cancel(response.id).status == "cancelled"
