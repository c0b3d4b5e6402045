"""Resuming a fine-tuning job from its last checkpoint (after a server, scheduler or engine restart).

The checkpoint folder holds the adapter, the optimizer state, the data position and the job's counters
(`coserve.trainer.checkpoint`). The job's spec gets the position to continue from and the
trained-token count to continue with, so `trained_tokens` goes on from the checkpoint's count instead
of restarting at 0. The steps after the checkpoint are redone; their metrics events were stored before
the restart and are not stored again (`EventTable.add_once`, keyed by step).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from coserve.contract.job_spec import FinetuneJobSpec, trained_tokens_before
from coserve.contract.trainer_state import read_trainer_state
from coserve.store import MetadataStore
from coserve.store.records import JobRecord


def resume_spec(store: MetadataStore, record: JobRecord, spec: FinetuneJobSpec) -> FinetuneJobSpec:
    """`spec`, resuming from the job's last recorded checkpoint when it has one (else unchanged).

    Raises:
        FileNotFoundError, ValueError: the checkpoint's state file is missing or malformed.
    """
    checkpoints, _ = store.checkpoints.page(record.tenant, record.id, limit=1)
    if not checkpoints or not checkpoints[0].adapter_path:
        return spec
    path = Path(checkpoints[0].adapter_path)
    state = read_trainer_state(path)
    tokens = state.trained_tokens
    if tokens is None:  # a checkpoint written before the count was kept: what the run had trained by then
        tokens = trained_tokens_before(spec, state.position)
    return replace(spec, resume_from=str(path), start_position=state.position, start_trained_tokens=tokens,
                   reference_logprobs={**spec.reference_logprobs, **state.reference_logprobs})
