"""A fine-tuning job's spec from chat examples (or DPO's preference rows): `prepare_job` tokenizes them
with the chat template (loss-masked to the assistant tokens) and resolves every "auto" setting. The
server's job manager and the offline `LLM` both start jobs from it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.training_plan import TrainingExample
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings, ResolvedHyperparameters
from coserve.jobs.preference_data import prepare_preference_data
from coserve.jobs.training_data import TrainingData, prepare_training_data

# Offline fine-tuning adapters take ids from here down, far from users' LoRARequest ids.
FIRST_TRAINING_ADAPTER_ID = 2**40


class ValidationFileError(ValueError):
    """The validation file cannot be tokenized (its job fails with `invalid_validation_file`)."""


@dataclass(slots=True)
class PreparedJob:
    """A job ready to schedule, and what preparing its data found."""

    spec: FinetuneJobSpec
    dataset: TrainingData
    hyperparameters: ResolvedHyperparameters


def prepare_job(tokenizer: Any, examples: Sequence[Mapping[str, Any] | Sequence[Mapping[str, Any]]],
                *, job_id: str, tenant: str, adapter_id: int, num_layers: int, max_len: int,
                output_dir: str | Path, hyperparameters: HyperparameterRequest | None = None,
                lora: LoRASettings | None = None, seed: int = 0,
                base_model_name_or_path: str | None = None,
                init_adapter: str | None = None,
                validation: Sequence[Mapping[str, Any] | Sequence[Mapping[str, Any]]] = (),
                loss: LossSpec | None = None) -> PreparedJob:
    """Tokenize the examples with the chat template and resolve every "auto" setting.

    `hyperparameters` None is all "auto"; `lora` None trains `LoRASettings()`; `loss` None is
    cross-entropy (a DPO loss takes preference rows: `jobs.preference_data`).

    Raises:
        TooFewExamplesError: fewer than 10 usable examples.
        SettingsError: a bad hyperparameter (`param` names it).
        ValueError: a conversation the template cannot mask exactly (`ValidationFileError` when it is
            in the validation file).
    """
    loss = loss or LossSpec()
    dataset, rejected = _tokenize(tokenizer, examples, max_len, loss, "training")
    resolved = (hyperparameters or HyperparameterRequest()).resolve(len(dataset.examples),
                                                                    dataset.trained_tokens)
    try:
        held_out, held_out_rejected = _tokenize(tokenizer, validation, max_len, loss, "validation") \
            if validation else (None, [])
    except ValueError as err:
        raise ValidationFileError(str(err)) from err
    spec = FinetuneJobSpec(
        job_id=job_id, tenant=tenant, adapter_id=adapter_id,
        examples=dataset.examples,
        n_epochs=resolved.n_epochs, batch_size=resolved.batch_size, seed=seed,
        num_layers=num_layers, output_dir=str(output_dir),
        lora=lora or LoRASettings(), optimizer=resolved.optimizer_settings(),
        base_model_name_or_path=base_model_name_or_path, init_adapter=init_adapter,
        validation_examples=held_out.examples if held_out else [], loss=loss,
        rejected_examples=rejected, validation_rejected=held_out_rejected)
    return PreparedJob(spec, dataset, resolved)


def _tokenize(tokenizer: Any, examples: Sequence[Any], max_len: int, loss: LossSpec,
              what: str) -> tuple[TrainingData, list[TrainingExample]]:
    """The examples' sequences, with a DPO job's rejected answers ([] for other losses)."""
    if loss.kind == LossKind.DPO:
        pairs = prepare_preference_data(tokenizer, examples, max_len, what=f"{what} pair")
        return pairs.chosen, pairs.rejected
    return prepare_training_data(tokenizer, examples, max_len, what=f"{what} example"), []
