"""`ClusterJobs`: the fine-tuning jobs of every engine, as those who submit and control them see them.

The job side of a `EngineCluster`, a `JobRunner` (`contract.job_runner`: start, cancel, pause,
resume, events) over its engines, one or many:

* `start(spec)` places the job on one engine (`job_placement`: memory, adapter slots, least
  fine-tuning there) and builds its `CoservedJob` on that engine's KV blocks and slots; with no engine
  that can hold it, the job waits with the reason (a `JobNotice`) and is placed when an engine joins or
  another job ends;
* the jobs of all engines are chosen and charged by the one set of counters the policies share
  (`shared_vtc`), so fine-tuning tokens count in a tenant's share of the whole machine;
* every confirmed checkpoint is kept (`job_checkpoints`), and every checkpoint and final adapter is
  published to all engines (`adapter_catalog`): any engine serves the fine-tuned model at once;
* a lost engine's jobs are placed again and resume from their last checkpoint (`engine_lost`);
* a reinforcement job's rollout loop (`finetune.rollouts`) lives beside it, its rollouts pinned to the
  job's engine (the adapter being trained is in that engine's bank), graded by `RolloutGrading` (set
  with `serve_rollouts`; without it a reinforcement job fails, saying so). A loop that raises fails its
  own job (`rollouts_failed`), never the step whose outputs it was given.

A job keeps its id across a move; its `CoservedJob` object does not (ask `get` for the current one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coserve.cluster.adapter_catalog import AdapterCatalog
from coserve.cluster.engine_core import Step
from coserve.cluster.failover import JobMove
from coserve.cluster.job_placement import Placement, place_job
from coserve.cluster.member import EngineMember
from coserve.contract.job_runner import JobNotice
from coserve.contract.job_spec import FinetuneJobSpec, JobEvent, JobEventKind
from coserve.contract.reinforcement import RolloutGrading
from coserve.contract.sampling import EosIds
from coserve.finetune.host import JobHost
from coserve.finetune.job import CoservedJob
from coserve.finetune.job_checkpoints import JobCheckpoints
from coserve.finetune.rollouts import RolloutDriver
from coserve.inference.request import Request
from coserve.tenancy.vtc import VirtualTokenCounter

logger = logging.getLogger(__name__)

_ENDS = (JobEventKind.SUCCEEDED, JobEventKind.FAILED, JobEventKind.CANCELLED)
ROLLOUTS_FAILED = "rollouts_failed"  # the code of a reinforcement job whose rollout loop raised


@dataclass(frozen=True, slots=True)
class RolloutService:
    """How the cluster runs rollout loops: queue a request on an engine (pinned there), abort one, grade,
    and the ids sampling stops on."""

    submit: Callable[[str, Request], None]  # (engine id, request)
    abort: Callable[[str], object]
    grading: RolloutGrading | None = None
    eos: EosIds | None = None


class ClusterJobs:
    """Jobs by id over the cluster's engines (module docstring).

    Args:
        members: the cluster's live engines by id (read, never changed here).
        vtc: the shared counters (a job's tenant weight weighs its engine's fine-tuning load).
        catalog: where published adapters go.
        default_weight: the weight of a tenant the counters do not know yet.
    """

    def __init__(self, members: Mapping[str, EngineMember], vtc: VirtualTokenCounter,
                 catalog: AdapterCatalog, rollouts: RolloutService, default_weight: float = 1.0) -> None:
        self._members, self._vtc, self._catalog = members, vtc, catalog
        self._rollout_service = rollouts
        self._drivers: dict[str, RolloutDriver] = {}  # placed reinforcement jobs' rollout loops
        self._default_weight = default_weight
        self._specs: dict[str, FinetuneJobSpec] = {}  # every job not ended
        self._engine: dict[str, str] = {}  # placed job -> its engine
        self._waiting: dict[str, str] = {}  # unplaced job -> why (oldest first)
        self._paused: set[str] = set()
        self._cancelled: set[str] = set()  # cancel asked, the engine not told yet
        self.checkpoints = JobCheckpoints()
        self.on_placed: list[Callable[[str], None]] = []  # told each job id placed (`training_runs` feeds its calls)
        self._events: list[JobEvent] = []
        self._notices: list[JobNotice] = []

    # ----------------------------------------------------------------------------- control

    def start(self, spec: FinetuneJobSpec) -> str | None:
        """Place and start a job; returns its engine, or None when it waits (a notice says why).

        Raises:
            ValueError: a job with this id is not ended yet.
        """
        if spec.job_id in self._specs:
            raise ValueError(f"job id {spec.job_id!r} is already scheduled")
        self._specs[spec.job_id] = spec
        return self._place(spec)

    def cancel(self, job_id: str) -> bool:
        """Cancel a job (in its engine's next plan; a waiting job at once); False when unknown."""
        if job_id not in self._specs or job_id in self._cancelled:
            return False
        if job_id in self._waiting:
            del self._waiting[job_id]
            self._end(job_id)
            self._events.append(JobEvent(job_id, JobEventKind.CANCELLED, 0, message="the job was cancelled"))
            return True
        host = self._host(job_id)
        if host is None or not host.cancel(job_id):
            return False
        self._cancelled.add(job_id)
        return True

    def pause(self, job_id: str) -> bool:
        """Pause a job (its sequence in flight is redone on resume); False when unknown."""
        if job_id not in self._specs or job_id in self._cancelled:
            return False
        self._paused.add(job_id)
        host = self._host(job_id)
        if host is not None:
            host.pause(job_id)
        return True

    def resume(self, job_id: str) -> bool:
        if job_id not in self._specs:
            return False
        self._paused.discard(job_id)
        host = self._host(job_id)
        if host is not None:
            host.resume(job_id)
        return True

    def serve_rollouts(self, grading: RolloutGrading, eos: EosIds) -> None:
        """Grade reinforcement jobs' rollouts with `grading`, sampling until `eos`."""
        service = self._rollout_service
        self._rollout_service = RolloutService(service.submit, service.abort, grading, eos)

    def _host(self, job_id: str) -> JobHost | None:
        """The job host of the engine the job is placed on; None while it waits."""
        engine = self._engine.get(job_id)
        return None if engine is None else self._members[engine].policy.jobs

    def work_arrived(self, job_id: str) -> None:
        """A placed job got work from outside its plans (a driven run's call): its tenant is backlogged
        again on the counters (the job host re-reports it)."""
        host, job = self._host(job_id), self.get(job_id)
        if host is not None and job is not None:
            host.sync_backlog(job.tenant)

    # ----------------------------------------------------------------------------- readings

    def get(self, job_id: str) -> CoservedJob | None:
        """The job's current `CoservedJob` (a new one after a move); None when waiting or ended."""
        engine = self._engine.get(job_id)
        return None if engine is None else self._members[engine].jobs.get(job_id)

    def engine_of(self, job_id: str) -> str | None:
        return self._engine.get(job_id)

    def waiting_reason(self, job_id: str) -> str | None:
        """Why the job is not placed (None: it is placed, or unknown)."""
        return self._waiting.get(job_id)

    def held_back(self, job_id: str) -> str | None:
        """Why the job got no work lately: it waits for an engine, its rollouts or an adapter slot, or its
        engine's last plan held fine-tuning back (`JobHost.finetune_held_back`); None: none of these."""
        if job_id in self._waiting:
            return self._waiting[job_id]
        driver = self._drivers.get(job_id)
        if driver is not None and driver.waiting_for is not None:
            return f"it waits for its rollouts: {driver.waiting_for}"
        job = self.get(job_id)
        if job is not None and job.slot_wait is not None:
            return f"it waits for an adapter slot: {job.slot_wait}"
        host = self._host(job_id)
        return None if host is None else host.finetune_held_back

    def plan_step(self, job_id: str) -> int:
        """Step id of the last plan of the job's engine (-1: not placed, or none yet)."""
        host = None if job_id in self._waiting else self._host(job_id)
        return -1 if host is None else host.roster.last_plan_step

    @property
    def job_ids(self) -> list[str]:
        """Jobs not ended: placed or waiting."""
        return list(self._specs)

    def pop_events(self) -> list[JobEvent]:
        """Every engine's job events (steps, checkpoints, ends) since the last call."""
        events, self._events = self._events, []
        return events

    def pop_notices(self) -> list[JobNotice]:
        notices, self._notices = self._notices, []
        return notices

    # ----------------------------------------------------------------------------- engines

    def observe(self, member: EngineMember, step: Step) -> None:
        """After a step of `member`: keep confirmed checkpoints, publish what jobs wrote, collect
        events, let ended jobs go (and place waiting jobs in the room they leave)."""
        if member.policy.jobs is None:
            return
        self.checkpoints.observe(step.plan, step.result, self._specs)
        self._advance_rollouts(member, step)
        self.settle(member)

    def settle(self, member: EngineMember) -> None:
        """Collect the member's job events (publish what jobs wrote, let ended jobs go and place waiting
        jobs in the room they leave): after each step, and after a plan that needed no step (a job
        cancelled before it started ends without one)."""
        host = member.policy.jobs
        if host is None:
            return
        for event in host.pop_events():
            self._events.append(event)
            if event.path is not None and event.kind in (JobEventKind.CHECKPOINT, JobEventKind.SUCCEEDED):
                self._catalog.publish(event.job_id, event.path, event.step,
                                      event.kind is JobEventKind.SUCCEEDED, member.engine_id)
            if event.kind in _ENDS:
                member.drop_job(event.job_id)
                self._end(event.job_id)
        if self._waiting:  # a job ended, or a run finished its call: a slot may be free
            self.place_waiting()

    def before_plan(self, member: EngineMember) -> None:
        """Before the member plans: its rollout loops feed what was graded since its last step (grading
        ends off the loop, and an engine with nothing else to run has no step to learn it from)."""
        self._advance_rollouts(member, None)

    def _advance_rollouts(self, member: EngineMember, step: Step | None) -> None:
        """Hand the step's outputs to the rollout loops of the member's jobs; collect their reports."""
        for job_id, driver in list(self._drivers.items()):
            if self._engine.get(job_id) != member.engine_id:
                continue
            try:
                driver.advance(step)
            except Exception as err:  # noqa: BLE001 - a job's failure is the job's: the step served others too
                self._rollouts_failed(job_id, driver, err)
                continue
            self._events.extend(driver.pop_events())
            for message in driver.notices:
                self._notices.append(JobNotice(job_id, member.engine_id, message))
            driver.notices.clear()

    def _rollouts_failed(self, job_id: str, driver: RolloutDriver, err: Exception) -> None:
        """A rollout loop raised (sampling, grading or feeding a batch): its job fails in its next plan, and
        what it has in flight is aborted; the other jobs' loops and the step's requests go on."""
        logger.error("reinforcement job %s: its rollout loop failed", job_id, exc_info=err)
        del self._drivers[job_id]
        try:
            driver.stop()
        except Exception:  # noqa: BLE001 - the job fails whatever is left in flight
            logger.exception("reinforcement job %s: aborting its rollouts failed", job_id)
        driver.job.fail(ROLLOUTS_FAILED, f"its rollouts failed on an internal error ({type(err).__name__}); "
                                         "the server's log has the details")

    def place_waiting(self) -> list[str]:
        """Try to place the waiting jobs, oldest first; returns those placed."""
        placed = []
        for job_id in list(self._waiting):
            if self._place(self._specs[job_id]) is not None:
                placed.append(job_id)
        return placed

    def engine_lost(self, member: EngineMember) -> list[JobMove]:
        """Place the jobs of a lost engine (already out of `members`) again, each resuming from its
        last checkpoint; a job whose cancel the engine never applied ends cancelled."""
        moves = []
        for job_id, job in list(member.jobs.items()):
            del self._engine[job_id]
            self._drivers.pop(job_id, None)  # its rollouts were on the lost engine
            if job_id in self._cancelled or job.state.is_finished:
                if job_id in self._cancelled:
                    self._events.append(JobEvent(job_id, JobEventKind.CANCELLED, job.position.step,
                                                 message="the job was cancelled"))
                self._end(job_id)
                continue
            if self._specs[job_id].driven:  # its client's calls and gradient were on that engine: it ends
                self._events.append(JobEvent(job_id, JobEventKind.FAILED, job.position.step, code="engine_lost",
                                             message=f"its engine {member.engine_id} was lost"))
                self._end(job_id)
                continue
            spec = self.checkpoints.resume_spec(self._specs[job_id])
            self._specs[job_id] = spec
            engine = self._place(spec, moved_from=member.engine_id)
            moves.append(JobMove(job_id, member.engine_id, engine, spec.resume_from,
                                 self._waiting.get(job_id)))
        return moves

    # ----------------------------------------------------------------------------- internals

    def _place(self, spec: FinetuneJobSpec, moved_from: str | None = None) -> str | None:
        job_id = spec.job_id
        claims = {engine_id: sum(1 for job in member.jobs.values() if job.claims_slot)
                  for engine_id, member in self._members.items()}
        answer = place_job(spec, list(self._members.values()), claims)
        if not isinstance(answer, Placement):
            if self._waiting.get(job_id) != answer.reason:
                self._notices.append(JobNotice(job_id, None, f"waiting for an engine: {answer.reason}"))
            self._waiting[job_id] = answer.reason
            return None
        self._waiting.pop(job_id, None)
        member = self._members[answer.engine_id]
        self._vtc.ensure_tenant(spec.tenant, self._default_weight)
        job = member.start_job(spec, self._vtc.weight(spec.tenant), paused=job_id in self._paused)
        self._engine[job_id] = answer.engine_id
        if spec.rollouts is not None:
            self._start_rollouts(job, answer.engine_id)
        for listener in self.on_placed:
            listener(job_id)
        where = "resumed from " + spec.resume_from if spec.resume_from else "started"
        moved = f" (its engine {moved_from} was lost)" if moved_from else ""
        self._notices.append(JobNotice(job_id, answer.engine_id,
                                       f"placed on engine {answer.engine_id}, {where}{moved}"))
        return answer.engine_id

    def _start_rollouts(self, job: CoservedJob, engine_id: str) -> None:
        service = self._rollout_service
        if service.grading is None or service.eos is None:
            job.fail("rollouts_unavailable", "this server has no grader for reinforcement jobs' rollouts")
            return
        self._drivers[job.job_id] = RolloutDriver(
            job, service.eos, service.grading, lambda request: service.submit(engine_id, request),
            service.abort, job.fail)

    def _end(self, job_id: str) -> None:
        self._drivers.pop(job_id, None)
        self._specs.pop(job_id, None)
        self._engine.pop(job_id, None)
        self._paused.discard(job_id)
        self._cancelled.discard(job_id)
        self.checkpoints.forget(job_id)
