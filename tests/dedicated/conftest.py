"""One real Ray cluster (2 CPUs: two gloo workers) for every test of the dedicated runs: starting Ray costs
~10 s here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[None]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
