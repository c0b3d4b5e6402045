"""Stored Responses API responses: per tenant, bounded in count and bytes, expiring.

A row holds the response object and the input items of its own request (JSON); `previous_response_id`
links it to the response it continues, so a conversation is the chain of its rows (`chain`). Each tenant's
store is bounded by its own `ResponseBounds`: storing one more response first marks the tenant's expired
ones, then evicts its least recently used ones (continuing a conversation uses every response of it) until
the new one fits. Eviction never touches another tenant's rows, nor a background response still running.
A removed response keeps a small row without its data (`removed`: why), so its id answers a 404 that says
it was deleted, evicted or expired; those rows are kept for `TOMBSTONES_PER_TENANT` removals per tenant.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from coserve.store._base import Database, check_tenant

Removal = Literal["deleted", "evicted", "expired", "not_stored"]
RUNNING = ("queued", "in_progress")
TOMBSTONES_PER_TENANT = 10_000


@dataclass(frozen=True, slots=True)
class ResponseBounds:
    """One tenant's store: at most `max_count` responses and `max_bytes` of their JSON, each kept until
    `ttl_s` seconds after it was created or last continued (None: no bound)."""

    max_count: int | None
    max_bytes: int | None
    ttl_s: int | None


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A live stored response: the response object and its request's input items."""

    id: str
    previous_response_id: str | None
    status: str
    body: dict[str, Any]
    input_items: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Gone:
    """A response of this tenant that is no longer stored, and why."""

    id: str
    removed: Removal


