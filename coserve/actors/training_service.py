"""`TrainingService`: the scheduler's answers to the gateway about driven training runs.

The gateway's Tinker API (`coserve.api.routers.tinker`) asks with a `RunQuery`
(`contract.training_calls`): create a run, submit a call, await a call's outcome, read a run. The runs
themselves are `cluster.training_runs.TrainingRuns`; this class adds what needs the actor: waiting on
the event loop for a call to finish (woken after every engine step), waking the engine loops when work
arrives, the tenants' quota of runs, and the store, where a sampler's weights become a model id the
OpenAI API serves (`tinker:<run id>:<name>`) the moment they are saved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path

from coserve.cluster.run_saves import RunSaves
from coserve.cluster.training_runs import TrainingRuns
from coserve.contract.training_calls import (
    AwaitOutcome,
    CallFailure,
    CallPending,
    CloseSession,
    CreateRun,
    DeleteSave,
    ForwardBackwardCall,
    GetRun,
    RunAnswer,
    RunQuery,
    SaveCall,
    SaveOutcome,
    SessionAlive,
    SubmitCall,
)
from coserve.store.store import MetadataStore
from coserve.tenancy.quotas import TenantLimits

MAX_WAIT_S = 30.0  # one AwaitOutcome waits at most this long (the SDK's retrieve times out at 45 s)
REPORT_WAITING_S = 2.0  # a call of a run that waits for an engine answers this soon, with the reason


class TrainingService:
    """Answers `RunQuery`s on the scheduler's loop (module docstring).

    Args:
        runs: the runs.
        store: where sampler weights are registered as models.
        limits: the tenants' quotas (`max_concurrent_jobs` counts runs too).
        wake: wakes the engine loops (a call has work for them).
    """

    def __init__(self, runs: TrainingRuns, store: MetadataStore, limits: Mapping[str, TenantLimits],
                 wake: Callable[[], None]) -> None:
        self._runs, self._store, self._limits, self._wake = runs, store, dict(limits), wake
        self._progress = asyncio.Event()

    async def answer(self, query: RunQuery) -> RunAnswer:
        self._settle()  # an idle engine takes no step: silent sessions end here too
        if isinstance(query, CreateRun):
            refusal = self._quota(query.request.tenant)
            if refusal is not None:
                return refusal
            info = self._runs.create(query.request, query.like_path)
            self._wake()
            return info
        if isinstance(query, SubmitCall):
            refusal = self._token_refusal(query) or self._save_refusal(query)
            if refusal is not None:
                return refusal
            ticket = self._runs.submit(query.tenant, query.run_id, query.call)
            self._wake()
            return ticket
        if isinstance(query, GetRun):
            return self._runs.info(query.tenant, query.run_id)
        if isinstance(query, SessionAlive):
            self._runs.session_alive(query.tenant, query.session_id)
            return None
        if isinstance(query, CloseSession):
            self._runs.close_session(query.tenant, query.session_id)
            self._wake()
            return None
        if isinstance(query, DeleteSave):
            return self._delete(query)
        return await self._await(query)

    def after_step(self) -> None:
        """An engine step was applied: calls may be done."""
        self._settle()
        progress, self._progress = self._progress, asyncio.Event()
        progress.set()

    def _settle(self) -> None:
        """The runs' bookkeeping (`TrainingRuns.after_step`); each save the engine wrote since is checked
        against its tenant's storage quota now (removed and failed when over it), and a sampler's weights
        become an OpenAI model id."""
        for tenant, op in self._runs.after_step():
            saved = op.outcome
            assert isinstance(saved, SaveOutcome)
            refused = self._storage_refusal(tenant, saved)
            if refused is None and "/sampler_weights/" in saved.path:
                saved.model_id = self._register(tenant, saved.path)
                if saved.model_id is None:
                    self._runs.forget_save(tenant, saved.path)
                    refused = CallFailure("invalid_name", f"the model id of {saved.path} was deleted, and a deleted "
                                          "model's id is not used again: save under another name")
            if refused is not None:
                op.outcome = refused

    def _delete(self, query: DeleteSave) -> CallFailure | None:
        """Delete a save; a sampler's weights stop being a model id at once (their bytes are freed)."""
        path = self._runs.delete_save(query.tenant, query.run_id, query.checkpoint_id)
        if isinstance(path, CallFailure):
            return path
        parsed = RunSaves.parse(path)
        assert parsed is not None
        run_id, kind, name = parsed
        if kind == "sampler_weights":
            self._store.models.delete(query.tenant, f"tinker:{run_id}:{name}")
        return None

    async def _await(self, query: AwaitOutcome) -> RunAnswer:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(query.timeout_s, 0.0), MAX_WAIT_S)
        report_by = loop.time() + REPORT_WAITING_S
        while True:
            outcome = self._runs.outcome(query.tenant, query.call_id)
            remaining = deadline - loop.time()
            waiting = isinstance(outcome, CallPending) and outcome.reason is not None
            if not isinstance(outcome, CallPending) or remaining <= 0 or (waiting and loop.time() >= report_by):
                break
            if waiting:
                remaining = min(remaining, max(report_by - loop.time(), 0.01))
            try:
                await asyncio.wait_for(self._progress.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        if isinstance(outcome, CallPending) or (isinstance(outcome, CallFailure) and outcome.code == "call_not_found"):
            return outcome
        self._runs.forget(query.call_id)  # delivered: its outcome is not kept
        return outcome

    def _storage_refusal(self, tenant: str, saved: SaveOutcome) -> CallFailure | None:
        """Over the tenant's `max_stored_bytes`, the saved folder is removed and the save fails."""
        limits = self._limits.get(tenant, TenantLimits())
        if limits.max_stored_bytes is None:
            return None
        folder = self._runs.saves.resolve_path(tenant, saved.path)
        if isinstance(folder, CallFailure):
            return None
        usage = self._store.usage.of(tenant)
        if usage.stored_bytes <= limits.max_stored_bytes:
            return None
        self._runs.forget_save(tenant, saved.path)
        return CallFailure("storage_quota_exceeded", f"the saved weights would bring your stored bytes to "
                           f"{usage.stored_bytes}, over max_stored_bytes={limits.max_stored_bytes}; they were "
                           f"not kept. Delete files, fine-tuned models or saved weights to free space")

    def _register(self, tenant: str, path: str) -> str | None:
        """The OpenAI model id of a sampler's weights (registered once)."""
        folder = self._runs.saves.resolve_path(tenant, path)
        if isinstance(folder, CallFailure):
            return None
        run_id, name = folder.parent.parent.name, folder.name
        model_id = f"tinker:{run_id}:{name}"
        if self._store.models.get(tenant, model_id) is None:
            try:
                self._store.models.register(model_id, tenant=tenant, base_model=self._runs.base_model_id,
                                            adapter_path=str(Path(folder).resolve()))
            except ValueError:  # deleted (DELETE /v1/models) and saved again: ids are never reused
                return None
        return model_id

    def _token_refusal(self, query: SubmitCall) -> CallFailure | None:
        """A `forward_backward` or `forward` that would take a run past the tenant's
        `max_training_tokens_per_job` (the tokens of a run's forward and forward_backward calls)."""
        limit = self._limits.get(query.tenant, TenantLimits()).max_training_tokens_per_job
        if limit is None or not isinstance(query.call, ForwardBackwardCall):
            return None
        tokens = sum(len(d.token_ids) - 1 for d in query.call.data)
        done = self._runs.tokens(query.run_id)
        if done + tokens <= limit:
            return None
        what = "forward_backward" if query.call.backward else "forward"
        return CallFailure("quota_exceeded", f"this {what} ({tokens} tokens) would take the run to {done + tokens} "
                           f"tokens of forward and forward_backward calls, over max_training_tokens_per_job={limit}")

    def _save_refusal(self, query: SubmitCall) -> CallFailure | None:
        """A save while the tenant stores `max_stored_bytes` already (one that fits is checked again once
        written, `_settle`)."""
        cap = self._limits.get(query.tenant, TenantLimits()).max_stored_bytes
        if cap is None or not isinstance(query.call, SaveCall):
            return None
        stored = self._store.usage.of(query.tenant).stored_bytes
        if stored < cap:
            return None
        return CallFailure("storage_quota_exceeded", f"you store {stored} bytes, max_stored_bytes={cap}: no room "
                           "for more saved weights. Delete saves (RestClient.delete_checkpoint), files or "
                           "fine-tuned models to free space")

    def _quota(self, tenant: str) -> CallFailure | None:
        limit = self._limits.get(tenant, TenantLimits()).max_concurrent_jobs
        if limit is None:
            return None
        running = self._runs.live_runs(tenant) + sum(1 for job in self._store.jobs.active() if job.tenant == tenant)
        if running >= limit:
            return CallFailure("quota_exceeded", f"tenant {tenant!r} may run {limit} fine-tuning jobs and "
                               f"training runs at once; {running} are running")
        return None
