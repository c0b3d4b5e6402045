"""What keeps one test from taking the suite down, and the suite from depending on a random draw.

* **Hypothesis runs derandomized** (profile `ci`, the default): every run draws the same examples, with
  no example database, so CI never fails or passes by chance. `HYPOTHESIS_PROFILE=explore` (`make
  fuzz`) draws fresh examples and keeps failures in `.hypothesis/`, to look for new ones on demand.
* **A memory cap** (`COSERVE_TEST_MEMORY_GB`, default 12, or 60% of the machine if less; 0 turns it
  off): RLIMIT_DATA, the private memory a process may commit, for the test process and every process it
  starts. A test that allocates past it gets MemoryError (or torch's allocation error) and fails alone,
  where without the cap the kernel's OOM killer would end the whole run. Shared mappings (Ray's object
  store) do not count. The grammar library, whose failed allocations abort, runs in capped workers of
  its own (`coserve.structured.guarded_check`).
* **The suite's peak RSS** (this process, and the largest process it started) is printed at the end,
  with the tests that raised this process's peak the most.
"""

from __future__ import annotations

import os
import resource

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_GB = 1 << 30
_raised: list[tuple[float, str]] = []  # (GB the test raised the peak by, its id)


def memory_cap_bytes() -> int | None:
    """The cap this run applies (None: off)."""
    wanted = os.environ.get("COSERVE_TEST_MEMORY_GB")
    if wanted is not None:
        return int(float(wanted) * _GB) or None
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(12 * _GB, int(machine * 0.6))


def pytest_configure(config: pytest.Config) -> None:
    cap = memory_cap_bytes()
    if cap is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.getrlimit(resource.RLIMIT_DATA)[1]))


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    before = _peak_gb()
    try:
        return (yield)
    finally:
        raised = _peak_gb() - before
        if raised > 0.25:
            _raised.append((raised, item.nodeid))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / (1 << 20)
    cap = memory_cap_bytes()
    capped = f"capped at {cap / _GB:.1f} GB per process" if cap else "no memory cap"
    terminalreporter.write_line(f"peak RSS: {_peak_gb():.2f} GB (tests), {child:.2f} GB (largest child); {capped}")
    for raised, nodeid in sorted(_raised, reverse=True)[:5]:
        terminalreporter.write_line(f"  +{raised:.2f} GB: {nodeid}")
