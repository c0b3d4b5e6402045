"""The features of an iteration plan that the latency model is linear in.

Each feature is a count of work the engine does in one iteration; the latency model multiplies each by a
fitted cost (seconds per unit) and adds a constant for the fixed per-iteration overhead (Python, kernel
launches, sampling set-up). The features are chosen so that their costs are roughly constant:

- ``prefill_tokens`` / ``decode_tokens``: rows through the weight matmuls. They are split because a decode
  batch is memory-bound (every weight is read for few rows) while a prefill chunk is compute-bound, so a
  token costs differently in each. A chunk of one token is counted as a decode whatever its position: it
  does exactly a decode's work (one query row), and the plan cannot tell a prompt's last token apart.
- ``prefill_attention``: (query, key) pairs a prefill chunk's causal attention computes. A chunk of ``n``
  tokens at ``start`` has query ``i`` attend ``start + i + 1`` keys, so the count is
  ``n * start + n * (n + 1) / 2`` (exact, not the ``n * (start + n/2)`` approximation). This is the
  quadratic compute term.
- ``decode_context``: keys a decode reads (``start + 1``), the K/V bytes streamed from the cache. Kept apart
  from ``prefill_attention`` because reading K/V for one query is memory-bound, unlike a prefill's
  query-block attention.
- ``ft_forward_tokens``: fine-tuning forward-window tokens (full depth, activations kept for backward).
- ``ft_backward_token_layers``: backward work as tokens times layers, because a backward tasklet covers a
  slice of the depth (LLMStation's layer-granular tasklets); ``num_layers`` converts a full-depth token.
- ``distinct_adapters``: LoRA bank slots used in the batch (the base model, slot -1, does not count): the
  LoRA kernels run one segment per distinct adapter.
- ``num_sequences``: chunks in the batch (per-sequence metadata, sampling, block-table preparation).
- ``adapter_loads``: adapters loaded from disk before the forward, a large fixed cost per load.
- ``prefill_chunks``: chunks of more than one token; each runs its own causal attention call.
- ``ft_pieces``: forward windows plus backward tasklets; each has a fixed cost (a window keeps its layer
  inputs and computes its loss; a tasklet rematerialises its layer and sets up its autograd graph).
  Added after `coserve profile` on a tiny CPU model: without these two, small windows, small tasklets
  and short prefill chunks were under-predicted by about half (in-sample MAPE 20.7% -> 14.7%).

The fine-tuning amounts are read from `plan.training` (forward windows, backward tasklets). A forward
window's attention pairs are not added to ``prefill_attention``: the planner sizes windows with the linear
``ft_forward_tokens`` increment, and no measurement yet says the window's quadratic term matters at the
window sizes used (add it here, and to the increment, if a profile shows it does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter

from coserve.contract.plan import IterationPlan

_START, _NUM_TOKENS = attrgetter("start"), attrgetter("num_tokens")
_REQUEST_ID = attrgetter("request_id")
_BASE_MODEL = frozenset({-1})

# The order of the model's coefficients after the constant term (and of `PlanFeatures.vector`).
FEATURE_NAMES: tuple[str, ...] = (
    "prefill_tokens",
    "decode_tokens",
    "prefill_attention",
    "decode_context",
    "ft_forward_tokens",
    "ft_backward_token_layers",
    "distinct_adapters",
    "num_sequences",
    "adapter_loads",
    "prefill_chunks",
    "ft_pieces",
)
CONSTANT = "constant"  # name of the intercept in coefficient tables


@dataclass(frozen=True, slots=True)
class PlanFeatures:
    """Work counts of one iteration (see the module docstring for each field's meaning).

    Fields are floats because the hybrid policy scales an increment (`scaled`) and adds it to a base
    (`+`); features of real plans are whole numbers. The constant term is not a field: it is implicit
    in every prediction, so ``base + s * increment`` never counts the overhead twice.
    """

    prefill_tokens: float = 0.0
    decode_tokens: float = 0.0
    prefill_attention: float = 0.0
    decode_context: float = 0.0
    ft_forward_tokens: float = 0.0
    ft_backward_token_layers: float = 0.0
    distinct_adapters: float = 0.0
    num_sequences: float = 0.0
    adapter_loads: float = 0.0
    prefill_chunks: float = 0.0
    ft_pieces: float = 0.0

    def vector(self) -> tuple[float, ...]:
        """The features in `FEATURE_NAMES` order (explicit: this runs on every planning call)."""
        return (
            self.prefill_tokens, self.decode_tokens, self.prefill_attention, self.decode_context,
            self.ft_forward_tokens, self.ft_backward_token_layers, self.distinct_adapters,
            self.num_sequences, self.adapter_loads, self.prefill_chunks, self.ft_pieces,
        )

    @classmethod
    def from_vector(cls, values: tuple[float, ...] | list[float]) -> PlanFeatures:
        """Inverse of `vector`."""
        if len(values) != len(FEATURE_NAMES):
            raise ValueError(f"expected {len(FEATURE_NAMES)} feature values, got {len(values)}")
        return cls(*(float(v) for v in values))

    def __add__(self, other: PlanFeatures) -> PlanFeatures:
        return PlanFeatures.from_vector([a + b for a, b in zip(self.vector(), other.vector())])

    @property
    def has_inference(self) -> bool:
        """Whether the iteration holds inference work (decodes or a prefill chunk): the iterations the
        latency model decides (with no request running or waiting, fine-tuning gets the whole
        iteration whatever the model says), and the ones it is fitted and checked on."""
        return bool(self.decode_tokens or self.prefill_tokens)

    def with_finetune(self, forward_tokens: float, backward_token_layers: float,
                      pieces: float) -> PlanFeatures:
        """These features with the fine-tuning amounts replaced (the planner's per-job what-if)."""
        return PlanFeatures(self.prefill_tokens, self.decode_tokens, self.prefill_attention,
                            self.decode_context, float(forward_tokens), float(backward_token_layers),
                            self.distinct_adapters, self.num_sequences, self.adapter_loads,
                            self.prefill_chunks, float(pieces))

    def scaled(self, factor: float) -> PlanFeatures:
        """Every feature times `factor` (an increment repeated `factor` times)."""
        return PlanFeatures.from_vector([factor * v for v in self.vector()])

    def validate(self, name: str = "features") -> None:
        """Raise ValueError when a feature is negative or not finite (no work is negative)."""
        for field_name, value in zip(FEATURE_NAMES, self.vector()):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}.{field_name} must be a finite number >= 0, got {value!r}")


def plan_features(plan: IterationPlan, adapter_slots: Mapping[str, int] | None = None, *,
                  distinct_adapters: int | None = None) -> PlanFeatures:
    """Count the work of `plan` (pure; see the module docstring for each feature).

    Args:
        plan: the iteration.
        adapter_slots: request_id -> adapter slot (-1: base model) for requests scheduled in `plan` whose
            `NewSequence` was sent in an earlier iteration; the scheduler knows them. Slots sent in
            `plan.new_sequences` take precedence.
        distinct_adapters: the number of adapters of the scheduled requests when the caller already
            knows it (a scheduler that keeps a tally of its running requests' slots); then
            `adapter_slots` is not read.

    Raises:
        ValueError: a chunk with num_tokens < 1 or start < 0, or a request whose adapter slot is unknown.
    """
    chunks = plan.chunks
    # Planned every iteration for every running request: C-level passes (map, sum, set) instead of
    # a Python loop over chunks, with a loop only over the few chunks that are not decodes.
    starts = list(map(_START, chunks))
    counts = list(map(_NUM_TOKENS, chunks))
    decode = counts.count(1)
    decode_context = prefill = prefill_attention = prefill_chunks = 0
    if chunks and (min(starts) < 0 or min(counts) < 1):
        bad = next(c for c in chunks if c.start < 0 or c.num_tokens < 1)
        raise ValueError(f"chunk of {bad.request_id!r}: need num_tokens >= 1 and start >= 0, "
                         f"got num_tokens={bad.num_tokens}, start={bad.start}")
    if decode == len(chunks):
        decode_context = sum(starts) + decode
    else:
        for n, start in zip(counts, starts):
            if n == 1:
                decode_context += start + 1
            else:
                prefill += n
                prefill_chunks += 1
                prefill_attention += n * start + n * (n + 1) // 2
    if distinct_adapters is None:
        distinct_adapters = len(_adapter_slots(plan, adapter_slots) - _BASE_MODEL)
    return PlanFeatures(
        prefill_tokens=float(prefill),
        decode_tokens=float(decode),
        prefill_attention=float(prefill_attention),
        decode_context=float(decode_context),
        ft_forward_tokens=float(plan.training.forward_tokens),
        ft_backward_token_layers=float(plan.training.backward_token_layers),
        distinct_adapters=float(distinct_adapters),
        num_sequences=float(len(plan.chunks)),
        adapter_loads=float(len(plan.adapter_loads)),
        prefill_chunks=float(prefill_chunks),
        ft_pieces=float(len(plan.training.forward_windows) + len(plan.training.backward_tasklets)),
    )


def _adapter_slots(plan: IterationPlan, adapter_slots: Mapping[str, int] | None) -> set[int]:
    """The adapter slots of the plan's chunks (-1 included when a base-model row is scheduled)."""
    slot_of: Mapping[str, int] = adapter_slots if adapter_slots is not None else {}
    if plan.new_sequences:  # this plan's NewSequence first, then the caller's map
        slot_of = {**slot_of, **{seq.request_id: seq.adapter_slot for seq in plan.new_sequences}}
    try:
        return set(map(slot_of.__getitem__, map(_REQUEST_ID, plan.chunks)))
    except KeyError as missing:
        # A wrong adapter count silently skews every prediction, so a missing slot is a bug.
        raise ValueError(
            f"adapter slot of request {missing.args[0]!r} is unknown: it is not sent in this plan's "
            "new_sequences and not in adapter_slots (pass request_id -> slot for every running "
            "request)") from None
