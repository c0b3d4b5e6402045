"""Offline reinforcement fine-tuning (`LLM.start_reinforcement`): a job and its rollout loop.

Rows are OpenAI's reinforcement rows: `messages` (the prompt, ending with a user turn) plus any fields
the grader reads as `{{ item.<field> }}`. Each row's prompt is its messages through the chat template
with the generation prompt. The grader is OpenAI's JSON (or a parsed `Grader`); python graders run in a
`PythonGraderRunner` (this process is the user's own: no operator switch offline).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coserve.contract.grader import Grader, parse_grader
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.training_plan import TrainingExample
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings, SettingsError
from coserve.finetune.rollouts import RolloutSettings
from coserve.frontend.chat_template import encode_chat
from coserve.graders.checks import check_grader
from coserve.graders.grading import grade
from coserve.graders.python_grader import PythonGraderRunner


@dataclass(frozen=True, slots=True)
class ReinforcementJob:
    """A prepared reinforcement job: its spec, its prompts' token ids and its reward function."""

    spec: FinetuneJobSpec
    prompts: list[list[int]]
    settings: RolloutSettings
    reward: Callable[[int, list[int]], float]


def _prompts(tokenizer: Any, rows: Sequence[Mapping[str, Any]], max_len: int, max_tokens: int) -> list[list[int]]:
    prompts = []
    for i, row in enumerate(rows):
        messages = row.get("messages") if isinstance(row, Mapping) else None
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "user":
            raise SettingsError("training_file", f"row {i + 1}: `messages` must end with a user turn")
        _, ids = encode_chat(tokenizer, messages)
        if len(ids) + max_tokens > max_len:
            raise SettingsError("training_file", f"row {i + 1}: its prompt ({len(ids)} tokens) and "
                                f"{max_tokens} sampled tokens exceed the context of {max_len}")
        prompts.append(list(ids))
    return prompts


def prepare_reinforcement(tokenizer: Any, rows: Sequence[Mapping[str, Any]], grader: Grader | Mapping[str, Any],
                          *, job_id: str, adapter_id: int, num_layers: int, max_len: int, output_dir: str,
                          hyperparameters: HyperparameterRequest | None = None, lora: LoRASettings | None = None,
                          seed: int = 0, samples: int = 4, max_tokens: int = 64,
                          loss: LossSpec | None = None, base_model_name_or_path: str | None = None,
                          ) -> ReinforcementJob:
    """The job (module docstring). Raises SettingsError for a bad row, grader or setting."""
    parsed = grader if not isinstance(grader, Mapping) else parse_grader(grader)
    check_grader(parsed, python=True)
    loss = loss or LossSpec(LossKind.IMPORTANCE_SAMPLING)
    if not loss.kind.needs_sampling_logprobs:
        raise SettingsError("loss", f"a reinforcement job trains a policy-gradient loss, not {loss.kind.value}")
    settings = RolloutSettings(samples, max_tokens)
    prompts = _prompts(tokenizer, rows, max_len, max_tokens)
    resolved = (hyperparameters or HyperparameterRequest()).resolve(len(prompts), sum(len(p) for p in prompts))
    spec = FinetuneJobSpec(job_id=job_id, tenant="offline", adapter_id=adapter_id,
                           examples=[TrainingExample(p, [False] * len(p)) for p in prompts],
                           n_epochs=resolved.n_epochs, batch_size=resolved.batch_size, seed=seed,
                           num_layers=num_layers, output_dir=output_dir, lora=lora or LoRASettings(),
                           optimizer=resolved.optimizer_settings(), loss=loss,
                           base_model_name_or_path=base_model_name_or_path)
    runner = PythonGraderRunner()
    items = [dict(row) for row in rows]

    def reward(index: int, completion: list[int]) -> float:
        text = tokenizer.decode(completion, skip_special_tokens=True)
        return grade(parsed, items[index], text, runner).reward

    return ReinforcementJob(spec, prompts, settings, reward)
