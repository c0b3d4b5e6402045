"""`/v1/files`: upload with validation, list with cursor pagination, retrieve, content, delete.

Reference: https://platform.openai.com/docs/api-reference/files. Another tenant's file is 404 like a
file that never existed (the store's reads are tenant-scoped, so there is no separate ownership check).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import BinaryIO, Literal

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.files import (
    SUPPORTED_UPLOAD_PURPOSES,
    FileDeleted,
    FileList,
    FileObject,
    validate_finetune_jsonl,
)
from coserve.api.serving.storage_errors import storage_quota_error
from coserve.store import FileRecord, MetadataStore, StorageLimitError
from coserve.tenancy.quotas import Refusal, TenantLimits
from coserve.tenancy.storage_quota import admit_upload

# What each purpose's content must satisfy, checked before anything is stored (raises ProtocolError), and
# the parsed form kept beside it: a training file is parsed here, once (`contract.training_rows`).
_PARSERS: dict[str, Callable[[bytes], bytes]] = {"fine-tune": lambda data: validate_finetune_jsonl(data).to_bytes()}

# Read uploads in pieces, so a body over the limit is refused after reading at most limit + 1 MiB.
_CHUNK = 1024 * 1024


def to_file_object(record: FileRecord) -> FileObject:
    """The OpenAI `FileObject` of a stored file."""
    return FileObject(id=record.id, bytes=record.bytes, created_at=record.created_at, filename=record.filename,
                      purpose=record.purpose, status=record.status)  # type: ignore[arg-type]


def read_limited(stream: BinaryIO, max_bytes: int) -> bytes:
    """All of `stream`, or a 413 `ProtocolError` (param `file`) once it exceeds `max_bytes`."""
    parts: list[bytes] = []
    size = 0
    while chunk := stream.read(_CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise ProtocolError(f"File too large: the limit is {max_bytes} bytes.", status=413, param="file",
                                code="file_too_large")
        parts.append(chunk)
    return b"".join(parts)


def _not_found(file_id: str) -> ProtocolError:
    return ProtocolError.not_found(f"No such File object: {file_id}", param="id")


class FilesService:
    """The files endpoints of one tenant-aware gateway.

    Args:
        store: where files live.
        max_upload_bytes: the largest upload accepted (413 beyond).
        limits: the tenant's limits (`max_stored_bytes` is checked here); default: none.
    """

    def __init__(self, store: MetadataStore, max_upload_bytes: int,
                 limits: TenantLimits | None = None) -> None:
        self.store = store
        self.max_upload_bytes = max_upload_bytes
        self.limits = limits or TenantLimits()

    def create(self, tenant: str, filename: str, purpose: str, stream: BinaryIO) -> FileObject:
        """Validate and store an upload.

        Raises:
            ProtocolError: 400 for an unsupported purpose (param `purpose`), a bad fine-tuning JSONL (param
                `file`, naming the first bad line) or an unusable filename; 413 over the size limit; 403
                `storage_quota_exceeded` (param `file`) when it would take the tenant over `max_stored_bytes`.
        """
        if purpose not in SUPPORTED_UPLOAD_PURPOSES:
            supported = ", ".join(sorted(SUPPORTED_UPLOAD_PURPOSES))
            raise ProtocolError(f"Invalid 'purpose': {purpose!r} is not supported by this server "
                                f"(supported: {supported}).", param="purpose", code="invalid_value")
        content = read_limited(stream, self.max_upload_bytes)
        parse = _PARSERS.get(purpose)
        parsed = None if parse is None else parse(content)
        budget = self._byte_budget(tenant, len(content))
        try:
            record = self.store.files.create(tenant, filename, purpose, content, byte_budget=budget, parsed=parsed)
        except StorageLimitError:
            # Another upload of the tenant took the room since `_byte_budget` measured it.
            raise storage_quota_error(self._refusal_now(tenant, len(content)), "file") from None
        except ValueError as exc:
            # Purpose and content are checked above, so what the store can still refuse is the filename.
            raise ProtocolError(f"Invalid file name: {exc}", param="file", code="invalid_value") from None
        return to_file_object(record)

    def _refusal_now(self, tenant: str, new_bytes: int) -> Refusal:
        refusal = admit_upload(self.limits, self.store.usage.of(tenant), new_bytes)
        # The transaction refused, so the files alone no longer fit; adapters only add to that.
        return refusal or Refusal("max_stored_bytes", f"storing this file ({new_bytes} bytes) would take "
                                  f"you over max_stored_bytes={self.limits.max_stored_bytes}", None)

    def _byte_budget(self, tenant: str, new_bytes: int) -> int | None:
        """What the tenant's files may hold together once this upload is in (None: no limit), or the 403
        when it does not fit now."""
        cap = self.limits.max_stored_bytes
        if cap is None:
            return None
        usage = self.store.usage.of(tenant)
        refusal = admit_upload(self.limits, usage, new_bytes)
        if refusal is not None:
            raise storage_quota_error(refusal, "file")
        return cap - usage.adapter_bytes

    def list_page(self, tenant: str, *, after: str | None, limit: int, order: Literal["asc", "desc"],
             purpose: str | None) -> FileList:
        """One page of the tenant's files (`order` by creation time; `after` is the previous page's last id).

        Raises:
            ProtocolError: 400 (param `after`) when `after` is none of the tenant's file ids.
        """
        try:
            records, has_more = self.store.files.page(tenant, after=after, limit=limit,
                                                      newest_first=order == "desc", purpose=purpose)
        except ValueError:
            # limit and purpose were validated by the router, so the cursor is what the store refused.
            raise ProtocolError(f"Invalid 'after': no file with id {after!r}.", param="after",
                                code="invalid_value") from None
        data = [to_file_object(r) for r in records]
        return FileList(data=data, first_id=data[0].id if data else None,
                        last_id=data[-1].id if data else None, has_more=has_more)

    def retrieve(self, tenant: str, file_id: str) -> FileObject:
        """The tenant's file `file_id`. Raises ProtocolError 404 if it has none by that id."""
        record = self.store.files.get(tenant, file_id)
        if record is None:
            raise _not_found(file_id)
        return to_file_object(record)

    def content(self, tenant: str, file_id: str) -> bytes:
        """The bytes of the tenant's file `file_id`. Raises ProtocolError 404 if it has none by that id."""
        data = self.store.files.content(tenant, file_id)
        if data is None:
            raise _not_found(file_id)
        return data

    def delete(self, tenant: str, file_id: str) -> FileDeleted:
        """Delete the tenant's file `file_id`. Raises ProtocolError 404 if it has none by that id."""
        if not self.store.files.delete(tenant, file_id):
            raise _not_found(file_id)
        return FileDeleted(id=file_id, deleted=True)
