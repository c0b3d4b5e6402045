"""A checkpoint's `trainer_state.json`: the file the engine's trainer writes into every checkpoint folder
(`coserve.trainer.checkpoint`) and the scheduler reads to resume a job, torch-free.

It holds the format version, the `DataPosition` (seed, epoch, index, step) and the job's counters that
a resume must continue rather than restart: `trained_tokens` (trained tokens of the steps up to this
checkpoint; absent in checkpoints written before it was kept) and, for a DPO job, `reference_logprobs`
(each pair's reference log-prob sums computed so far: they never change, so a resume does not pay for
them again), as a list of `[pair index, chosen, rejected]`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
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
    reference_logprobs: dict[int, tuple[float, float]] = field(default_factory=dict)

    def to_json(self) -> str:
        state: dict[str, object] = {"format": CHECKPOINT_FORMAT, "position": self.position.to_dict()}
        if self.trained_tokens is not None:
            state["trained_tokens"] = self.trained_tokens
        if self.reference_logprobs:
            state["reference_logprobs"] = [[i, c, r] for i, (c, r) in sorted(self.reference_logprobs.items())]
        return json.dumps(state, indent=2, sort_keys=True) + "\n"


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
    return TrainerState(DataPosition.from_dict(state["position"]), tokens,
                        _reference_logprobs(path, state.get("reference_logprobs", [])))


def _reference_logprobs(path: Path, raw: object) -> dict[int, tuple[float, float]]:
    def valid(entry: object) -> bool:
        return (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int and entry[0] >= 0
                and all(type(x) in (int, float) and math.isfinite(x) for x in entry[1:]))

    if not isinstance(raw, list) or not all(valid(entry) for entry in raw):
        raise ValueError(f"checkpoint {path}: reference_logprobs must be a list of [index, chosen, "
                         f"rejected] with finite sums")
    return {int(i): (float(c), float(r)) for i, c, r in raw}
