"""Where a co-served job's batches come from: the `BatchSource` protocol, one implementation per training
method, so that `CoservedJob` (`job.py`) plans every method's batches the same way and a new method is a new
source:

* supervised: `supervised_batches.SupervisedBatches` (the job's examples, in its data order);
* preference (DPO): `preference_batches.PreferenceBatches` (each pair's reference passes, then the pair);
* reinforcement: `rollout_batches.FedBatches` (graded rollouts, fed by the job's rollout loop);
* driven (the Tinker API): `driven_ops.DrivenOps` (its client's calls);
* validation: `validation_pass.ValidationPass` (asked first: after each epoch that ends with a checkpoint).

`methods.batch_sources` picks a job's sources from its spec: the one place where a method is told apart.
A source implements what its method does differently; the protocol's defaults are what most methods do.
Pure Python.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import JobState
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.training_plan import JobStart, PairStart
from coserve.finetune.progress import BatchProgress, SequenceProgress


class NoBatch(enum.Enum):
    """Why a source has no batch for its job now."""

    WAIT = "wait"  # none yet (a graded batch is being sampled, a driven run has no call, no validation due)
    DONE = "done"  # its data is done: the job plans its final save
    PLANNED = "planned"  # work without a batch went into the plan (a driven run's step, save or load)


@dataclass(frozen=True, slots=True)
class StartTerms:
    """What a sequence's start carries besides its batch's sequence: a DPO pair's partner and reference
    sums, and the normalizer its loss is divided by."""

    pair: PairStart | None
    normalizer: int


class SourceJob(Protocol):
    """What a source reads of its job."""

    @property
    def position(self) -> DataPosition:
        """Where the job's data is: its next batch follows it."""
        ...

    @property
    def trained_tokens(self) -> int:
        """Trained tokens of its completed optimizer steps."""
        ...

    def restart_message(self) -> JobStart:
        """The `JobStart` that creates its adapter again in the slot it holds (a driven run's load)."""
        ...


class BatchSource(Protocol):
    """One job's batches, as its method makes them (module docstring)."""

    def next_batch(self, job: SourceJob, plan: IterationPlan) -> BatchProgress | NoBatch:
        """The job's next batch (after `job.position`), or why there is none."""
        ...

    def batch_planned(self, batch: BatchProgress, plan: IterationPlan) -> bool:
        """The batch's last work is in `plan`; True when an optimizer step follows it (the job plans it and
        moves to `batch.after`)."""
        ...

    def start_terms(self, batch: BatchProgress, seq: SequenceProgress) -> StartTerms | None:
        """What `seq`'s start carries; None while it cannot start (a DPO pair's references are not back)."""
        return StartTerms(None, batch.normalizer)

    def update(self, plan: IterationPlan, result: IterationResult) -> None:
        """What the engine reported for `plan` that the source keeps (reference sums, a call's outputs)."""
        return None

    def redo(self, sequence_id: str) -> None:
        """A sequence of its batch was dropped (its KV reclaimed) and is redone: its reports come again."""
        return None

    def checkpoint_state(self) -> dict[int, tuple[float, float]] | None:
        """What a checkpoint keeps of the source for a resume (a DPO job's reference sums)."""
        return None

    @property
    def idle(self) -> bool:
        """No work until its client asks for some (a driven run between its calls)."""
        return False

    @property
    def parks(self) -> bool:
        """Whether its job gives its adapter slot back while idle (`run_parking`)."""
        return False

    def fail_current(self, message: str, own: bool) -> str | None:
        """The job's work in a plan could not run. None: the job fails; else the source goes on (a driven
        run's call fails alone) and this is the sequence whose gradient is to be put back ("" for none)."""
        del message, own
        return None

    def end(self, state: JobState) -> None:
        """The job ended in `state`: whatever waits on the source is told so."""
        return None
