"""The SQLite schema of the metadata store and its migrations, applied in order when the file is opened.

A migration is appended, never edited: an existing data dir at version N runs migrations N+1.. only.
Every table has an AUTOINCREMENT `seq`: it orders rows by insertion (created_at has one-second ties) and
is the position behind an `after` cursor; AUTOINCREMENT never reuses a value, so order survives deletes.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

_V1 = """
CREATE TABLE files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    status TEXT NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX files_tenant ON files (tenant, seq);
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    training_file TEXT NOT NULL,
    validation_file TEXT,
    hyperparameters TEXT NOT NULL,
    method TEXT,
    suffix TEXT,
    seed INTEGER NOT NULL,
    metadata TEXT,
    status TEXT NOT NULL,
    fine_tuned_model TEXT,
    trained_tokens INTEGER,
    error TEXT,
    created_at INTEGER NOT NULL,
    finished_at INTEGER,
    estimated_finish INTEGER,
    result_files TEXT NOT NULL,
    extensions TEXT NOT NULL
);
CREATE INDEX jobs_tenant ON jobs (tenant, seq);
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL REFERENCES jobs (id),
    created_at INTEGER NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    type TEXT NOT NULL,
    data TEXT
);
CREATE INDEX events_job ON events (job_id, seq);
CREATE TABLE checkpoints (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL REFERENCES jobs (id),
    step_number INTEGER NOT NULL,
    fine_tuned_model_checkpoint TEXT NOT NULL UNIQUE,
    metrics TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    adapter_path TEXT,
    UNIQUE (job_id, step_number)
);
CREATE TABLE models (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT,
    base_model TEXT,
    created_at INTEGER NOT NULL,
    adapter_path TEXT,
    job_id TEXT,
    deleted INTEGER NOT NULL DEFAULT 0
);
"""

# Events that must be stored once per job whatever the number of resumes (a step's metrics: the steps
# after the last checkpoint are redone by a resumed job) carry a key; NULL keys never collide.
_V2 = """
ALTER TABLE events ADD COLUMN dedup_key TEXT;
CREATE UNIQUE INDEX events_job_dedup ON events (job_id, dedup_key);
"""

# Stored Responses API responses (`coserve.store.responses`): the response object and its own input items as
# JSON; a removed one keeps its row without them (`removed`: deleted, evicted, expired, not_stored), so its id
# answers a 404 that says what happened to it.
_V3 = """
CREATE TABLE responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    previous_response_id TEXT,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    last_used_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    body TEXT,
    input_items TEXT,
    removed TEXT,
    removed_at INTEGER
);
CREATE INDEX responses_tenant ON responses (tenant, removed, last_used_at)
"""

MIGRATIONS: tuple[str, ...] = (_V1, _V2, _V3)
"""MIGRATIONS[i] takes the schema from version i to version i + 1."""

SCHEMA_VERSION = len(MIGRATIONS)

BUSY_TIMEOUT_S = 30.0
"""How long a write waits for another process's write transaction (each is milliseconds long)."""


def open_database(path: Path) -> sqlite3.Connection:
    """Open (creating if needed) the database at `path` and bring its schema to `SCHEMA_VERSION`.

    Raises:
        ValueError: the file was written by a newer coserve (its schema version is unknown here).
    """
    # The store serialises every call with its own lock, so sharing the connection across threads is safe;
    # autocommit mode (isolation_level=None) lets `BEGIN IMMEDIATE` take the write lock up front, and
    # another process holding it (the gateway and the scheduler each open the store) makes this one wait
    # up to BUSY_TIMEOUT_S instead of failing with "database is locked".
    conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_S)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    # FULL syncs the WAL on every commit: a committed row survives a power cut, not just a process crash.
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    try:
        _migrate(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _migrate(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM schema_version").fetchone()
        current = 0 if row is None else int(row[0])
        if current > SCHEMA_VERSION:
            raise ValueError(f"metadata store schema version {current} is newer than this coserve's "
                             f"{SCHEMA_VERSION}; upgrade coserve to open it")
        for script in MIGRATIONS[current:]:
            # executescript would COMMIT the open transaction; run statement by statement inside it.
            for statement in script.split(";"):
                if statement.strip():
                    conn.execute(statement)
        if row is None:
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        else:
            conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
