"""The OpenAI-style error of a refused storage quota (`coserve.tenancy.storage_quota`).

A storage limit only clears when the tenant deletes something, so the refusal is a 403
`insufficient_quota` (the official client does not retry it), with the limit's own code:
`storage_quota_exceeded` (`max_stored_bytes`) or `model_quota_exceeded` (`max_fine_tuned_models`).
"""

from __future__ import annotations

from coserve.api.protocol.base import ProtocolError
from coserve.tenancy.quotas import Refusal, TenantLimits
from coserve.tenancy.storage_quota import QUOTA_CODES
from coserve.tenancy.tenants import TenantsConfig


def tenant_limits(tenants: TenantsConfig, tenant: str) -> TenantLimits:
    """The limits of `tenant` (none for a tenant the file does not name)."""
    config = tenants.tenants.get(tenant)
    return TenantLimits() if config is None else config.limits


def storage_quota_error(refusal: Refusal, param: str | None) -> ProtocolError:
    """The 403 for a storage refusal, naming the request's `param` (None: the request as a whole)."""
    reason = refusal.reason[:1].upper() + refusal.reason[1:]
    return ProtocolError(f"{reason}.", status=403, type="insufficient_quota", param=param,
                         code=QUOTA_CODES[refusal.limit])
