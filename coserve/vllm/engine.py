"""`VllmEngine`: vLLM as coserve's engine, with fine-tuning co-served on vLLM's own weights.

It implements the `Engine` protocol (`coserve.contract.engine`), so the scheduler, the policy,
the job manager, the metrics and the API are the ones of coserve's engine. One `step(plan)`:

1. adapter unloads and loads (a slot now names a vLLM `LoRARequest`; a folder gets a new vLLM LoRA id
   whenever its weights changed), freed sequences aborted in vLLM, new sequences added to vLLM;
2. job and sequence control of the fine-tuning work (`TrainingRuntime.apply_control`);
3. one vLLM step computing exactly the plan's chunks (each request up to the position coserve planned,
   nothing for the requests it did not schedule): vLLM owns the KV cache, its prefix cache and the
   sampling; coserve's scheduler decided admission order (VTC), chunk sizes and the fine-tuning share;
4. the forward windows, with coserve's trainer on zero-copy views of vLLM's weights (their K/V in the
   sequences' own buffers), then backward tasklets, optimizer steps and saves, as on coserve's engine;
5. every adapter saved in this step (checkpoint or final) is loaded into vLLM at once, so a fine-tuned
   model is served by vLLM the moment its job reports it; a request sampling from an adapter being
   trained (a reinforcement job's rollout) gets the trainer's current weights exported to vLLM once per
   optimizer step (`training_adapters`: the weight sync coserve's own engine does not need).

Grammars (`response_format`, forced `tool_choice`) are enforced by vLLM's own structured output (its
`guidance` backend: llguidance, as on coserve's engine), with coserve's grammar text; a sequence whose
grammar cannot go on ends with `grammar_error` as on coserve's engine. What vLLM does not do as
coserve's engine does (documented in docs/vllm.md): after a preemption a sequence is re-added with its
outputs as prompt (its grammar replayed through them), so a seeded request's tokens and the
frequency/presence penalties (output tokens only) may differ from an uninterrupted run; logprobs
under a grammar are vLLM's, after the grammar's mask.

Faults: a request vLLM cannot take (a token id outside the vocabulary, an adapter that does not load,
what vLLM's own checks refuse) fails alone (`RequestFault`) and the step goes on without it; a job's
likewise (`trainer.runtime`). A failure inside vLLM's step cannot be told apart by request (vLLM's
scheduler has moved on), so it raises as is: the scheduler fails that plan's work with a generic error,
and the engine keeps serving.
"""

from __future__ import annotations

import time

import torch

from coserve.contract import defaults
from coserve.contract.engine import EngineKind, RuntimeLayout, fault_text
from coserve.contract.engine_config import EngineConfig
from coserve.contract.plan import (
    IterationPlan,
    IterationResult,
    NewSequence,
    RequestFault,
    SampledToken,
    ScheduledChunk,
    StepTimings,
)
from coserve.forward.transformer import Transformer
from coserve.model.config import ModelConfig, dtype_name
from coserve.model.memory import DTYPE_BYTES, WorkingSizes, trainer_reserve_bytes
from coserve.trainer.runtime import TrainingRuntime
from coserve.vllm.backend import VllmRuntime, VllmSettings
from coserve.vllm.memory_share import vllm_utilization
from coserve.vllm.training_adapters import TrainingAdapters

DEFAULT_CPU_KV_CACHE_GB = 1.0  # vLLM's KV cache on CPU when the config names no size


def _is_cpu(device: str) -> bool:
    return torch.device(device).type == "cpu"


