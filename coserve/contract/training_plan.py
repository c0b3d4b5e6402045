"""The fine-tuning part of the scheduler/engine contract: what to train this iteration, and what happened.

Plain dataclasses of ints, floats, strings and lists (they cross a Ray call). A job's data is sent once
(`JobStart`), tokenized; afterwards an iteration names sequences and token ranges only.

Work of one training sequence (`sequence_id`, one example of one batch of one job):

* `SequenceStart`: the engine sets up the sequence's state (kept layer inputs, gradient buffer). A DPO
  job's sequences: reference passes (`reference`: the base model alone, forward only, their summed
  log-prob reported in their windows' `loss_sum`) and the pairs' two trained sequences (`pair`: the
  partner and the reference sums), whose gradients the engine scales by the pair's DPO coefficient once
  both forwards are done, before either backward (`coserve.trainer.preference_step`).
* `ForwardWindow`: positions [start, start + num_tokens) run through every layer *inside the same
  fused forward as the inference tokens*, through the job's trainable adapter (bank slot
  `JobStart.adapter_slot`); their K/V go to the paged KV cache at `block_table`, like a prefill chunk.
  Windows of one sequence come in order, and their union is the whole sequence.
* `BackwardTasklet`: layers [layer_start, layer_end) (the highest first) on the token window
  [start, end). Valid orders: a tasklet needs the whole forward done, every later token of its layers
  done, and its tokens done in the layer above (layer-major and window-major orders both satisfy it).
* `OptimizerStep`: after the backward of every sequence of a batch, one AdamW step of the job (a
  driven run's step carries its own hyperparameters, `AdamStep`, and comes when its client asks).
* `SaveAdapter`: write the job's adapter (PEFT format, servable); with `position`, a resumable
  checkpoint (optimizer state + data position); `final` ends the job (the engine drops its state).

A driven run between its client's calls gives its bank slot back (`job_parks`: the engine keeps its
adapter, gradient and optimizer state in host memory, nothing lost) and takes one again for its next
call (`JobUnpark`: the state goes back to the device, into the new slot), `finetune.run_parking`.

The engine runs a plan's fine-tuning work in this order: job parks, job unparks (a slot given back may be
taken again in the same plan), job stops, job starts, gradient rollbacks, sequence drops, sequence
starts, the fused forward (inference chunks + forward windows), backward tasklets in list order,
optimizer steps, saves. A failure (a NaN/inf loss or gradient) fails the job, not the engine: it is
reported in `TrainingReport.failures` and the engine drops the job's state. An error in one sequence's
work (its tokens, a window, a tasklet) is that job's alone: the engine drops the sequence (its gradient
restored) and reports a `JobFault`; the scheduler then ends the job, or a driven run's call
(`gradient_rollbacks` puts the gradient back as it was before the call's first sequence).

A sequence's id is its job's id, `/`, and a name without `/` (`sequence_job`): the scheduler tells
whose a window or a tasklet is by it (`coserve.cluster.fault_isolation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.contract.loss_spec import LossSpec, TokenInputs
from coserve.contract.training_settings import AdamStep, LoRASettings, OptimizerSettings


@dataclass(slots=True)
class TrainingExample:
    """One tokenized example: `trained[p]` says token p is learned (the target of position p - 1)."""

    token_ids: list[int]
    trained: list[bool]


@dataclass(slots=True)
class JobStart:
    """Create a job's trainable adapter (or resume it from a checkpoint) in the engine."""

    job_id: str
    adapter_slot: int  # bank slot the trainable adapter occupies for forward windows (kept pinned)
    lora: LoRASettings
    optimizer: OptimizerSettings
    seed: int
    examples: list[TrainingExample]
    resume_from: str | None = None  # a checkpoint folder (adapter + optimizer + position)
    init_adapter: str | None = None  # a PEFT folder to start from (fine-tuning a fine-tuned model)
    validation_examples: list[TrainingExample] = field(default_factory=list)
    base_model_name_or_path: str | None = None  # written into adapter_config.json
    loss: LossSpec = field(default_factory=LossSpec)
    rejected_examples: list[TrainingExample] = field(default_factory=list)  # a DPO job's (per example)
    validation_rejected: list[TrainingExample] = field(default_factory=list)


@dataclass(slots=True)
class PairStart:
    """A DPO pair's trained sequence: its partner and the pair's reference log-prob sums."""

    partner_id: str  # the pair's other sequence (started in the same or an earlier plan)
    chosen: bool  # this sequence is the chosen answer (the partner the rejected one)
    reference_chosen: float
    reference_rejected: float
    pairs_in_batch: int  # the batch's pairs: the loss is their mean


@dataclass(slots=True)
class SequenceStart:
    sequence_id: str
    job_id: str
    example_index: int
    loss_normalizer: int  # trained tokens of the whole batch: gradients are of the batch mean
    evaluate: bool = False  # a validation example: forward windows only (loss, no gradient, no backward)
    rejected: bool = False  # the example is a DPO pair's rejected answer (`JobStart.rejected_examples`)
    reference: bool = False  # the base model alone (adapter off), forward only: DPO's reference pass
    pair: PairStart | None = None  # a DPO pair's trained sequence
    # A sequence made while the job runs (a reinforcement job's graded rollout): its tokens, in place of
    # `JobStart.examples[example_index]`, and its loss's per-token inputs (sampling log-probs, advantages).
    example: TrainingExample | None = None
    inputs: TokenInputs | None = None
    # A training run driven by its client (`contract.training_calls`): the loss of this sequence (None:
    # the job's), and whether its windows report the log-prob of every token (`WindowReport.logprobs`).
    loss: LossSpec | None = None
    report_logprobs: bool = False
    # The job's gradient before this sequence is kept (until its next mark): `gradient_rollbacks` puts it
    # back (a driven run's call that failed leaves no gradient behind).
    marks_gradient: bool = False


