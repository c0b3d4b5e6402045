"""Offline reinforcement fine-tuning (`LLM.start_reinforcement`): the job, prepared as the server prepares
one (`jobs.reinforcement_data`), and its grading on the caller's thread.

This process is the user's own, so python graders run here without an operator's switch (each still in
its bubblewrap sandbox, `graders.python_grader`; without bubblewrap a python grader's samples score 0
with `python_grader_server_error` type `sandbox_unavailable`, naming the package).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.reinforcement import BASE_SAMPLES, ReinforcementRequest
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings
from coserve.graders.python_grader import PythonGraderRunner
from coserve.graders.rollout_grading import RolloutGrader
from coserve.jobs.prepared_job import PreparedJob
from coserve.jobs.reinforcement_data import prepare_reinforcement_job


def prepare_reinforcement(tokenizer: Any, rows: Sequence[Mapping[str, Any]], grader: Mapping[str, Any],
                          *, job_id: str, adapter_id: int, num_layers: int, max_len: int, output_dir: str,
                          hyperparameters: HyperparameterRequest | None = None, lora: LoRASettings | None = None,
                          seed: int = 0, samples: int = 4, max_tokens: int = 64, loss: LossSpec | None = None,
                          base_model_name_or_path: str | None = None, validation: Sequence[Mapping[str, Any]] = (),
                          eval_interval: int | None = None) -> PreparedJob:
    """The job: `samples` completions per prompt of at most `max_tokens` tokens, graded by `grader` (OpenAI's
    JSON). Raises SettingsError for a bad row, grader or setting."""
    request = ReinforcementRequest(grader, compute_multiplier=samples / BASE_SAMPLES, eval_interval=eval_interval,
                                   max_completion_tokens=max_tokens)
    return prepare_reinforcement_job(
        tokenizer, rows, request, job_id=job_id, tenant="offline", adapter_id=adapter_id, num_layers=num_layers,
        max_len=max_len, output_dir=output_dir, hyperparameters=hyperparameters, lora=lora, seed=seed,
        base_model_name_or_path=base_model_name_or_path, validation=validation,
        loss=loss or LossSpec(LossKind.IMPORTANCE_SAMPLING))


def offline_grading(tokenizer: Any) -> RolloutGrader:
    """Grading on the caller's thread, python graders in their sandbox."""
    return RolloutGrader(lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True), PythonGraderRunner())
