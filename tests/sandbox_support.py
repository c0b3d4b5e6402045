"""Test helper for python graders' sandbox: skip without bubblewrap, except where it is required (`make
test`, CI: `COSERVE_REQUIRE_SANDBOX=1`, set after the Makefile's set-up installed it)."""

from __future__ import annotations

import os

import pytest

from coserve.graders.python_grader import PythonGraderRunner, SandboxUnavailable

REQUIRED = os.environ.get("COSERVE_REQUIRE_SANDBOX") == "1"


def require_sandbox() -> None:
    """Skip the calling test (module) when this machine cannot run the sandbox, unless it is required."""
    try:
        PythonGraderRunner().check()
    except SandboxUnavailable as err:
        if REQUIRED:
            pytest.fail(f"COSERVE_REQUIRE_SANDBOX=1 but the python grader sandbox cannot run: {err} "
                        "(make sandbox installs it)")
        pytest.skip(f"no python grader sandbox here: {err}", allow_module_level=True)
