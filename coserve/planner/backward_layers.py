"""How much backward work fits a time budget when it spans layers.

A job's backward runs layer-major (`finetune.progress.SequenceProgress.take_backward`): a budget of
token-layers becomes the rest of the current layer, then one tasklet per further layer, each with a
piece's fixed cost (`ft_pieces` in the latency model). A planner that prices the budget as one piece
under-counts those fixed costs: on SmolLM2 (30 layers, short sequences, a piece ~8.6 ms on a CPU) a
226 ms iteration can span ten layers and run over by nine pieces.
"""

from __future__ import annotations

from coserve.planner.latency import LatencyModel, PlanFeatures

_TOKEN_LAYER = PlanFeatures(ft_backward_token_layers=1.0)


def backward_within(latency: LatencyModel, base: PlanFeatures, planned: tuple[int, int, int], budget_s: float,
                    layers: tuple[int, int], cap: int) -> int:
    """The most backward token-layers one job can add to a plan within `budget_s`, as the model predicts it
    with one more piece per further layer.

    Args:
        base: the plan's inference features.
        planned: the plan's fine-tuning so far: forward tokens, backward token-layers, and pieces counting
            the one this job adds.
        layers: the job's `layer_tokens` (tokens left in its current layer, in a whole one); (0, 0): not
            known, priced as one piece.
        cap: at most this many.
    """
    forward, backward, pieces = planned
    left, whole = layers
    features = base.with_finetune(forward, backward, pieces)
    total = latency.max_extra_tokens(features, _TOKEN_LAYER, budget_s, min(cap, left) if left > 0 else cap)
    if left <= 0 or whole <= 0 or total < left or total >= cap:
        return total
    # Whole layers after it, each one more piece and `whole` token-layers; then part of one more.
    features = base.with_finetune(forward, backward + total, pieces)
    layers_fit = latency.max_extra_tokens(features, PlanFeatures(ft_backward_token_layers=float(whole), ft_pieces=1.0),
                                          budget_s, (cap - total) // whole)
    total, pieces = total + layers_fit * whole, pieces + layers_fit + 1
    features = base.with_finetune(forward, backward + total, pieces)
    return total + latency.max_extra_tokens(features, _TOKEN_LAYER, budget_s, min(whole, cap - total))
