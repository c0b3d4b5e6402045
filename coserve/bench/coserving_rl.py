"""The co-serving benchmark's reinforcement job (`coserve bench co-serving --method reinforcement`).

The job: 64 synthetic prompts (`traces.synthetic_reinforcement_rows`: the questions of the chat
benchmark's conversations, the answers kept as each row's `answer`), GRPO with 4 samples per prompt of at
most `--rollout-tokens` tokens (default 32), 2 prompts per step (8 trained sequences a step), graded by
`text_similarity` `fuzzy_match` against the row's answer (RapidFuzz: a continuous reward, so groups have
non-zero advantages), importance-sampling loss, LoRA r=16. Its rollouts are inference requests of the
job's tenant, so every policy co-batches them with the chat traffic; what differs is when the training
pieces run: coserve's hybrid share, or a time-sliced baseline (`temporal-n16`: a whole iteration of
training every 16; rollouts in between, as colocated RL frameworks alternate a rollout phase and a
training phase). The latency model is calibrated with the supervised job of the same lengths (an RL job's
batches only exist once its rollouts are graded). Each run reports RL steps/s (`rl_steps_per_s`: trained
sequences/s over the 8 of a step) and each step's time sampling, grading and training
(`rollout_phases`). The simulator check is skipped (the simulator samples no log-probs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coserve.bench.replay import RolloutSetup, RunRecord
from coserve.bench.traces import synthetic_reinforcement_rows
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.reinforcement import BASE_SAMPLES, ReinforcementRequest
from coserve.contract.sampling import EosIds
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings
from coserve.graders.rollout_grading import RolloutGrader

GRADER = {"type": "text_similarity", "name": "close", "input": "{{ sample.output_text }}",
          "reference": "{{ item.answer }}", "evaluation_metric": "fuzzy_match"}
PROMPTS_PER_STEP = 2
DEFAULT_ROLLOUT_TOKENS = 32


def reinforcement_spec(tokenizer: Any, num_layers: int, max_len: int, output_dir: Path, seed: int,
                       lengths: tuple[int, int], adapter_id: int,
                       rollout_tokens: int = DEFAULT_ROLLOUT_TOKENS) -> FinetuneJobSpec:
    """The benchmark's reinforcement job (module docstring); `lengths`: the conversations' range, whose
    questions (about a third) are the prompts."""
    from coserve.jobs.reinforcement_data import prepare_reinforcement_job

    rows = synthetic_reinforcement_rows(tokenizer, 64, seed, lengths[0], lengths[1])
    request = ReinforcementRequest(GRADER, compute_multiplier=1.0, max_completion_tokens=rollout_tokens)
    return prepare_reinforcement_job(
        tokenizer, rows, request, job_id="bench", tenant="finetune", adapter_id=adapter_id, num_layers=num_layers,
        max_len=max_len, output_dir=output_dir,
        hyperparameters=HyperparameterRequest(n_epochs=50, batch_size=PROMPTS_PER_STEP),
        lora=LoRASettings(r=16, lora_alpha=32), seed=seed, python=False).spec


def rollout_setup(tokenizer: Any, model_eos_ids: list[int]) -> RolloutSetup:
    """Rollouts stop at the model's EOS; grading runs inline (fuzzy matching 32 tokens is microseconds)."""
    grading = RolloutGrader(lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))
    return RolloutSetup(EosIds.resolve(tokenizer, model_eos_ids), grading)


def reinforcement_metrics(record: RunRecord, sequences_per_s: float) -> dict[str, Any]:
    """A run's RL steps/s and its steps' phases."""
    return {"rl_steps_per_s": sequences_per_s / (PROMPTS_PER_STEP * BASE_SAMPLES),
            "rollout_phases": record.rollout_phases}
