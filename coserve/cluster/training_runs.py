"""`TrainingRuns`: training runs driven by their clients, call by call, as co-served jobs of the cluster.

A run is a driven fine-tuning job (`FinetuneJobSpec.driven`) placed like any job (`ClusterJobs`): its
adapter sits in its engine's bank, and its calls (`contract.training_calls`) become that job's work,
scheduled under the hybrid policy and the tenant's virtual token counter like a job's
(`finetune.driven_ops`).

This class keeps the runs by id and tenant and queues each run's calls in the order they arrive
(Tinker's SDK sends a client's calls one after the other, in `seq_id` order, each once the one before
it was accepted), at most `MAX_QUEUED_CALLS` not done per run, and counts the tokens of its forward and
forward_backward calls (the tenant's `max_training_tokens_per_job`). Its saves are `run_saves`' (paths
resolved for their tenant only, names checked whole, deletion); it records each save when the engine
has written it and hands it to the caller then (`after_step`: the storage quota is checked at save
time, not when the client reads the outcome). It hands out outcomes. A call to a run that waits for an
engine or an adapter slot waits with it, and its pending answer says why.

A run lives as long as its session (its id is `<session>:train:<n>`): it ends when the session finishes
or sends no heartbeat for `session_timeout_s`, and its adapter slot goes back. Its saves stay on disk,
each with the run's `run.json` (its tenant and settings), so a later run loads them. Pure Python.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from coserve.cluster.jobs import ClusterJobs
from coserve.cluster.run_saves import RUN_FILE, RUN_ID, RunSaves, tree_size
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.loss_spec import LossSpec
from coserve.contract.trainer_state import read_trainer_state
from coserve.contract.training_calls import (
    CallFailure,
    CallOutcome,
    CallPending,
    CallTicket,
    ForwardBackwardCall,
    LoadCall,
    RunCheckpoint,
    RunInfo,
    RunRequest,
    SaveCall,
    SaveOutcome,
    TrainingCall,
)
from coserve.contract.training_settings import LoRASettings
from coserve.finetune.driven_ops import DrivenCall, DrivenOp, ResolvedLoad, driven_calls

MAX_QUEUED_CALLS = 16  # calls of one run not done yet; more wait at the client (a 429 it retries)
SESSION_TIMEOUT_S = 120.0  # the SDK heartbeats every 10 s, and warns after 2 minutes without one
KEEP_UNREAD_S = 3600.0  # a done call's outcome waits this long for its client
FIRST_RUN_ADAPTER_ID = 2**50  # runs' adapter ids: above every job's and every served adapter's


@dataclass(slots=True)
class _Run:
    info: RunInfo
    folder: Path
    session: str
    unplaced: list[DrivenOp] = field(default_factory=list)  # in order, while the run waits for an engine
    tokens: int = 0  # tokens of its accepted forward and forward_backward calls (the tenant's quota)
    queued: list[DrivenOp] = field(default_factory=list)  # its calls not known to be done


class TrainingRuns:
    """Driven runs over `jobs` (module docstring).

    Args:
        jobs: the cluster's jobs (a run is one of them).
        base_model: the served base model's id, and its path (written into saved adapters).
        folder: where runs keep their saves (`<folder>/<run id>/...`).
        num_layers: the model's.
        session_timeout_s: a session silent this long (no heartbeat, no call) ends with its runs.
        clock: seconds, for held calls, sessions and checkpoint times.
    """

    def __init__(self, jobs: ClusterJobs, base_model: tuple[str, str], folder: Path, num_layers: int,
                 session_timeout_s: float = SESSION_TIMEOUT_S, clock: Callable[[], float] = time.time) -> None:
        self._jobs, (self._base_id, self._base_path) = jobs, base_model
        self._folder, self._num_layers, self._clock = folder, num_layers, clock
        self._session_timeout_s = session_timeout_s
        self._runs: dict[str, _Run] = {}
        self._calls: dict[str, tuple[str, DrivenOp]] = {}  # call id -> (tenant, op)
        self._run_of: dict[str, str] = {}  # call id -> its run
        self._seen: dict[str, float] = {}  # session id -> its last heartbeat or call
        self._recorded: set[str] = set()  # calls whose save was recorded
        self.saves = RunSaves(folder)
        jobs.on_placed.append(self._placed)

    def create(self, request: RunRequest, like_path: str | None = None) -> RunInfo | CallFailure:
        """Start a run of `request.tenant` (it waits for an engine like a job when none has room); with
        `like_path`, with the LoRA settings of the run that saved it."""
        if like_path is not None:
            folder = self.saves.resolve_path(request.tenant, like_path)
            if isinstance(folder, CallFailure):
                return folder
            saved = json.loads((folder.parent.parent / RUN_FILE).read_text())
            request = RunRequest(request.tenant, request.run_id, LoRASettings.from_dict(saved["lora"]),
                                 int(saved["seed"]), request.metadata)
        run_id = request.run_id
        if not re.fullmatch(RUN_ID, run_id) or run_id in self._runs or (self._folder / run_id).exists():
            return CallFailure("invalid_run_id", f"training run id {run_id!r} is taken or malformed")
        folder = self._folder / run_id
        info = RunInfo(run_id, request.tenant, self._base_id, request.lora, 0)
        folder.mkdir(parents=True, exist_ok=False)
        (folder / RUN_FILE).write_text(json.dumps({"tenant": request.tenant, "base_model": self._base_id,
                                                   "lora": request.lora.to_dict(), "seed": request.seed}))
        spec = FinetuneJobSpec(job_id=run_id, tenant=request.tenant, adapter_id=FIRST_RUN_ADAPTER_ID + len(self._runs),
                               examples=[], n_epochs=1, batch_size=1, seed=request.seed,
                               num_layers=self._num_layers, output_dir=str(folder), lora=request.lora,
                               base_model_name_or_path=self._base_path, loss=LossSpec(), driven=True)
        self._jobs.start(spec)
        session = run_id.split(":", 1)[0]
        self._runs[run_id] = _Run(info, folder, session)
        self._seen[session] = self._clock()
        return info

    def session_alive(self, tenant: str, session_id: str) -> None:
        if any(r.session == session_id and r.info.tenant == tenant for r in self._runs.values()):
            self._seen[session_id] = self._clock()

    def close_session(self, tenant: str, session_id: str, why: str = "its session finished") -> None:
        """End the session's runs: their jobs are cancelled, their adapter slots freed; saves stay."""
        for run in self._runs.values():
            if run.session == session_id and run.info.tenant == tenant and run.info.failure is None:
                run.info.failure = CallFailure("run_closed", f"training run {run.info.run_id} was closed: {why}; "
                                               "its saved weights stay (load them into a new run)")
                self._jobs.cancel(run.info.run_id)
                self._fail(run.unplaced, run.info.failure)
                run.unplaced.clear()
        self._seen.pop(session_id, None)

    @property
    def base_model_id(self) -> str:
        return self._base_id

    def live_runs(self, tenant: str) -> int:
        """The tenant's runs that have not ended."""
        return sum(1 for r in self._runs.values() if r.info.tenant == tenant and r.info.failure is None)

    def info(self, tenant: str, run_id: str) -> RunInfo | CallFailure:
        run = self._runs.get(run_id)
        if run is None or run.info.tenant != tenant:
            return CallFailure("run_not_found", f"training run {run_id!r} does not exist")
        job = self._jobs.get(run_id)
        calls = None if job is None else driven_calls(job.source)
        if calls is not None:
            run.info.steps = calls.steps
        return run.info

    def submit(self, tenant: str, run_id: str, call: TrainingCall) -> CallTicket | CallFailure:
        """Queue a call on the tenant's run (a refusal: unknown run, bad name or path)."""
        run = self._runs.get(run_id)
        if run is None or run.info.tenant != tenant:
            return CallFailure("run_not_found", f"training run {run_id!r} does not exist")
        if run.info.failure is not None:
            return run.info.failure
        run.queued = [op for op in run.queued if not op.done]
        if len(run.queued) >= MAX_QUEUED_CALLS:
            return CallFailure("too_many_queued_calls", f"training run {run_id} has {MAX_QUEUED_CALLS} calls "
                               "not done yet, the most a run queues; retry once one is done")
        resolved = self._resolve(tenant, run, call)
        if isinstance(resolved, CallFailure):
            return resolved
        if isinstance(resolved, ForwardBackwardCall):
            run.tokens += sum(len(d.token_ids) - 1 for d in resolved.data)
        op = DrivenOp(f"call-{uuid.uuid4().hex[:24]}", resolved, self._clock())
        run.queued.append(op)
        self._calls[op.call_id] = (tenant, op)
        self._run_of[op.call_id] = run_id
        self._seen[run.session] = self._clock()
        self._deliver(run, op)
        return CallTicket(op.call_id, run_id)

    def tokens(self, run_id: str) -> int:
        """Tokens of the run's accepted forward and forward_backward calls."""
        run = self._runs.get(run_id)
        return 0 if run is None else run.tokens

    def forget_save(self, tenant: str, path: str) -> None:
        """Remove saved weights of the tenant's runs (over its storage quota) and their record."""
        folder = self.saves.resolve_path(tenant, path)
        if isinstance(folder, CallFailure):
            return
        self.saves.remove(folder)
        for run in self._runs.values():
            run.info.checkpoints = [c for c in run.info.checkpoints if c.path != path]

    def delete_save(self, tenant: str, run_id: str, checkpoint_id: str) -> str | CallFailure:
        """Delete a save of the tenant's run, ended or not (`RunSaves.delete`); returns its path."""
        path = self.saves.delete(tenant, run_id, checkpoint_id)
        run = self._runs.get(run_id)
        if run is not None and isinstance(path, str):
            run.info.checkpoints = [c for c in run.info.checkpoints if c.path != path]
        return path

    def outcome(self, tenant: str, call_id: str) -> CallOutcome | CallPending:
        """The call's outcome, or why it is pending; an unknown call, or another tenant's, is a failure."""
        entry = self._calls.get(call_id)
        if entry is None or entry[0] != tenant:
            return CallFailure("call_not_found", f"no call {call_id!r}")
        op = entry[1]
        if op.outcome is not None:
            return op.outcome
        run_id = self._run_of.get(call_id, "")
        run = self._runs.get(run_id)
        if run is not None and op in run.unplaced:
            reason = self._jobs.waiting_reason(run_id)
            return CallPending(None if reason is None else f"the training run waits for an engine: {reason}")
        job = self._jobs.get(run_id)
        waits = None if job is None or job.parking is None else job.parking.wait_reason
        return CallPending(None if waits is None else f"the training run waits for an adapter slot: {waits}")

    def forget(self, call_id: str) -> None:
        """The call's outcome was delivered: it is not kept."""
        self._calls.pop(call_id, None)
        self._run_of.pop(call_id, None)
        self._recorded.discard(call_id)

    def after_step(self) -> list[tuple[str, DrivenOp]]:
        """After any engine step: end the runs of silent sessions, mark runs whose job ended, and record the
        saves done since the last call, returned as (tenant, call) for the storage quota."""
        now = self._clock()
        for session, seen in list(self._seen.items()):
            if now - seen > self._session_timeout_s:
                for tenant in {r.info.tenant for r in self._runs.values() if r.session == session}:
                    self.close_session(tenant, session, f"its session sent no heartbeat for "
                                       f"{self._session_timeout_s:g} s")
        for run in self._runs.values():
            if run.info.failure is None and run.info.run_id not in self._jobs.job_ids:
                run.info.failure = CallFailure("run_ended", "the training run ended (its engine was lost or "
                                               "it failed); start a new run from its last saved state",
                                               user=False)
                mine = [op for call_id, (_, op) in self._calls.items() if self._run_of[call_id] == run.info.run_id]
                self._fail(mine, run.info.failure)  # queued in the job's object, which went with it
                run.unplaced.clear()
        saved = []
        for call_id, (tenant, op) in list(self._calls.items()):
            if isinstance(op.outcome, SaveOutcome) and isinstance(op.call, SaveCall) and call_id not in self._recorded:
                self._recorded.add(call_id)
                self._record_save(op.outcome, op.call)
                saved.append((tenant, op))
            if op.done and now - op.created > KEEP_UNREAD_S:  # its client never asked
                self.forget(call_id)
        return saved

    # ----------------------------------------------------------------------------- internals

    def _placed(self, run_id: str) -> None:
        """A run's job was placed (at once, or when a slot freed): its waiting calls go to it."""
        run = self._runs.get(run_id)
        if run is not None and run.unplaced:
            waiting, run.unplaced = run.unplaced, []
            for op in waiting:
                self._deliver(run, op)

    def _deliver(self, run: _Run, op: DrivenOp) -> None:
        """To the run's job; while it waits for an engine, after the calls already waiting."""
        job = self._jobs.get(run.info.run_id)
        calls = None if job is None else driven_calls(job.source)
        if calls is None or run.unplaced:
            run.unplaced.append(op)
            return
        calls.submit(op)
        self._jobs.work_arrived(run.info.run_id)

    @staticmethod
    def _fail(ops: list[DrivenOp], failure: CallFailure) -> None:
        for op in ops:
            if op.outcome is None:
                op.outcome = failure

    def _resolve(self, tenant: str, run: _Run, call: TrainingCall) -> DrivenCall | CallFailure:
        if isinstance(call, SaveCall):
            return self.saves.check_name(run.info.run_id, call.name, call.resumable) or call
        if not isinstance(call, LoadCall):
            return call
        folder = self.saves.resolve_path(tenant, call.path)
        if isinstance(folder, CallFailure):
            return folder
        steps = 0
        if call.with_optimizer:
            try:
                steps = read_trainer_state(folder).position.step
            except (OSError, ValueError, KeyError):
                return CallFailure("invalid_path", f"{call.path!r} is not a saved training state "
                                   f"(save_state writes one)")
        return ResolvedLoad(str(folder), call.path, call.with_optimizer, steps)

    def _record_save(self, outcome: SaveOutcome, call: SaveCall) -> None:
        parsed = RunSaves.parse(outcome.path)
        assert parsed is not None  # made by driven_ops
        run_id, kind, name = parsed
        run = self._runs.get(run_id)
        folder = self._folder / run_id / kind / name
        if run is None or not folder.is_dir():
            return
        run.info.checkpoints = [c for c in run.info.checkpoints if c.path != outcome.path]  # saved again
        run.info.checkpoints.append(RunCheckpoint(call.name, outcome.path, call.resumable, self._clock(),
                                                     tree_size(folder)))
