"""Exact token-window forward and backward of one training sequence (FlexLLM Algorithm 2, fixed).

A sequence of L tokens is trained in pieces the scheduler can interleave with inference:

* `forward_window(state, s)`: the next s tokens run through every layer with no autograd graph. The
  input of every layer for those tokens and the post-rope K/V of every layer are kept in `state`;
  then the window's loss (the targets' log-probs from the chunked cross-entropy, labels from the whole
  sequence, and what the sequence's loss makes of them: `token_losses`) and its gradient w.r.t. the
  last hidden state are computed at once and stored in `state.grad_hidden`. A loss over whole-sequence
  sums (DPO) scales that gradient once every forward it needs is done (`SequenceState.scale_gradient`).
* `backward_tasklet(state, layer, s)`: recomputes one layer on the last s not-yet-done tokens of that
  layer from its saved input, with the K/V of earlier tokens as leaves, and back-propagates the
  window's output gradient plus the K/V gradient that later windows left in the layer's accumulator.
  The window's input gradient replaces its output gradient in `state.grad_hidden`, the K/V gradients
  of earlier tokens are added to the accumulator, and LoRA gradients accumulate in `lora`'s `.grad`.

Both run the engine's own `Transformer.layer`, so a window computes what serving computes. Only the
K/V store differs: a dense per-layer buffer (forward) or the earlier-token leaves concatenated with
the window's fresh K/V (backward), each passed where the engine passes its paged `KVCache`.

Normalisation: `state.loss_scale` multiplies every gradient. The default 1 / (trained tokens of the
sequence) gives the gradient of the sequence's mean loss. For a batch, pass `loss_normalizer` = trained
tokens of the whole batch to every sequence: the summed `.grad` is then the gradient of
(sum of the batch's token losses) / (batch's trained tokens), the batch mean whatever the windowing.

Two K/V homes. Standalone (`forward_window`), a sequence's K/V live in dense per-layer buffers of its
state. Co-served, the window runs inside the engine's fused forward (`Engine.step`): its K/V go to
the paged `KVCache` like a prefill chunk's, the engine copies each layer's input rows into the state
(`keep_layer_input`) and hands the last hidden rows to `record_window`; the state then holds the
positions' cache slots (`kv_slots`) and a tasklet gathers the earlier tokens' K/V from the cache as
leaves. The fused forward runs under `torch.inference_mode`; the kept buffers are ordinary tensors
allocated outside it (copies into them are allowed), so autograd can use them later.

Dependencies (checked): a tasklet on tokens [a, b) of layer n needs the whole forward done, tokens
[b, L) of layer n done (so the accumulator holds every later contribution) and tokens [a, L) of
layer n + 1 done (so `grad_hidden[a:b]` is the gradient w.r.t. layer n's output). Layer-major order
(last layer first, last window first) is one valid order; backward windows need not match the
forward windows, and a later "layer range x window" tasklet is a sequence of these calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from coserve.forward.attention import ChunkSpan, build_metadata
from coserve.forward.kv_cache import KVCache
from coserve.forward.lora import AdapterLayer, AdapterWeights, LoRABank, LoRASegment
from coserve.forward.transformer import ForwardBatch, Transformer
from coserve.trainer.lora_params import TrainableLoRA
from coserve.trainer.loss import DEFAULT_VOCAB_CHUNK, IGNORE_INDEX, WindowLoss, window_loss
from coserve.trainer.token_losses import TokenLoss

_SLOT = 0  # the trainer's private bank has one slot: the job's adapter


def next_token_targets(token_ids: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Target of every position from the whole sequence: token p + 1, or IGNORE_INDEX.

    `trained[p]` says whether token p is learned (an assistant token), as HF labels != -100 do; it is
    the target of position p - 1. The last position has no target. A window's last position thus
    takes its label from the first token of the next window (FlexLLM left that label stale).
    """
    targets = torch.full_like(token_ids, IGNORE_INDEX)
    targets[:-1] = torch.where(trained[1:].bool(), token_ids[1:],
                               torch.full_like(token_ids[1:], IGNORE_INDEX))
    return targets


