"""The engine side of the scheduler/engine contract: what any backend implements (no torch here).

An engine executes plans; it decides nothing. Everything it is told arrives in the `IterationPlan`:
which tokens run and in which KV blocks, adapter loads and unloads into bank slots
(`plan.adapter_loads` / `plan.adapter_unloads`, applied before the forward), which sequences are
dropped, and the fine-tuning work (`plan.training`: forward windows, backward tasklets, optimizer
steps, saves), which the engine's own trainer runs against the base weights it holds. So a second
backend (vLLM next) implements `Engine` (`layout` and `step`) and the scheduler does not change.

`EngineCore` (`coserve/cluster/engine_core.py`) drives an engine through this contract.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Protocol

from coserve.contract.plan import IterationPlan, IterationResult


class EngineKind(enum.Enum):
    """Which backend executes the plans (`coserve serve --engine`, `LLM(engine=...)`); each kind has its
    builder in `coserve.backends.registry`."""

    TORCH = "torch"  # coserve's own torch engine (coserve.torch_engine.engine)
    VLLM = "vllm"  # vLLM's engine, co-serving on its weights (coserve.vllm.engine)

    @classmethod
    def parse(cls, value: str | EngineKind) -> EngineKind:
        """The kind named `value` ("native", coserve's engine's name before "torch", is still accepted).

        Raises:
            ValueError: no such kind (the message lists them).
        """
        try:
            return cls(ENGINE_ALIASES.get(value, value) if isinstance(value, str) else value)
        except ValueError:
            raise ValueError(f"engine must be one of {', '.join(k.value for k in cls)}, got {value!r}") from None


ENGINE_ALIASES = {"native": "torch"}  # older names of the kinds, accepted wherever a kind is named


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """The engine's tokenizer, as the processes without torch rebuild it (`coserve.frontend.tokenizer`):
    the serialized `tokenizers` tokenizer that transformers loads for the model (its class may change the
    folder's `tokenizer.json`, e.g. Qwen2's digit splitting), the named special tokens and the chat
    template(s). So the gateway's token ids are the engine's and the offline `LLM`'s."""

    tokenizer_json: str
    special_tokens: dict[str, str]
    chat_template: str | dict[str, str] | None


@dataclass(frozen=True, slots=True)
class RuntimeLayout:
    """What the scheduler and the gateway need to know about a built engine (plain data: it crosses a
    Ray call). `tokenizer` is None only for an engine a test lays out by hand without a gateway.

    `engine_owns_kv_cache`: the engine keeps its own KV cache and prefix cache (vLLM): block tables are
    the scheduler's accounting only (it then matches no prefix and plans every chunk from the first
    uncomputed position, so its block count bounds the engine's), and a sequence's earlier positions
    must have been computed by earlier chunks (no plan can start a sequence past position 0).
    `structured_output`: the engine enforces grammars (`SamplingParams.structured_output`); when it
    does not, the gateway refuses requests that need one before they are queued.
    `engine` and `dtype`: the backend serving (`EngineKind` value) and the dtype its weights are in
    ("float32", "bfloat16", "float16": `--dtype auto` resolved by `coserve.model.config.dtype_name`), for
    the banner, the log and `GET /v1/models/{base}` (its `coserve` extension field).
    """

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    num_adapter_slots: int
    max_lora_rank: int
    tokenizer: TokenizerSpec | None = None
    engine_owns_kv_cache: bool = False
    structured_output: bool = True
    engine: str = "torch"
    dtype: str = "float32"


class EngineStartError(RuntimeError):
    """A backend could not be built; the message is the backend's own reason (e.g. vLLM missing, or the
    model vLLM could not load), shown to the operator as is."""


@dataclass(slots=True)
class EngineFailure:
    """An engine step raised. `isolatable`: it raised `PlanFault`, so the scheduler retries the plan's
    pieces without the one at fault (`coserve.cluster.fault_isolation`); otherwise the plan's work fails
    with a generic error and the engine goes on. `message` is the engine's own text (`fault_text`): logged,
    and shown to a tenant only once isolation found that tenant's work alone at fault."""

    step_id: int
    message: str
    isolatable: bool = False


class PlanFault(Exception):
    """Raised by `Engine.step` when the fused part of a plan failed (its forward and sampling, where the
    pieces of every tenant run together), leaving the engine as if that part had not run: the plan's
    control applied (adapter changes, frees, new sequences, job and sequence starts), no token committed,
    no window recorded, no gradient touched. Any plan made of whole pieces of it may run next (new
    sequences and job and sequence starts sent again, `coserve.cluster.fault_isolation`). Its message is
    the original error's `fault_text`."""


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.@+~-]+){2,}[/\\]?")
FAULT_TEXT_CHARS = 300


def fault_text(error: BaseException) -> str:
    """An error as the tenant whose work raised it may read it: its type and message, every file path
    replaced by `<path>`, at most `FAULT_TEXT_CHARS` characters."""
    text = _PATH.sub("<path>", f"{type(error).__name__}: {error}".strip())
    return text if len(text) <= FAULT_TEXT_CHARS else text[:FAULT_TEXT_CHARS - 3] + "..."


class StepExecutor(Protocol):
    """What the iteration loop needs of an engine: execute one plan. The simulator's latency-model
    stand-in (`coserve.bench.simulator.LatencyExecutor`) is one too."""

    def step(self, plan: IterationPlan) -> IterationResult:
        """Execute `plan` and report what was done (sampled tokens, timings, training reports).

        Raises:
            PlanFault: the plan's fused part failed and the engine is as if it had not run (the caller
                retries the plan's pieces apart, `coserve.cluster.fault_isolation`).
            Exception: any other failure of the step; the plan's work then fails with a generic error.
        """
        ...


class Engine(StepExecutor, Protocol):
    """A serving backend: its layout (sizes the scheduler plans with) and `step`.

    coserve's torch engine (`coserve.torch_engine.engine.TorchEngine`) implements it.
    """

    @property
    def layout(self) -> RuntimeLayout:
        """KV blocks, context length, vocabulary, adapter slots and the largest LoRA rank."""
        ...
