"""A checkpoint's `trainer_state.json`: the file the engine's trainer writes into every checkpoint folder
(`coserve.trainer.checkpoint`) and the scheduler reads to resume a job, torch-free.

It holds the format version, the `DataPosition` (seed, epoch, index, step) and the job's counters that
a resume must continue rather than restart: `trained_tokens` (trained tokens of the steps up to this
checkpoint; absent in checkpoints written before it was kept).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from coserve.contract.data_position import DataPosition

CHECKPOINT_FORMAT = 1
STATE_FILE = "trainer_state.json"


@dataclass(frozen=True, slots=True)
class TrainerState:
    """What `trainer_state.json` says: where the job is in its data and its counters at that point.

    `trained_tokens` is None for a checkpoint written before the counter was kept (format 1 without it).
    """

    position: DataPosition
    trained_tokens: int | None = None


def read_trainer_state(path: str | Path) -> TrainerState:
    """The data position and counters of the checkpoint folder `path` (no torch load: the scheduler
    reads it to resume a job).

    Raises:
        FileNotFoundError: no `trainer_state.json` in `path`.
        ValueError: another format, or a malformed position or counter.
    """
    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {path}: format {state.get('format')!r}, "
                         f"expected {CHECKPOINT_FORMAT}")
    tokens = state.get("trained_tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
        raise ValueError(f"checkpoint {path}: trained_tokens must be an integer >= 0, got {tokens!r}")
    return TrainerState(DataPosition.from_dict(state["position"]), tokens)
