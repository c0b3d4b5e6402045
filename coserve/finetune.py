"""Fine-tuning jobs from chat examples: building a job's spec, and running jobs offline next to `LLM`.

    from coserve import LLM
    llm = LLM(model="path/to/hf-folder", dtype="float32")
    result = llm.fine_tune(examples, output_dir="out/my-job", hyperparameters={"n_epochs": 2})
    # result.adapter_path is a PEFT folder: serve it with LoRARequest("mine", 1, result.adapter_path)

`LLM.start_fine_tune` returns at once; the job then trains inside every `generate`/`chat` call (the
same iterations as the inference tokens) and `LLM.wait` finishes it. Offline there is no latency
SLO: each iteration gives fine-tuning what the inference tokens leave of `max_batch_tokens`
(forward-window tokens, or the same number of full-depth tokens as backward token-layers).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coserve.platform.trainer.data import PreparedDataset, prepare_dataset
from coserve.policies.adapter_slots import AdapterSlots
from coserve.policies.finetune_job import (FinetuneJob, FinetuneJobSpec, JobEvent, JobEventKind,
                                           JobState)
from coserve.policies.job_host import JobHost
from coserve.policies.job_roster import whole_iteration_allowance
from coserve.policies.kv_blocks import KVBlockManager
from coserve.policies.plan import IterationPlan, IterationResult
from coserve.policies.training_plan import TrainingExample
from coserve.policies.training_settings import HyperparameterRequest, LoRASettings, ResolvedHyperparameters
from coserve.policies.vtc import VirtualTokenCounter, VTCWeights

# Offline fine-tuning adapters take ids from here down, far from users' LoRARequest ids.
FIRST_TRAINING_ADAPTER_ID = 2**40


class ValidationFileError(ValueError):
    """The validation file cannot be tokenized (its job fails with `invalid_validation_file`)."""


@dataclass(slots=True)
class PreparedJob:
    """A job ready to schedule, and what preparing its data found."""

    spec: FinetuneJobSpec
    dataset: PreparedDataset
    hyperparameters: ResolvedHyperparameters


def prepare_job(tokenizer: Any, examples: Sequence[Mapping[str, Any] | Sequence[Mapping[str, Any]]],
                *, job_id: str, tenant: str, adapter_id: int, num_layers: int, max_len: int,
                output_dir: str | Path, hyperparameters: HyperparameterRequest | None = None,
                lora: LoRASettings | None = None, seed: int = 0,
                base_model_name_or_path: str | None = None,
                init_adapter: str | None = None,
                validation: Sequence[Mapping[str, Any] | Sequence[Mapping[str, Any]]] = ()) -> PreparedJob:
    """Tokenize the examples with the chat template and resolve every "auto" setting.

    `hyperparameters` None is all "auto"; `lora` None trains `LoRASettings()`.

    Raises:
        TooFewExamplesError: fewer than 10 usable examples.
        SettingsError: a bad hyperparameter (`param` names it).
        ValueError: a conversation the template cannot mask exactly (`ValidationFileError` when it is
            in the validation file).
    """
    dataset = prepare_dataset(tokenizer, examples, max_len)
    resolved = (hyperparameters or HyperparameterRequest()).resolve(len(dataset.sequences),
                                                                    dataset.trained_tokens)
    try:
        held_out = (prepare_dataset(tokenizer, validation, max_len, what="validation example").sequences
                    if validation else [])
    except ValueError as err:
        raise ValidationFileError(str(err)) from err
    spec = FinetuneJobSpec(
        job_id=job_id, tenant=tenant, adapter_id=adapter_id,
        examples=[TrainingExample(seq.token_ids.tolist(), seq.trained.tolist())
                  for seq in dataset.sequences],
        n_epochs=resolved.n_epochs, batch_size=resolved.batch_size, seed=seed,
        num_layers=num_layers, output_dir=str(output_dir),
        lora=lora or LoRASettings(), optimizer=resolved.optimizer_settings(),
        base_model_name_or_path=base_model_name_or_path, init_adapter=init_adapter,
        validation_examples=[TrainingExample(seq.token_ids.tolist(), seq.trained.tolist())
                             for seq in held_out])
    return PreparedJob(spec, dataset, resolved)


@dataclass(slots=True)
class FineTuneResult:
    """A finished offline job."""

    job_id: str
    state: JobState
    adapter_path: str | None  # the final PEFT adapter (None unless the job succeeded)
    checkpoints: list[str]  # one resumable, servable checkpoint per epoch
    events: list[JobEvent]
    trained_tokens: int
    warnings: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def losses(self) -> list[float]:
        """The mean training loss of every optimizer step, in order."""
        return [e.loss for e in self.events if e.kind == JobEventKind.STEP and e.loss is not None]

    @property
    def validation_losses(self) -> list[float]:
        """The validation set's mean token loss at the end of each epoch (empty without one)."""
        return [e.loss for e in self.events if e.kind == JobEventKind.VALIDATION and e.loss is not None]


