"""A roofline iteration-time model of one GPU, from published figures: the GPU projection's "truth".

An iteration's time is

    t = constant + max(M_fwd, C_fwd) + max(M_bwd, C_bwd) + small per-sequence, per-chunk and per-piece terms

with ``M = bytes / (bandwidth * bandwidth_efficiency)`` and ``C = FLOPs / (peak * compute_efficiency)``:

* the fused forward (prefill chunks, decodes and fine-tuning forward-window rows in one pass) reads every
  weight once (``weight_bytes``) plus the K/V its decodes attend to (``decode_context`` keys x
  ``kv_bytes_per_token``), and computes ``2 * body_params`` FLOPs a row, ``2 * head_params`` for each row
  that needs logits (a decode, a prefill chunk's last row; a fine-tuning row twice: its logits and their
  gradient) and ``4 * hidden * layers`` FLOPs per (query, key) attention pair (QK^T and AV);
* backward tasklets (layer-major slices, after the forward) compute ``4 * body_params / layers`` FLOPs per
  token-layer (the layer's forward recomputed plus the gradient of its input; the base weights are frozen,
  and LoRA's own gradients at rank 16 are under 1% of that) and read one layer's weights per tasklet.

So a decode batch is memory-bound: fine-tuning rows riding in it cost nothing until its FLOPs reach the
weight-read time (the ridge, ``peak * compute_efficiency / (bandwidth * bandwidth_efficiency)`` rows: ~90
on an A100, ~140 on an H100, whatever the model), and a prefill chunk or a fine-tuning window of hundreds
of rows is compute-bound. A linear model charges every row its FLOPs and cannot see this.

What the model leaves out (each small at these sizes, and charged to no policy in particular): the
attention FLOPs of fine-tuning windows and of the backward's recompute (not in `PlanFeatures`; about
3-5% of a 4096-token sequence's FLOPs), K/V writes, activation traffic, LoRA's FLOPs, kernel-level
overlap of the two segments, and any interference beyond the roofline (Harli measures decode slowing
down under SM sharing; fused rows in one pass share the SMs by construction).

Published figures (none measured here):

* A100-80GB SXM: 2,039 GB/s HBM2e, 312 TFLOPS dense BF16 (NVIDIA A100 datasheet). H100-80GB SXM5:
  3.35 TB/s HBM3, 989 TFLOPS dense BF16 (NVIDIA H100 datasheet; 1,979 is with sparsity).
* bandwidth_efficiency 0.85: Harli (Xu et al., "SLO-Aware Co-location of LLM Inference and
  PEFT-based Finetuning", §2.2.1, Fig. 4): Llama3-8B decode averages 85% DRAM
  bandwidth utilisation across batch sizes and sequence lengths.
* compute_efficiency: A100 0.52, the per-GPU share of peak of Megatron-LM's GPT runs (Narayanan et al.,
  SC'21: "52% of theoretical peak"); H100 0.40, Llama 3's BF16 MFU of 38-43% on H100s (Llama 3 Herd of
  Models, arXiv 2407.21783, Table 4). Both are large-scale training figures; a single GPU's LoRA windows
  are smaller GEMMs, so these are at the optimistic end for the 1B model.
* constant 1.5 ms: with the above, Llama-3.1-8B's batch-1 decode reads 15.0 GB: 5.27 ms on an H100 and
  11.35 ms on an A100-40GB (1,555 GB/s). Published vLLM batch-1 TPOTs are 6.48 ms on an H100-80GB
  (InferenceBench concurrency sweep, vLLM 0.21, https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/)
  and ~13.3 ms on an A100-40GB ("about 75 tokens/sec", vLLM 0.23,
  https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on), i.e. 1.2 and ~1.9 ms outside the weight
  read; 1.5 ms puts both within 5%.
* per_sequence 20 us, per_prefill_chunk 20 us, per_piece 50 us, per_adapter 50 us: assumptions (sampling
  and metadata per sequence, an attention call per chunk, a window's loss or a tasklet's autograd set-up,
  a LoRA segment); no published figure isolates them. At 64 decodes the per-sequence term is 1.3 ms.
* Model shapes from the Hugging Face configs: Llama-3.1-8B (32 layers, hidden 4096, 8 KV heads of 128,
  6.98e9 parameters in the layers, a 525M-parameter untied LM head), Llama-3.2-1B (16 layers, hidden
  2048, 8 KV heads of 64, 0.97e9 in the layers, the 263M embedding tied as the head).
"""

from __future__ import annotations

from dataclasses import dataclass

from coserve.planner.latency_features import PlanFeatures

