"""`EngineCore`: the iteration loop, the only place where a plan becomes an engine step and the result
is fed back. Pure Python (the scheduler's side); the engine is anything with `step` (`coserve.contract.engine`).

One iteration::

    plan = source.plan()              # the policy decides (inference first, fine-tuning in what is left)
    jobs.schedule(plan)               # jobs kept beside the policy add their work (a benchmark's pieces)
    result = engine.step(plan)        # the engine executes: here, or in another process
    jobs.update(plan, result)         # training reports: steps, saves, failures
    advanced = source.update(plan, result)   # tokens appended, requests finished

In-process drivers (the offline `LLM`, the benchmark replay and simulator, calibration, the profiler)
call `step(engine)`, which does all of it. The server's engine runs in another process and pulls
plans, so the SchedulerActor uses the two halves: `next_plan()` (what it hands the engine) and
`apply(result)` (what the engine sent back), with one plan in flight at a time.

A step that fails in its fused part (`PlanFault`) is retried in pieces (`fault_isolation`): the next
plans handed out are its sub-plans, until the work at fault is found; then the plan's result is applied
with the culprits' faults in it, and the work of the others as if nothing had happened. Requests the
engine failed alone (`IterationResult.faults`) are left out of what the policy applies (the driver
ends them); jobs handle their own faults (`CoservedJob.update`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from coserve.cluster.fault_isolation import FaultIsolation, without_requests
from coserve.contract.engine import EngineFailure, PlanFault, StepExecutor
from coserve.contract.plan import IterationPlan, IterationResult, TokenLogprobs
from coserve.inference.request import Request


class PlanSource(Protocol):
    """What decides the iterations: a policy, or a driver's designed plans (the profiler)."""

    def plan(self) -> IterationPlan:
        """The next iteration's plan (possibly empty)."""
        ...

    def update(self, plan: IterationPlan, result: IterationResult) -> list[Request]:
        """Apply the engine's result of `plan`; returns the requests that received a token."""
        ...

    def has_work(self) -> bool:
        """Whether a plan would have anything to run."""
        ...


class JobSide(Protocol):
    """Fine-tuning jobs kept beside a policy that plans none (`coserve.finetune.pieces.JobPieces`)."""

    def schedule(self, plan: IterationPlan) -> None:
        """Add the jobs' work (and deferred control) to the plan the policy made."""
        ...

    def update(self, plan: IterationPlan, result: IterationResult) -> None:
        """Apply the training part of the engine's result."""
        ...


class PlanMismatch(ValueError):
    """A result that answers no plan in flight (another step id, or nothing was handed out)."""


class PlanInFlight(RuntimeError):
    """`next_plan` while the previous plan's result has not been applied."""


class StepFailed(Exception):
    """The engine reported that it could not execute `plan` (`EngineFailure`): its requests fail.

    Args:
        plan: the plan that failed (no policy update was made for it).
        message: the engine's error.
    """

    def __init__(self, plan: IterationPlan, message: str) -> None:
        super().__init__(f"engine step {plan.step_id} failed: {message}")
        self.plan = plan
        self.message = message


@dataclass(slots=True)
class Step:
    """One applied iteration: the plan, the engine's result, and the requests whose tokens advanced
    (finished ones included, in batch order). `plan` is what the policy applied: without the requests
    that failed alone (`result.faults`). `retries`: the sub-plans run to find the work at fault."""

    plan: IterationPlan
    result: IterationResult
    advanced: list[Request]
    retries: int = 0

    def logprobs(self) -> dict[str, TokenLogprobs | None]:
        """request id -> the logprobs of the token sampled for it in this step."""
        return {s.request_id: s.logprobs for s in self.result.sampled}