@dataclass(slots=True)
class _Tracked:
    job: FinetuneJob
    warnings: list[str]
    events: list[JobEvent] = field(default_factory=list)


class OfflineJobs:
    """Fine-tuning jobs attached to one policy and engine: the `LLM`'s `EngineCore` `JobSide` (the
    core calls `schedule` after the policy plans an iteration and `update` after the engine ran it).

    The jobs live in a `JobHost` (`host`), the same class the co-serving policy keeps its jobs in, so
    the server's `JobManager` can drive offline jobs through it too (add, cancel, pause, resume, pop
    events); offline there is no SLO, so the allowance is what the inference tokens leave of
    `max_batch_tokens`. Jobs submitted here stay here, finished, for their results.
    """

    def __init__(self, kv: KVBlockManager, adapters: AdapterSlots, max_batch_tokens: int,
                 num_layers: int) -> None:
        self.host = JobHost(VirtualTokenCounter(VTCWeights()), kv, adapters)
        self._max_batch_tokens, self._num_layers = max_batch_tokens, num_layers
        self._jobs: dict[str, _Tracked] = {}
        self._adapter_ids = itertools.count(FIRST_TRAINING_ADAPTER_ID)

    def next_adapter_id(self) -> int:
        return next(self._adapter_ids)

    def submit(self, prepared: PreparedJob) -> FinetuneJob:
        """Schedule a prepared job from the next iteration on. Raises ValueError on a duplicate id."""
        job = FinetuneJob(prepared.spec, self.host.kv, self.host.adapters)
        if job.job_id in self._jobs:
            raise ValueError(f"job id {job.job_id!r} is already used")
        self.host.add_job(job)
        self._jobs[job.job_id] = _Tracked(job, list(prepared.dataset.warnings))
        return job

    def _collect_events(self) -> None:
        """Keep the events of the jobs submitted here (a `JobManager` pops its own from `host`)."""
        for event in self.host.pop_job_events():
            tracked = self._jobs.get(event.job_id)
            if tracked is not None:
                tracked.events.append(event)

    def schedule(self, plan: IterationPlan) -> None:
        """Apply deferred control, then give the running jobs what the inference tokens leave of
        the iteration's token budget."""
        roster = self.host.roster
        roster.apply_control(plan)
        budget = max(0, self._max_batch_tokens - plan.num_tokens)
        if budget == 0:
            return
        # Both amounts: a sequence whose forward completes may start its backward at once.
        roster.fill(plan, whole_iteration_allowance(budget, budget * self._num_layers))

    def update(self, plan: IterationPlan, result: IterationResult) -> None:
        self.host.roster.update(plan, result)

    def result(self, job_id: str) -> FineTuneResult:
        self._collect_events()  # events nobody popped yet belong to the result too
        tracked = self._jobs[job_id]
        job, events = tracked.job, tracked.events
        final = next((e.path for e in events if e.kind == JobEventKind.SUCCEEDED), None)
        failure = next((e for e in events if e.kind == JobEventKind.FAILED), None)
        return FineTuneResult(
            job_id=job_id, state=job.state, adapter_path=final,
            checkpoints=[e.path for e in events if e.kind == JobEventKind.CHECKPOINT and e.path],
            events=list(events), trained_tokens=job.trained_tokens, warnings=list(tracked.warnings),
            error=None if failure is None else f"{failure.code}: {failure.message}")

    def job(self, job_id: str) -> FinetuneJob:
        return self._jobs[job_id].job
