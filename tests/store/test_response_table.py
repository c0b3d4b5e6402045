"""The store's responses table on a real SQLite file: per tenant, bounded by count and bytes (least recently
used evicted first, running ones never), expiring, and a removed id says why; it survives reopening."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coserve.store import MetadataStore
from coserve.store.responses import TOMBSTONES_PER_TENANT, Gone, ResponseBounds, StoredResponse

UNBOUNDED = ResponseBounds(None, None, None)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _body(response_id: str, status: str = "completed", previous: str | None = None, text: str = "x") -> dict[str, Any]:
    return {"id": response_id, "status": status, "created_at": 1000, "previous_response_id": previous,
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]}


def _items(text: str = "hi") -> list[dict[str, Any]]:
    return [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


def test_put_get_chain_and_reopen(tmp_path: Path) -> None:
    with MetadataStore(tmp_path) as store:
        assert store.responses.put("a", _body("resp_1"), _items(), UNBOUNDED) == []
        assert store.responses.put("a", _body("resp_2", previous="resp_1"), _items("more"), UNBOUNDED) == []
        assert store.responses.get("b", "resp_1") is None  # another tenant's id is unknown to it
    with MetadataStore(tmp_path) as store:
        found = store.responses.get("a", "resp_2")
        assert isinstance(found, StoredResponse) and found.input_items == _items("more")
        chain = store.responses.chain("a", "resp_2", 10, 2**20, None)
        assert isinstance(chain, list) and [link.id for link in chain] == ["resp_1", "resp_2"]
        assert store.responses.chain("b", "resp_2", 10, 2**20, None) is None
        with pytest.raises(ValueError, match="longer than"):
            store.responses.chain("a", "resp_2", 1, 2**20, None)


def test_eviction_is_least_recently_used_and_per_tenant(tmp_path: Path) -> None:
    clock = Clock()
    bounds = ResponseBounds(max_count=3, max_bytes=None, ttl_s=None)
    with MetadataStore(tmp_path, clock=clock) as store:
        for n in range(3):
            store.responses.put("a", _body(f"resp_{n}"), _items(), bounds)
            store.responses.put("victim", _body(f"resp_v{n}"), _items(), bounds)
            clock.now += 1
        store.responses.chain("a", "resp_0", 10, 2**20, None)  # used now: the oldest is resp_1
        clock.now += 1
        assert store.responses.put("a", _body("resp_3"), _items(), bounds) == ["resp_1"]
        assert store.responses.get("a", "resp_1") == Gone("resp_1", "evicted")
        assert store.responses.usage("a") == (3, store.responses.usage("a")[1])
        assert all(isinstance(store.responses.get("victim", f"resp_v{n}"), StoredResponse) for n in range(3))


def test_bytes_bound_running_ones_stay_and_too_large_is_not_stored(tmp_path: Path) -> None:
    with MetadataStore(tmp_path) as store:
        big = ResponseBounds(max_count=None, max_bytes=2_000, ttl_s=None)
        store.responses.put("a", _body("resp_run", status="in_progress", text="r" * 600), _items(), big)
        store.responses.put("a", _body("resp_done", text="d" * 600), _items(), big)
        assert store.responses.put("a", _body("resp_new", text="n" * 600), _items(), big) == ["resp_done"]
        assert store.responses.put("a", _body("resp_huge", text="h" * 5_000), _items(), big) == "not_stored"
        assert store.responses.get("a", "resp_huge") == Gone("resp_huge", "not_stored")
        assert isinstance(store.responses.get("a", "resp_run"), StoredResponse)


def test_expiry_and_delete_say_why(tmp_path: Path) -> None:
    clock = Clock()
    bounds = ResponseBounds(None, None, ttl_s=60)
    with MetadataStore(tmp_path, clock=clock) as store:
        store.responses.put("a", _body("resp_old"), _items(), bounds)
        store.responses.put("a", _body("resp_used"), _items(), bounds)
        store.responses.put("a", _body("resp_del"), _items(), bounds)
        clock.now += 50
        store.responses.chain("a", "resp_used", 10, 2**20, 60)  # its expiry starts again
        clock.now += 20
        assert store.responses.get("a", "resp_old") == Gone("resp_old", "expired")
        assert isinstance(store.responses.get("a", "resp_used"), StoredResponse)
        assert store.responses.delete("a", "resp_del") and not store.responses.delete("a", "resp_del")
        assert store.responses.get("a", "resp_del") == Gone("resp_del", "deleted")
        assert not store.responses.delete("b", "resp_used")


def test_removed_rows_are_bounded_per_tenant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("coserve.store.responses.TOMBSTONES_PER_TENANT", 5)
    bounds = ResponseBounds(max_count=1, max_bytes=None, ttl_s=None)
    with MetadataStore(tmp_path) as store:
        for n in range(20):
            store.responses.put("a", _body(f"resp_{n}"), _items(), bounds)
        with store.db.read() as conn:
            rows = conn.execute("SELECT COUNT(*) FROM responses WHERE tenant = 'a'").fetchone()[0]
        assert rows == 1 + 5
    assert TOMBSTONES_PER_TENANT >= 1000


def test_responses_running_when_the_server_stopped_are_failed(tmp_path: Path) -> None:
    with MetadataStore(tmp_path) as store:
        store.responses.put("a", _body("resp_run", status="in_progress"), _items(), UNBOUNDED)
        store.responses.put("a", _body("resp_done"), _items(), UNBOUNDED)
    with MetadataStore(tmp_path) as store:
        assert store.responses.fail_interrupted() == 1
        failed = store.responses.get("a", "resp_run")
        assert isinstance(failed, StoredResponse) and failed.status == "failed"
        assert failed.body["status"] == "failed" and failed.body["error"]["code"] == "server_error"
        done = store.responses.get("a", "resp_done")
        assert isinstance(done, StoredResponse) and done.body["status"] == "completed"
