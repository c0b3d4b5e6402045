"""HTTP routes of `/v1/files` (https://platform.openai.com/docs/api-reference/files)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import Response
from pydantic import WithJsonSchema

from coserve.api.auth import Tenant
from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.files import FileDeleted, FileList, FileObject, FilePurpose, UploadPurpose
from coserve.api.protocol.param_support import FILES
from coserve.api.serving.files import FilesService
from coserve.api.serving.storage_errors import tenant_limits
from coserve.api.state import GatewayState, get_state

router = APIRouter(prefix="/v1/files", tags=["files"])

# OpenAI's bounds and default for `limit` on this endpoint.
MAX_LIST_LIMIT = 10_000


def get_files_service(state: Annotated[GatewayState, Depends(get_state)], tenant: Tenant) -> FilesService:
    """FastAPI dependency: the files service over the app's store, with the caller's limits."""
    return FilesService(state.store, state.max_upload_bytes, tenant_limits(state.tenants, tenant))


Service = Annotated[FilesService, Depends(get_files_service)]

# A `file` part sent as a plain form field arrives as a string: taken here, so that it is refused in the
# client's terms (FastAPI's own refusal names Python classes); the published schema still says binary.
FilePart = Annotated[UploadFile | str, File(),
                     WithJsonSchema({"type": "string", "contentMediaType": "application/octet-stream"})]

# Handlers are plain `def`: the store blocks (SQLite, fsync), so FastAPI runs them in its thread pool.


# The official client sends `expires_after={"anchor": ..., "seconds": ...}` as these two form fields.
ExpiresAfterPart = Annotated[str | None, Form(alias="expires_after[anchor]")]
ExpiresAfterSeconds = Annotated[str | None, Form(alias="expires_after[seconds]")]


@router.post("", response_model=FileObject)
def create_file(tenant: Tenant, service: Service, file: FilePart, purpose: Annotated[str, Form()],
                expires_anchor: ExpiresAfterPart = None, expires_seconds: ExpiresAfterSeconds = None) -> FileObject:
    """Upload a file (multipart `file` + `purpose`); fine-tuning JSONL is validated before it is stored.
    What coserve refuses (`expires_after`) is a 400 naming it (`param_support.FILES`)."""
    if expires_anchor is not None or expires_seconds is not None:
        FILES.check({"expires_after": {"anchor": expires_anchor, "seconds": expires_seconds}})
    if isinstance(file, str):
        raise ProtocolError("Invalid type for 'file': expected a file (a multipart part with a filename), "
                            "but got a plain form field instead.", param="file", code="invalid_type")
    return service.create(tenant, file.filename or "", purpose, file.file)


@router.get("", response_model=FileList)
def list_files(tenant: Tenant, service: Service,
               after: Annotated[str | None, Query()] = None,
               limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = MAX_LIST_LIMIT,
               order: Annotated[Literal["asc", "desc"], Query()] = "desc",
               purpose: Annotated[FilePurpose | UploadPurpose | None, Query()] = None) -> FileList:
    """A page of the tenant's files, newest first by default; page on with `after=<last_id>`."""
    return service.list_page(tenant, after=after, limit=limit, order=order, purpose=purpose)


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(tenant: Tenant, service: Service, file_id: str) -> FileObject:
    """One of the tenant's files."""
    return service.retrieve(tenant, file_id)


@router.get("/{file_id}/content", response_class=Response)
def file_content(tenant: Tenant, service: Service, file_id: str) -> Response:
    """The raw bytes of one of the tenant's files."""
    return Response(content=service.content(tenant, file_id), media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(tenant: Tenant, service: Service, file_id: str) -> FileDeleted:
    """Delete one of the tenant's files."""
    return service.delete(tenant, file_id)
