"""The fine-tuning jobs of one engine: which job gets fine-tuning work next (VTC), and job control.

This is the fine-tuning half of FlexLLM Algorithm 4 (lines 21-27): while the iteration has room for
fine-tuning work, the backlogged tenant with the smallest counter among those with a runnable job
goes next, its job appends up to the amount it is given, and the tenant is charged `w_r` times the
fine-tuning tokens the job reports (a forward token counts 1; a backward tasklet of t tokens over k
of the model's L layers counts t * k / L, see `vtc.backward_tasklet_tokens`, so a training token
costs 2 * w_r over its forward and its backward). Each job is asked at most once per iteration (it
runs one window or one run of tasklets of its sequence in flight). How much each job may add is the
caller's decision (`Allowance`): the latency model for the hybrid policy, fixed shares for baselines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from coserve.contract.job_spec import JobEvent, JobPhase, JobState
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.tenancy.vtc import VirtualTokenCounter


class TrainingJob(Protocol):
    """What the policies need of a fine-tuning job (`finetune_job.CoservedJob` is the real one)."""

    @property
    def job_id(self) -> str: ...

    @property
    def tenant(self) -> str: ...

    @property
    def runnable(self) -> bool:
        """Whether the job has work to schedule now."""

    @property
    def has_work(self) -> bool:
        """Runnable with something to do (a driven run between its client's calls has not)."""

    @property
    def phase(self) -> JobPhase: ...

    @property
    def layer_tokens(self) -> tuple[int, int]:
        """Backward tokens left in the layer whose tasklets come next, and in a whole layer ((0, 0)
        outside the backward phase): a backward budget runs as one tasklet per layer, each with its
        fixed cost."""

    @property
    def last_planned_step(self) -> int:
        """Step id of the last plan this job put work into (-1: none yet)."""

    @property
    def state(self) -> JobState: ...

    def schedule(self, plan: IterationPlan, forward_tokens: int, backward_token_layers: int) -> float:
        """Append work within the amounts to `plan.training`; returns the fine-tuning tokens to charge."""

    def release_kv(self, plan: IterationPlan) -> int:
        """Drop the sequence in flight (redone later); returns the KV blocks freed."""

    @property
    def kv_reserve(self) -> int:
        """Free KV blocks inference's admissions must leave for the job's kept sequence (`sequence_kv`)."""

    def cancel(self, plan: IterationPlan) -> JobEvent | None: ...

    def apply_failure(self, plan: IterationPlan) -> JobEvent | None:
        """End the job if a failure was asked for it (its event), else None."""

    def pause(self, plan: IterationPlan) -> None: ...

    def resume(self) -> None: ...

    def settle(self, plan: IterationPlan) -> None:
        """Give back what it holds and does not use now (a driven run between calls: its adapter slot)."""

    def update(self, plan: IterationPlan, result: IterationResult) -> list[JobEvent]: ...


# (job, plan) -> (forward tokens, backward token-layers) the job may add to the plan now, or None
# when the iteration is full (no job is asked after that).
Allowance = Callable[[TrainingJob, IterationPlan], "tuple[int, int] | None"]


class JobRoster:
    """Jobs by id, VTC selection among their tenants, KV reclaim, deferred job control.

    Args:
        vtc: the counters shared with inference admission.
        on_change: called with a tenant whose set of runnable jobs may have changed; the policy
            re-reports the tenant's backlog to `vtc` (a tenant with runnable jobs is backlogged).
    """

    def __init__(self, vtc: VirtualTokenCounter, on_change: Callable[[str], None]) -> None:
        self._vtc = vtc
        self._on_change = on_change
        self._jobs: dict[str, TrainingJob] = {}
        self._cancels: list[str] = []  # applied in the next plan (the engine learns it there)
        self._pauses: list[str] = []
        self._events: list[JobEvent] = []
        self.last_plan_step = -1
        """Step id of the last plan built (-1: none yet); the watchdog tells a slow engine from a job
        left out of the plans by it."""

    def __iter__(self) -> Iterator[TrainingJob]:
        return iter(self._jobs.values())

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, job_id: str) -> TrainingJob | None:
        return self._jobs.get(job_id)

    def has_runnable(self, tenant: str) -> bool:
        """Whether the tenant has a job with work to schedule (part of its VTC backlog; a driven run
        waiting for its client's next call is not)."""
        return any(job.has_work and job.tenant == tenant for job in self._jobs.values())

    @property
    def has_work(self) -> bool:
        """A runnable job, a job waiting for its final save's result, or control for the next plan."""
        return bool(self._cancels or self._pauses) or any(
            job.has_work or job.state is JobState.FINISHING for job in self._jobs.values())

    # --------------------------------------------------------------------------- job control

    def add(self, job: TrainingJob) -> None:
        """Start scheduling a job. Raises ValueError on a duplicate id."""
        if job.job_id in self._jobs:
            raise ValueError(f"job id {job.job_id!r} is already scheduled")
        self._jobs[job.job_id] = job
        self._on_change(job.tenant)

    def cancel(self, job_id: str) -> bool:
        """Cancel a job in the next plan; False when the job is unknown or finished."""
        return self._defer(job_id, self._cancels)

    def pause(self, job_id: str) -> bool:
        """Pause a job in the next plan (its sequence in flight is dropped); False when unknown."""
        return self._defer(job_id, self._pauses)

    def _defer(self, job_id: str, queue: list[str]) -> bool:
        job = self._jobs.get(job_id)
        if job is None or job.state.is_finished:
            return False
        queue.append(job_id)
        return True

    def resume(self, job_id: str) -> bool:
        """Resume a paused job now; False when unknown."""
        job = self._jobs.get(job_id)
        if job is None:
            return False
        job.resume()
        self._on_change(job.tenant)
        return True

    def apply_control(self, plan: IterationPlan) -> None:
        """Carry out the pauses, cancellations and failures asked since the last plan (cancelled and failed
        jobs leave), then let jobs give back what they hold idle (`TrainingJob.settle`)."""
        self.last_plan_step = plan.step_id
        for job_id, failing in list(self._jobs.items()):
            failed = failing.apply_failure(plan)
            if failed is not None:
                del self._jobs[job_id]
                self._events.append(failed)
                self._on_change(failing.tenant)
        for job_id in self._pauses:
            if job_id in self._jobs:
                self._jobs[job_id].pause(plan)
                self._on_change(self._jobs[job_id].tenant)
        self._pauses.clear()
        for job_id in self._cancels:
            job = self._jobs.pop(job_id, None)
            if job is None:
                continue
            event = job.cancel(plan)
            if event is not None:
                self._events.append(event)
            self._on_change(job.tenant)
        self._cancels.clear()
        for job in self._jobs.values():
            job.settle(plan)

    def pop_events(self) -> list[JobEvent]:
        """Job events (steps, checkpoints, ends) since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------------------- scheduling

    def fill(self, plan: IterationPlan, allowance: Allowance) -> float:
        """Give fine-tuning work to jobs, tenants in VTC order, each job at most once.

        Returns:
            The fine-tuning tokens charged in total (each tenant's share is charged to its counter).
        """
        # Each job is asked once per plan (one window or one run of tasklets of its sequence in
        # flight): one that the liveness floor already served in this plan is not asked again.
        pending = [job for job in self._jobs.values()
                   if job.has_work and job.last_planned_step != plan.step_id]
        total = 0.0
        while pending:
            by_tenant: dict[str, TrainingJob] = {}
            for job in pending:  # roster order: a job that got work moves to the back (turns)
                by_tenant.setdefault(job.tenant, job)
            tenant = self._vtc.select(by_tenant)
            assert tenant is not None
            job = by_tenant[tenant]
            pending.remove(job)
            amounts = allowance(job, plan)
            if amounts is None:
                break
            forward_tokens, backward_token_layers = amounts
            if forward_tokens <= 0 and backward_token_layers <= 0:
                continue
            charged = job.schedule(plan, forward_tokens, backward_token_layers)
            if charged > 0:
                self._vtc.charge_finetune(tenant, charged)
                total += charged
                self._jobs[job.job_id] = self._jobs.pop(job.job_id)
        return total

    def longest_waiting(self) -> TrainingJob | None:
        """The job with work whose last work is oldest (the liveness floor's next), or None."""
        return min((job for job in self._jobs.values() if job.has_work), key=lambda job: job.last_planned_step,
                   default=None)

    def fill_longest_waiting(self, plan: IterationPlan, allowance: Allowance) -> float:
        """Give work to the runnable jobs, the one that has waited longest first (the liveness floor:
        every job in turn, whatever the counters), until the allowance says the plan has enough (None);
        a job that cannot take any is passed over. Charged like `fill`; returns the tokens charged."""
        waiting = sorted((job for job in self._jobs.values() if job.has_work),
                         key=lambda job: job.last_planned_step)
        total = 0.0
        for job in waiting:
            amounts = allowance(job, plan)
            if amounts is None:
                break
            charged = job.schedule(plan, *amounts) if max(amounts) > 0 else 0.0
            if charged > 0:
                self._vtc.charge_finetune(job.tenant, charged)
                total += charged
        return total

    def reclaim_kv(self, plan: IterationPlan) -> bool:
        """Free the KV blocks of one job's sequence in flight, the most-served tenant's first.

        Returns:
            Whether any block was freed (a job with work in `plan` keeps its blocks).
        """
        order = sorted(self._jobs.values(),
                       key=lambda j: (-self._vtc.counter(j.tenant), j.tenant, j.job_id))
        return any(job.release_kv(plan) > 0 for job in order)

    def kv_reserve(self) -> int:
        """Free KV blocks inference's admissions must leave: what the runnable jobs' kept sequences still
        need (a sequence dropped too often keeps its blocks, `sequence_kv`)."""
        return sum(job.kv_reserve for job in self._jobs.values() if job.runnable)

    def update(self, plan: IterationPlan, result: IterationResult) -> None:
        """Let every job consume the result; finished jobs leave the roster (events are kept)."""
        for job_id, job in list(self._jobs.items()):
            self._events.extend(job.update(plan, result))
            if job.state.is_finished:
                del self._jobs[job_id]
            self._on_change(job.tenant)


def fixed_allowance(forward_tokens: int, backward_token_layers: int) -> Allowance:
    """Fixed amounts of fine-tuning work per iteration, shared by the jobs in VTC order (baselines)."""

    def allow(job: TrainingJob, plan: IterationPlan) -> tuple[int, int]:
        training = plan.training
        if job.phase is JobPhase.FORWARD:
            return max(0, forward_tokens - training.forward_tokens), 0
        return 0, max(0, backward_token_layers - training.backward_token_layers)

    return allow


def whole_iteration_allowance(forward_tokens: int, backward_token_layers: int) -> Allowance:
    """Both amounts at once, shared by the jobs in VTC order: for an iteration without inference, where
    a sequence whose forward completes may start its backward in the same plan."""

    def allow(job: TrainingJob, plan: IterationPlan) -> tuple[int, int]:
        training = plan.training
        return (max(0, forward_tokens - training.forward_tokens),
                max(0, backward_token_layers - training.backward_token_layers))

    return allow
