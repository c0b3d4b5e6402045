"""Default sizes of a server, in one place: the scheduler's budgets, the KV block and adapter bank
sizes, fine-tuning's minimum share of an engine's time and its forward window, how long a paused dedicated run keeps its
workers.

`SchedulerConfig`, `SchedulerSettings`, `ServeOptions`, `coserve serve`'s flags, `EngineConfig`,
the offline `LLM` and `CoServingConfig` take their defaults from here (torch-free, so the gateway
and the scheduler's process import it freely).
"""

from __future__ import annotations

MAX_NUM_SEQS = 64  # requests running at once
MAX_BATCH_TOKENS = 2048  # tokens computed in one engine iteration
BLOCK_SIZE = 16  # token positions per KV block
ADAPTER_SLOTS = 4  # LoRA adapters resident in the engine's bank at once
MAX_LORA_RANK = 64  # the largest adapter rank the bank holds
FINETUNE_MIN_SHARE = 0.05  # fine-tuning's least share of an engine's time while a job is runnable
FINETUNE_WINDOW_TOKENS = 256  # a fine-tuning job's longest forward window (FinetuneJobSpec.max_window_tokens)
DEDICATED_PAUSE_TIMEOUT_S = 300.0  # a paused dedicated run's workers are given back after this long
