"""The iteration latency model `f(plan)`: linear in the plan's features, fitted offline, refined online.

``f(features) = c_0 + sum_j c_j * x_j`` with every coefficient >= 0 (seconds per unit of work; see
`latency_features` for the features). Non-negativity is physics, not taste: more work never makes an
iteration faster, and it makes `f` monotone in every feature, which `max_extra_tokens` relies on.

Fitting (`fit`) minimises the squared *relative* error (each row divided by its measured time) because the
target is a MAPE: plain least squares would let a few long prefill iterations outweigh many short decode
iterations. It solves the non-negative problem exactly (Lawson-Hanson NNLS), not "clip and refit", which
can stop at a worse point when features are correlated (prefill tokens and attention pairs are).

Online refinement (`observe`) is recursive least squares with a forgetting factor λ: an observation
``k`` iterations old weighs ``λ**k``, so the model remembers about ``1 / (1 - λ)`` iterations and follows
drift or a new machine within a few times that. It is kept in information form (``R = λR + x xᵀ``,
``r = λr + x y``, then a 10x10 solve) rather than the classic covariance recursion: with λ = 0.95 and
correlated features the covariance form lost positive-definiteness to rounding and diverged in our tests,
while ``R`` is a sum of PSD terms and cannot. A fixed ridge term ``|θ - θ0|² / prior_variance`` anchors
the solve at the fitted (or loaded) coefficients θ0: it is what stops wind-up in directions that are never
excited (no fine-tuning for an hour keeps those costs instead of letting them drift to anything), and it
is negligible wherever data exist. The solve is non-negative like `fit` (`nonnegative_quadratic`,
warm-started from the last iteration's positive set: online, that set rarely changes, so one
restricted solve and a check of the optimality conditions usually settle it).

Columns are scaled by their largest magnitude at fit time (attention pairs are ~1e6, adapters ~1) so the
solve and the information matrix are well conditioned; the scales travel in the JSON so a loaded model refines the
same way. A profile file carries a fingerprint (model, machine, dtype); `check_compatible` refuses one from
elsewhere so the serve path refits instead of scheduling with another machine's costs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from coserve.contract.engine import EngineKind
from coserve.planner.latency_features import (
    CONSTANT,
    FEATURE_NAMES,
    PlanFeatures,
    plan_features,
)
from coserve.planner.nonnegative import nnls, nonnegative_quadratic
from coserve.planner.sample_guard import SampleGuard

__all__ = [
    "FEATURE_NAMES", "LatencyModel", "ModelFingerprint", "PlanFeatures",
    "machine_id", "model_id_from_config", "plan_features",
]

FORMAT = "coserve.latency/2"  # /2: prefill_chunks and ft_pieces
COEFFICIENT_NAMES: tuple[str, ...] = (CONSTANT, *FEATURE_NAMES)
# Column scales of a model never fitted: typical magnitudes of each feature in a busy iteration, so RLS
# from scratch is conditioned like a fitted one (attention pairs ~1e5..1e6, adapters ~1..8).
DEFAULT_SCALES: tuple[float, ...] = (
    1.0, 512.0, 256.0, 512.0 * 1024, 256.0 * 1024, 512.0, 512.0 * 32, 8.0, 256.0, 1.0, 8.0, 32.0,
)
Sample = tuple[PlanFeatures, float]  # (features of an iteration, its measured wall time in seconds)


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Where a latency profile is valid: which model, on which machine, in which dtype."""

    model_id: str
    machine: str
    dtype: str


