"""`/v1/fine_tuning/jobs`: create, list, retrieve, cancel, pause, resume, events, checkpoints.

Reference: https://platform.openai.com/docs/api-reference/fine-tuning. The gateway writes intents into
the metadata store (a new job in `validating_files`, `cancelled`, `paused`, `queued` on resume); the
scheduler's `JobManager` applies them to the engine and writes progress back, so a job survives a
gateway or scheduler restart. Another tenant's job is 404 like an unknown one.

A reinforcement job is checked at creation, before it exists: its grader must be one this server runs in
a job (`job_request.grader_variables`), and every row of its files must hold each `{{ item.* }}` value
the grader reads (else a 400 naming the variable, the file and the row).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from coserve.api.auth import Caller
from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.files import validate_finetune_jsonl
from coserve.api.protocol.fine_tuning import (
    CheckpointMetrics,
    FineTuningJob,
    FineTuningJobCheckpoint,
    FineTuningJobCheckpointList,
    FineTuningJobCreate,
    FineTuningJobError,
    FineTuningJobEvent,
    FineTuningJobEventList,
    FineTuningJobList,
    Hyperparameters,
    LoRAParams,
    Method,
    TrainingParams,
)
from coserve.api.serving.job_request import GRADER_PARAM, DedicatedCapacity, grader_variables, job_request
from coserve.api.serving.storage_errors import storage_quota_error, tenant_limits
from coserve.contract.job_request import FineTuningMethod, JobRequest
from coserve.contract.training_rows import ParsedTrainingFile, TrainingFileKind
from coserve.contract.training_settings import HYPERPARAMETERS, MIN_EXAMPLES, TooFewExamplesError, auto_n_epochs
from coserve.graders.checks import Variable
from coserve.graders.item_fields import missing_item_field
from coserve.store import MetadataStore
from coserve.store.records import CheckpointRecord, EventRecord, JobRecord, JobStatus
from coserve.store.usage import RESERVED_MODELS_KEY
from coserve.tenancy.quotas import TenantQuota
from coserve.tenancy.storage_quota import admit_job, has_storage_limits, models_per_job
from coserve.tenancy.tenants import TenantsConfig

REWARD_METRICS = ("train_reward_", "valid_reward_", "train_grade_", "valid_grade_")
# The rows each method trains on.
METHOD_FILES = {FineTuningMethod.SUPERVISED: TrainingFileKind.CHAT,
                FineTuningMethod.DPO: TrainingFileKind.PREFERENCE,
                FineTuningMethod.REINFORCEMENT: TrainingFileKind.REINFORCEMENT}


def to_job(record: JobRecord) -> FineTuningJob:
    """The OpenAI `fine_tuning.job` of a stored job (`method` echoes the hyperparameters, resolved once
    the job's file is tokenized, and DPO's beta)."""
    request = JobRequest.from_row(record.hyperparameters, record.method, record.extensions)
    hp = {k: record.hyperparameters.get(k, "auto") for k in HYPERPARAMETERS}
    training = request.training.to_dict()
    return FineTuningJob(
        id=record.id, created_at=record.created_at, model=record.model, organization_id=record.tenant,
        status=record.status.value, training_file=record.training_file,
        validation_file=record.validation_file, seed=record.seed, hyperparameters=Hyperparameters(**hp),
        method=Method.model_validate(request.method_json(hp)),
        fine_tuned_model=record.fine_tuned_model, finished_at=record.finished_at,
        trained_tokens=record.trained_tokens, estimated_finish=record.estimated_finish,
        error=FineTuningJobError(**record.error) if record.error else None,
        metadata=record.metadata, result_files=record.result_files,
        user_provided_suffix=record.suffix,
        lora=LoRAParams(**request.lora.to_dict()) if request.lora else None,
        training=TrainingParams(**training) if training else None)


def to_event(record: EventRecord) -> FineTuningJobEvent:
    return FineTuningJobEvent(id=record.id, created_at=record.created_at, level=record.level,  # type: ignore[arg-type]
                              message=record.message, data=record.data, type=record.type)  # type: ignore[arg-type]


def to_checkpoint(record: CheckpointRecord) -> FineTuningJobCheckpoint:
    # OpenAI's fields, a DPO job's rewards (TRL's names: `rewards/accuracies`, ...) and a reinforcement
    # job's (`train_reward_mean`, `train_reward/<sub-grader>`, ...) beside them.
    metrics = {k: v for k, v in record.metrics.items()
               if k in CheckpointMetrics.model_fields or "/" in k or k.startswith(REWARD_METRICS)}
    return FineTuningJobCheckpoint(id=record.id, created_at=record.created_at,
                                   fine_tuned_model_checkpoint=record.fine_tuned_model_checkpoint,
                                   fine_tuning_job_id=record.job_id, step_number=record.step_number,
                                   metrics=CheckpointMetrics(**metrics))


def _check_item_fields(variables: list[Variable], parsed: ParsedTrainingFile, param: str) -> None:
    """Every row of the file (`param`) holds each `{{ item.* }}` value the grader reads.

    Raises:
        ProtocolError: 400 `invalid_grader` naming the first missing variable, the file and the row.
    """
    for number, row in enumerate(parsed.rows, start=1):
        missing = missing_item_field(variables, row)
        if missing is not None:
            raise ProtocolError(f"the grader reads {missing}, and row {number} of the {param} has no such "
                                f"value; give every row the fields the grader reads", param=GRADER_PARAM,
                                code="invalid_grader")


def _no_file(file_id: str, param: str) -> ProtocolError:
    return ProtocolError(f"invalid {param}: no such file {file_id}", param=param, code="invalid_file")


def _job_not_found(job_id: str) -> ProtocolError:
    return ProtocolError.not_found(f"No such fine-tuning job: {job_id}", param="fine_tuning_job_id",
                                   code="fine_tuning_job_not_found")


class FineTuningService:
    """The fine-tuning endpoints over the metadata store.

    Args:
        store: where jobs live.
        tenants: the tenants file (limits on concurrent jobs).
        base_models: the base model ids a job may train from (besides the tenant's fine-tuned models).
        max_lora_rank: the engine's largest adapter rank; a larger `lora.r` is a 400 (None: unchecked).
        dedicated: the Ray cluster's room for dedicated runs (None: no Ray; asking for one is a 400).
        python_graders: the server runs `python` graders (`--enable-python-graders`); else a
            reinforcement job graded by one is a 400.
        live_runs: the tenant's open Tinker training runs, which count against `max_concurrent_jobs`
            with its jobs (`TinkerFutures.live_runs`).
    """

    def __init__(self, store: MetadataStore, tenants: TenantsConfig, base_models: tuple[str, ...],
                 max_lora_rank: int | None = None, dedicated: DedicatedCapacity | None = None,
                 python_graders: bool = False, live_runs: Callable[[str], int] = lambda tenant: 0) -> None:
        self.store, self.tenants, self.base_models = store, tenants, base_models
        self.max_lora_rank, self.dedicated, self.python_graders = max_lora_rank, dedicated, python_graders
        self.live_runs = live_runs

    def create(self, tenant: str, body: FineTuningJobCreate) -> FineTuningJob:
        """Check the model, the files and the tenant's job limit, then record the job.

        Raises:
            ProtocolError: 400 naming `model`, `training_file` or `validation_file`; 429 over the
                tenant's concurrent-jobs limit; 403 `model_quota_exceeded` when the models the job will
                write (reserved now) do not fit under `max_fine_tuned_models`, or `storage_quota_exceeded`
                when the tenant has no byte left under `max_stored_bytes`; 400 naming `training.mode`
                or `training.workers` for a dedicated run this server cannot hold (`training_mode`);
                400 `invalid_grader` for a reinforcement grader this server cannot run, or that reads
                an item field a row lacks.
        """
        self._check_model(tenant, body.model)
        request = job_request(body, self.max_lora_rank, self.dedicated)
        if body.lora is not None and body.model not in self.base_models:
            # Training on from a fine-tuned model continues its adapter, whose shape is fixed: settings
            # given here could not apply, and ignoring them silently would mislead.
            raise ProtocolError("lora: a job that continues a fine-tuned model trains that model's adapter "
                                "as it is (its r, lora_alpha and target_modules); leave lora out",
                                param="lora", code="invalid_lora")
        variables = grader_variables(request.reinforcement, self.python_graders,
                                     lambda model: self._usable_model(tenant, model)) \
            if request.reinforcement is not None else None
        count = self._count_examples(tenant, body.training_file, "training_file", request.method, variables)
        if count < MIN_EXAMPLES:
            err = TooFewExamplesError(count)
            raise ProtocolError(err.message, param=err.param, code="invalid_n_examples")
        if body.validation_file is not None:
            self._count_examples(tenant, body.validation_file, "validation_file", request.method, variables)
        self._check_job_limit(tenant)
        hp = request.hyperparameters
        # "auto" resolves from the examples the trainer keeps, which the job manager counts again (and
        # checks the reservation again) once it has tokenized the file.
        n_epochs = hp.n_epochs if hp.n_epochs is not None else auto_n_epochs(count)
        reserved = models_per_job(n_epochs)
        limits = tenant_limits(self.tenants, tenant)
        if has_storage_limits(limits):  # measuring walks the tenant's adapter folders: only when needed
            refusal = admit_job(limits, self.store.usage.of(tenant), reserved)
            if refusal is not None:
                raise storage_quota_error(refusal, None)
        row = request.row()
        record = self.store.jobs.create(
            tenant, body.model, body.training_file, validation_file=body.validation_file,
            hyperparameters=row.hyperparameters, method=row.method, suffix=body.suffix,
            seed=body.seed, metadata=body.metadata,
            extensions={**row.extensions, RESERVED_MODELS_KEY: reserved})
        self.store.events.add(record.id, f"Created fine-tuning job: {record.id}")
        return to_job(record)

    def _usable_model(self, tenant: str, model: str) -> bool:
        """Whether `model` is this server's base model or one of the tenant's fine-tuned models."""
        if model in self.base_models:
            return True
        record = self.store.models.get(tenant, model)
        return record is not None and record.adapter_path is not None

    def _check_model(self, tenant: str, model: str) -> None:
        if model in self.base_models:
            return
        record = self.store.models.get(tenant, model)
        if record is None or record.adapter_path is None:
            raise ProtocolError(f"Model {model} is not available for fine-tuning or does not exist.",
                                param="model", code="model_not_available")

    def _count_examples(self, tenant: str, file_id: str, param: str, method: FineTuningMethod,
                        variables: list[Variable] | None = None) -> int:
        """The examples of a file the job trains (or validates) on, checked for the method (and, given the
        grader's `variables`, for the item fields it reads)."""
        record = self.store.files.get(tenant, file_id)
        if record is None:
            raise _no_file(file_id, param)
        if record.purpose != "fine-tune":
            raise ProtocolError(f"invalid {param}: file {file_id} has purpose '{record.purpose}', "
                                f"not 'fine-tune'", param=param, code="invalid_file_purpose")
        summary = self._parsed(tenant, file_id, param)
        wanted = METHOD_FILES[method]
        if summary.kind != wanted:
            raise ProtocolError(f"invalid {param}: file {file_id} holds {summary.kind.value} rows, and a "
                                f"{method.value} job trains on {wanted.value} rows", param=param,
                                code="invalid_file_format")
        if variables:
            _check_item_fields(variables, summary, param)
        return summary.num_examples

    def _parsed(self, tenant: str, file_id: str, param: str) -> ParsedTrainingFile:
        """The file as it was parsed at upload; a file uploaded before the server kept that is parsed now,
        once, and kept so (the job manager reads it too)."""
        stored = self.store.files.parsed(tenant, file_id)
        if stored is not None:
            return ParsedTrainingFile.from_bytes(stored)
        content = self.store.files.content(tenant, file_id)
        if content is None:  # deleted meanwhile
            raise _no_file(file_id, param)
        try:
            parsed = validate_finetune_jsonl(content)
        except ProtocolError as err:
            raise ProtocolError(f"invalid {param}: {err.message}", param=param,
                                code="invalid_file_format") from None
        self.store.files.keep_parsed(tenant, file_id, parsed.to_bytes())
        return parsed

    def _check_job_limit(self, tenant: str) -> None:
        """The tenant's concurrent-jobs quota (training tokens are checked once the file is tokenized)."""
        config = self.tenants.tenants.get(tenant)
        if config is None:
            return
        active = sum(1 for job in self.store.jobs.active() if job.tenant == tenant) + self.live_runs(tenant)
        refusal = TenantQuota(config.limits).admit_job(active, 0)
        if refusal is None:
            return
        retry = refusal.retry_after_s
        if retry is None:
            # A limit that can never clear: 403, which clients (the official one included) do not retry.
            raise ProtocolError(f"{refusal.reason}. Ask the operator to raise the tenant's "
                                f"{refusal.limit}.", status=403, type="insufficient_quota",
                                param=None, code="quota_exceeded")
        raise ProtocolError(f"{refusal.reason} (Tinker training runs included). Retry when one of your jobs or "
                            "runs ends.", status=429,
                            type="rate_limit_error", code="rate_limit_exceeded",
                            headers={"retry-after": str(math.ceil(retry))})

    def scope(self, caller: Caller, job_id: str) -> str:
        """The tenant a request on job `job_id` acts for: the caller's own, or for an admin the job's owner.

        Raises:
            ProtocolError: 404 for an admin naming a job that does not exist.
        """
        if caller.tenant is not None:
            return caller.tenant
        owner = self.store.jobs.owner(job_id)
        if owner is None:
            raise _job_not_found(job_id)
        return owner

    def list_page(self, tenant: str | None, after: str | None, limit: int) -> FineTuningJobList:
        """A page of `tenant`'s jobs; every tenant's for None (an admin)."""
        try:
            records, has_more = self.store.jobs.page(tenant, after=after, limit=limit)
        except ValueError as err:
            raise ProtocolError(str(err), param="after") from None
        return FineTuningJobList(data=[to_job(r) for r in records], has_more=has_more)

    def retrieve(self, tenant: str, job_id: str) -> FineTuningJob:
        return to_job(self._get(tenant, job_id))

    def _get(self, tenant: str, job_id: str) -> JobRecord:
        record = self.store.jobs.get(tenant, job_id)
        if record is None:
            raise _job_not_found(job_id)
        return record

    def _transition(self, tenant: str, job_id: str, status: JobStatus, allowed: set[JobStatus],
                    verb: str) -> FineTuningJob:
        record = self._get(tenant, job_id)
        if record.status not in allowed:
            raise ProtocolError(f"Cannot {verb} job {job_id}: it is {record.status.value}.",
                                param="fine_tuning_job_id", code="invalid_job_status")
        try:
            record = self.store.jobs.update(job_id, status=status)
        except ValueError as err:  # the scheduler moved it meanwhile (e.g. it just succeeded)
            raise ProtocolError(f"Cannot {verb} job {job_id}: {err}", param="fine_tuning_job_id",
                                code="invalid_job_status") from None
        self.store.events.add(job_id, f"Job {status.value if status != JobStatus.QUEUED else 'resumed'}"
                              f" by request")
        return to_job(record)

    def cancel(self, tenant: str, job_id: str) -> FineTuningJob:
        active = {JobStatus.VALIDATING_FILES, JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED}
        return self._transition(tenant, job_id, JobStatus.CANCELLED, active, "cancel")

    def pause(self, tenant: str, job_id: str) -> FineTuningJob:
        return self._transition(tenant, job_id, JobStatus.PAUSED, {JobStatus.QUEUED, JobStatus.RUNNING},
                                "pause")

    def resume(self, tenant: str, job_id: str) -> FineTuningJob:
        return self._transition(tenant, job_id, JobStatus.QUEUED, {JobStatus.PAUSED}, "resume")

    def events(self, tenant: str, job_id: str, after: str | None, limit: int) -> FineTuningJobEventList:
        self._get(tenant, job_id)
        try:
            records, has_more = self.store.events.page(tenant, job_id, after=after, limit=limit)
        except ValueError as err:
            raise ProtocolError(str(err), param="after") from None
        return FineTuningJobEventList(data=[to_event(r) for r in records], has_more=has_more)

    def checkpoints(self, tenant: str, job_id: str, after: str | None,
                    limit: int) -> FineTuningJobCheckpointList:
        self._get(tenant, job_id)
        try:
            records, has_more = self.store.checkpoints.page(tenant, job_id, after=after, limit=limit)
        except ValueError as err:
            raise ProtocolError(str(err), param="after") from None
        data = [to_checkpoint(r) for r in records]
        return FineTuningJobCheckpointList(data=data, has_more=has_more,
                                           first_id=data[0].id if data else None,
                                           last_id=data[-1].id if data else None)