class ResponseTable:
    """Put, read, continue and delete a tenant's stored responses."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def put(self, tenant: str, body: dict[str, Any], input_items: Sequence[dict[str, Any]],
            bounds: ResponseBounds) -> list[str] | Removal:
        """Store (or replace: a background response's final state) the response `body["id"]`.

        Returns the ids evicted to make room, or "not_stored" when it cannot fit even alone beside the
        tenant's running background responses (a row then says so).
        """
        check_tenant(tenant)
        body_json, items_json = json.dumps(body), json.dumps(list(input_items))
        size = len(body_json.encode()) + len(items_json.encode())
        now = self._db.now()
        with self._db.write() as conn:
            self._expire(conn, tenant, now)
            evicted = self._make_room(conn, tenant, body["id"], size, bounds, now)
            if evicted is None:
                self._remove(conn, tenant, [body["id"]], "not_stored", now)
                self._insert_tombstone(conn, tenant, body, now)
                return "not_stored"
            expires = now + bounds.ttl_s if bounds.ttl_s is not None else 2**62
            conn.execute(
                "INSERT INTO responses (id, tenant, previous_response_id, status, created_at, last_used_at, "
                "expires_at, bytes, body, input_items) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET status = excluded.status, bytes = excluded.bytes, "
                "body = excluded.body, input_items = excluded.input_items WHERE tenant = excluded.tenant "
                "AND removed IS NULL",
                (body["id"], tenant, body.get("previous_response_id"), body["status"], int(body["created_at"]),
                 now, expires, size, body_json, items_json))
            self._purge_tombstones(conn, tenant)
        return evicted

    def get(self, tenant: str, response_id: str) -> StoredResponse | Gone | None:
        """The tenant's response `response_id`; `Gone` when it was removed (an expired one is marked
        so on this read); None when this tenant never stored it (another tenant's id included)."""
        with self._db.read() as conn:
            row = conn.execute("SELECT * FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant)).fetchone()
        if row is None:
            return None
        if row["removed"] is not None:
            return Gone(response_id, row["removed"])
        if row["expires_at"] <= self._db.now() and row["status"] not in RUNNING:
            with self._db.write() as conn:
                self._remove(conn, tenant, [response_id], "expired", self._db.now())
            return Gone(response_id, "expired")
        return _stored(row)

    def chain(self, tenant: str, response_id: str, max_links: int, max_bytes: int,
              ttl_s: int | None) -> list[StoredResponse] | Gone | None:
        """The conversation `response_id` ends: its responses, oldest first, each used now (its expiry
        starts again). `Gone`/None as `get` for the first link that is missing.

        Raises:
            ValueError: the chain is longer than `max_links` responses or `max_bytes` bytes.
        """
        links: list[StoredResponse] = []
        total = 0
        current: str | None = response_id
        while current is not None:
            found = self.get(tenant, current)
            if not isinstance(found, StoredResponse):
                return found
            links.append(found)
            total += len(json.dumps(found.input_items)) + len(json.dumps(found.body.get("output", [])))
            if len(links) > max_links or total > max_bytes:
                raise ValueError(f"the conversation is longer than this server replays: more than "
                                 f"{max_links} responses or {max_bytes} bytes of items")
            current = found.previous_response_id
        self._touch(tenant, [link.id for link in links], ttl_s)
        return links[::-1]

    def delete(self, tenant: str, response_id: str) -> bool:
        """Delete the tenant's response; False when it has no such live response."""
        with self._db.write() as conn:
            row = conn.execute("SELECT removed FROM responses WHERE id = ? AND tenant = ?",
                               (response_id, tenant)).fetchone()
            if row is None or row["removed"] is not None:
                return False
            self._remove(conn, tenant, [response_id], "deleted", self._db.now())
        return True

    def fail_interrupted(self) -> int:
        """Mark every response still queued or running as failed (the server that ran them stopped: a
        background response runs in its gateway's process); returns how many. Call it when a server starts
        on the data dir (one server per data dir: its lock)."""
        error = json.dumps({"code": "server_error", "message": "The server stopped while this response ran."})
        with self._db.write() as conn:
            return int(conn.execute(
                "UPDATE responses SET status = 'failed', body = json_set(body, '$.status', 'failed', '$.error', "
                "json(?)) WHERE removed IS NULL AND status IN (?, ?)", (error, *RUNNING)).rowcount)

    def usage(self, tenant: str) -> tuple[int, int]:
        """The tenant's live stored responses and their bytes."""
        with self._db.read() as conn:
            row = conn.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses WHERE tenant = ? "
                               "AND removed IS NULL", (tenant,)).fetchone()
        return int(row[0]), int(row[1])

    # ------------------------------------------------------------------------------------- helpers

    def _touch(self, tenant: str, ids: list[str], ttl_s: int | None) -> None:
        now = self._db.now()
        marks = ",".join("?" * len(ids))
        expires = now + ttl_s if ttl_s is not None else 2**62
        with self._db.write() as conn:
            conn.execute(f"UPDATE responses SET last_used_at = ?, expires_at = MAX(expires_at, ?) WHERE tenant = ? "
                         f"AND removed IS NULL AND id IN ({marks})", (now, expires, tenant, *ids))

    @staticmethod
    def _expire(conn: sqlite3.Connection, tenant: str, now: int) -> None:
        ids = [row[0] for row in conn.execute(
            "SELECT id FROM responses WHERE tenant = ? AND removed IS NULL AND expires_at <= ? AND status NOT IN "
            "(?, ?)", (tenant, now, *RUNNING))]
        ResponseTable._remove(conn, tenant, ids, "expired", now)

    @staticmethod
    def _make_room(conn: sqlite3.Connection, tenant: str, response_id: str, size: int,
                   bounds: ResponseBounds, now: int) -> list[str] | None:
        """Evict the tenant's least recently used finished responses until one of `size` bytes fits;
        the ids evicted, or None (nothing evicted) when it cannot fit."""
        rows = conn.execute("SELECT id, bytes, status FROM responses WHERE tenant = ? AND removed IS NULL AND id != ? "
                            "ORDER BY last_used_at, seq", (tenant, response_id)).fetchall()
        count, held = len(rows), sum(row["bytes"] for row in rows)
        max_count = bounds.max_count if bounds.max_count is not None else 2**62
        max_bytes = bounds.max_bytes if bounds.max_bytes is not None else 2**62
        evict: list[str] = []
        for row in rows:
            if count + 1 <= max_count and held + size <= max_bytes:
                break
            if row["status"] in RUNNING:
                continue
            evict.append(row["id"])
            count, held = count - 1, held - row["bytes"]
        if count + 1 > max_count or held + size > max_bytes:
            return None
        ResponseTable._remove(conn, tenant, evict, "evicted", now)
        return evict

    @staticmethod
    def _remove(conn: sqlite3.Connection, tenant: str, ids: list[str], why: Removal, now: int) -> None:
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            conn.execute(f"UPDATE responses SET removed = ?, removed_at = ?, body = NULL, input_items = NULL, "
                         f"bytes = 0 WHERE tenant = ? AND id IN ({marks})", (why, now, tenant, *chunk))

    @staticmethod
    def _insert_tombstone(conn: sqlite3.Connection, tenant: str, body: dict[str, Any], now: int) -> None:
        conn.execute("INSERT OR IGNORE INTO responses (id, tenant, previous_response_id, status, created_at, "
                     "last_used_at, expires_at, bytes, removed, removed_at) VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?, ?)",
                     (body["id"], tenant, body.get("previous_response_id"), body["status"], int(body["created_at"]),
                      now, now, "not_stored", now))

    @staticmethod
    def _purge_tombstones(conn: sqlite3.Connection, tenant: str) -> None:
        conn.execute("DELETE FROM responses WHERE seq IN (SELECT seq FROM responses WHERE tenant = ? AND removed IS "
                     "NOT NULL ORDER BY seq DESC LIMIT -1 OFFSET ?)", (tenant, TOMBSTONES_PER_TENANT))


def _stored(row: sqlite3.Row) -> StoredResponse:
    return StoredResponse(id=row["id"], previous_response_id=row["previous_response_id"], status=row["status"],
                          body=json.loads(row["body"]), input_items=json.loads(row["input_items"]))
