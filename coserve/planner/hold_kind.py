"""Why a plan gave runnable fine-tuning jobs no work (`FinetuneFloor.held_kind`), as a kind to count by:
the co-serving benchmark splits the iterations fine-tuning sat out by it (`bench.gap_breakdown`)."""

from __future__ import annotations

import enum


class HoldKind(enum.Enum):
    TTFT_GUARD = "ttft_guard"  # a request waited past the TTFT guard: the batch drains into it first
    ADMISSION = "admission"  # a request waiting for admission (a sequence slot, blocks) nears the TTFT guard
    NOT_BANKED = "not_banked"  # bursts: the running requests have not banked the slack for one yet
    FULL = "full"  # the latency model says the iteration is full at the SLO
    SHARE = "share"  # the share strategy gave the iteration to inference (a temporal turn, a split)
    NO_MEMORY = "no_memory"  # no free KV block or adapter slot for the job's next piece
