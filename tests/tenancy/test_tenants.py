"""Loading and validating the tenants file; key lookups."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from coserve.tenancy.quotas import DEFAULT_LIMITS, TenantLimits
from coserve.tenancy.tenants import load_tenants

GLOBEX_KEY_SHA = hashlib.sha256(b"sk-globex-secret").hexdigest()

VALID = f"""\
tenants:
  acme:
    api_keys: ["sk-acme-1", "sk-acme-2"]
    weight: 2.5
    limits:
      requests_per_minute: 600
      tokens_per_minute: 200000
      max_concurrent_jobs: 2
      max_training_tokens_per_job: 5000000
  globex:
    api_keys: ["sha256:{GLOBEX_KEY_SHA.upper()}"]
admin_api_keys: ["sk-admin"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_valid_file(tmp_path: Path) -> None:
    config = load_tenants(write(tmp_path, VALID))
    assert set(config.tenants) == {"acme", "globex"}
    acme = config.tenants["acme"]
    assert acme.weight == 2.5
    assert acme.limits == replace(DEFAULT_LIMITS, requests_per_minute=600, tokens_per_minute=200000,
                                  max_concurrent_jobs=2, max_training_tokens_per_job=5000000)
    globex = config.tenants["globex"]
    assert globex.weight == 1.0 and globex.limits == DEFAULT_LIMITS
    assert config.weights() == {"acme": 2.5, "globex": 1.0}


def test_key_lookup_plain_and_hashed(tmp_path: Path) -> None:
    config = load_tenants(write(tmp_path, VALID))
    assert config.tenant_for_key("sk-acme-1") == "acme"
    assert config.tenant_for_key("sk-acme-2") == "acme"
    assert config.tenant_for_key("sk-globex-secret") == "globex"
    assert config.tenant_for_key(f"sha256:{GLOBEX_KEY_SHA}") is None  # the digest is not the key
    assert config.tenant_for_key("sk-acme-") is None
    assert config.tenant_for_key("sk-admin") is None
    assert config.is_admin("sk-admin") and not config.is_admin("sk-acme-1")


def test_plain_keys_are_not_kept(tmp_path: Path) -> None:
    config = load_tenants(write(tmp_path, VALID))
    assert "sk-acme-1" not in repr(config)


@pytest.mark.parametrize(("text", "message"), [
    ("tenants: {}\n", "tenants: must be a mapping with at least one tenant"),
    ("- a\n", "the tenants file must be a mapping"),
    ("tenants:\n  a: {api_keys: [k]}\nextra: 1\n", "unknown field.*extra"),
    ("tenants:\n  a: {api_keys: [k], color: red}\n", "tenant 'a': unknown field.*color"),
    ("tenants:\n  a: {api_keys: [k], limits: {rpm: 3}}\n", "tenant 'a': limits: unknown field.*rpm"),
    ("tenants:\n  a: {api_keys: [k], weight: 0}\n", "tenant 'a': weight must be .* > 0, got 0"),
    ("tenants:\n  a: {api_keys: [k], weight: -1.5}\n", "tenant 'a': weight"),
    ("tenants:\n  a: {api_keys: [k], weight: .nan}\n", "tenant 'a': weight"),
    ("tenants:\n  a: {weight: 1}\n", "tenant 'a': api_keys is required"),
    ("tenants:\n  a: {api_keys: []}\n", "tenant 'a': api_keys must be a list of keys, not empty"),
    ("tenants:\n  a: {api_keys: ['']}\n", r"tenant 'a': api_keys\[0\] must be a non-empty string"),
    ("tenants:\n  a: {api_keys: ['sha256:abc']}\n", "64 hex digits"),
    ("tenants:\n  a: {api_keys: [k], limits: {tokens_per_minute: 0}}\n",
     "tenant 'a': limits: tokens_per_minute must be an integer >= 1"),
    ("tenants:\n  'a:b': {api_keys: [k]}\n", "tenant name 'a:b' must match"),
    ("tenants:\n  a: {api_keys: [k1]}\n  b: {api_keys: [k2, k1]}\n",
     r"tenant 'b': api_keys\[1\]: the same key is also used by tenant 'a'"),
    ("tenants:\n  a: {api_keys: [k1]}\nadmin_api_keys: [k1]\n",
     r"admin_api_keys\[0\]: the same key is also used by tenant 'a'"),
    ("tenants:\n  a: {api_keys: [k1]}\n  a: {api_keys: [k2]}\n", "duplicate key 'a' at line 3"),
    ("tenants: [\n", "not valid YAML"),
])
def test_invalid_files_name_tenant_and_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_tenants(write(tmp_path, text))


def test_plain_key_and_its_hash_count_as_the_same_key(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"k1").hexdigest()
    text = f"tenants:\n  a: {{api_keys: [k1]}}\n  b: {{api_keys: ['sha256:{digest}']}}\n"
    with pytest.raises(ValueError, match="also used by tenant 'a'"):
        load_tenants(write(tmp_path, text))


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tenants(tmp_path / "absent.yaml")


def test_limits_left_out_are_finite_defaults_and_null_is_unlimited(tmp_path: Path) -> None:
    """A tenant with no limits gets DEFAULT_LIMITS, every one finite; `default_limits:` replaces them for
    every tenant; `null` is unlimited, said explicitly."""
    assert all(getattr(DEFAULT_LIMITS, name) is not None for name in TenantLimits.__dataclass_fields__)
    config = load_tenants(write(tmp_path, """\
default_limits: {max_concurrent_jobs: 3, tinker_requests_per_minute: 100}
tenants:
  a: {api_keys: [k1]}
  b: {api_keys: [k2], limits: {max_concurrent_jobs: null, max_stored_bytes: 10}}
"""))
    a, b = config.tenants["a"].limits, config.tenants["b"].limits
    assert a == replace(DEFAULT_LIMITS, max_concurrent_jobs=3, tinker_requests_per_minute=100)
    assert b.max_concurrent_jobs is None and b.max_stored_bytes == 10 and b.tinker_requests_per_minute == 100
    with pytest.raises(ValueError, match="default_limits: unknown field"):
        load_tenants(write(tmp_path, "default_limits: {rpm: 1}\ntenants:\n  a: {api_keys: [k]}\n"))
    with pytest.raises(ValueError, match="default_limits: max_concurrent_jobs must be"):
        load_tenants(write(tmp_path, "default_limits: {max_concurrent_jobs: -1}\ntenants:\n  a: {api_keys: [k]}\n"))
