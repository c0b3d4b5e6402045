"""Token-level LoRA fine-tuning on the engine: adapters, the windowed forward/backward, losses, steps.
Imported by: torch_engine, vllm, dedicated, bench."""

from coserve.contract.data_position import DataPosition
from coserve.trainer.checkpoint import load_checkpoint, save_checkpoint
from coserve.trainer.lora_params import TrainableLoRA, peft_key
from coserve.trainer.loss import IGNORE_INDEX, WindowLoss, chunked_cross_entropy, full_cross_entropy, window_loss
from coserve.trainer.optimizer import LoRAOptimizer, NonFiniteGradientError, StepStats, TrainingSequence, train_batch
from coserve.trainer.windowed import SequenceState, WindowedTrainer, next_token_targets, run_schedule, train_sequence

__all__ = ["IGNORE_INDEX", "DataPosition", "LoRAOptimizer",
           "NonFiniteGradientError",
           "SequenceState", "StepStats",
           "TrainableLoRA", "TrainingSequence", "WindowLoss", "WindowedTrainer",
           "chunked_cross_entropy", "full_cross_entropy", "load_checkpoint", "next_token_targets",
           "peft_key", "run_schedule",
           "save_checkpoint", "train_batch", "train_sequence", "window_loss"]
