"""Which work of a failed plan was at fault: the plan's pieces retried apart until the one at fault is alone.

An engine step that raised `PlanFault` (`contract.engine`) failed in its fused part, where the pieces of
every tenant run together, and left the engine as if that part had not run. A *piece* is one tenant's
work that runs or fails as a whole: a request (its new sequence and its chunk), or a job (all its training
work in the plan: its start, sequence starts, forward windows, backward tasklets, optimizer steps and
saves; a window's or a tasklet's job is told by its sequence's id, `training_plan.sequence_job`). The
plan's control (frees, adapter changes, job stops, sequence drops, gradient rollbacks) ran in the failed
step and is not sent again.

The retries (`FaultIsolation`): the plan's inference and its training apart first, then each group that
fails cut in two, depth first, until a group of one fails: that piece is the culprit, and fails with its
own error (a `RequestFault` or a `JobFault` in the plan's result). A group that runs is kept: its tokens
and training reports join the plan's result, which the policy then applies as if the plan had run without
the culprit. So the other tenants' work completes as planned and sees no error. One culprit among n
pieces costs about 2 log2(n) retries; they are bounded (`retry_limit`), and past the bound the groups not
run yet fail with a generic error. When nothing ran and several pieces each failed alone, the engine
may be failing whatever it runs (`engine_broken`): their errors are then reported as generic ones (the
engine's text would be no tenant's own).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields

from coserve.contract.engine import EngineFailure
from coserve.contract.plan import IterationPlan, IterationResult, RequestFault, StepTimings
from coserve.contract.training_plan import JobFault, TrainingReport, TrainingWork, sequence_job

GENERIC_FAULT = "internal error: the engine step it ran in failed"


class PieceKind(enum.Enum):
    REQUEST = "request"
    JOB = "job"


@dataclass(frozen=True, slots=True)
class Piece:
    """One tenant's work in a plan, retried or failed as a whole: a request, or a job (`key`: its id)."""

    kind: PieceKind
    key: str


def plan_pieces(plan: IterationPlan) -> list[Piece]:
    """The plan's requests in batch order, then its jobs with work beyond control."""
    pieces: dict[Piece, None] = {}
    for request_id in (*(c.request_id for c in plan.chunks), *(n.request_id for n in plan.new_sequences)):
        pieces.setdefault(Piece(PieceKind.REQUEST, request_id))
    work = plan.training
    for job_id in (*(s.job_id for s in work.job_starts), *(s.job_id for s in work.sequence_starts),
                   *(sequence_job(w.sequence_id) for w in work.forward_windows),
                   *(sequence_job(t.sequence_id) for t in work.backward_tasklets),
                   *(s.job_id for s in work.optimizer_steps), *(s.job_id for s in work.saves)):
        pieces.setdefault(Piece(PieceKind.JOB, job_id))
    return list(pieces)


def sub_plan(plan: IterationPlan, pieces: list[Piece]) -> IterationPlan:
    """The work of `pieces` in `plan`, under the same step id, without the plan's control."""
    requests = {p.key for p in pieces if p.kind is PieceKind.REQUEST}
    jobs = {p.key for p in pieces if p.kind is PieceKind.JOB}
    work = plan.training
    return IterationPlan(
        step_id=plan.step_id,
        new_sequences=[n for n in plan.new_sequences if n.request_id in requests],
        chunks=[c for c in plan.chunks if c.request_id in requests],
        training=TrainingWork(
            job_starts=[s for s in work.job_starts if s.job_id in jobs],
            sequence_starts=[s for s in work.sequence_starts if s.job_id in jobs],
            forward_windows=[w for w in work.forward_windows if sequence_job(w.sequence_id) in jobs],
            backward_tasklets=[t for t in work.backward_tasklets if sequence_job(t.sequence_id) in jobs],
            optimizer_steps=[s for s in work.optimizer_steps if s.job_id in jobs],
            saves=[s for s in work.saves if s.job_id in jobs]))


def without_requests(plan: IterationPlan, request_ids: set[str]) -> IterationPlan:
    """`plan` less these requests' new sequences and chunks (what the policy applies once they failed)."""
    return IterationPlan(
        step_id=plan.step_id, new_sequences=[n for n in plan.new_sequences if n.request_id not in request_ids],
        chunks=[c for c in plan.chunks if c.request_id not in request_ids], freed=plan.freed,
        adapter_unloads=plan.adapter_unloads, adapter_loads=plan.adapter_loads, training=plan.training)