@dataclass(slots=True)
class SequenceState:
    """Everything one training sequence keeps between its forward windows and backward tasklets.

    Memory: per layer its input [L, hidden] and K/V [L, kv_heads, head_dim] (freed when the layer's
    backward completes), one gradient buffer [L, hidden] and, per layer being back-propagated, a K/V
    gradient accumulator. No other activation outlives a window or a tasklet.
    """

    token_ids: torch.Tensor  # [L]
    targets: torch.Tensor  # [L] next-token targets, IGNORE_INDEX where no loss
    loss_scale: float
    layer_inputs: list[torch.Tensor | None]  # [L, hidden] per layer
    keys: list[torch.Tensor | None]  # [L, kv_heads, head_dim] per layer, post-rope (dense mode)
    values: list[torch.Tensor | None]
    grad_hidden: torch.Tensor | None  # [L, hidden] fp32: see the module docstring
    key_grads: list[torch.Tensor | None]  # fp32 accumulators, allocated when a layer's backward starts
    value_grads: list[torch.Tensor | None]
    forward_end: int = 0  # tokens [0, forward_end) have run forward
    backward_end: list[int] = field(default_factory=list)  # per layer: [0, end) still to back-propagate
    loss_sum: float = 0.0
    num_loss_tokens: int = 0
    kv_slots: torch.Tensor | None = None  # [L] paged-cache slot of each position (co-served mode)
    loss: TokenLoss | None = None  # None: cross-entropy (weight 1 on every trained token)
    # [L] fp32: log-prob of token t given tokens < t, for trained t (0 elsewhere), filled by the windows
    logprobs: torch.Tensor | None = None
    adapter: bool = True  # False: the base model alone (DPO's reference pass; no gradient)

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    @property
    def forward_done(self) -> bool:
        return self.forward_end == self.length

    @property
    def backward_done(self) -> bool:
        return self.backward_end[0] == 0

    def kept_bytes(self) -> int:
        """Bytes the sequence holds now (layer inputs, K/V, gradient buffer, accumulators).

        This is the trainer's activation memory, for the benchmark's bytes-per-token and for the
        scheduler's memory budget.
        """
        tensors = [*self.layer_inputs, *self.keys, *self.values, *self.key_grads,
                   *self.value_grads, self.grad_hidden]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def scale_gradient(self, coefficient: float) -> None:
        """Multiply the loss's gradient by `coefficient`, once the forward is done and before the first
        backward tasklet: a loss over whole-sequence sums (`token_losses.SequenceLogprob`) learns its
        d(loss)/d(sum) only when every sequence it spans has run forward."""
        if not self.forward_done or any(end != self.length for end in self.backward_end):
            raise RuntimeError("a sequence's gradient is scaled between its forward and its backward")
        assert self.grad_hidden is not None  # kept until layer 0's backward completes
        self.grad_hidden.mul_(coefficient)

    def next_backward_layer(self) -> int | None:
        """The layer whose tasklet comes next in layer-major order (None when all are done)."""
        for n in reversed(range(len(self.backward_end))):
            if self.backward_end[n] > 0:
                return n
        return None


class _DenseKV:
    """Forward K/V store: per-layer [L, kv_heads, head_dim] buffers seen as blocks of one slot.

    Duck-types the two `KVCache` methods `Transformer.layer` uses. With block size 1 and the block
    table 0..L-1, a token's slot is its position.
    """

    def __init__(self, keys: list[torch.Tensor | None], values: list[torch.Tensor | None]) -> None:
        self.keys, self.values = keys, values

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys[layer].index_copy_(0, slots, k)  # type: ignore[union-attr]
        self.values[layer].index_copy_(0, slots, v)  # type: ignore[union-attr]

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer].unsqueeze(1), self.values[layer].unsqueeze(1)  # type: ignore[union-attr]


