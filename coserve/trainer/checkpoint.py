"""Training checkpoints: adapter + optimizer state + data position in one folder, written atomically.

Layout of a checkpoint folder:

* `adapter_config.json`, `adapter_model.safetensors`: the adapter in PEFT format, at the top level so
  the folder itself loads in `peft` and in the engine's adapter bank (checkpoints are servable).
* `optimizer.pt`: `LoRAOptimizer.state_dict()` (AdamW moments as tensors), `torch.save`d; read back
  with `weights_only=True`, so a checkpoint cannot run code.
* `trainer_state.json`: the format version, the `DataPosition` (seed, epoch, index, step) and the job's
  counters that a resume must continue rather than restart: `trained_tokens` (trained tokens of the
  steps up to this checkpoint; absent in checkpoints written before it was kept; read torch-free by
  `coserve.contract.trainer_state`).

The data order is a rule, not stored data: epoch e of a job with seed s visits the examples in `DataPosition.order`
= a permutation drawn from (s, e) (`coserve.contract.data_position`). A position (epoch, index) plus the seed is
therefore enough to continue with exactly the batches an uninterrupted run would have taken.

Atomicity: everything is written and fsynced in a hidden temporary folder beside the target, which
is then renamed into place. A reader sees the old checkpoint or the new one, never a mix; a crash
while writing leaves only a `.<name>.tmp-*` folder. Replacing an existing checkpoint swaps folders
with two renames (Linux cannot rename over a non-empty folder): an exception between them puts the
old one back; a process crash between them leaves it as `.<name>.old-*/checkpoint` and no folder at
`path`, so `load_checkpoint` fails loudly rather than resuming from a mix.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from coserve.contract.data_position import DataPosition
from coserve.contract.trainer_state import STATE_FILE, TrainerState, read_trainer_state
from coserve.model.config import ModelConfig
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.optimizer import LoRAOptimizer

OPTIMIZER_FILE = "optimizer.pt"


def _fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (created files, renames)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file and the folder itself, so the rename publishes durable contents."""
    for item in folder.iterdir():
        with open(item, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def _write_contents(folder: Path, lora: TrainableLoRA, optimizer: LoRAOptimizer, state: TrainerState,
                    base_model_name_or_path: str | None) -> None:
    lora.save_pretrained(folder, base_model_name_or_path)
    torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)
    (folder / STATE_FILE).write_text(state.to_json())


def save_checkpoint(path: str | Path, lora: TrainableLoRA, optimizer: LoRAOptimizer,
                    position: DataPosition, base_model_name_or_path: str | None = None,
                    trained_tokens: int | None = None,
                    reference_logprobs: Mapping[int, tuple[float, float]] | None = None) -> Path:
    """Write a checkpoint folder at `path` atomically (replacing one that is there); returns `path`.

    `trained_tokens`: the job's trained tokens up to `position` (kept so that a resume continues the
    count instead of restarting it from 0); `reference_logprobs`: a DPO job's reference sums so far.

    Raises:
        ValueError: the optimizer is not over `lora`, or the position's step disagrees with the
            optimizer's step count (a checkpoint that would resume inconsistently is refused).
    """
    if optimizer.lora is not lora:
        raise ValueError("the optimizer does not belong to this adapter")
    if position.step != optimizer.step_count:
        raise ValueError(f"data position is at step {position.step}, the optimizer at "
                         f"{optimizer.step_count}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    old: Path | None = None
    try:
        state = TrainerState(position, trained_tokens, dict(reference_logprobs or {}))
        _write_contents(tmp, lora, optimizer, state, base_model_name_or_path)
        _fsync_tree(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, old / "checkpoint")
        os.rename(tmp, path)
    except BaseException:
        if old is not None and not path.exists():  # put the previous checkpoint back
            os.rename(old / "checkpoint", path)
        for leftover in (tmp, old):
            if leftover is not None:
                shutil.rmtree(leftover, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(path.parent)
    return path


def load_checkpoint(path: str | Path, model_config: ModelConfig, device: torch.device | str = "cpu"
                    ) -> tuple[TrainableLoRA, LoRAOptimizer, DataPosition]:
    """Read a checkpoint back as trainable weights, their optimizer and the data position.

    Raises:
        FileNotFoundError: `path` is not a complete checkpoint folder.
        ValueError: another format, an adapter that does not fit `model_config`, or an optimizer
            state that does not fit the adapter or disagrees with the position's step.
    """
    path = Path(path)
    missing = [name for name in (STATE_FILE, OPTIMIZER_FILE, "adapter_config.json",
                                 "adapter_model.safetensors") if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not a complete checkpoint: missing {missing}")
    position = read_trainer_state(path).position
    lora = TrainableLoRA.from_pretrained(path, model_config, device)
    optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location=device, weights_only=True)
    optimizer = LoRAOptimizer.from_state_dict(lora, optimizer_state)
    if optimizer.step_count != position.step:
        raise ValueError(f"checkpoint {path}: optimizer at step {optimizer.step_count}, data position "
                         f"at step {position.step}")
    return lora, optimizer, position
