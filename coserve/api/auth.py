"""Authentication: `Authorization: Bearer <key>` -> the tenant that owns the key.

Failures are 401 `invalid_api_key` in OpenAI's error body (the official client raises
`openai.AuthenticationError`, which it does not retry). The lookup itself is constant-time per stored
key (`TenantsConfig.tenant_for_key`).

Admin keys (`admin_api_keys` in the tenants file) run the server, not a tenant's work: they read
`/metrics` with tenant labels and list, read and cancel every tenant's fine-tuning jobs (`Caller`).
On a tenant's endpoints (chat, files, creating jobs) an admin key is a 403 that says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from coserve.api.protocol.base import ProtocolError
from coserve.api.state import GatewayState, get_state

_MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")


def mask_key(key: str) -> str:
    """Enough of `key` for its owner to recognise it, too little to use it (error bodies end up in logs)."""
    if len(key) < 12:
        return "*" * len(key)
    return f"{key[:3]}{'*' * (len(key) - 7)}{key[-4:]}"


def _unauthorized(message: str) -> ProtocolError:
    return ProtocolError(message, status=401, type="invalid_request_error", code="invalid_api_key")


def bearer_key(request: Request) -> str:
    """The API key of `request`'s `Authorization: Bearer` header.

    Raises:
        ProtocolError: 401 when the header is missing, is not Bearer auth, or carries an empty key.
    """
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    # The scheme is case-insensitive (RFC 7235); anything else is as good as no key.
    if scheme.lower() != "bearer" or not key:
        raise _unauthorized(_MISSING_KEY)
    return key


def _forbidden(message: str, code: str) -> ProtocolError:
    return ProtocolError(message, status=403, type="permission_error", code=code)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: a tenant, or an admin (`tenant` None)."""

    tenant: str | None

    @property
    def is_admin(self) -> bool:
        return self.tenant is None


def identify(key: str, state: GatewayState) -> Caller:
    """The caller holding `key`.

    Raises:
        ProtocolError: 401 `invalid_api_key` for a key that is neither a tenant's nor an admin's.
    """
    tenant = state.tenants.tenant_for_key(key)
    if tenant is not None:
        return Caller(tenant)
    if state.tenants.is_admin(key):
        return Caller(None)
    raise _unauthorized(f"Incorrect API key provided: {mask_key(key)}.")


def require_caller(request: Request, state: Annotated[GatewayState, Depends(get_state)]) -> Caller:
    """FastAPI dependency: the tenant or admin behind the request's API key (401 otherwise)."""
    return identify(bearer_key(request), state)


def require_tenant(caller: Annotated[Caller, Depends(require_caller)]) -> str:
    """FastAPI dependency: the tenant owning the request's API key.

    Raises:
        ProtocolError: 401 `invalid_api_key` for a missing or unknown key; 403 `admin_key_not_allowed`
            for an admin key (its work is the server's, not a tenant's).
    """
    if caller.tenant is None:
        raise _forbidden("This is an admin key: it reads /metrics and manages every tenant's fine-tuning "
                         "jobs, but it is not a tenant. Use a tenant's API key here.", "admin_key_not_allowed")
    return caller.tenant


def require_admin(caller: Annotated[Caller, Depends(require_caller)]) -> Caller:
    """FastAPI dependency for operator routes.

    Raises:
        ProtocolError: 401 for a missing or unknown key, 403 `admin_key_required` for a tenant's key.
    """
    if not caller.is_admin:
        raise _forbidden("This endpoint needs an admin key (admin_api_keys in the tenants file).",
                         "admin_key_required")
    return caller


Tenant = Annotated[str, Depends(require_tenant)]
"""A route parameter typed `Tenant` receives the authenticated tenant's name (401/403 otherwise)."""

AnyCaller = Annotated[Caller, Depends(require_caller)]
"""A route parameter typed `AnyCaller` receives a tenant or an admin (401 otherwise)."""