def merge_results(step_id: int, results: list[IterationResult]) -> IterationResult:
    """One result of the plan from the results of its sub-plans (their timings added up)."""
    merged = IterationResult(step_id=step_id, timings=StepTimings())
    report = merged.training
    for result in results:
        merged.sampled += result.sampled
        merged.num_tokens += result.num_tokens
        merged.faults += result.faults
        for timing in fields(StepTimings):
            name = timing.name
            setattr(merged.timings, name, getattr(merged.timings, name) + getattr(result.timings, name))
        for part in fields(TrainingReport):
            getattr(report, part.name).extend(getattr(result.training, part.name))
    return merged


def _halves(group: list[Piece]) -> list[list[Piece]]:
    middle = len(group) // 2
    return [group[:middle], group[middle:]]


def retry_limit(num_pieces: int) -> int:
    """Sub-plans allowed to isolate the faults of a plan of `num_pieces` pieces: enough for two culprits."""
    return 4 * (math.ceil(math.log2(max(1, num_pieces))) + 1)


@dataclass(slots=True)
class FaultIsolation:
    """The retries of one failed plan (module docstring): hand out `next_plan`, `record` each outcome,
    until `done`; then `result` is the plan's result, the culprits' faults in it.

    Args:
        plan: the plan whose step raised `PlanFault`.
        message: that step's error (the culprit's own when the plan has a single piece).
    """

    plan: IterationPlan
    message: str
    pieces: list[Piece] = field(init=False)
    culprits: list[tuple[Piece, str]] = field(default_factory=list)  # (piece, its error; GENERIC_FAULT)
    retries: int = 0  # sub-plans handed out
    _todo: list[list[Piece]] = field(default_factory=list)  # a stack: the next group last
    _running: list[Piece] | None = None
    _results: list[IterationResult] = field(default_factory=list)
    _limit: int = 0

    def __post_init__(self) -> None:
        self.pieces = plan_pieces(self.plan)
        self._limit = retry_limit(len(self.pieces))
        if len(self.pieces) == 1:
            self.culprits.append((self.pieces[0], self.message))
        else:
            requests = [p for p in self.pieces if p.kind is PieceKind.REQUEST]
            jobs = [p for p in self.pieces if p.kind is PieceKind.JOB]
            self._push([requests, jobs] if requests and jobs else _halves(self.pieces))

    def _push(self, groups: list[list[Piece]]) -> None:
        self._todo.extend(reversed([g for g in groups if g]))

    @property
    def done(self) -> bool:
        return self._running is None and not self._todo

    def next_plan(self) -> IterationPlan | None:
        """The next sub-plan to run (None when done); past the retry limit the groups left fail."""
        if self._running is not None:
            raise RuntimeError(f"a sub-plan of step {self.plan.step_id} is still running")
        if self._todo and self.retries >= self._limit:
            self._give_up()
        if not self._todo:
            return None
        self._running = self._todo.pop()
        self.retries += 1
        return sub_plan(self.plan, self._running)

    def record(self, outcome: IterationResult | EngineFailure) -> None:
        """The outcome of the sub-plan handed out last."""
        group, self._running = self._running, None
        if group is None:
            raise RuntimeError(f"no sub-plan of step {self.plan.step_id} is running")
        if isinstance(outcome, IterationResult):
            self._results.append(outcome)
        elif not outcome.isolatable:  # the engine is no longer as the fault left it: stop here
            self._todo.append(group)
            self._give_up()
        elif len(group) == 1:
            self.culprits.append((group[0], outcome.message))
        else:
            self._push(_halves(group))

    def _give_up(self) -> None:
        for group in self._todo:
            self.culprits.extend((piece, GENERIC_FAULT) for piece in group)
        self._todo.clear()

    @property
    def engine_broken(self) -> bool:
        """Several pieces failed each alone and none ran: the engine may fail whatever it runs."""
        return not self._results and len(self.culprits) > 1

    def result(self) -> IterationResult:
        """The plan's result: what the sub-plans that ran did, and the culprits' faults."""
        merged = merge_results(self.plan.step_id, self._results)
        broken = self.engine_broken
        for piece, message in self.culprits:
            text = GENERIC_FAULT if broken else message
            if piece.kind is PieceKind.REQUEST:
                merged.faults.append(RequestFault(piece.key, text))
            else:
                merged.training.faults.append(JobFault(piece.key, self._sequence_of(piece.key), text))
        return merged

    def _sequence_of(self, job_id: str) -> str:
        """The first sequence of the job's work in the plan ("" when its work names none)."""
        work = self.plan.training
        ids = (*(s.sequence_id for s in work.sequence_starts if s.job_id == job_id),
               *(w.sequence_id for w in work.forward_windows), *(t.sequence_id for t in work.backward_tasklets))
        return next((s for s in ids if sequence_job(s) == job_id), "")
