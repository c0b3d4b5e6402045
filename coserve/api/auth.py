"""Authentication: `Authorization: Bearer <key>` -> the tenant that owns the key.

Failures are 401 `invalid_api_key` in OpenAI's error body (the official client raises
`openai.AuthenticationError`, which it does not retry). The lookup itself is constant-time per stored
key (`TenantsConfig.tenant_for_key`).
"""

from __future__ import annotations

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


def require_tenant(request: Request, state: Annotated[GatewayState, Depends(get_state)]) -> str:
    """FastAPI dependency: the tenant owning the request's API key.

    Admin keys are not tenants: they are refused here like unknown keys (admin routes come later).

    Raises:
        ProtocolError: 401 `invalid_api_key` for a missing or unknown key.
    """
    key = bearer_key(request)
    tenant = state.tenants.tenant_for_key(key)
    if tenant is None:
        raise _unauthorized(f"Incorrect API key provided: {mask_key(key)}.")
    return tenant


Tenant = Annotated[str, Depends(require_tenant)]
"""A route parameter typed `Tenant` receives the authenticated tenant's name (401 otherwise)."""
