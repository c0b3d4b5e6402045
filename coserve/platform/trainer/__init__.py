"""Token-level LoRA fine-tuning: trainable adapters, the windowed exact forward/backward, the loss."""

from coserve.platform.trainer.lora_params import LoRATrainConfig, TrainableLoRA, peft_key
from coserve.platform.trainer.loss import (IGNORE_INDEX, WindowLoss, chunked_cross_entropy,
                                           window_loss)
from coserve.platform.trainer.windowed import (SequenceState, WindowedTrainer, next_token_targets,
                                               run_schedule, train_sequence)

__all__ = ["IGNORE_INDEX", "LoRATrainConfig", "SequenceState", "TrainableLoRA", "WindowLoss",
           "WindowedTrainer", "chunked_cross_entropy", "next_token_targets", "peft_key",
           "run_schedule", "train_sequence", "window_loss"]