def model_id_from_config(config: Mapping[str, Any]) -> str:
    """A short stable hash of a model config (e.g. config.json): same architecture, same id."""
    text = json.dumps(dict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpu_model() -> str:
    """The CPU's marketing name: /proc/cpuinfo on Linux, else whatever `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def machine_id(device: str = "cpu") -> str:
    """System, CPU model, usable cores and device name: what changes an iteration's cost.

    Usable cores (the affinity mask, not the host's count) because a container limited to 2 of 64 cores
    runs at the speed of 2.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.system()}-{platform.machine()} | {_cpu_model()} x{cores} | {device}"


def engine_machine_id(device: str, engine: EngineKind) -> str:
    """`machine_id` plus the engine when it is not coserve's own: a profile measured on one backend
    is refused by a server running the other (their iterations cost differently)."""
    base = machine_id(device)
    return base if engine is EngineKind.TORCH else f"{base} | engine {engine.value}"


def _positive(name: str, value: float) -> float:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (is_number and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class LatencyModel:
    """Predicts an iteration's wall time in seconds from its `PlanFeatures`.

    Args:
        fingerprint: the model, machine and dtype the coefficients are for.
        coefficients: seconds per unit, by name (`COEFFICIENT_NAMES`); missing names are 0. None: all 0
            (an unfitted model, refined by `observe` alone).
        forgetting: RLS forgetting factor λ in (0, 1]; 1 never forgets. Memory ~ 1 / (1 - λ) iterations.
        prior_variance: how far (squared, per scaled coefficient) online refinement may move a
            coefficient away from its fitted value without data; the inverse of the ridge weight. Larger
            adapts faster at first; smaller holds unexcited coefficients more firmly.
        scales: per-coefficient column scales (normally set by `fit`); None: `DEFAULT_SCALES`.
        guard: which measurements `observe` learns from (warm-up, outliers, step bound); None: a
            default `SampleGuard`, already trusting the model when coefficients are given.

    Raises:
        ValueError: a setting out of range, an unknown or negative coefficient.
    """

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        coefficients: Mapping[str, float] | None = None,
        *,
        forgetting: float = 0.995,
        prior_variance: float = 1.0,
        scales: Sequence[float] | None = None,
        guard: SampleGuard | None = None,
    ) -> None:
        if not (isinstance(forgetting, (int, float)) and 0.0 < forgetting <= 1.0):
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        self.fingerprint = fingerprint
        self.forgetting = float(forgetting)
        self.prior_variance = _positive("prior_variance", prior_variance)
        coefficients = dict(coefficients or {})
        unknown = sorted(set(coefficients) - set(COEFFICIENT_NAMES))
        if unknown:
            raise ValueError(f"unknown latency coefficients {unknown}; known: {list(COEFFICIENT_NAMES)}")
        for name, value in coefficients.items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"coefficient {name} must be a finite number >= 0, got {value!r}")
        self._coef = [float(coefficients.get(name, 0.0)) for name in COEFFICIENT_NAMES]
        n = len(COEFFICIENT_NAMES)
        self._scales = list(DEFAULT_SCALES) if scales is None else [_positive("scales", s) for s in scales]
        if len(self._scales) != n:
            raise ValueError(f"scales must have {n} entries, got {len(self._scales)}")
        self.guard = SampleGuard() if guard is None else guard
        if any(self._coef):
            self.guard.on_fit()  # given coefficients (a profile, a simulator's truth) are trusted
        self._reset_online()

    @property
    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each feature, and the constant per-iteration overhead."""
        return dict(zip(COEFFICIENT_NAMES, self._coef))

    def _reset_online(self, info: np.ndarray | None = None, moment: np.ndarray | None = None) -> None:
        """Restart online refinement: anchor at the current coefficients, with the given information."""
        n = len(COEFFICIENT_NAMES)
        self._anchor = np.array(self._coef) * np.array(self._scales)  # θ0, scaled coordinates
        self._info = np.zeros((n, n)) if info is None else info  # R
        self._moment = np.zeros(n) if moment is None else moment  # r
        self._positive: np.ndarray | None = None  # the last solve's positive coefficients (a warm start)

    def predict(self, features: PlanFeatures) -> float:
        """Predicted wall time of an iteration with these features, in seconds (pure Python: hot path)."""
        total = self._coef[0]
        for c, x in zip(self._coef[1:], features.vector()):
            total += c * x
        return total

    @staticmethod
    def _checked(samples: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
        """Design matrix (constant column first) and targets; rejects empty or invalid samples."""
        if not samples:
            raise ValueError("samples must not be empty: need measured iterations to fit or evaluate")
        rows, ys = [], []
        for i, (features, measured_s) in enumerate(samples):
            features.validate(f"samples[{i}].features")
            ys.append(_positive(f"samples[{i}].measured_s", measured_s))
            rows.append((1.0, *features.vector()))
        return np.array(rows, dtype=float), np.array(ys, dtype=float)

    def fit(self, samples: Sequence[Sample]) -> None:
        """Fit the coefficients to measured iterations (NNLS on relative error) and restart RLS from them.

        The fit's information becomes the RLS state, so later `observe` calls continue this least-squares
        problem (with the old samples fading by λ per call) instead of starting over.

        Raises:
            ValueError: empty samples, a negative feature, or a measured time that is not > 0.
        """
        x, y = self._checked(samples)
        scales = np.abs(x).max(axis=0)
        # A feature never seen keeps coefficient 0; its nominal scale keeps later online updates (when
        # fine-tuning starts) as well conditioned as the rest.
        unseen = scales == 0
        scales[unseen] = np.array(DEFAULT_SCALES)[unseen]
        a = x / scales / y[:, None]  # relative error: row i divided by its measured time
        theta = nnls(a, np.ones(len(y)))
        self._scales = scales.tolist()
        self._coef = (theta / scales).tolist()
        self._reset_online(a.T @ a, a.T @ np.ones(len(y)))
        self.guard.on_fit()

    def heldout_mape(self, samples: Sequence[Sample]) -> float:
        """Mean absolute percentage error on `samples` (percent: 5.0 means 5 %), e.g. held-out iterations.

        Raises:
            ValueError: empty samples, or a measured time that is not > 0 (the error is relative to it).
        """
        x, y = self._checked(samples)
        predicted = x @ np.array(self._coef)
        return float(np.mean(np.abs(predicted - y) / y) * 100.0)

    @property
    def trusted(self) -> bool:
        """Whether predictions rest on a fit or on enough measurements (`SampleGuard.trusted`)."""
        return self.guard.trusted

    def observe(self, features: PlanFeatures, measured_s: float) -> float:
        """Refine the coefficients with one measured iteration (RLS step); returns the prior prediction.

        The guard may drop the sample (an isolated outlier) or clip it to within its step bound of the
        prediction before the fit sees it.

        Raises:
            ValueError: a negative feature, or measured_s not > 0.
        """
        features.validate()
        measured_s = _positive("measured_s", measured_s)
        predicted = self.predict(features)
        admitted = self.guard.admit(predicted, measured_s)
        if admitted is None:
            return predicted
        measured_s = admitted
        scales = np.array(self._scales)
        # Scaled coordinates, the row divided by its time: the same relative error `fit` minimises.
        x = np.array((1.0, *features.vector())) / scales / measured_s
        lam = self.forgetting
        self._info = lam * self._info + np.outer(x, x)
        self._moment = lam * self._moment + x  # target of a relative row is 1
        ridge = 1.0 / self.prior_variance
        system = self._info + ridge * np.eye(len(x))
        rhs = self._moment + ridge * self._anchor
        theta = np.linalg.solve(system, rhs)
        if theta.min() < 0.0:  # a cost that is really ~0 estimated slightly negative: constrained solve
            theta = nonnegative_quadratic(system, rhs, self._positive)
        self._positive = theta > 0.0
        self._coef = (theta / scales).tolist()
        return predicted

    def max_extra_tokens(
        self, base: PlanFeatures, increment: PlanFeatures, budget_s: float, cap: int | None = None
    ) -> int:
        """The largest s >= 0 with ``predict(base + s * increment) <= budget_s`` (0 when base exceeds it).

        Closed form for a linear model, ``floor((budget - f(base)) / slope)``, then nudged by a step or two
        so the answer satisfies the inequality exactly as `predict` evaluates it (floating rounding).

        Args:
            base: the plan's features before the extra tokens (inference work).
            increment: what one more token adds (e.g. `PlanFeatures(ft_forward_tokens=1)`); all entries >= 0.
            budget_s: the iteration's latency budget (the SLO minus any safety margin), seconds.
            cap: upper bound on the answer (e.g. the tokens the job has ready). Required when the model
                says the increment costs nothing (a coefficient still 0 before any fine-tuning was seen).

        Raises:
            ValueError: budget_s not > 0, a negative increment or cap, or a free increment with no cap.
        """
        budget_s = _positive("budget_s", budget_s)
        increment.validate("increment")
        if cap is not None and cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        base_s = self.predict(base)
        if base_s > budget_s:
            return 0
        slope = sum(c * v for c, v in zip(self._coef[1:], increment.vector()))
        if slope <= 0.0:
            if cap is None:
                raise ValueError("increment adds no predicted time (its coefficients are 0): pass cap")
            return cap
        s = math.floor((budget_s - base_s) / slope)
        if cap is not None:
            s = min(s, cap)
        base_v, inc_v, coef = base.vector(), increment.vector(), self._coef

        def predict_at(k: int) -> float:
            # predict(base + increment.scaled(k)) with the same float operations, without building
            # feature objects: the planner calls this several times per job per iteration.
            total = coef[0]
            for c, b, i in zip(coef[1:], base_v, inc_v):
                total += c * (b + k * i)
            return total

        while s > 0 and predict_at(s) > budget_s:
            s -= 1
        while (cap is None or s < cap) and predict_at(s + 1) <= budget_s:
            s += 1
        return s

    def check_compatible(self, fingerprint: ModelFingerprint) -> None:
        """Raise ValueError when this profile was fitted for another model, machine or dtype."""
        mismatches = [
            f"{field}: profile has {mine!r}, this server has {theirs!r}"
            for field, mine, theirs in (
                ("model_id", self.fingerprint.model_id, fingerprint.model_id),
                ("machine", self.fingerprint.machine, fingerprint.machine),
                ("dtype", self.fingerprint.dtype, fingerprint.dtype),
            )
            if mine != theirs
        ]
        if mismatches:
            kinds = ", ".join(m.split(":", 1)[0] for m in mismatches)
            raise ValueError(
                f"latency profile is from another model/machine (differs in {kinds}): "
                + "; ".join(mismatches) + ". Refit it with `coserve profile` on this machine."
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready state: coefficients (seconds per unit), scales, settings and fingerprint.

        The RLS information is not saved: a loaded model is anchored at its coefficients and learns
        afresh from the iterations it observes.
        """
        return {
            "format": FORMAT,
            "fingerprint": asdict(self.fingerprint),
            "coefficients": self.coefficients,
            "scales": dict(zip(COEFFICIENT_NAMES, self._scales)),
            "forgetting": self.forgetting,
            "prior_variance": self.prior_variance,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyModel:
        """Inverse of `to_dict`; extra keys (held-out metrics written by the profiler) are ignored.

        Raises:
            ValueError: another format version, a missing field, or invalid coefficients.
        """
        if data.get("format") != FORMAT:
            raise ValueError(f"latency profile format must be {FORMAT!r}, got {data.get('format')!r}")
        try:
            fingerprint = ModelFingerprint(**data["fingerprint"])
            scales = [data["scales"][name] for name in COEFFICIENT_NAMES]
            return cls(fingerprint, data["coefficients"], forgetting=data["forgetting"],
                       prior_variance=data["prior_variance"], scales=scales)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"latency profile is missing or has a malformed field: {exc}") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LatencyModel:
        return cls.from_dict(json.loads(text))
