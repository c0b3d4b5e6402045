"""A training file as it was parsed once, at upload: its kind of rows and the rows, in the form every later
step reads (the gateway when a job is created, the job manager when the job's data is tokenized).

The gateway reads an upload with the strict reader (`training_jsonl`) and checks every row
(`api/protocol/files.py`); what it accepted is stored beside the file's bytes as a `ParsedTrainingFile`
(the store keeps it as JSON: `to_bytes`, `from_bytes`). A file uploaded before the server kept parsed files
has none: it is parsed again, once, the first time a job names it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

FORMAT = 1  # the stored form's version (`from_bytes` refuses another)


class TrainingFileKind(str, enum.Enum):
    """The kind of every row of a fine-tuning file (a file holds one)."""

    CHAT = "chat"  # `messages` rows: supervised fine-tuning
    PREFERENCE = "preference"  # `input` / `preferred_output` / `non_preferred_output` rows: DPO
    REINFORCEMENT = "reinforcement"  # `messages` ending with a user message, and item fields: reinforcement


@dataclass(frozen=True, slots=True)
class ParsedTrainingFile:
    """What a valid fine-tuning file holds: the kind of its rows, and the rows as the upload's reader read
    them (JSON values, every row checked for its kind)."""

    kind: TrainingFileKind
    rows: list[Any]

    @property
    def num_examples(self) -> int:
        return len(self.rows)

    def to_bytes(self) -> bytes:
        """The stored form: compact JSON in UTF-8, about the upload's own size (a lone surrogate a row's
        escapes held is kept as such: any string the reader accepted round-trips exactly)."""
        return json.dumps({"format": FORMAT, "kind": self.kind.value, "rows": self.rows}, ensure_ascii=False,
                          separators=(",", ":")).encode("utf-8", "surrogatepass")

    @classmethod
    def from_bytes(cls, data: bytes) -> ParsedTrainingFile:
        """The parsed file `to_bytes` stored.

        Raises:
            ValueError: not a stored parsed file of this format.
        """
        stored = json.loads(data.decode("utf-8", "surrogatepass"))
        if not isinstance(stored, dict) or stored.get("format") != FORMAT or not isinstance(stored.get("rows"), list):
            raise ValueError("not a parsed training file of format 1")
        return cls(TrainingFileKind(stored["kind"]), stored["rows"])
