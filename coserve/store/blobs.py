"""File contents on disk, one file per upload, written atomically (temp file, fsync, rename, fsync dir).

Names are store-generated ids only (checked here again), so no caller-supplied string ever becomes a path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from coserve.store.records import is_generated_id

_TMP_SUFFIX = ".tmp"
ORPHAN_GRACE_S = 600.0
"""Bytes without a row are swept only once this old: far longer than an upload takes from its bytes to its
row (a write waits at most `schema.BUSY_TIMEOUT_S` for the database)."""


PARSED_SUFFIX = ".parsed.json"
"""The parsed form of a file (a training file's rows, `contract.training_rows`) lies beside its bytes."""


class BlobDir:
    """A folder of immutable blobs named by file id.

    Args:
        root: the folder (created if missing).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str, parsed: bool = False) -> Path:
        """Where the bytes of `file_id` live (`parsed`: the parsed form kept beside them).

        Raises:
            ValueError: `file_id` is not a store-generated file id.
        """
        if not (is_generated_id(file_id) and file_id.startswith("file-")):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / (file_id + PARSED_SUFFIX if parsed else file_id)

    def write(self, file_id: str, content: bytes, parsed: bool = False) -> None:
        """Write `content` durably: after this returns, a crash leaves either all of it or nothing."""
        final = self.path(file_id, parsed)
        tmp = final.with_name(final.name + _TMP_SUFFIX)
        with open(tmp, "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        self._sync_dir()

    def read(self, file_id: str, parsed: bool = False) -> bytes:
        """The bytes of `file_id`, or its parsed form (FileNotFoundError if they are gone)."""
        return self.path(file_id, parsed).read_bytes()

    def remove(self, file_id: str) -> None:
        """Delete the bytes of `file_id` and its parsed form; missing ones are not an error."""
        self.path(file_id, parsed=True).unlink(missing_ok=True)
        self.path(file_id).unlink(missing_ok=True)

    def sweep(self, live_ids: Iterable[str], grace_s: float = ORPHAN_GRACE_S) -> list[str]:
        """Remove temp files and blobs without a live row (left by a crash); return the names removed.

        Only entries last written more than `grace_s` ago: another process with the store open may be
        between writing an upload's bytes and committing its row (`live_ids` was read before that commit).
        """
        keep = {name for file_id in live_ids for name in (file_id, file_id + PARSED_SUFFIX)}
        cutoff = time.time() - grace_s
        removed = []
        for entry in self.root.iterdir():
            try:
                stale = entry.is_file() and entry.name not in keep and entry.stat().st_mtime < cutoff
            except FileNotFoundError:  # renamed or removed meanwhile by the process writing it
                continue
            if stale:
                entry.unlink(missing_ok=True)
                removed.append(entry.name)
        return sorted(removed)

    def _sync_dir(self) -> None:
        # The rename is only durable once the directory entry is; not every platform can open a directory.
        try:
            fd = os.open(self.root, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
