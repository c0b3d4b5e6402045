"""A reinforcement job ready to run: its rows' prompts tokenized, its grader checked against them, every
"auto" resolved (`prepare_reinforcement_job`). The server's job manager and the offline `LLM` both use it.

Rows are OpenAI's reinforcement rows: `messages` (the prompt, ending with a user turn) plus any fields the
grader reads as `{{ item.<field> }}`. Each prompt is its messages through the chat template with the
generation prompt. A prompt with `max_completion_tokens` more must fit the context (a prompt whose text
certainly does not, at `longest_token_chars` characters a token, is refused without being tokenized).

"auto" hyperparameters resolve as for supervised jobs (`HyperparameterRequest.resolve`), counting as a
job's trained tokens the most its rollouts can train: prompts x samples x `max_completion_tokens` per
epoch (the per-job token quota is checked against that bound).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.reinforcement import ReinforcementRequest, RolloutSpec
from coserve.contract.training_plan import TrainingExample
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings, SettingsError
from coserve.frontend.chat_template import chat_template_refusal, encode_chat
from coserve.frontend.prompt_encoder import longest_token_chars
from coserve.graders.checks import check_grader
from coserve.graders.item_fields import missing_item_field
from coserve.jobs.prepared_job import PreparedJob, ValidationFileError
from coserve.jobs.training_data import TrainingData


def _prompts(tokenizer: Any, rows: Sequence[Mapping[str, Any]], max_len: int, max_tokens: int,
             param: str) -> list[list[int]]:
    prompts = []
    longest = longest_token_chars(tokenizer)
    for i, row in enumerate(rows):
        messages = row.get("messages") if isinstance(row, Mapping) else None
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], Mapping) \
                or messages[-1].get("role") != "user":
            raise SettingsError(param, f"row {i + 1}: `messages` must end with a user turn")
        chars = sum(len(m["content"]) for m in messages if isinstance(m, Mapping) and isinstance(m.get("content"), str))
        if -(-chars // longest) + max_tokens > max_len:  # too long for certain: not even tokenized
            raise SettingsError(param, f"row {i + 1}: its prompt (at least {-(-chars // longest)} tokens) and "
                                f"{max_tokens} sampled tokens exceed the context of {max_len}")
        try:
            _, ids = encode_chat(tokenizer, messages)
        except Exception as err:  # noqa: BLE001 - whatever the template or tokenizer raises is the row's fault
            raise SettingsError(param, f"row {i + 1}: {chat_template_refusal(err)}") from err
        if len(ids) + max_tokens > max_len:
            raise SettingsError(param, f"row {i + 1}: its prompt ({len(ids)} tokens) and {max_tokens} sampled "
                                f"tokens exceed the context of {max_len}")
        prompts.append(list(ids))
    return prompts


def _check_items(variables: list[tuple[str, list[str | int]]], rows: Sequence[Mapping[str, Any]],
                 what: str) -> None:
    for i, row in enumerate(rows):
        missing = missing_item_field(variables, row)
        if missing is not None:
            raise SettingsError("method.reinforcement.grader",
                                f"the grader reads {missing}, which row {i + 1} of the {what} file lacks")


def prepare_reinforcement_job(tokenizer: Any, rows: Sequence[Mapping[str, Any]], request: ReinforcementRequest,
                              *, job_id: str, tenant: str, adapter_id: int, num_layers: int, max_len: int,
                              output_dir: str | Path, hyperparameters: HyperparameterRequest | None = None,
                              lora: LoRASettings | None = None, seed: int = 0,
                              base_model_name_or_path: str | None = None, init_adapter: str | None = None,
                              validation: Sequence[Mapping[str, Any]] = (), python: bool = True,
                              judges: bool = False,
                              loss: LossSpec = LossSpec(LossKind.IMPORTANCE_SAMPLING)) -> PreparedJob:
    """The job (module docstring); `python`: whether python graders may run here; `judges`: whether model
    graders can (a server judges with the models it serves); `loss`: a policy-gradient loss (importance
    sampling, PPO or CISPO).

    Raises:
        TooFewExamplesError: fewer than 10 rows.
        SettingsError: a bad row, grader or setting (`param` names it; `ValidationFileError` for the
            validation file's rows).
    """
    if not loss.kind.needs_sampling_logprobs:
        raise SettingsError("loss", f"a reinforcement job trains a policy-gradient loss, not {loss.kind.value}")
    grader = request.parsed_grader()
    variables = check_grader(grader, "method.reinforcement.grader", python=python, judges=judges)
    _check_items(variables, rows, "training")
    max_tokens = request.completion_tokens
    prompts = _prompts(tokenizer, rows, max_len, max_tokens, "training_file")
    bound = len(prompts) * request.samples * max_tokens
    resolved = (hyperparameters or HyperparameterRequest()).resolve(len(prompts), bound)
    try:
        _check_items(variables, validation, "validation")
        eval_prompts = _prompts(tokenizer, validation, max_len, max_tokens, "validation_file")
    except SettingsError as err:
        raise ValidationFileError(err.message) from err
    rollouts = RolloutSpec(grader, [dict(r) for r in rows], request.samples, max_tokens, eval_prompts,
                           [dict(r) for r in validation], request.resolved_eval_interval(resolved.total_steps),
                           request.eval_samples or 1)
    spec = FinetuneJobSpec(
        job_id=job_id, tenant=tenant, adapter_id=adapter_id,
        examples=[TrainingExample(p, [False] * len(p)) for p in prompts], n_epochs=resolved.n_epochs,
        batch_size=resolved.batch_size, seed=seed, num_layers=num_layers, output_dir=str(output_dir),
        lora=lora or LoRASettings(), optimizer=resolved.optimizer_settings(),
        base_model_name_or_path=base_model_name_or_path, init_adapter=init_adapter,
        loss=loss, rollouts=rollouts)
    dataset = TrainingData(spec.examples, num_examples=len(rows), num_skipped=0, num_truncated=0,
                           trained_tokens=bound, example_indices=list(range(len(rows))))
    return PreparedJob(spec, dataset, resolved)
