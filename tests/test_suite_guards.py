"""The suite's own guards (tests/suite_guards.py): hypothesis draws the same examples on every run, and a
test that allocates past the memory cap fails alone, with MemoryError, in this process and in the
processes it starts."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
import torch
from hypothesis import settings

from suite_guards import memory_cap_bytes

_PRINT_CAP = "import resource; print(resource.getrlimit(resource.RLIMIT_DATA)[0])"


def test_hypothesis_is_derandomized_unless_exploring() -> None:
    import os

    exploring = os.environ.get("HYPOTHESIS_PROFILE") == "explore"
    assert settings.default.derandomize is not exploring
    assert exploring or settings.default.database is None


def test_an_allocation_past_the_cap_fails_its_test_not_the_run() -> None:
    cap = memory_cap_bytes()
    if cap is None:
        pytest.skip("COSERVE_TEST_MEMORY_GB=0 turned the cap off")
    assert resource.getrlimit(resource.RLIMIT_DATA)[0] == cap
    with pytest.raises(MemoryError):
        bytearray(cap)
    with pytest.raises(RuntimeError, match="allocate"):
        torch.empty(cap, dtype=torch.uint8)
    child = subprocess.run([sys.executable, "-c", _PRINT_CAP],
                           capture_output=True, text=True, check=True)
    assert int(child.stdout) == cap
    assert len(bytearray(1 << 20)) == 1 << 20  # and the process goes on
