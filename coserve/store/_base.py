"""What every table of the metadata store shares (`Database`: the connection, its lock, the clock, the
blob folder) and the helpers.

SQL in this package is built from table and column names that are constants of this package (never from
caller input); every value goes through a `?` parameter.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from coserve.store.blobs import BlobDir
from coserve.store.schema import open_database

R = TypeVar("R")

MAX_PAGE = 10_000
"""The largest `limit` a list call accepts (OpenAI's bound for files)."""


def check_tenant(tenant: str) -> None:
    """Raise ValueError unless `tenant` is a non-empty string."""
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")


def check_limit(limit: int) -> None:
    """Raise ValueError unless 1 <= limit <= MAX_PAGE."""
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be an integer in [1, {MAX_PAGE}], got {limit!r}")


def to_json(name: str, value: Any) -> str | None:
    """`value` as JSON text (None stays NULL); ValueError naming `name` if it is not JSON-able."""
    if value is None:
        return None
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be JSON-serialisable: {exc}") from None


def from_row(cls: type[R], row: sqlite3.Row, json_columns: frozenset[str],
             convert: Mapping[str, Callable[[Any], Any]] | None = None) -> R:
    """Build the dataclass `cls` from the row's columns of the same names, decoding JSON columns."""
    convert = convert or {}
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = row[f.name]
        if f.name in json_columns and value is not None:
            value = json.loads(value)
        if f.name in convert:
            value = convert[f.name](value)
        values[f.name] = value
    return cls(**values)


class Database:
    """The connection and its lock, the clock and the blob folder: what every table of the store uses.

    Args:
        data_dir: folder of the store: `metadata.sqlite3` and `files/` live in it (created if missing).
        clock: seconds since the epoch; injectable so tests get deterministic timestamps.
    """

    DB_NAME = "metadata.sqlite3"

    def __init__(self, data_dir: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        # One lock around every statement: a sqlite3 connection is not safe for concurrent use by threads.
        # Other processes with the store open are serialised by SQLite's file lock; a check and the write
        # that depends on it share one `write()` transaction, so nothing interleaves between them.
        self._lock = threading.RLock()
        self._conn = open_database(self.data_dir / self.DB_NAME)
        self.blobs = BlobDir(self.data_dir / "files")

    def close(self) -> None:
        """Close the database; the store must not be used afterwards."""
        with self._lock:
            self._conn.close()

    def now(self) -> int:
        """The clock, in whole seconds (what `created_at` and friends hold)."""
        return int(self._clock())

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction under the lock: committed on success, rolled back on any exception."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """The connection under the lock, for reads (autocommit: each statement sees committed data)."""
        with self._lock:
            yield self._conn

    def page(self, table: str, scope: str, params: tuple[Any, ...], *, visible: str = "1",
              visible_params: tuple[Any, ...] = (), after: str | None, limit: int, order: str = "seq",
              newest_first: bool = True) -> tuple[list[sqlite3.Row], bool]:
        """One page of `table`'s rows matching `scope AND visible`, ordered by `order`.

        `after` names a row in `scope` (visible or not: a file deleted between two pages is still a valid
        cursor); the page starts just past it. Returns the rows and whether more follow.

        Raises:
            ValueError: bad `limit`, or `after` is no row in `scope` (another tenant's id included).
        """
        check_limit(limit)
        op, direction = ("<", "DESC") if newest_first else (">", "ASC")
        where, values = f"({scope}) AND ({visible})", (*params, *visible_params)
        with self.read() as conn:
            if after is not None:
                cursor = conn.execute(f"SELECT {order} FROM {table} WHERE ({scope}) AND id = ?",
                                      (*params, after)).fetchone()
                if cursor is None:
                    raise ValueError(f"after: no such id {after!r}")
                where, values = f"{where} AND {order} {op} ?", (*values, cursor[0])
            rows = conn.execute(f"SELECT * FROM {table} WHERE {where} ORDER BY {order} {direction} LIMIT ?",
                                (*values, limit + 1)).fetchall()
        return rows[:limit], len(rows) > limit
