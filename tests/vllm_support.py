"""Test helpers for the vLLM engine: skip without vLLM, except where vLLM is required (`make test`)."""

from __future__ import annotations

import importlib.util
import os

import pytest

# `make test` sets it: there (CI included) a missing vLLM fails the vLLM tests instead of skipping them.
REQUIRED = os.environ.get("COSERVE_REQUIRE_VLLM") == "1"
# vLLM's CPU KV cache in the tests, GiB: a few thousand tokens of the tiny models is plenty.
TEST_KV_GB = 0.25


def require_vllm() -> None:
    """Skip the calling test (module) when vLLM is not installed, unless `COSERVE_REQUIRE_VLLM=1`."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if REQUIRED:
        pytest.fail("vLLM is not installed but COSERVE_REQUIRE_VLLM=1: run `make vllm`")
    pytest.skip("vLLM is not installed (make vllm)", allow_module_level=True)
