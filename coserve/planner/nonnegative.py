"""Non-negative least squares, two ways: on the data (the offline fit) and on the normal equations
(the online refit, warm-started).

`LatencyModel.fit` solves min |a θ − b| over θ >= 0 on the measured rows (`nnls`: Lawson-Hanson, a
least-squares solve of the passive columns per step; the data's own conditioning). `LatencyModel.observe`
solves its ridge-anchored least squares each iteration, and when a cost whose true value is ~0 comes
out slightly negative it needs the non-negative optimum of ½θᵀSθ − rᵀθ (`nonnegative_quadratic`). That
branch ran on ~73% of iterations in the cluster projection and, as Lawson-Hanson on the Cholesky factor,
was 86% of the scheduler's decision CPU. The same active-set steps on the normal equations (Bro and
de Jong's "fast NNLS", as aᵀa = S and aᵀb = r) are a solve of S restricted to the passive set each, and
starting from the previous iteration's positive set, which online rarely changes, a start that is already
optimal ends after one small solve. S is positive definite (the ridge term is always in it), so the
optimum is unique and does not depend on the start.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Gradient = Callable[[np.ndarray], np.ndarray]  # θ -> minus the objective's gradient at θ
Restricted = Callable[[np.ndarray], np.ndarray]  # passive mask -> the optimum with the others held at 0


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x − b| subject to x >= 0 (Lawson-Hanson)."""
    n = a.shape[1]
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(a.shape)

    def restricted(passive: np.ndarray) -> np.ndarray:
        z = np.zeros(n)
        z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
        return z

    return _active_set(lambda x: a.T @ (b - a @ x), restricted, n, tol, None)


def nonnegative_quadratic(system: np.ndarray, rhs: np.ndarray, positive: np.ndarray | None = None) -> np.ndarray:
    """argmin over θ >= 0 of ½θᵀ·system·θ − rhsᵀθ, for a positive definite `system`.

    Args:
        system: S (n x n, symmetric positive definite).
        rhs: r (n).
        positive: a guess of the coefficients positive at the optimum (bool, n), e.g. the previous
            solve's; None: start from all zero.

    Returns:
        θ (n), every entry >= 0.
    """
    n = len(rhs)
    tol = 10 * np.finfo(float).eps * max(1.0, float(np.abs(system).sum(axis=0).max())) * n

    def restricted(passive: np.ndarray) -> np.ndarray:
        z = np.zeros(n)
        if passive.any():
            z[passive] = np.linalg.solve(system[np.ix_(passive, passive)], rhs[passive])
        return z

    return _active_set(lambda x: rhs - system @ x, restricted, n, tol, positive)


def _active_set(gradient: Gradient, restricted: Restricted, n: int, tol: float,
                positive: np.ndarray | None) -> np.ndarray:
    """Lawson-Hanson's active-set loop, from the passive set `positive` when its optimum is feasible."""
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    if positive is not None and positive.any():
        z = restricted(positive)
        if z[positive].min() > tol:  # a feasible start: the loop confirms it or moves on from it
            x, passive = z, positive.copy()
    for _ in range(3 * n):  # each outer step frees one variable; 3n is the classic bound
        w = gradient(x)
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        for _ in range(3 * n):  # inner loop: step back until the passive solution is positive
            z = restricted(passive)
            if z[passive].min() > tol:
                break
            bad = passive & (z <= tol)
            gap = x[bad] - z[bad]
            # A variable already at 0 that would stay at 0 blocks the step (ratio 0) instead of 0/0.
            alpha = np.divide(x[bad], gap, out=np.zeros_like(gap), where=gap > 0).min()
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                z = np.zeros(n)
                break
        x = z
    return np.maximum(x, 0.0)