def sequence_job(sequence_id: str) -> str:
    """The job a training sequence belongs to (its id is `<job id>/<name>`)."""
    return sequence_id.rpartition("/")[0]


@dataclass(slots=True)
class ForwardWindow:
    sequence_id: str
    start: int
    num_tokens: int
    block_table: list[int]  # every block of the sequence up to start + num_tokens


@dataclass(slots=True)
class BackwardTasklet:
    sequence_id: str
    layer_start: int
    layer_end: int  # exclusive; layers run from layer_end - 1 down to layer_start
    start: int
    end: int

    @property
    def token_layers(self) -> int:
        return (self.end - self.start) * (self.layer_end - self.layer_start)


@dataclass(slots=True)
class OptimizerStep:
    job_id: str
    step: int  # the optimizer step this is (1-based); the engine checks it
    num_sequences: int
    num_tokens: int  # trained tokens of the batch
    adam: AdamStep | None = None  # this step's own hyperparameters (a driven run's); None: the job's


@dataclass(slots=True)
class SaveAdapter:
    job_id: str
    path: str
    step: int
    position: dict[str, int] | None = None  # DataPosition.to_dict(): save a resumable checkpoint
    trained_tokens: int | None = None  # the job's trained tokens up to `position` (kept in the checkpoint)
    reference_logprobs: dict[int, tuple[float, float]] | None = None  # a DPO job's, kept in the checkpoint
    final: bool = False  # the job's last save: the engine drops the job's state after it


@dataclass(slots=True)
class JobUnpark:
    """Put a parked job's state (`TrainingWork.job_parks`) back on the device, its adapter in `adapter_slot`."""

    job_id: str
    adapter_slot: int


@dataclass(slots=True)
class TrainingWork:
    """The fine-tuning part of one `IterationPlan`."""

    job_unparks: list[JobUnpark] = field(default_factory=list)
    job_parks: list[str] = field(default_factory=list)  # idle driven runs: state to host memory, slot emptied
    job_stops: list[str] = field(default_factory=list)
    job_starts: list[JobStart] = field(default_factory=list)
    sequence_drops: list[str] = field(default_factory=list)  # state dropped: the sequence is redone
    # sequences that `marks_gradient` (a driven call's first): their job's sequences are dropped, and its
    # gradient put back as it was before that sequence (when the engine started it)
    gradient_rollbacks: list[str] = field(default_factory=list)
    sequence_starts: list[SequenceStart] = field(default_factory=list)
    forward_windows: list[ForwardWindow] = field(default_factory=list)
    backward_tasklets: list[BackwardTasklet] = field(default_factory=list)
    optimizer_steps: list[OptimizerStep] = field(default_factory=list)
    saves: list[SaveAdapter] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.job_unparks or self.job_parks or self.job_stops or self.job_starts or self.sequence_drops
                    or self.gradient_rollbacks or self.sequence_starts
                    or self.forward_windows or self.backward_tasklets or self.optimizer_steps
                    or self.saves)

    @property
    def forward_tokens(self) -> int:
        return sum(w.num_tokens for w in self.forward_windows)

    @property
    def backward_token_layers(self) -> int:
        return sum(t.token_layers for t in self.backward_tasklets)


@dataclass(slots=True)
class WindowReport:
    sequence_id: str
    loss_sum: float  # summed token losses of the window (unnormalised)
    num_tokens: int  # tokens with a target in the window
    # `SequenceStart.report_logprobs`, on the sequence's last window: the log-prob of every token given
    # the tokens before it (entry t: token t; entry 0 and untrained tokens: 0.0)
    logprobs: list[float] | None = None


@dataclass(slots=True)
class StepReport:
    job_id: str
    step: int
    loss: float  # the batch's mean token loss
    grad_norm: float
    learning_rate: float
    num_sequences: int
    num_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)  # DPO's rewards (TRL's names)


@dataclass(slots=True)
class JobFailure:
    job_id: str
    code: str  # e.g. "non_finite_loss", "bad_checkpoint"
    message: str


@dataclass(slots=True)
class JobFault:
    """Work of a job in the plan that could not run (on sequence `sequence_id`, "" when on none), and why
    (`contract.engine.fault_text` of its own error). Unlike `JobFailure` the engine keeps the job (it
    dropped that sequence, its gradient restored): the scheduler ends the job, or a driven run's call."""

    job_id: str
    sequence_id: str
    message: str


@dataclass(slots=True)
class SavedAdapter:
    job_id: str
    path: str
    step: int


@dataclass(slots=True)
class TrainingReport:
    """The fine-tuning part of one `IterationResult`."""

    windows: list[WindowReport] = field(default_factory=list)
    steps: list[StepReport] = field(default_factory=list)
    saved: list[SavedAdapter] = field(default_factory=list)
    failures: list[JobFailure] = field(default_factory=list)
    faults: list[JobFault] = field(default_factory=list)
