"""`backward_within`: backward token-layers within a budget, one piece per further layer."""

from __future__ import annotations

from coserve.planner.backward_layers import backward_within
from coserve.planner.latency import LatencyModel, PlanFeatures
from coserving_sim import FP

# 1 ms an iteration, 0.5 ms a piece, 0.01 ms a token-layer.
MODEL = LatencyModel(FP, {"constant": 1e-3, "ft_pieces": 5e-4, "ft_backward_token_layers": 1e-5})
BASE = PlanFeatures()


def test_within_the_current_layer_it_is_the_linear_answer() -> None:
    # 1 ms + 0.5 ms piece leave 0.5 ms: 50 token-layers of the 80 left in the layer.
    assert backward_within(MODEL, BASE, (0, 0, 1), 0.002, (80, 100), cap=10_000) == 50


def test_each_further_layer_pays_a_piece() -> None:
    # 6 ms: 1 + 0.5 + 0.2 (the current layer's 20) leave 4.3 ms: 2 layers of 1.5 ms (0.5 + 100 x 0.01),
    # then 1.3 ms: a piece and 80 token-layers of the third.
    assert backward_within(MODEL, BASE, (0, 0, 1), 0.006, (20, 100), cap=10_000) == 20 + 2 * 100 + 80
    assert backward_within(MODEL, BASE, (0, 0, 1), 0.006, (20, 100), cap=150) == 150


def test_an_unknown_layer_is_priced_as_one_piece() -> None:
    assert backward_within(MODEL, BASE, (0, 0, 1), 0.006, (0, 0), cap=10_000) == 450


def test_a_plan_already_over_the_budget_gets_nothing() -> None:
    assert backward_within(MODEL, BASE, (0, 0, 9), 0.005, (20, 100), cap=10_000) == 0
