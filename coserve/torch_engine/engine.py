"""The engine of the GPU process: executes one `IterationPlan` per call and reports what it did.

It makes no scheduling decision: which tokens run, which KV blocks they use, which adapter lives in
which slot, and when state is dropped all come from the plan. What it keeps between iterations is
the minimum to execute plans: each sequence's token ids (the newest sampled token is the next
decode's input), its sampling settings, its adapter slot and, for structured output, its grammar
matcher (`coserve.torch_engine.grammar`).

Faults stay with the work that caused them. A request whose data the engine cannot take (a token id
outside the vocabulary, a `logit_bias` key outside it, a grammar or an adapter that does not load) fails
alone (`RequestFault`) and the step runs without it; a job's likewise (`trainer.runtime`). An error in
the fused forward or the sampling, where every piece of the plan runs together, raises `PlanFault` with
nothing committed (sampled tokens are appended only once the whole batch is sampled; K/V writes of the
same positions are redone identically), so the scheduler can retry the plan's pieces apart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from coserve.contract import defaults
from coserve.contract.engine import EngineKind, PlanFault, RuntimeLayout, fault_text
from coserve.contract.engine_config import EngineConfig
from coserve.contract.plan import (
    IterationPlan,
    IterationResult,
    NewSequence,
    RequestFault,
    SampledToken,
    ScheduledChunk,
    StepTimings,
    TokenLogprobs,
)
from coserve.contract.sampling import SamplingParams
from coserve.forward.attention import ChunkSpan, attends_row_wise, build_metadata
from coserve.forward.kv_cache import KVCache
from coserve.forward.lora import LoRABank, LoRASegment
from coserve.forward.native import load_paged_decode
from coserve.forward.transformer import Transformer
from coserve.model.config import ModelConfig, resolve_dtype
from coserve.model.memory import WorkingSizes
from coserve.model.weights import load_weights
from coserve.torch_engine.grammar import GrammarCompiler
from coserve.torch_engine.memory_budget import cuda_kv_cache_bytes
from coserve.torch_engine.sampler import RowSampling, Sampler
from coserve.trainer.runtime import TrainingRuntime, WindowRows

DEFAULT_CPU_KV_CACHE_GB = 0.5  # the KV cache on the CPU when the config names no size


@dataclass(slots=True)
class _Rows:
    """One piece of the fused batch: an inference chunk or a fine-tuning forward window."""

    start: int
    num_tokens: int
    block_table: Sequence[int]
    slot: int  # adapter bank slot, -1: the base model
    token_ids: list[int]
    chunk: ScheduledChunk | None = None
    window: WindowRows | None = None


@dataclass(slots=True)
class _Sequence:
    tokens: list[int]
    sampling: SamplingParams
    adapter_slot: int
    num_outputs: int
    grammar: llguidance.LLMatcher | None = None  # structured output: advanced with every sampled token


@dataclass(slots=True)
class _Sampled:
    """The tokens sampled for a batch's sequences, in its order, not yet appended to them."""

    chunks: list[ScheduledChunk]
    seqs: list[_Sequence]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    stuck: list[bool]  # its grammar allowed no token (the token is the EOS put in its place)


