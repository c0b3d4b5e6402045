"""A training run driven by its client, call by call: what the gateway sends the scheduler, and what
comes back. Plain dataclasses (they cross a Ray call).

This is the shape of Tinker's training primitives (`forward_backward`, `forward`, `optim_step`,
`save_state`, `save_weights_for_sampler`, `load_state`): a run is a trainable LoRA adapter on the served
base model, and each call is work the scheduler co-serves with inference, as it does a fine-tuning
job's (forward windows, backward tasklets, an optimizer step, a save). A run's calls are done one after
the other, in the order they arrive; `forward_backward` adds to the adapter's gradient, and
`optim_step` applies it and clears it.

A datum is one training sequence with its loss's per-token inputs, aligned with its token ids (entry
t: token t, the target of position t - 1; entry 0 is never used). Every token from 1 on has its
log-prob computed and reported; the loss weighs them with its inputs (`coserve.contract.loss_spec`).
Losses are sums over tokens, as Tinker's are: no normalizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coserve.contract.loss_spec import LossSpec, TokenInputs
from coserve.contract.training_settings import AdamStep, LoRASettings


@dataclass(slots=True)
class TrainingDatum:
    token_ids: list[int]  # at least 2
    inputs: TokenInputs


@dataclass(slots=True)
class ForwardBackwardCall:
    """Log-probs and loss of every datum; with `backward`, their gradient added to the adapter's."""

    data: list[TrainingDatum]
    loss: LossSpec
    backward: bool = True


@dataclass(slots=True)
class OptimStepCall:
    adam: AdamStep


@dataclass(slots=True)
class SaveCall:
    """Save the adapter as `name`: with `resumable`, its state too (optimizer and step: `load_state`
    resumes it exactly); without, a sampler's weights (a PEFT folder, servable at once)."""

    name: str
    resumable: bool


@dataclass(slots=True)
class LoadCall:
    """Replace the run's adapter with a saved one of the same tenant (`with_optimizer`: its optimizer
    state and step too)."""

    path: str  # a path `SaveOutcome` gave
    with_optimizer: bool


TrainingCall = ForwardBackwardCall | OptimStepCall | SaveCall | LoadCall


@dataclass(slots=True)
class DatumOutput:
    logprobs: list[float]  # entry t: the log-prob of token t + 1 given tokens <= t (one per input token)


@dataclass(slots=True)
class CallTimings:
    """Where a call's time went in the scheduler: waiting behind its run's earlier calls (`queued_s`),
    then from its first planned work to its outcome (`compute_s`) over `iterations` engine steps."""

    queued_s: float = 0.0
    compute_s: float = 0.0
    iterations: int = 0


@dataclass(slots=True)
class ForwardBackwardOutcome:
    outputs: list[DatumOutput]
    loss_sum: float
    timings: CallTimings = field(default_factory=CallTimings)


@dataclass(slots=True)
class OptimStepOutcome:
    step: int
    grad_norm: float
    learning_rate: float
    timings: CallTimings = field(default_factory=CallTimings)


@dataclass(slots=True)
class SaveOutcome:
    path: str  # tinker://<run id>/weights/<name> or tinker://<run id>/sampler_weights/<name>
    model_id: str | None = None  # a sampler's weights: the OpenAI model id that serves them


@dataclass(slots=True)
class LoadOutcome:
    path: str
    run_id: str


@dataclass(slots=True)
class CallFailure:
    """A call that could not be done: `user` when the caller's input is at fault (Tinker's category)."""

    code: str
    message: str
    user: bool = True


CallOutcome = ForwardBackwardOutcome | OptimStepOutcome | SaveOutcome | LoadOutcome | CallFailure


@dataclass(slots=True)
class CallTicket:
    """A call accepted by the scheduler: the id its outcome is asked for with."""

    call_id: str
    run_id: str


@dataclass(slots=True)
class RunRequest:
    """Create a training run for `tenant` on the served base model, with the id `run_id`: Tinker's
    `<session id>:train:<model seq id>`, which its SDK derives itself."""

    tenant: str
    run_id: str
    lora: LoRASettings
    seed: int = 0
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class RunCheckpoint:
    """A training run's saved state or sampler weights (a job's checkpoint row: `store.records.CheckpointRecord`)."""

    name: str
    path: str  # its tinker:// path
    resumable: bool  # a training state (else a sampler's weights)
    created: float  # unix time
    size_bytes: int


@dataclass(slots=True)
class RunInfo:
    run_id: str
    tenant: str
    base_model: str
    lora: LoRASettings
    steps: int  # optimizer steps done
    checkpoints: list[RunCheckpoint] = field(default_factory=list)
    failure: CallFailure | None = None  # the run ended (its engine was lost, or it failed)


@dataclass(slots=True)
class CreateRun:
    """Create a run; with `like_path` (a saved path of the tenant's), with the LoRA settings of the run
    that saved it (`request.lora` is not used): the run a saved state is loaded into."""

    request: RunRequest
    like_path: str | None = None


@dataclass(slots=True)
class SubmitCall:
    """Queue `call` on the tenant's run, after the calls queued before it."""

    tenant: str
    run_id: str
    call: TrainingCall


@dataclass(slots=True)
class AwaitOutcome:
    """The call's outcome, waiting up to `timeout_s` for it (None back: not done yet)."""

    tenant: str
    call_id: str
    timeout_s: float = 0.0


@dataclass(slots=True)
class GetRun:
    tenant: str
    run_id: str


@dataclass(slots=True)
class SessionAlive:
    """The session's client is alive (a heartbeat): its runs stay."""

    tenant: str
    session_id: str


@dataclass(slots=True)
class CloseSession:
    """The session finished: its runs end (their saved weights stay)."""

    tenant: str
    session_id: str


@dataclass(slots=True)
class DeleteSave:
    """Delete a save of the tenant's run (the SDK's `RestClient.delete_checkpoint`): its folder and, for a
    sampler's weights, its OpenAI model id. `checkpoint_id` is `weights/<name>` or `sampler_weights/<name>`."""

    tenant: str
    run_id: str
    checkpoint_id: str


@dataclass(slots=True)
class CallPending:
    """A call not done yet, and why it waits when it is not being worked on (None: it is)."""

    reason: str | None = None


# What the gateway asks the scheduler about driven runs (`SchedulerActor.training`), and the answers:
# CreateRun -> RunInfo | CallFailure; SubmitCall -> CallTicket | CallFailure; AwaitOutcome -> CallOutcome
# | CallPending; GetRun -> RunInfo | CallFailure; SessionAlive, CloseSession -> None; DeleteSave -> None |
# CallFailure.
RunQuery = CreateRun | SubmitCall | AwaitOutcome | GetRun | SessionAlive | CloseSession | DeleteSave
RunAnswer = RunInfo | CallTicket | ForwardBackwardOutcome | OptimStepOutcome | SaveOutcome | LoadOutcome \
    | CallFailure | CallPending | None
