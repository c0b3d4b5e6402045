"""The two arms of ``coserve bench trainer`` (``coserve/bench/trainer.py``) and the activation-memory meter they share.

Both arms train one 512-token sequence per optimizer step (batch 1): LoRA r=16, alpha=32 on all seven
projections, fp32, AdamW lr 1e-4 (weight decay 0), gradient clipping at 1.0, the same initial
adapter (PEFT's init from one seed) and the same token ids and answer mask.

Activation memory, one rule for both arms (``SavedMeter``): the peak over one whole step of

* bytes the trainer itself keeps between its pieces (coserve only: ``SequenceState.kept_bytes()``:
  per-layer inputs, post-rope K/V, the loss gradient buffer ``grad_hidden`` and the K/V gradient
  accumulators; HF keeps nothing between pieces, its step is one graph), plus
* bytes of the tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``)
  that are alive at that moment: every saved tensor is charged its whole untyped storage, each
  storage once (deduplicated by ``data_ptr``), and storages of the frozen base weights, of the LoRA
  master parameters and (coserve) of the kept buffers above are not charged (they are counted once,
  or are not activations). A saved tensor lives until its graph's backward; so the live sum of a
  graph is its running sum during the forward part: HF's one graph, coserve's one tasklet at a time.

Not counted for either arm: transient workspace that is neither kept nor saved (the chunked
cross-entropy's [tokens, 4096] logit chunk in coserve; autograd's gradient buffers during backward,
e.g. coserve's leaf K/V gradients before they are added to the accumulator), the optimizer state and
the gradients of the LoRA parameters (the same in both arms).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from coserve.trainer.windowed import SequenceState

SEQ_LEN, R, ALPHA, LR = 512, 16, 32.0, 1e-4


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Every tensor reachable from a dataclass / list / tuple / dict tree."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif is_dataclass(obj):
        for f in fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class SavedMeter:
    """saved_tensors_hooks that sum the bytes of one graph's saved activations (see module doc).

    ``kept`` returns (bytes the trainer keeps now, their storage pointers); the meter's ``peak`` is
    the largest kept + saved seen at any pack call or ``sample()``.
    """

    def __init__(self, frozen: Iterable[torch.Tensor],
                 kept: Callable[[], tuple[int, set[int]]] = lambda: (0, set())) -> None:
        self.frozen = {_storage(t)[0] for t in frozen}
        self.kept, self.saved, self.peak = kept, 0, 0
        self.seen: set[int] = set()
        self.saved_peak = self.kept_peak = 0  # the two parts' own peaks (not simultaneous)

    def new_graph(self) -> None:
        """The previous graph's backward has run: its saved tensors are gone."""
        self.seen, self.saved = set(), 0

    def sample(self) -> None:
        kept_bytes = self.kept()[0]
        self.kept_peak = max(self.kept_peak, kept_bytes)
        self.peak = max(self.peak, kept_bytes + self.saved)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(t)
        kept_bytes, kept_ptrs = self.kept()
        if ptr not in self.seen and ptr not in self.frozen and ptr not in kept_ptrs and ptr != 0:
            self.seen.add(ptr)
            self.saved += nbytes
            self.saved_peak = max(self.saved_peak, self.saved)
        self.peak = max(self.peak, kept_bytes + self.saved)
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def make_batch_data(vocab: int, n: int, seed: int, seq_len: int = SEQ_LEN) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` random sequences of ``seq_len`` ids (ids >= 8: no special tokens); the second half trains."""
    g = torch.Generator().manual_seed(seed)
    trained = torch.arange(seq_len) >= seq_len // 2
    return [(torch.randint(8, vocab, (seq_len,), generator=g), trained.clone()) for _ in range(n)]


class CoserveArm:
    """coserve's WindowedTrainer + LoRAOptimizer; `forward` / `backward` are window-size lists. The base
    weights in `dtype` on `device` (the benchmark: float32 on the CPU), the LoRA master weights float32."""

    def __init__(self, model_dir: Path, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        from coserve.contract.training_settings import LoRASettings, OptimizerSettings
        from coserve.forward.transformer import Transformer
        from coserve.model.config import ModelConfig
        from coserve.model.weights import load_weights
        from coserve.trainer import LoRAOptimizer, TrainableLoRA, WindowedTrainer

        cfg = ModelConfig.from_pretrained(model_dir)
        weights = load_weights(model_dir, cfg, dtype, torch.device(device))
        self.model = Transformer(cfg, weights, dtype, torch.device(device))
        self.lora = TrainableLoRA.init(cfg, LoRASettings(r=R, lora_alpha=ALPHA), seed=seed, device=device)
        self.trainer = WindowedTrainer(self.model, self.lora)
        self.optimizer = LoRAOptimizer(self.lora, OptimizerSettings())  # lr 1e-4, wd 0, clip 1.0
        assert abs(self.optimizer.config.learning_rate - LR) < 1e-12

    def initial_adapter(self) -> dict[str, torch.Tensor]:
        return {k: t.detach().clone() for k, t in self.lora.named_parameters().items()}

    def step(self, ids: torch.Tensor, trained: torch.Tensor, forward: list[int],
             backward: list[int] | None = None) -> float:
        from coserve.trainer import TrainingSequence, train_batch

        stats = train_batch(self.trainer, self.optimizer,
                            [TrainingSequence(ids, trained, forward, backward)])
        assert stats.loss is not None  # train_batch always reports its batch's loss
        return float(stats.loss)

    def measure(self, ids: torch.Tensor, trained: torch.Tensor, forward: list[int],
                backward: list[int] | None = None) -> dict[str, Any]:
        """One untimed, instrumented step: peak kept + saved bytes (module doc), and its split."""
        trainer = self.trainer
        states: list[SequenceState] = []
        orig_start, orig_fwd, orig_bwd = (trainer.start_sequence, trainer.forward_window,
                                          trainer.backward_tasklet)

        def kept() -> tuple[int, set[int]]:
            if not states:
                return 0, set()
            s = states[-1]
            bufs = [*s.layer_inputs, *s.keys, *s.values, *s.key_grads, *s.value_grads, s.grad_hidden]
            return s.kept_bytes(), {_storage(t)[0] for t in bufs if t is not None}

        frozen = list(_tensors(self.model.weights)) + self.lora.parameters()
        meter = SavedMeter(frozen, kept)

        def start(*a: Any, **kw: Any) -> Any:
            states.append(orig_start(*a, **kw))
            return states[-1]

        def fwd(*a: Any, **kw: Any) -> Any:
            meter.new_graph()
            out = orig_fwd(*a, **kw)
            meter.sample()
            return out

        def bwd(state: Any, layer: int, num_tokens: int) -> Any:
            meter.new_graph()
            if state.key_grads[layer] is None:  # what the tasklet allocates first, made visible
                state.key_grads[layer] = torch.zeros_like(state.keys[layer], dtype=torch.float32)
                state.value_grads[layer] = torch.zeros_like(state.values[layer], dtype=torch.float32)
            meter.sample()
            out = orig_bwd(state, layer, num_tokens)
            meter.sample()
            return out

        # Instance attributes shadow the three methods for this one step (deleted again below).
        vars(trainer).update(start_sequence=start, forward_window=fwd, backward_tasklet=bwd)
        try:
            with meter.hooks():
                loss = self.step(ids, trained, forward, backward)
        finally:  # drop the instance attributes: the class methods show through again
            del trainer.start_sequence, trainer.forward_window, trainer.backward_tasklet
        return {"peak_bytes": meter.peak, "kept_peak_bytes": meter.kept_peak,
                "saved_peak_bytes": meter.saved_peak, "loss": loss}


class HFArm:
    """transformers + peft: one full-sequence forward with labels, backward, clip, AdamW. The base model in
    `dtype` on `device`; peft keeps the LoRA weights in float32 (its default upcast of adapters)."""

    def __init__(self, model_dir: Path, init: dict[str, torch.Tensor], device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device)
        # peft annotates lora_alpha as int; it takes any number (the scaling is lora_alpha / r).
        cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                         "up_proj", "down_proj"])
        self.model = get_peft_model(hf, cfg)
        self.model.train()  # dropout is 0: train() only sets the mode, as a Trainer would
        self.params = {n.replace(".default.weight", ".weight"): p
                       for n, p in self.model.named_parameters() if p.requires_grad}
        assert set(self.params) == set(init), "peft and coserve disagree on which tensors train"
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(init[name])  # the same initial adapter as coserve's
        self.adamw = torch.optim.AdamW(self.params.values(), lr=LR, weight_decay=0.0)

    def step(self, ids: torch.Tensor, trained: torch.Tensor, meter: SavedMeter | None = None) -> float:
        ids, trained = ids.to(self.device), trained.to(self.device)
        labels = torch.where(trained, ids, torch.full_like(ids, -100))
        if meter is None:
            loss = self.model(input_ids=ids[None], labels=labels[None]).loss
        else:
            with meter.hooks():
                loss = self.model(input_ids=ids[None], labels=labels[None]).loss
            meter.sample()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params.values(), 1.0)
        self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        return float(loss.detach())

    def measure(self, ids: torch.Tensor, trained: torch.Tensor) -> dict[str, Any]:
        frozen = [*self.model.parameters(), *self.model.buffers()]
        meter = SavedMeter(frozen)
        loss = self.step(ids, trained, meter)
        return {"peak_bytes": meter.peak, "kept_peak_bytes": 0,
                "saved_peak_bytes": meter.saved_peak, "loss": loss}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start
