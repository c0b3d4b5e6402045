"""The tenants file (YAML, format in docs/tenants.md): API keys, weights and limits per tenant, admin keys.

Only SHA-256 digests of keys are kept in memory, whether the file holds a key or its
`sha256:<hex>` form, and a key is looked up by comparing its digest to every stored digest with
`hmac.compare_digest`: the time taken does not depend on how much of a key matches, nor on which
tenant holds it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from coserve.tenancy.quotas import DEFAULT_LIMITS, TenantLimits

SHA256_PREFIX = "sha256:"
# Tenant names appear in model ids (`ft:{base}:{tenant}:...`), so no ':' and nothing exotic.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_TOP_FIELDS = {"tenants", "admin_api_keys", "default_limits"}
_TENANT_FIELDS = {"api_keys", "weight", "limits"}
_LIMIT_FIELDS = {f.name for f in fields(TenantLimits)}


def key_digest(key: str) -> bytes:
    """SHA-256 digest of an API key as sent by a client."""
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant: its name, the digests of its API keys, its share under contention, its limits."""

    name: str
    key_digests: tuple[bytes, ...]
    weight: float = 1.0
    limits: TenantLimits = DEFAULT_LIMITS


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    """Every tenant and the admin keys, with key lookups."""

    tenants: Mapping[str, TenantConfig]
    admin_key_digests: tuple[bytes, ...] = ()

    def tenant_for_key(self, key: str) -> str | None:
        """The tenant owning `key`, or None. Compares against every key, in constant time each."""
        digest = key_digest(key)
        found: str | None = None
        for tenant in self.tenants.values():
            for stored in tenant.key_digests:
                # No early exit: the time does not reveal which tenant (or how many) were checked.
                if hmac.compare_digest(digest, stored):
                    found = tenant.name
        return found

    def is_admin(self, key: str) -> bool:
        """Whether `key` is an admin key."""
        digest = key_digest(key)
        matches = [hmac.compare_digest(digest, stored) for stored in self.admin_key_digests]
        return any(matches)

    def weights(self) -> dict[str, float]:
        """Tenant name -> weight, for the virtual token counter."""
        return {name: tenant.weight for name, tenant in self.tenants.items()}


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate mapping keys (PyYAML silently keeps the last one)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise ValueError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique_mapping)


def load_tenants(path: str | Path) -> TenantsConfig:
    """Read and validate a tenants file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: invalid YAML or content; the message names the file, the tenant and the field.
    """
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from error
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    try:
        return parse_tenants(data)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error


def parse_tenants(data: Any) -> TenantsConfig:
    """Validate the tenants file's parsed content.

    Raises:
        ValueError: unknown fields, missing or empty `tenants`, a bad tenant name, weight or limit,
            a malformed key, or a key used twice (across tenants, or by a tenant and the admins).
    """
    _check_mapping("the tenants file", data, _TOP_FIELDS)
    raw_tenants = data.get("tenants")
    if not isinstance(raw_tenants, dict) or not raw_tenants:
        raise ValueError("tenants: must be a mapping with at least one tenant")
    owners: dict[bytes, str] = {}  # key digest -> who holds it, to reject reuse
    defaults = _parse_limits("default_limits", data.get("default_limits") or {}, DEFAULT_LIMITS)
    tenants = {}
    for name, raw in raw_tenants.items():
        tenants[name] = _parse_tenant(name, raw, owners, defaults)
    admin = _parse_keys("admin_api_keys", data.get("admin_api_keys", []), "the admins", owners,
                        allow_empty=True)
    return TenantsConfig(tenants=tenants, admin_key_digests=admin)


def _parse_limits(where: str, raw: Any, defaults: TenantLimits) -> TenantLimits:
    """A `limits` mapping over `defaults`: a limit left out is the default's, `null` is unlimited."""
    _check_mapping(where, raw, _LIMIT_FIELDS)
    try:
        return replace(defaults, **raw)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error


def _parse_tenant(name: Any, raw: Any, owners: dict[bytes, str], defaults: TenantLimits) -> TenantConfig:
    if not isinstance(name, str) or TENANT_NAME.fullmatch(name) is None:
        raise ValueError(f"tenant name {name!r} must match {TENANT_NAME.pattern}")
    where = f"tenant {name!r}"
    _check_mapping(where, raw, _TENANT_FIELDS)
    if "api_keys" not in raw:
        raise ValueError(f"{where}: api_keys is required")
    digests = _parse_keys(f"{where}: api_keys", raw["api_keys"], where, owners, allow_empty=False)
    weight = raw.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 \
            or math.isinf(weight):
        raise ValueError(f"{where}: weight must be a finite number > 0, got {weight!r}")
    parsed_limits = _parse_limits(f"{where}: limits", raw.get("limits") or {}, defaults)
    return TenantConfig(name=name, key_digests=digests, weight=float(weight), limits=parsed_limits)


def _parse_keys(where: str, raw: Any, owner: str, owners: dict[bytes, str],
                allow_empty: bool) -> tuple[bytes, ...]:
    if not isinstance(raw, list) or (not raw and not allow_empty):
        raise ValueError(f"{where} must be a list of keys" + ("" if allow_empty else ", not empty"))
    digests = []
    for index, key in enumerate(raw):
        digest = _parse_key(f"{where}[{index}]", key)
        if digest in owners:
            # Say who else has it, never the key itself: error messages end up in logs.
            raise ValueError(f"{where}[{index}]: the same key is also used by {owners[digest]}")
        owners[digest] = owner
        digests.append(digest)
    return tuple(digests)


def _parse_key(where: str, key: Any) -> bytes:
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where} must be a non-empty string")
    if not key.startswith(SHA256_PREFIX):
        return key_digest(key)
    hex_digest = key[len(SHA256_PREFIX):]
    if re.fullmatch(r"[0-9a-fA-F]{64}", hex_digest) is None:
        raise ValueError(f"{where}: a sha256: key must be followed by 64 hex digits")
    return bytes.fromhex(hex_digest)


def _check_mapping(where: str, raw: Any, allowed: set[str]) -> None:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in allowed)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                         f"expected {', '.join(sorted(allowed))}")
