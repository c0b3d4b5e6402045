"""The test tiers: markers a test gets from what it uses, and CUDA tests skipped without a GPU.

`make test` runs everything but the `slow` tier (one process: on 2 cores, two pytest-xdist workers were no faster,
11-12 minutes against 13 for the whole suite, the machine being busy either way); `make test-slow` runs the `slow`
tier: end-to-end runs of a minute or more each (the notebook, the real-model training journeys, Ray Train runs).
CI runs both (.ci/run). `make test-fast` (the inner loop, under 2 minutes on 2 cores) runs
the pure packages and the engine math on tiny models: the folders listed in the Makefile, minus every test marked
`ray`, `real_model`, `vllm`, `slow` or `gpu`. A test is marked in its file (`pytestmark`), and here from what it
uses: the `smollm2_dir` fixture makes it `real_model`.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = _has_cuda()
    for item in items:
        if "smollm2_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
        if not cuda and item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
