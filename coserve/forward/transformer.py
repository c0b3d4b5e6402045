"""coserve's own forward for Llama, Qwen2, Qwen3 and Mistral over a flattened ragged batch.

No transformers modeling code runs here. One call computes every scheduled token of every sequence
(prefill chunks and decodes mixed), each token through its own LoRA adapter, writing K/V into the
paged cache. Layers are plain functions of (weights, inputs) so a trainer can recompute any single
layer on any token window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from coserve.forward.attention import AttentionMetadata, paged_attention
from coserve.forward.kv_cache import KVCache
from coserve.forward.lora import LoRABank, LoRASegment, Projection
from coserve.forward.rope import RotaryTable, apply_rope
from coserve.model.config import ModelConfig
from coserve.model.weights import LayerWeights, ModelWeights


@dataclass(slots=True)
class ForwardBatch:
    """The inputs of one fused forward."""

    token_ids: torch.Tensor  # [T]
    attn: AttentionMetadata
    lora: list[LoRASegment]  # rows through each adapter; rows in no segment use the base model
    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF computes it: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:  # nothing to cast: one fused kernel
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class Transformer:
    """A loaded base model: weights, rotary tables and the layer functions."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg, self.weights, self.dtype, self.device = cfg, weights, dtype, device
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, dtype, device)
        # oneDNN's blocked layout runs the LM head (a wide [vocab, hidden] matrix) about 1.5x faster
        # than MKL's sgemm on a CPU decode batch. It is a second copy of the matrix, so only when small.
        head_bytes = weights.lm_head.numel() * weights.lm_head.element_size()
        use_onednn = (device.type == "cpu" and dtype == torch.float32 and head_bytes <= 2**28
                      and torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]  # unannotated in torch
        self._lm_head_onednn = weights.lm_head.to_mkldnn() if use_onednn else None
        self._lm_head_t_onednn: torch.Tensor | None = None  # see `head_input_grad`

    def make_batch(self, token_ids: torch.Tensor, attn: AttentionMetadata,
                   lora: list[LoRASegment]) -> ForwardBatch:
        cos, sin = self.rotary.lookup(attn.positions)
        return ForwardBatch(token_ids=token_ids, attn=attn, lora=lora, cos=cos, sin=sin)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, bank: LoRABank,
                keep: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states after the last layer (before the final norm), [T, hidden].

        `keep(i, h)` sees each layer's input (a trainer keeps its windows' rows for the recompute).
        """
        h = self.weights.embed[batch.token_ids]
        for i in range(self.cfg.num_layers):
            if keep is not None:
                keep(i, h)
            h = self.layer(i, h, batch, cache, bank)
        return h

    def layer(self, i: int, h: torch.Tensor, batch: ForwardBatch, cache: KVCache,
              bank: LoRABank) -> torch.Tensor:
        """One decoder layer on the batch's rows; writes the rows' K/V into the cache."""
        w = self.weights.layers[i]
        h = h + self._attention(i, w, rms_norm(h, w.input_norm, self.cfg.rms_norm_eps), batch, cache,
                                bank)
        return h + self._mlp(i, w, rms_norm(h, w.post_norm, self.cfg.rms_norm_eps), batch, bank)

    def _attention(self, i: int, w: LayerWeights, x: torch.Tensor, batch: ForwardBatch,
                   cache: KVCache, bank: LoRABank) -> torch.Tensor:
        cfg = self.cfg
        qkv = F.linear(x, w.qkv_w, w.qkv_b)
        bank.apply(Projection.QKV, i, x, qkv, batch.lora)
        heads = cfg.num_heads + cfg.num_kv_heads
        # q and k sit side by side in the fused output: rotate them in one call.
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(-1, heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            assert w.q_norm is not None and w.k_norm is not None  # loaded whenever the config has qk_norm
            qk = torch.cat([rms_norm(qk[:, : cfg.num_heads], w.q_norm, cfg.rms_norm_eps),
                            rms_norm(qk[:, cfg.num_heads:], w.k_norm, cfg.rms_norm_eps)], dim=1)
        qk = apply_rope(qk, batch.cos, batch.sin)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]
        cache.write(i, batch.attn.slots, k, v)
        attn = paged_attention(q, k, v, cache, i, batch.attn)
        out = F.linear(attn, w.o_w, w.o_b)
        bank.apply(Projection.O, i, attn, out, batch.lora)
        return out

    def _mlp(self, i: int, w: LayerWeights, x: torch.Tensor, batch: ForwardBatch,
             bank: LoRABank) -> torch.Tensor:
        gate_up = F.linear(x, w.gate_up_w, w.gate_up_b)
        bank.apply(Projection.GATE_UP, i, x, gate_up, batch.lora)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        out = F.linear(act, w.down_w, w.down_b)
        bank.apply(Projection.DOWN, i, act, out, batch.lora)
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the given rows only, [N, vocab] in float32."""
        return self.head_logits(rms_norm(hidden, self.weights.final_norm, self.cfg.rms_norm_eps))

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """`normed @ lm_head.T` (final-normed rows in the model dtype), cast to float32: [N, vocab]."""
        if self._lm_head_onednn is not None:
            return torch._C._nn.mkldnn_linear(normed.to_mkldnn(), self._lm_head_onednn, None).to_dense()
        return F.linear(normed, self.weights.lm_head).float()

    def head_input_grad(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """`grad_logits @ lm_head` in float32, [N, hidden]: the gradient w.r.t. the LM head's input.

        On CPU in float32 a training loss runs it on every forward window; oneDNN's blocked layout of
        the head's transpose (built on first use, a second copy of the matrix, so only when the head
        is small) takes it from 1.5 to 0.5 ms for 4 rows of the small preset, 13 to 10 ms for 256.
        """
        if self._lm_head_onednn is None:
            return grad_logits @ self.weights.lm_head.float()
        if self._lm_head_t_onednn is None:
            self._lm_head_t_onednn = self.weights.lm_head.t().contiguous().to_mkldnn()
        return torch._C._nn.mkldnn_linear(grad_logits.contiguous().to_mkldnn(), self._lm_head_t_onednn,
                                          None).to_dense()
