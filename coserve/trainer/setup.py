"""A job's trainable adapter and optimizer at its start: fresh, from a fine-tuned model, or resumed.

One function for both ways a job trains: the engine's co-served trainer (`TrainingRuntime`, from the
plan's `JobStart`) and a dedicated Ray Train run (`coserve.dedicated.worker`, from the job's spec on
every worker). The same seed gives the same initial weights in both, so their loss curves agree.
"""

from __future__ import annotations

import torch

from coserve.contract.training_settings import LoRASettings, OptimizerSettings
from coserve.model.config import ModelConfig
from coserve.trainer.checkpoint import load_checkpoint
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.optimizer import LoRAOptimizer


def build_trainable(cfg: ModelConfig, device: torch.device | str, lora: LoRASettings,
                    optimizer: OptimizerSettings, seed: int, resume_from: str | None = None,
                    init_adapter: str | None = None) -> tuple[TrainableLoRA, LoRAOptimizer]:
    """The adapter and optimizer a job starts with.

    `resume_from`: a checkpoint folder (adapter, optimizer state, data position). `init_adapter`: a PEFT
    folder to train on from (its own LoRA settings, a fresh optimizer). Neither: PEFT's init of `lora`
    drawn from `seed`.

    Raises:
        OSError, ValueError, TypeError, KeyError: an unreadable or mismatched checkpoint or adapter.
    """
    if resume_from is not None:
        trainable, opt, _ = load_checkpoint(resume_from, cfg, device)
        return trainable, opt
    if init_adapter is not None:
        trainable = TrainableLoRA.from_pretrained(init_adapter, cfg, device)
    else:
        trainable = TrainableLoRA.init(cfg, lora, seed, device)
    return trainable, LoRAOptimizer(trainable, optimizer)