class VllmEngine:
    """coserve's `Engine` over an in-process vLLM engine (module docstring).

    Args:
        config: the engine settings; `num_kv_blocks` and `block_size` are vLLM's to choose (its
            `kv_cache_memory_gb`, or on CUDA `gpu_memory_utilization` less the trainer's reserve, size
            the cache: `memory_share`).

    Raises:
        VllmUnavailable: vLLM is missing or of another version (the message names the install command).
        VllmLoadError: vLLM could not load the model (vLLM's message).
        UnsupportedModelError: a model family coserve's trainer does not know.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        kv_gb = config.kv_cache_memory_gb
        if kv_gb is None and _is_cpu(config.device):
            kv_gb = DEFAULT_CPU_KV_CACHE_GB
        # "auto" resolved as coserve's engine resolves it, then handed to vLLM by name: vLLM's own "auto"
        # turns a float32 model into bfloat16 on the CPU, and the two engines would answer differently.
        self.runtime = VllmRuntime(VllmSettings(
            model=config.model, dtype=dtype_name(config.dtype, self.model_config), device=config.device,
            max_num_seqs=config.max_num_seqs,
            max_batch_tokens=config.max_batch_tokens, max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank, max_model_len=config.max_model_len, kv_cache_memory_gb=kv_gb,
            gpu_memory_utilization=self._vllm_utilization(kv_gb), seed=config.seed))
        self.dtype: torch.dtype = self.runtime.dtype
        self.device = torch.device(config.device)
        self.model = Transformer(self.model_config, self.runtime.weights(self.model_config), self.dtype,
                                 self.device)
        self.training = TrainingRuntime(self.model, cache=None, bank=None, max_lora_rank=config.max_lora_rank)
        self.layout = RuntimeLayout(
            num_kv_blocks=self.runtime.num_blocks, block_size=self.runtime.block_size,
            max_model_len=self.runtime.max_model_len, vocab_size=self.model_config.vocab_size,
            num_adapter_slots=config.max_loras, max_lora_rank=config.max_lora_rank,
            engine_owns_kv_cache=True, engine=EngineKind.VLLM.value,
            dtype=str(self.dtype).removeprefix("torch."))
        self._slots: dict[int, object] = {}  # bank slot -> vLLM LoRARequest
        self.training_adapters = TrainingAdapters(self.training, self.runtime)

    def _vllm_utilization(self, kv_gb: float | None) -> float:
        """The fraction of the GPU vLLM is given: the operator's, less the trainer's reserve (`memory_share`);
        unused when the KV cache has a size (the CPU, or `kv_cache_memory_gb`)."""
        config = self.config
        if kv_gb is not None:
            return config.gpu_memory_utilization
        cfg = self.model_config
        max_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        sizes = WorkingSizes(max_batch_tokens=config.max_batch_tokens, max_num_seqs=config.max_num_seqs,
                             max_model_len=max_len, window_tokens=defaults.FINETUNE_WINDOW_TOKENS,
                             max_lora_rank=config.max_lora_rank)
        dtype_bytes = DTYPE_BYTES[dtype_name(config.dtype, cfg)]
        _, total = torch.cuda.mem_get_info(torch.device(config.device))
        return vllm_utilization(config.gpu_memory_utilization, trainer_reserve_bytes(cfg, dtype_bytes, sizes), total)

    @property
    def num_sequences(self) -> int:
        """Sequences vLLM holds for coserve now."""
        return self.runtime.num_sequences

    def step(self, plan: IterationPlan) -> IterationResult:
        """Execute one plan (module docstring: adapters, sequences, one vLLM step, fine-tuning)."""
        t0 = time.perf_counter()
        for slot in plan.adapter_unloads:
            self._slots.pop(slot, None)
        result = IterationResult(step_id=plan.step_id, num_tokens=plan.num_tokens)
        failed = self._load_adapters(plan, result)
        taken = [s.adapter_slot for s in plan.training.job_starts] + [u.adapter_slot for u in plan.training.job_unparks]
        for slot in taken:  # the slot now holds the trainer's weights, not a folder's
            self._slots.pop(slot, None)
        self.runtime.abort(plan.freed)
        for new in plan.new_sequences:
            if new.request_id not in failed and not self._add(new, result):
                failed.add(new.request_id)
        self.training.apply_control(plan.training, result.training)
        t1 = time.perf_counter()
        chunks = [c for c in plan.chunks if c.request_id not in failed]
        if chunks:
            self._infer(chunks, result)
        self.training.run_windows(plan.training, result.training)
        t3 = time.perf_counter()
        self.training.run_after_forward(plan.training, result.training)
        self.training_adapters.stepped([*plan.training.job_stops, *(s.job_id for s in result.training.steps)])
        for saved in result.training.saved:
            self.runtime.lora(saved.path)  # published: vLLM serves it from the next request on
        t4 = time.perf_counter()
        result.timings = StepTimings(total_s=t4 - t0, prepare_s=t1 - t0, forward_s=t3 - t1, sample_s=0.0,
                                     backward_s=t4 - t3)
        return result

    def _load_adapters(self, plan: IterationPlan, result: IterationResult) -> set[str]:
        """The plan's adapter loads; the requests of one that does not load fail (returned)."""
        failed: set[str] = set()
        for load in plan.adapter_loads:
            try:
                self._slots[load.slot] = self.runtime.lora(load.path)
            except Exception as error:  # noqa: BLE001 - the requests of this adapter fail, not the step
                self._slots.pop(load.slot, None)
                users = [n.request_id for n in plan.new_sequences if n.adapter_slot == load.slot]
                if not users:
                    raise
                failed.update(users)
                result.faults.extend(RequestFault(r, f"its adapter could not be loaded: {fault_text(error)}")
                                     for r in users)
        return failed

    def _add(self, new: NewSequence, result: IterationResult) -> bool:
        """Hand a new sequence to vLLM; False (a `RequestFault`) when it is refused."""
        vocab = self.model_config.vocab_size
        try:
            for token in (min(new.token_ids, default=0), max(new.token_ids, default=0),
                          *(new.sampling.logit_bias or {})):
                if not 0 <= token < vocab:
                    raise ValueError(f"token id {token} is outside the model's vocabulary (0..{vocab - 1})")
            lora = None if new.adapter_slot < 0 else self._slots.get(new.adapter_slot)
            if lora is None and new.adapter_slot >= 0:  # a rollout of a job's adapter being trained
                lora = self.training_adapters.lora(new.adapter_slot)
            self.runtime.add(new.request_id, new.token_ids, new.sampling, new.num_output_tokens, lora)
        except Exception as error:  # noqa: BLE001 - this request's alone: the step goes on without it
            self.runtime.abort([new.request_id])
            result.faults.append(RequestFault(new.request_id, fault_text(error)))
            return False
        return True

    def _infer(self, chunks: list[ScheduledChunk], result: IterationResult) -> None:
        """One vLLM step over the chunks; a token for every chunk that samples, and none other."""
        for chunk in chunks:
            if not self.runtime.has(chunk.request_id):
                raise RuntimeError(f"plan schedules {chunk.request_id}, which vLLM does not hold")
        sampled = {s.request_id: s for s in self.runtime.run(
            {c.request_id: c.start + c.num_tokens for c in chunks})}
        for chunk in (c for c in chunks if c.sample):
            token = sampled.pop(chunk.request_id, None)
            if token is None:
                raise RuntimeError(f"vLLM sampled no token for {chunk.request_id} at position "
                                   f"{chunk.start + chunk.num_tokens}")
            result.sampled.append(SampledToken(chunk.request_id, token.token_id, token.logprobs,
                                               grammar_error=token.grammar_error))
        if sampled:
            raise RuntimeError(f"vLLM sampled for requests the plan did not sample: {sorted(sampled)}")