BF16_BYTES = 2


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU's published peaks and the share of them an engine reaches (module docstring)."""

    name: str
    memory_bandwidth: float  # bytes/s, datasheet
    bf16_flops: float  # dense FLOP/s, datasheet
    bandwidth_efficiency: float
    compute_efficiency: float

    @property
    def bytes_per_s(self) -> float:
        return self.memory_bandwidth * self.bandwidth_efficiency

    @property
    def flops_per_s(self) -> float:
        return self.bf16_flops * self.compute_efficiency


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder's shape as the roofline needs it (bf16 weights and K/V)."""

    name: str
    num_layers: int
    hidden: int
    num_kv_heads: int
    head_dim: int
    body_params: float  # the layers' weights (attention and MLP)
    head_params: float  # the LM head (the tied embedding for the 1B)
    vocab_size: int = 128256

    @property
    def weight_bytes(self) -> float:
        """Bytes one forward pass reads: every layer and the head (an untied embedding is only looked up)."""
        return BF16_BYTES * (self.body_params + self.head_params)

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * BF16_BYTES

    @property
    def attention_flops_per_pair(self) -> float:
        return 4.0 * self.hidden * self.num_layers


A100_80GB = GpuSpec("A100-80GB-SXM", 2.039e12, 312e12, 0.85, 0.52)
H100_80GB = GpuSpec("H100-80GB-SXM", 3.35e12, 989e12, 0.85, 0.40)
LLAMA_3_1_8B = ModelSpec("Llama-3.1-8B", 32, 4096, 8, 128, 6.98e9, 0.525e9)
LLAMA_3_2_1B = ModelSpec("Llama-3.2-1B", 16, 2048, 8, 64, 0.973e9, 0.263e9)
GPUS = {"a100": A100_80GB, "h100": H100_80GB}
MODELS = {"1b": LLAMA_3_2_1B, "8b": LLAMA_3_1_8B}


@dataclass(frozen=True, slots=True)
class FixedCosts:
    """The terms outside the roofline, seconds (module docstring)."""

    constant: float = 1.5e-3
    per_sequence: float = 20e-6
    per_prefill_chunk: float = 20e-6
    per_piece: float = 50e-6
    per_adapter: float = 50e-6
    per_adapter_load: float = 5e-3

    def of(self, f: PlanFeatures) -> float:
        return (self.constant + self.per_sequence * f.num_sequences + self.per_prefill_chunk * f.prefill_chunks
                + self.per_piece * f.ft_pieces + self.per_adapter * f.distinct_adapters
                + self.per_adapter_load * f.adapter_loads)


class RooflineModel:
    """Iteration time of `model` on `gpu` from an iteration's `PlanFeatures` (module docstring).

    It answers `predict` like a `LatencyModel`, so the simulator's `LatencyExecutor` can run on it; it is
    not fitted and does not learn.
    """

    def __init__(self, model: ModelSpec, gpu: GpuSpec, fixed: FixedCosts = FixedCosts()) -> None:
        self.model, self.gpu, self.fixed = model, gpu, fixed

    def inference_flops(self, f: PlanFeatures) -> float:
        """FLOPs of the iteration's prefill chunks and decodes."""
        m = self.model
        rows, logits = f.prefill_tokens + f.decode_tokens, f.decode_tokens + f.prefill_chunks
        return (2.0 * m.body_params * rows + 2.0 * m.head_params * logits
                + m.attention_flops_per_pair * (f.prefill_attention + f.decode_context))

    def finetune_flops(self, f: PlanFeatures) -> float:
        """FLOPs of the iteration's fine-tuning: window rows (with their logits' gradient) and backward."""
        m = self.model
        forward = (2.0 * m.body_params + 4.0 * m.head_params) * f.ft_forward_tokens
        return forward + 4.0 * m.body_params / m.num_layers * f.ft_backward_token_layers

    def compute_s(self, f: PlanFeatures) -> float:
        """The iteration's FLOPs at the reachable rate: no iteration can be shorter than this."""
        return (self.inference_flops(f) + self.finetune_flops(f)) / self.gpu.flops_per_s

    def predict(self, features: PlanFeatures) -> float:
        """The iteration's time, seconds."""
        f, m, gpu = features, self.model, self.gpu
        forward_rows = f.prefill_tokens + f.decode_tokens + f.ft_forward_tokens
        forward_flops = self.inference_flops(f) + (2.0 * m.body_params + 4.0 * m.head_params) * f.ft_forward_tokens
        forward_bytes = (m.weight_bytes + m.kv_bytes_per_token * f.decode_context) if forward_rows else 0.0
        forward = max(forward_bytes / gpu.bytes_per_s, forward_flops / gpu.flops_per_s)
        backward = 0.0
        if f.ft_backward_token_layers:
            # One window per job with forward rows; the other pieces are tasklets, one layer's weights each.
            tasklets = max(1.0, f.ft_pieces - (1.0 if f.ft_forward_tokens else 0.0))
            backward_bytes = tasklets * BF16_BYTES * m.body_params / m.num_layers
            backward_flops = 4.0 * m.body_params / m.num_layers * f.ft_backward_token_layers
            backward = max(backward_bytes / gpu.bytes_per_s, backward_flops / gpu.flops_per_s)
        return self.fixed.of(f) + forward + backward

    def ridge_rows(self) -> float:
        """Rows a forward pass holds before its FLOPs outlast its weight read (body FLOPs only)."""
        read_s = self.model.weight_bytes / self.gpu.bytes_per_s
        return read_s * self.gpu.flops_per_s / (2.0 * self.model.body_params)
