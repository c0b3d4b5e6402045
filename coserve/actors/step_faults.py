"""What the scheduler does when an engine step fails: only the work at fault fails, with its own error.

The engine and the `EngineCore` isolate a fault (`coserve.cluster.fault_isolation`): a step whose fused
part failed is retried in pieces until the request or job at fault is alone, and everyone else's work
completes. What is left here is what tenants and operators see:

* a request that failed alone (`IterationResult.faults`) ends with its own error, `The engine could not
  run this request: <its error>` (an HTTP 500, or an error event in its stream); nobody else sees it;
* a job's fault is the job's (`CoservedJob.fault`: a driven run's call fails, any other job fails);
* a step that failed whole, its work not told apart (the vLLM engine's own step, a fault in the plan's
  control), ends its requests and its jobs' work with a generic error (`GENERIC_MESSAGE`), never the
  engine's text, which may come from another tenant's input;
* an engine whose steps keep failing whole (`ENGINE_BROKEN_AFTER` in a row: a CUDA context lost to a
  device-side assert fails every step so, `TorchEngine`) is lost: the existing failover
  (`SchedulerActor.engine_lost`) takes over. A fault isolated to a piece never counts: a tenant whose
  every request fails cannot take the engine down.

Counted in `/metrics`: `coserve_engine_step_faults_total`, `coserve_engine_step_retries_total`,
`coserve_engine_failed_steps_total`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from coserve.actors.metrics import SchedulerMetrics
from coserve.cluster.engine_cluster import EngineCluster
from coserve.cluster.engine_core import Step
from coserve.cluster.fault_isolation import GENERIC_FAULT
from coserve.contract.plan import IterationPlan

logger = logging.getLogger(__name__)

ENGINE_BROKEN_AFTER = 3  # steps in a row failed whole (or with every piece failing alone): the engine is lost
GENERIC_MESSAGE = "The engine could not run this request (internal error); retry the request."


def request_message(fault: str) -> str:
    """The error a request that failed alone ends with (`fault`: its own, `contract.engine.fault_text`)."""
    if fault == GENERIC_FAULT:
        return GENERIC_MESSAGE
    return f"The engine could not run this request: {fault}"


class StepFaults:
    """Ends the work of failed engine steps as the module docstring says.

    Args:
        cluster: the engines' scheduler (its `fail_plan`, and each engine's count of failures in a row).
        metrics: where faults are counted.
        fail_requests: ends the submissions of these child requests with a message (their streams' error).
        engine_lost: gives up an engine that keeps failing, with the reason.
    """

    def __init__(self, cluster: EngineCluster, metrics: SchedulerMetrics,
                 fail_requests: Callable[[Iterable[str], str], None],
                 engine_lost: Callable[[str, str], None]) -> None:
        self._cluster, self._metrics = cluster, metrics
        self._fail_requests, self._engine_lost = fail_requests, engine_lost

    def applied(self, engine_id: str, step: Step) -> None:
        """An applied step: its requests that failed alone end with their own error; retries counted."""
        faults, job_faults = step.result.faults, step.result.training.faults
        for fault in faults:
            logger.warning("engine %s step %d: request %s failed alone: %s", engine_id, step.plan.step_id,
                           fault.request_id, fault.message)
            self._fail_requests([fault.request_id], request_message(fault.message))
        for job_fault in job_faults:
            logger.warning("engine %s step %d: job %s failed alone: %s", engine_id, step.plan.step_id,
                           job_fault.job_id, job_fault.message)
        if faults:
            self._metrics.step_faults.labels(engine_id, "request").inc(len(faults))
        if job_faults:
            self._metrics.step_faults.labels(engine_id, "job").inc(len(job_faults))
        if step.retries:
            self._metrics.step_retries.labels(engine_id).inc(step.retries)

    def plan_failed(self, engine_id: str, plan: IterationPlan, message: str) -> None:
        """A plan failed whole (`StepFailed`): its requests and its jobs' work end with a generic error;
        `message` (the engine's) is only logged."""
        logger.error("engine %s step %d failed whole: %s", engine_id, plan.step_id, message)
        self._metrics.failed_steps.labels(engine_id).inc()
        if engine_id not in self._cluster.engines:
            return
        aborted = self._cluster.fail_plan(engine_id, plan, GENERIC_FAULT)
        self._fail_requests(aborted, GENERIC_MESSAGE)
        if self._cluster.member(engine_id).core.failures_in_a_row >= ENGINE_BROKEN_AFTER:
            self._engine_lost(engine_id, f"its last {ENGINE_BROKEN_AFTER} steps failed ({message})")