class TorchEngine:
    """Base model + paged KV cache + LoRA bank + sampler, driven by plans: coserve's implementation of
    the `Engine` protocol (`coserve.contract.engine`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, self.model_config)
        torch.manual_seed(config.seed)
        weights = load_weights(Path(config.model), self.model_config, self.dtype, self.device)
        self.model = Transformer(self.model_config, weights, self.dtype, self.device)
        max_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                      self.model_config.max_position_embeddings)
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(max_len)
        cfg = self.model_config
        self.cache = KVCache(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads,
                             cfg.head_dim, self.dtype, self.device)
        self.bank = LoRABank(cfg, config.max_loras, config.max_lora_rank, self.dtype, self.device)
        self.sampler = Sampler()
        native = config.native_kernels and self.device.type == "cpu" and self.dtype == torch.float32
        self._decode_kernel = load_paged_decode() if native else None
        self.layout = RuntimeLayout(num_kv_blocks=num_blocks, block_size=config.block_size,
                                    max_model_len=max_len, vocab_size=cfg.vocab_size,
                                    num_adapter_slots=config.max_loras,
                                    max_lora_rank=config.max_lora_rank, engine=EngineKind.TORCH.value,
                                    dtype=str(self.dtype).removeprefix("torch."))
        self._seqs: dict[str, _Sequence] = {}
        self.training = TrainingRuntime(self.model, self.cache, self.bank)
        self.grammars = GrammarCompiler(config.model, cfg.vocab_size, cfg.eos_token_ids)

    def _blocks_for_memory(self, max_len: int) -> int:
        """`kv_cache_memory_gb`; else on CUDA what `gpu_memory_utilization` leaves (`memory_budget`), on the
        CPU `DEFAULT_CPU_KV_CACHE_GB`."""
        cfg, c = self.model_config, self.config
        per_block = KVCache.bytes_per_block(cfg.num_layers, c.block_size, cfg.num_kv_heads,
                                            cfg.head_dim, self.dtype)
        if c.kv_cache_memory_gb is not None:
            budget = c.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            sizes = WorkingSizes(max_batch_tokens=c.max_batch_tokens, max_num_seqs=c.max_num_seqs,
                                 max_model_len=max_len, window_tokens=defaults.FINETUNE_WINDOW_TOKENS,
                                 max_lora_rank=c.max_lora_rank)
            budget = cuda_kv_cache_bytes(self.device, cfg, self.dtype.itemsize, c.max_loras, sizes,
                                         c.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_CACHE_GB * 2**30
        return max(1, int(budget // per_block))

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def step(self, plan: IterationPlan) -> IterationResult:
        """Execute one plan: adapter changes, frees, one fused forward (inference chunks and
        fine-tuning forward windows) and sampling, then backward tasklets, optimizer steps, saves.

        Raises:
            PlanFault: the fused forward or the sampling failed (module docstring); the engine is as if
                they had not run.
        """
        t0 = time.perf_counter()
        for slot in plan.adapter_unloads:
            self.bank.unload(slot)
        for request_id in plan.freed:
            self._seqs.pop(request_id, None)
        result = IterationResult(step_id=plan.step_id, num_tokens=plan.num_tokens)
        failed = self._admit(plan, result)
        self.training.apply_control(plan.training, result.training)
        windows = self.training.window_rows(plan.training, result.training)
        chunks = [c for c in plan.chunks if c.request_id not in failed] if failed else plan.chunks
        if chunks or windows:
            self._run(chunks, windows, result, t0)
        t_backward = time.perf_counter()
        self.training.run_after_forward(plan.training, result.training)
        result.timings.backward_s = time.perf_counter() - t_backward
        result.timings.total_s = time.perf_counter() - t0
        return result

    def _admit(self, plan: IterationPlan, result: IterationResult) -> set[str]:
        """Adapter loads and new sequences, each request's alone: one that cannot be taken (its adapter
        does not load, its data is refused) fails (`RequestFault`). Returns the failed request ids."""
        failed: set[str] = set()
        for load in plan.adapter_loads:
            try:
                self.bank.load(load.slot, load.adapter_id, load.path)
            except Exception as error:  # noqa: BLE001 - the requests of this adapter fail, not the step
                self.bank.unload(load.slot)
                users = [n.request_id for n in plan.new_sequences if n.adapter_slot == load.slot]
                if not users:
                    raise
                failed.update(users)
                result.faults.extend(RequestFault(r, f"its adapter could not be loaded: {fault_text(error)}")
                                     for r in users)
        for new in plan.new_sequences:
            self._seqs.pop(new.request_id, None)
            if new.request_id in failed:
                continue
            try:
                self._seqs[new.request_id] = self._new_sequence(new)
            except Exception as error:  # noqa: BLE001 - this request's alone: the step goes on without it
                failed.add(new.request_id)
                result.faults.append(RequestFault(new.request_id, fault_text(error)))
        return failed

    def _rows(self, chunks: list[ScheduledChunk], windows: list[WindowRows]) -> list[_Rows]:
        """Every piece of the fused batch: decodes (and chunks short enough to attend row by row,
        `attends_row_wise`) first, in one batched decode attention, then grouped by adapter so each
        adapter's rows are contiguous. Row order is an execution detail; results are keyed by id."""
        pieces = []
        for chunk in chunks:
            seq = self._seqs[chunk.request_id]
            if chunk.start + chunk.num_tokens > len(seq.tokens):
                raise RuntimeError(f"plan asks for positions up to {chunk.start + chunk.num_tokens} of "
                                   f"{chunk.request_id}, which has {len(seq.tokens)} tokens")
            pieces.append(_Rows(chunk.start, chunk.num_tokens, chunk.block_table, seq.adapter_slot,
                                seq.tokens[chunk.start: chunk.start + chunk.num_tokens], chunk=chunk))
        for item in windows:
            w = item.window
            pieces.append(_Rows(w.start, w.num_tokens, w.block_table, item.slot, item.token_ids,
                                window=item))
        kernel = self._decode_kernel
        return sorted(pieces,
                      key=lambda p: (not attends_row_wise(p.start, p.num_tokens, kernel), p.slot))

    def _run(self, chunks: list[ScheduledChunk], windows: list[WindowRows], result: IterationResult,
             t0: float) -> None:
        try:
            hidden, placed, sampled, t1, t2 = self._forward(chunks, windows)
        except Exception as error:  # noqa: BLE001 - whose it is, the scheduler finds out (`PlanFault`)
            if not self._device_alive():
                raise  # no retry can run (a CUDA context lost to a device-side assert): a plain failure
            raise PlanFault(fault_text(error)) from error
        t3 = time.perf_counter()
        self._commit(sampled, result)
        if placed:
            self.training.record_windows(placed, hidden, result.training)
        result.timings = StepTimings(prepare_s=t1 - t0, forward_s=t2 - t1 + time.perf_counter() - t3,
                                     sample_s=t3 - t2)

    def _forward(self, chunks: list[ScheduledChunk], windows: list[WindowRows]) -> tuple[
            torch.Tensor, list[tuple[int, WindowRows]], _Sampled | None, float, float]:
        """The fused forward and the sampling, committing nothing: (last hidden rows, windows' rows, the
        sampled tokens, when the forward started, when the sampling started)."""
        order = self._rows(chunks, windows)
        spans, token_ids, sample_rows, to_sample, placed = [], [], [], [], []
        segments: list[LoRASegment] = []
        row = 0
        for piece in order:
            spans.append(ChunkSpan(row, piece.start, piece.num_tokens, piece.block_table))
            token_ids.extend(piece.token_ids)
            _extend_segments(segments, piece.slot, row, row + piece.num_tokens)
            if piece.window is not None:
                placed.append((row, piece.window))
            row += piece.num_tokens
            if piece.chunk is not None and piece.chunk.sample:
                sample_rows.append(row - 1)
                to_sample.append(piece.chunk)
        meta = build_metadata(spans, self.cache.block_size, self.device, self._decode_kernel)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        batch = self.model.make_batch(ids, meta, segments)
        t1 = time.perf_counter()
        keep = (lambda i, h: self.training.keep_layer_input(placed, i, h)) if placed else None
        hidden = self.model.forward(batch, self.cache, self.bank, keep)
        logits = self.model.logits(hidden[sample_rows]) if sample_rows else None
        t2 = time.perf_counter()
        sampled = self._sample(to_sample, logits) if logits is not None else None
        return hidden, placed, sampled, t1, t2

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> _Sampled:
        seqs = [self._seqs[c.request_id] for c in chunks]
        rows = [_row_sampling(s) for s in seqs]
        constrained = {i: s.grammar for i, s in enumerate(seqs) if s.grammar is not None}  # row -> matcher
        mask, stuck = None, [False] * len(seqs)
        if constrained:
            # CUDA kernels run asynchronously, so on a GPU the CPU can fill the masks while the
            # forward may still be running (not measured here: this machine has no GPU).
            fill = self.grammars.fill_masks(list(constrained), list(constrained.values()))
            mask = fill.mask
            for i, is_stuck in zip(constrained, fill.stuck):
                stuck[i] = is_stuck
        token_ids, logprobs = self.sampler(logits, rows, mask)
        return _Sampled(chunks, seqs, token_ids, logprobs, stuck)

    def _device_alive(self) -> bool:
        """Whether the device still runs work (a CUDA error such as a device-side assert ends the context)."""
        if self.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError:
            return False
        return True

    @staticmethod
    def _commit(sampled: _Sampled | None, result: IterationResult) -> None:
        """Append the sampled tokens to their sequences (once the whole batch is sampled)."""
        if sampled is None:
            return
        for chunk, seq, token, lp, is_stuck in zip(sampled.chunks, sampled.seqs, sampled.token_ids,
                                                   sampled.logprobs, sampled.stuck):
            seq.tokens.append(token)
            seq.num_outputs += 1
            if seq.grammar is not None and not is_stuck:
                seq.grammar.consume_token(token)  # allowed by the mask, so it parses
            result.sampled.append(SampledToken(chunk.request_id, token, lp, grammar_error=is_stuck))

    def _new_sequence(self, new: NewSequence) -> _Sequence:
        """The engine's state of a new sequence. Raises ValueError: a token id (or a `logit_bias` key)
        outside the vocabulary; what the grammar compiler raises for its spec."""
        vocab = self.model_config.vocab_size
        bias = new.sampling.logit_bias or {}
        for token in (min(new.token_ids, default=0), max(new.token_ids, default=0), *bias):
            if not 0 <= token < vocab:
                raise ValueError(f"token id {token} is outside the model's vocabulary (0..{vocab - 1})")
        seq = _Sequence(tokens=list(new.token_ids), sampling=new.sampling, adapter_slot=new.adapter_slot,
                        num_outputs=new.num_output_tokens)
        spec = new.sampling.structured_output
        if spec is not None:
            # After a preemption the outputs so far are in token_ids: replay them into the matcher.
            outputs = seq.tokens[len(seq.tokens) - seq.num_outputs:] if seq.num_outputs else []
            seq.grammar = self.grammars.matcher(spec, outputs)
        return seq


def _row_sampling(seq: _Sequence) -> RowSampling:
    """The sampler's settings for the sequence's next token; its token history only when a penalty
    needs it (slicing every sequence's tokens each iteration would cost for nothing)."""
    p = seq.sampling
    row = RowSampling(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                      output_index=seq.num_outputs, num_logprobs=p.logprobs, logit_bias=p.logit_bias,
                      repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
                      presence_penalty=p.presence_penalty, min_p=p.min_p)
    if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        split = len(seq.tokens) - seq.num_outputs
        row.prompt_ids, row.output_ids = seq.tokens[:split], seq.tokens[split:]
    return row


def _extend_segments(segments: list[LoRASegment], slot: int, start: int, end: int) -> None:
    if slot < 0:
        return
    if segments and segments[-1].slot == slot and segments[-1].end == start:
        segments[-1].end = end
    else:
        segments.append(LoRASegment(slot, start, end))