class _LeafKV:
    """Backward K/V store of one layer: earlier tokens' K/V (autograd leaves) + the window's own.

    `write` keeps the window's K/V (part of the recompute graph) and appends them to the leaves
    without touching them in place, so gradients reach both.
    """

    def __init__(self, past_k: torch.Tensor, past_v: torch.Tensor) -> None:
        self.past_k, self.past_v = past_k, past_v
        self.new_k: torch.Tensor | None = None
        self.new_v: torch.Tensor | None = None
        self.all_k: torch.Tensor | None = None
        self.all_v: torch.Tensor | None = None

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.new_k, self.new_v = k, v
        self.all_k, self.all_v = torch.cat([self.past_k, k]), torch.cat([self.past_v, v])

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.all_k is not None and self.all_v is not None  # a layer writes its K/V before attending
        return self.all_k.unsqueeze(1), self.all_v.unsqueeze(1)


class WindowedTrainer:
    """Forward windows and backward tasklets of training sequences over a frozen `Transformer`."""

    def __init__(self, model: Transformer, lora: TrainableLoRA,
                 vocab_chunk: int = DEFAULT_VOCAB_CHUNK, cache: KVCache | None = None) -> None:
        self.model, self.lora, self.vocab_chunk = model, lora, vocab_chunk
        self.cache = cache  # the engine's paged cache, for sequences started with paged=True
        cfg = model.cfg
        self._bank = LoRABank(cfg, 1, lora.config.r, model.dtype, model.device)
        self._forward_adapter: AdapterWeights | None = None

    def refresh_adapter(self) -> None:
        """Snapshot the master weights for forward windows; call after every optimizer step."""
        self._forward_adapter = self.lora.adapter_weights(adapter_id=-1, dtype=self.model.dtype)

    def drop_snapshot(self) -> None:
        """Free the snapshot and the bank's adapter (the job is parked); remade when a sequence starts."""
        self._forward_adapter = None
        self._bank.unload(_SLOT)

    def start_sequence(self, token_ids: torch.Tensor | list[int], trained: torch.Tensor | list[bool],
                       loss_normalizer: int | None = None, paged: bool = False,
                       keep_inputs: bool = True, loss: TokenLoss | None = None,
                       adapter: bool = True) -> SequenceState:
        """Set up the state of one sequence. `trained[p]`: token p is a learned (assistant) token.

        `loss_normalizer`: trained tokens of the whole batch (default: of this sequence).
        `paged`: the K/V live in the trainer's `cache` (co-served windows), not in the state.
        `keep_inputs=False`: an evaluation-only sequence (loss, no backward): no layer inputs kept.
        `loss`: what the trained tokens' log-probs are trained on (default: their cross-entropy).
        `adapter=False`: through the base model alone (a reference pass: give `keep_inputs=False`).
        """
        if not adapter and keep_inputs:
            raise ValueError("a sequence without the adapter has nothing to train: keep_inputs=False")
        if paged and self.cache is None:
            raise ValueError("a paged sequence needs the trainer to have the engine's KV cache")
        device = self.model.device
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=device)
        mask = torch.as_tensor(trained, device=device)
        if ids.dim() != 1 or ids.numel() < 2 or mask.shape != ids.shape:
            raise ValueError(f"need 1-D token ids (>= 2) and a mask of the same shape, got "
                             f"{tuple(ids.shape)} and {tuple(mask.shape)}")
        targets = next_token_targets(ids, mask)
        count = int((targets != IGNORE_INDEX).sum())
        normalizer = count if loss_normalizer is None else loss_normalizer
        if normalizer <= 0:
            raise ValueError("the sequence has no trained token (and no batch normalizer was given)")
        if self._forward_adapter is None:
            self.refresh_adapter()
        cfg, length, n = self.model.cfg, ids.numel(), self.model.cfg.num_layers

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=self.model.dtype, device=device)

        def kv() -> list[torch.Tensor | None]:
            return [None if paged else empty(length, cfg.num_kv_heads, cfg.head_dim) for _ in range(n)]

        return SequenceState(
            token_ids=ids, targets=targets, loss_scale=1.0 / normalizer,
            layer_inputs=[empty(length, cfg.hidden_size) if keep_inputs else None for _ in range(n)],
            keys=kv(), values=kv(),
            grad_hidden=torch.zeros(length, cfg.hidden_size, device=device),
            key_grads=[None] * n, value_grads=[None] * n, backward_end=[length] * n,
            kv_slots=torch.full((length,), -1, dtype=torch.int64, device=device) if paged else None,
            loss=loss, logprobs=torch.zeros(length, device=device), adapter=adapter)

    def _batch(self, state: SequenceState, start: int, end: int) -> ForwardBatch:
        """Metadata of tokens [start, end) attending to [0, end): block size 1, slot = position."""
        span = ChunkSpan(row=0, start=start, num_tokens=end - start, block_table=list(range(end)))
        attn = build_metadata([span], block_size=1, device=self.model.device)
        segments = [LoRASegment(_SLOT, 0, end - start)] if state.adapter else []
        return self.model.make_batch(state.token_ids[start:end], attn, segments)

    @torch.no_grad()
    def forward_window(self, state: SequenceState, num_tokens: int) -> WindowLoss:
        """Run the next `num_tokens` tokens forward, keep what the backward needs, return the loss."""
        start, end = state.forward_end, state.forward_end + num_tokens
        if num_tokens < 1 or end > state.length:
            raise ValueError(f"window of {num_tokens} tokens at {start} exceeds length {state.length}")
        self._bank.install(_SLOT, self._forward_adapter)  # type: ignore[arg-type]
        batch, cache = self._batch(state, start, end), _DenseKV(state.keys, state.values)
        h = self.model.weights.embed[state.token_ids[start:end]]
        for n in range(self.model.cfg.num_layers):
            kept = state.layer_inputs[n]
            if kept is not None:  # None: a forward-only sequence (evaluation, reference) keeps nothing
                kept[start:end] = h
            h = self.model.layer(n, h, batch, cache, self._bank)  # type: ignore[arg-type]
        return self.record_window(state, start, end, h)

    def record_window(self, state: SequenceState, start: int, end: int,
                      hidden: torch.Tensor) -> WindowLoss:
        """Loss and output gradient of tokens [start, end), whose last hidden states are `hidden`."""
        if start != state.forward_end or end > state.length:
            raise ValueError(f"window [{start}, {end}) does not continue the sequence's forward at "
                             f"{state.forward_end} (length {state.length})")
        result = window_loss(self.model, hidden, state.targets[start:end], state.loss_scale,
                             self.vocab_chunk, state.loss, start)
        state.grad_hidden[start:end] = result.grad_hidden  # type: ignore[index]
        assert state.logprobs is not None  # set by start_sequence
        state.logprobs[result.positions + start + 1] = result.logprobs
        state.forward_end, state.loss_sum = end, state.loss_sum + result.loss_sum
        state.num_loss_tokens += result.num_tokens
        return result

    def _check_tasklet(self, state: SequenceState, layer: int, start: int, end: int) -> None:
        if not state.forward_done:
            raise RuntimeError("backward tasklets need the sequence's forward to be complete")
        if not 0 <= layer < len(state.backward_end) or not 0 <= start < end:
            raise ValueError(f"no tasklet for layer {layer}, tokens [{start}, {end})")
        above = state.backward_end[layer + 1] if layer + 1 < len(state.backward_end) else 0
        if above > start:
            raise RuntimeError(f"layer {layer} tokens [{start}, {end}) need layer {layer + 1} done "
                               f"down to {start}; it is done down to {above}")

    def backward_tasklet(self, state: SequenceState, layer: int, num_tokens: int) -> tuple[int, int]:
        """Back-propagate `layer` over its last `num_tokens` pending tokens; returns (start, end)."""
        end = state.backward_end[layer]
        start = end - num_tokens
        self._check_tasklet(state, layer, start, end)
        cfg = self.model.cfg
        if state.key_grads[layer] is None:  # first tasklet of this layer: a fresh accumulator
            shape = (state.length, cfg.num_kv_heads, cfg.head_dim)
            state.key_grads[layer] = torch.zeros(shape, device=self.model.device)
            state.value_grads[layer] = torch.zeros(shape, device=self.model.device)
        grad_hidden, key_grads, value_grads = state.grad_hidden, state.key_grads[layer], state.value_grads[layer]
        # Kept until the layer's backward completes (the gradient buffer: until layer 0's).
        assert grad_hidden is not None and key_grads is not None and value_grads is not None
        x = state.layer_inputs[layer][start:end].detach()  # type: ignore[index]
        # The embeddings are frozen: layer 0 needs no input gradient, only LoRA gradients.
        x.requires_grad_(layer > 0)
        past_k, past_v = self._past_kv(state, layer, start)
        cache = _LeafKV(past_k.requires_grad_(start > 0), past_v.requires_grad_(start > 0))
        with torch.enable_grad():
            self._bank.install(_SLOT, self._grad_adapter(layer))
            out = self.model.layer(layer, x, self._batch(state, start, end), cache,  # type: ignore[arg-type]
                                   self._bank)
            assert cache.new_k is not None and cache.new_v is not None  # the layer wrote them
            pairs = [(out, grad_hidden[start:end]), (cache.new_k, key_grads[start:end]),
                     (cache.new_v, value_grads[start:end])]
            # At layer 0 with no LoRA on q/k/v, the window's K/V do not depend on anything trained.
            pairs = [(t, g.to(t.dtype)) for t, g in pairs if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if layer > 0:
            assert x.grad is not None  # x required grad and fed the layer's output
            grad_hidden[start:end] = x.grad
        if start > 0:
            assert past_k.grad is not None and past_v.grad is not None  # leaves the window attended to
            key_grads[:start] += past_k.grad
            value_grads[:start] += past_v.grad
        state.backward_end[layer] = start
        if start == 0:
            self._release_layer(state, layer)
        return start, end

    def _past_kv(self, state: SequenceState, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Detached copies of the K/V of positions [0, start) of `layer` (dense buffers or cache)."""
        if state.kv_slots is None:
            return (state.keys[layer][:start].detach(),  # type: ignore[index]
                    state.values[layer][:start].detach())  # type: ignore[index]
        slots = state.kv_slots[:start]
        return self.cache.k[layer][slots], self.cache.v[layer][slots]  # type: ignore[union-attr]

    def _grad_adapter(self, layer: int) -> AdapterWeights:
        """An adapter whose only built layer is `layer`, differentiable into the master weights."""
        cfg = self.model.cfg
        layers: list[AdapterLayer] = [(None, None, None, None)] * cfg.num_layers
        layers[layer] = self.lora.fused_layer(layer, self.model.dtype)
        return AdapterWeights(adapter_id=-1, rank=self.lora.config.r,
                              target_modules=self.lora.config.target_modules,
                              layers=layers)

    @staticmethod
    def _release_layer(state: SequenceState, layer: int) -> None:
        """A layer whose backward is complete needs none of its buffers any more."""
        state.layer_inputs[layer] = state.keys[layer] = state.values[layer] = None
        state.key_grads[layer] = state.value_grads[layer] = None
        if layer == 0:
            state.grad_hidden = None  # the embeddings' gradient: nothing trains them


def run_schedule(trainer: WindowedTrainer, state: SequenceState, forward_windows: list[int],
                 backward_windows: list[int] | None = None) -> SequenceState:
    """Forward then backward `state` with the given window sizes (layer-major backward).

    `backward_windows` lists the sizes from the end of the sequence backwards (default: the forward
    windows reversed); the same schedule is used for every layer. LoRA grads accumulate in `.grad`.
    """
    sizes = list(reversed(forward_windows)) if backward_windows is None else backward_windows
    if sum(forward_windows) != state.length - state.forward_end or sum(sizes) != state.length:
        raise ValueError(f"windows {forward_windows} / {sizes} do not cover the sequence's "
                         f"{state.length} tokens ({state.forward_end} already forwarded)")
    for size in forward_windows:
        trainer.forward_window(state, size)
    for layer in reversed(range(trainer.model.cfg.num_layers)):
        for size in sizes:
            trainer.backward_tasklet(state, layer, size)
    return state


def train_sequence(trainer: WindowedTrainer, token_ids: torch.Tensor | list[int],
                   trained: torch.Tensor | list[bool], forward_windows: list[int],
                   backward_windows: list[int] | None = None,
                   loss_normalizer: int | None = None) -> SequenceState:
    """Start one sequence and run it with `run_schedule`; returns its (released) state."""
    state = trainer.start_sequence(token_ids, trained, loss_normalizer)
    return run_schedule(trainer, state, forward_windows, backward_windows)
