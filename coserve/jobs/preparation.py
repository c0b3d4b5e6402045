"""Turning a stored fine-tuning job into one the policy can run: the one place a job is validated.

`JobManager` calls `JobPreparation.prepare` for a new job (on the job loop's worker thread) and again for
a job resumed after a restart; everything that can refuse a job before it trains is here: the files
still exist, the base model is this server's or the tenant's own fine-tuned model, the per-job token
quota, the tenant's storage, and where the job trains (the shared engines or Ray Train).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coserve.contract.job_request import JobRequest
from coserve.contract.training_jsonl import RowError, read_rows
from coserve.contract.training_rows import ParsedTrainingFile
from coserve.contract.training_settings import LoRASettings
from coserve.finetune.dedicated import DedicatedSettings
from coserve.jobs.dedicated_jobs import route_job
from coserve.jobs.failures import JobRefused
from coserve.jobs.prepared_job import FIRST_TRAINING_ADAPTER_ID, PreparedJob, prepare_job
from coserve.jobs.reinforcement_data import prepare_reinforcement_job
from coserve.jobs.storage import JobStorage
from coserve.jobs.watchdog import DEFAULT_STALL_AFTER_S
from coserve.store import MetadataStore
from coserve.store.records import JobRecord
from coserve.tenancy.quotas import TenantLimits, TenantQuota
from coserve.tenancy.storage_quota import QUOTA_CODES


@dataclass(frozen=True, slots=True)
class FineTuningSettings:
    """What the scheduler's job manager needs to know of the server it runs jobs for."""

    base_model_id: str  # the public id of the served base model
    base_model_path: str
    data_dir: Path  # adapters go to {data_dir}/adapters/{job_id}/ (stored as absolute paths)
    num_layers: int
    max_model_len: int
    stall_after_s: float = DEFAULT_STALL_AFTER_S  # a running job without progress this long gets an event
    dedicated: DedicatedSettings | None = None  # jobs on Ray Train of their own (None: no Ray, none)
    python_graders: bool = False  # reinforcement jobs may grade with `python` graders


class JobPreparation:
    """Validates and tokenizes jobs for one server; hands out the adapter ids of the jobs it prepares.

    Args:
        store: the metadata store (files, models, job rows, events).
        tokenizer: the engine's tokenizer (torch-free).
        settings: the server's fine-tuning settings.
        limits: tenant -> quota limits (a tenant not in it has the defaults).
        storage: the tenant storage reservations.
    """

    def __init__(self, store: MetadataStore, tokenizer: Any, settings: FineTuningSettings,
                 limits: Mapping[str, TenantLimits], storage: JobStorage) -> None:
        self._store, self._tokenizer, self._settings = store, tokenizer, settings
        self._limits, self._storage = limits, storage
        self._next_adapter_id = FIRST_TRAINING_ADAPTER_ID

    def prepare(self, record: JobRecord, *, resume: bool = False) -> PreparedJob:
        """The job's training data tokenized, its hyperparameters resolved, its route (engine or Ray Train)
        decided and, for a new job (not `resume`), its storage reserved and its resolved hyperparameters and
        data warnings written to the store.

        Raises:
            ValueError: the job cannot run (`JobRefused` with its OpenAI code and param, or the
                tokenizer's reason); `failures.failure` maps it to the job's error (and anything else
                to an internal error).
        """
        examples = self._rows(record, record.training_file, "training_file")
        validation = [] if record.validation_file is None else \
            self._rows(record, record.validation_file, "validation_file")
        request = JobRequest.from_row(record.hyperparameters, record.method, record.extensions)
        init_adapter = None
        if record.model != self._settings.base_model_id:
            model = self._store.models.get(record.tenant, record.model)
            if model is None or model.adapter_path is None:
                raise JobRefused(f"model {record.model} is not this server's base model or one of "
                                 f"your fine-tuned models", "model_not_available", "model")
            init_adapter = model.adapter_path
        common: dict[str, Any] = dict(
            job_id=record.id, tenant=record.tenant, adapter_id=self._allocate_adapter_id(),
            num_layers=self._settings.num_layers, max_len=self._settings.max_model_len,
            output_dir=self._settings.data_dir.resolve() / "adapters" / record.id,
            hyperparameters=request.hyperparameters, lora=request.lora or LoRASettings(), seed=record.seed,
            base_model_name_or_path=self._settings.base_model_path, init_adapter=init_adapter, validation=validation)
        if request.reinforcement is not None:  # always co-served: its rollouts sample the adapter it trains
            prepared = prepare_reinforcement_job(self._tokenizer, examples, request.reinforcement,
                                                 python=self._settings.python_graders, judges=True, **common)
        else:
            prepared = prepare_job(self._tokenizer, examples, loss=request.loss(), **common)
            route_job(self._store, record, prepared.hyperparameters.total_trained_tokens, self._settings.dedicated,
                      decide=not resume)  # decided once, kept in the row; JobRefused when it needs Ray
        quota = TenantQuota(self._limits.get(record.tenant, TenantLimits()))
        # The concurrency part of the quota was checked when the job was created.
        refusal = quota.admit_job(0, prepared.hyperparameters.total_trained_tokens)
        if refusal is not None and refusal.limit == "max_training_tokens_per_job":
            raise JobRefused(refusal.reason, "quota_exceeded", "training_file")
        if not resume:  # a resumed job keeps the reservation it was admitted with
            refusal = self._storage.reserve(record, prepared.hyperparameters.n_epochs)
            if refusal is not None:
                raise JobRefused(refusal.reason, QUOTA_CODES[refusal.limit], None)
            hp = prepared.hyperparameters
            self._store.jobs.update(record.id, hyperparameters={
                "n_epochs": hp.n_epochs, "batch_size": hp.batch_size,
                "learning_rate_multiplier": hp.learning_rate_multiplier})
            for warning in prepared.dataset.warnings:
                self._store.events.add(record.id, warning, level="warn")
        return prepared

    def _rows(self, record: JobRecord, file_id: str, param: str) -> list[Any]:
        """The rows of one of the job's files, as the gateway parsed them at upload (`contract.training_rows`);
        a file stored before the server kept them (a job created before too) is read as strictly as at upload
        (one stored before a check existed fails the job naming the line)."""
        code = f"invalid_{param}"
        parsed = self._store.files.parsed(record.tenant, file_id)
        if parsed is not None:
            return ParsedTrainingFile.from_bytes(parsed).rows
        content = self._store.files.content(record.tenant, file_id)
        if content is None:
            raise JobRefused(f"the {param.replace('_', ' ')} {file_id} no longer exists", code, param)
        try:
            return read_rows(content)
        except RowError as err:
            raise JobRefused(f"the {param.replace('_', ' ')} {file_id} cannot be read: {err}", code, param) from None

    def _allocate_adapter_id(self) -> int:
        self._next_adapter_id += 1
        return self._next_adapter_id

