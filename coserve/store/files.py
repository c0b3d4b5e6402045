"""Uploaded files: the row in SQLite, the bytes in `<data_dir>/files/<file_id>`, and a file's parsed form
(what the gateway read of a training file at upload, so that no later step reads it again) beside them in
`<file_id>.parsed.json`.

Order of writes, so that a crash never serves half a file: bytes first (atomically, fsynced), then the
row. A crash in between leaves bytes without a row, which nothing can reach and the next open removes.
Deleting marks the row deleted first, then removes the bytes: again the only possible leftover is
unreachable bytes. Deleted rows are kept so that a deleted id still works as an `after` cursor.
"""

from __future__ import annotations

from coserve.store._base import Database, check_tenant, from_row
from coserve.store.records import FILE_PURPOSES, FileRecord, StorageLimitError, check_choice, new_id

_NO_JSON: frozenset[str] = frozenset()
MAX_FILENAME = 512


class FileTable:
    """Create, read, list and delete a tenant's files."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create(self, tenant: str, filename: str, purpose: str, content: bytes,
                    *, status: str = "processed", byte_budget: int | None = None,
                    parsed: bytes | None = None) -> FileRecord:
        """Store `content` durably and record it as a file of `tenant`.

        Args:
            tenant: owner; only this tenant will ever see the file.
            filename: the client's name for it (metadata only, never used as a path).
            purpose: one of OpenAI's file purposes (e.g. "fine-tune", "fine-tune-results").
            content: the bytes.
            status: OpenAI's (deprecated) file status; "processed" makes `wait_for_processing` return.
            byte_budget: the most the tenant's live files may hold together, this one included; checked
                in the transaction that records it, so concurrent uploads cannot both take the last room
                (None: no limit).
            parsed: the content's parsed form, kept beside it (`parsed`); written before the row, as the bytes.

        Raises:
            ValueError: empty tenant or filename, filename longer than 512 characters, unknown purpose,
                content not bytes.
            StorageLimitError: the file does not fit in `byte_budget`; nothing is stored.
        """
        check_tenant(tenant)
        if not isinstance(filename, str) or not filename or len(filename) > MAX_FILENAME:
            raise ValueError(f"filename must be 1-{MAX_FILENAME} characters, got {filename!r:.80}")
        check_choice("purpose", purpose, FILE_PURPOSES)
        check_choice("status", status, frozenset({"uploaded", "processed", "error"}))
        if not isinstance(content, (bytes, bytearray, memoryview)):
            raise ValueError(f"content must be bytes, got {type(content).__name__}")
        content = bytes(content)
        record = FileRecord(id=new_id("file"), tenant=tenant, bytes=len(content), created_at=self._db.now(),
                            filename=filename, purpose=purpose, status=status)
        # Outside the lock: a large upload must not stall every other call; the id is fresh, so no race.
        self._db.blobs.write(record.id, content)
        if parsed is not None:
            self._db.blobs.write(record.id, parsed, parsed=True)
        try:
            self._insert_file_row(record, byte_budget)
        except BaseException:
            self._db.blobs.remove(record.id)
            raise
        return record

    def _insert_file_row(self, record: FileRecord, byte_budget: int | None) -> None:
        with self._db.write() as conn:
            if byte_budget is not None:
                held = conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ? AND deleted = 0",
                                    (record.tenant,)).fetchone()[0]
                if held + record.bytes > byte_budget:
                    raise StorageLimitError(f"{held} bytes of files held, {record.bytes} more exceed the "
                                            f"budget of {byte_budget}")
            conn.execute("INSERT INTO files (id, tenant, bytes, created_at, filename, purpose, status) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (record.id, record.tenant, record.bytes, record.created_at, record.filename,
                          record.purpose, record.status))

    def get(self, tenant: str, file_id: str) -> FileRecord | None:
        """The file `file_id` of `tenant`; None when it does not exist, is deleted or is another tenant's."""
        with self._db.read() as conn:
            row = conn.execute("SELECT * FROM files WHERE id = ? AND tenant = ? AND deleted = 0",
                               (file_id, tenant)).fetchone()
        return None if row is None else from_row(FileRecord, row, _NO_JSON)

    def content(self, tenant: str, file_id: str) -> bytes | None:
        """The bytes of `tenant`'s file `file_id`; None when `get` would return None."""
        record = self.get(tenant, file_id)
        if record is None:
            return None
        try:
            return self._db.blobs.read(record.id)
        except FileNotFoundError:
            # Deleted by a concurrent `delete` after the row was read: it is gone for the caller too.
            return None

    def parsed(self, tenant: str, file_id: str) -> bytes | None:
        """The parsed form kept beside `tenant`'s file `file_id`; None when it has none (a file stored
        before the server kept one) or `get` would return None."""
        if self.get(tenant, file_id) is None:
            return None
        try:
            return self._db.blobs.read(file_id, parsed=True)
        except FileNotFoundError:
            return None

    def keep_parsed(self, tenant: str, file_id: str, parsed: bytes) -> bool:
        """Keep the parsed form of a file stored without one; False when `get` would return None."""
        if self.get(tenant, file_id) is None:
            return False
        self._db.blobs.write(file_id, parsed, parsed=True)
        return True

    def page(self, tenant: str, *, after: str | None = None, limit: int = 10_000,
                   newest_first: bool = True, purpose: str | None = None) -> tuple[list[FileRecord], bool]:
        """A page of `tenant`'s files in upload order (newest first by default) and whether more follow.

        Args:
            after: id of the last file of the previous page.
            limit: files per page, 1..10000 (OpenAI's default is 10000).
            newest_first: OpenAI's `order=desc` (True) or `order=asc` (False).
            purpose: only files with this purpose.

        Raises:
            ValueError: bad limit or purpose, or `after` is not one of the tenant's file ids.
        """
        visible: str = "deleted = 0"
        visible_params: tuple[str, ...] = ()
        if purpose is not None:
            check_choice("purpose", purpose, FILE_PURPOSES)
            visible, visible_params = "deleted = 0 AND purpose = ?", (purpose,)
        rows, has_more = self._db.page("files", "tenant = ?", (tenant,), visible=visible,
                                    visible_params=visible_params, after=after, limit=limit,
                                    newest_first=newest_first)
        return [from_row(FileRecord, row, _NO_JSON) for row in rows], has_more

    def delete(self, tenant: str, file_id: str) -> bool:
        """Delete `tenant`'s file; False when there is no such file of this tenant (already deleted too)."""
        with self._db.write() as conn:
            changed = conn.execute("UPDATE files SET deleted = 1 WHERE id = ? AND tenant = ? AND deleted = 0",
                                   (file_id, tenant)).rowcount
        if changed:
            self._db.blobs.remove(file_id)
        return bool(changed)

    def live_ids(self) -> list[str]:
        with self._db.read() as conn:
            return [row[0] for row in conn.execute("SELECT id FROM files WHERE deleted = 0")]
