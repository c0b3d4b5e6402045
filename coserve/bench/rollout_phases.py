"""Where a reinforcement job's steps spend their time in a benchmark run: sampling its rollouts, grading
them, and training the graded batch (until its optimizer step completes), per step, from the rollout
loop's state after each iteration (`RolloutPhases.observe`). Run seconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class RolloutState(Protocol):
    """What the tracker reads of a rollout loop (`finetune.rollouts.RolloutDriver`)."""

    @property
    def in_flight(self) -> tuple[int, bool] | None: ...


@dataclass(slots=True)
class _Step:
    sampling_s: float  # when its rollouts were first seen in flight
    grading_s: float | None = None
    fed_s: float | None = None
    trained_s: float | None = None


@dataclass(slots=True)
class RolloutPhases:
    """Each step's phase boundaries (module docstring)."""

    _steps: dict[int, _Step] = field(default_factory=dict)
    _last: tuple[int, bool] | None = None

    def observe(self, now_s: float, driver: RolloutState, steps_completed: int) -> None:
        """After an iteration ending at `now_s`; `steps_completed`: optimizer steps that iteration completed."""
        state = driver.in_flight
        if state is not None and state[0] not in self._steps:
            self._steps[state[0]] = _Step(now_s)
        if state is not None and state[1] and self._steps[state[0]].grading_s is None:
            self._steps[state[0]].grading_s = now_s
        if self._last is not None and state != self._last and self._last[0] in self._steps:
            step = self._steps[self._last[0]]
            if step.fed_s is None and (state is None or state[0] != self._last[0]):
                step.fed_s = now_s
        self._last = state
        for _ in range(steps_completed):
            pending = [s for s in sorted(self._steps.items()) if s[1].fed_s is not None and s[1].trained_s is None]
            if pending:
                pending[0][1].trained_s = now_s

    def summary(self) -> dict[str, Any]:
        """Per completed step: seconds sampling, grading and training; their means and shares."""
        done = [(n, s) for n, s in sorted(self._steps.items()) if s.trained_s is not None]
        rows = []
        for number, s in done:
            assert s.fed_s is not None and s.trained_s is not None
            graded_from = s.grading_s if s.grading_s is not None else s.fed_s
            rows.append({"step": number, "sampling_s": graded_from - s.sampling_s,
                         "grading_s": s.fed_s - graded_from, "training_s": s.trained_s - s.fed_s})
        out: dict[str, Any] = {"steps": rows}
        if rows:
            total = sum(r["sampling_s"] + r["grading_s"] + r["training_s"] for r in rows) or 1.0
            for key in ("sampling_s", "grading_s", "training_s"):
                out[f"mean_{key}"] = sum(r[key] for r in rows) / len(rows)
                out[f"share_{key[:-2]}"] = sum(r[key] for r in rows) / total
        return out
