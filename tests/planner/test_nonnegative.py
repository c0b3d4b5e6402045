"""The online refit's constrained solve: the normal-equation form with a warm start gives the optimum
Lawson-Hanson gives on the Cholesky factor (the form it replaced), whatever the start."""

from __future__ import annotations

import numpy as np
import pytest

from coserve.planner.nonnegative import nnls, nonnegative_quadratic


def _problem(seed: int, n: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """A ridge-anchored system like `LatencyModel.observe`'s: correlated rows, some true costs ~0."""
    rng = np.random.default_rng(seed)
    rows = rng.uniform(0.0, 1.0, size=(40, n))
    rows[:, 1] = rows[:, 2] + rng.normal(0.0, 0.01, size=40)  # two nearly equal features
    truth = rng.uniform(0.0, 1.0, size=n) * (rng.uniform(size=n) > 0.4)
    y = rows @ truth + rng.normal(0.0, 0.05, size=40)
    system = rows.T @ rows + 1e-3 * np.eye(n)
    return system, rows.T @ y + 1e-3 * truth


def _reference(system: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """The form `observe` used before: NNLS of |Lᵀθ − L⁻¹r| with system = L Lᵀ."""
    lower = np.linalg.cholesky(system)
    return nnls(lower.T, np.linalg.solve(lower, rhs))


def test_the_problems_are_ones_that_need_the_constraint() -> None:
    constrained = sum(np.linalg.solve(*_problem(seed)).min() < 0 for seed in range(40))
    assert constrained >= 30, constrained


@pytest.mark.parametrize("seed", range(40))
def test_the_warm_started_solve_is_the_constrained_optimum_from_any_start(seed: int) -> None:
    system, rhs = _problem(seed)
    expected = _reference(system, rhs)
    rng = np.random.default_rng(1000 + seed)
    starts = [None, expected > 0, ~(expected > 0), np.ones(len(rhs), bool), rng.uniform(size=len(rhs)) > 0.5]
    for start in starts:
        theta = nonnegative_quadratic(system, rhs, start)
        assert theta.min() >= 0.0
        np.testing.assert_allclose(theta, expected, rtol=1e-7, atol=1e-9)
        gradient = rhs - system @ theta  # KKT: 0 where θ > 0, <= 0 where θ == 0
        assert np.all(np.abs(gradient[theta > 0]) < 1e-8)
        assert np.all(gradient[theta == 0] < 1e-8)


def test_the_start_is_not_changed_by_the_solve() -> None:
    system, rhs = _problem(3)
    start = np.array([True, False] * 5)
    nonnegative_quadratic(system, rhs, start)
    assert start.tolist() == [True, False] * 5


def test_an_unconstrained_optimum_that_is_positive_is_returned_as_is() -> None:
    system = np.array([[2.0, 0.5], [0.5, 1.0]])
    rhs = np.array([1.0, 1.0])
    np.testing.assert_allclose(nonnegative_quadratic(system, rhs), np.linalg.solve(system, rhs))
    np.testing.assert_allclose(nonnegative_quadratic(system, -rhs, np.array([True, True])), [0.0, 0.0])