class EngineCore:
    """Turns plans into engine steps and feeds the results back (module docstring).

    Args:
        source: the policy (or designed plans) that decides each iteration.
        jobs: fine-tuning jobs that plan beside `source`, if any.
    """

    def __init__(self, source: PlanSource, jobs: JobSide | None = None) -> None:
        self.source = source
        self._jobs = jobs
        self._in_flight: IterationPlan | None = None
        self._isolation: FaultIsolation | None = None  # the retries of a failed plan, when one runs
        self.failures_in_a_row = 0  # steps failed whole (`StepFailed`) since one was applied

    @property
    def in_flight(self) -> IterationPlan | None:
        """The plan handed out by `next_plan` whose result has not been applied yet."""
        return self._in_flight

    def has_work(self) -> bool:
        """Whether the source has anything to run, or a failed plan is being retried in pieces (jobs
        beside the source are not counted)."""
        return self._isolation is not None or self.source.has_work()

    def step(self, engine: StepExecutor) -> Step:
        """Plan, execute on `engine` in this process, and apply the result; a `PlanFault` is isolated here
        (its sub-plans run on `engine` before this returns).

        Raises:
            PlanMismatch: the engine answered with another step's result (nothing is applied).
            PlanFault: the plan failed with no piece to retry (nothing is applied).
            Exception: what the engine's step raised otherwise; nothing is left in flight and the policy
                is not updated for that plan.
        """
        plan = self._plan()
        try:
            result = engine.step(plan)
        except PlanFault as fault:
            isolation = FaultIsolation(plan, str(fault))
            if not isolation.pieces:
                raise
            while (sub := isolation.next_plan()) is not None:
                try:
                    outcome: IterationResult | EngineFailure = engine.step(sub)
                except PlanFault as again:
                    outcome = EngineFailure(sub.step_id, str(again), isolatable=True)
                isolation.record(outcome)
            return self._finish(isolation)
        return self._apply(plan, result)

    def next_plan(self) -> IterationPlan | None:
        """The next plan for an engine in another process, kept in flight until `apply`; None when the
        plan is empty (nothing for the engine: no result is expected for it). While a failed plan is
        retried in pieces, its next sub-plan.

        Raises:
            PlanInFlight: the previous plan has not been answered.
        """
        if self._in_flight is not None:
            raise PlanInFlight(f"plan {self._in_flight.step_id} is still in flight")
        plan = self._isolation.next_plan() if self._isolation is not None else self._plan()
        if plan is None or plan.is_empty:
            return None
        self._in_flight = plan
        return plan

    def apply(self, result: IterationResult | EngineFailure) -> Step | None:
        """Apply the remote engine's answer to the plan in flight (which is then no longer in flight).

        Returns:
            The applied step; None while a failed plan is retried in pieces (nothing is applied until
            its work at fault is found).

        Raises:
            PlanMismatch: no plan is in flight, or `result` answers another one.
            StepFailed: the engine could not execute the plan, and its work cannot be told apart (a
                failure that is not a `PlanFault`, or a plan with no piece to retry).
        """
        plan, self._in_flight = self._in_flight, None
        if plan is None:
            raise PlanMismatch(f"result of step {result.step_id}, but no plan is in flight")
        _check_answers(plan, result)
        isolation = self._isolation
        if isolation is None and isinstance(result, EngineFailure):
            isolation = FaultIsolation(plan, result.message) if result.isolatable else None
            if isolation is None or not isolation.pieces:
                self.failures_in_a_row += 1
                raise StepFailed(plan, result.message)
            self._isolation = isolation
        elif isolation is not None:
            isolation.record(result)
        if isolation is not None:
            return self._finish(isolation) if isolation.done else None
        assert isinstance(result, IterationResult)
        return self._apply(plan, result)

    def _finish(self, isolation: FaultIsolation) -> Step:
        """A failed plan's retries are over: apply its result (the culprits' faults in it)."""
        self._isolation = None
        step = self._apply(isolation.plan, isolation.result())
        step.retries = isolation.retries
        return step

    def _plan(self) -> IterationPlan:
        plan = self.source.plan()
        if self._jobs is not None:
            self._jobs.schedule(plan)
        return plan

    def _apply(self, plan: IterationPlan, result: IterationResult) -> Step:
        _check_answers(plan, result)
        if result.faults:  # no token for them: the driver ends them (`EngineCluster`, the `LLM`)
            plan = without_requests(plan, {f.request_id for f in result.faults})
        if self._jobs is not None:
            self._jobs.update(plan, result)
        self.failures_in_a_row = 0
        return Step(plan, result, self.source.update(plan, result))


def _check_answers(plan: IterationPlan, result: IterationResult | EngineFailure) -> None:
    if result.step_id != plan.step_id:
        raise PlanMismatch(f"result of step {result.step_id} does not answer plan {plan.step_id}")
