"""benchmarks/constant_floor.py: the heaviest set of pairwise disjoint SLO windows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "constant_floor.py"
spec = importlib.util.spec_from_file_location("constant_floor", SCRIPT)
assert spec is not None and spec.loader is not None
constant_floor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(constant_floor)


def test_disjoint_windows_add_and_overlapping_ones_share() -> None:
    min_iterations = constant_floor.min_iterations
    assert min_iterations([]) == 0
    assert min_iterations([(0.0, 1.0, 10), (2.0, 3.0, 20)]) == 30  # disjoint: their iterations add up
    assert min_iterations([(0.0, 2.0, 10), (1.0, 3.0, 20)]) == 20  # overlapping: one may serve both
    # The heaviest disjoint set, not the most windows: 5 + 5 < 12, and 12 + 4 beats both.
    windows = [(0.0, 1.0, 5), (1.5, 2.5, 5), (0.5, 2.0, 12), (3.0, 4.0, 4)]
    assert min_iterations(windows) == 16
    assert min_iterations([(0.0, 1.0, 5), (1.0, 2.0, 7)]) == 7  # touching at 1.0: one iteration there
