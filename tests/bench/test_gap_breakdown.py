"""The gap to the bound split into its parts (`gap_breakdown`): the terms add up to bound - trained, each
lands where its seconds went, and a simulated run's hold reasons are recorded and counted."""

from __future__ import annotations

import dataclasses

import pytest
from test_headroom import simulated_rate
from test_simulator import FP, SHAPE, _job

from coserve.bench.gap_breakdown import (
    WINDOW_EDGES,
    GapBreakdown,
    gap_breakdown,
    measured_over_predicted,
    split_window,
    work_per_token_s,
)
from coserve.bench.headroom import headroom
from coserve.bench.policy_set import make_factory
from coserve.bench.replay import IterationRecord, RunLimits, RunRecord
from coserve.bench.simulator import simulate
from coserve.planner.hold_kind import HoldKind
from coserve.planner.latency import LatencyModel, PlanFeatures

MODEL = {"constant": 0.010, "decode_tokens": 0.001, "num_sequences": 0.001, "ft_forward_tokens": 0.0005,
         "ft_pieces": 0.004}


def _at(start: float, wall: float, engine: float, features: PlanFeatures, tokens: int = 0,
        held: HoldKind | None = None) -> IterationRecord:
    return IterationRecord(start, start + wall, engine, features, tokens, held=held)


def test_each_second_lands_in_its_term_and_the_terms_add_up_to_the_gap() -> None:
    model = LatencyModel(FP, MODEL)
    decode = PlanFeatures(decode_tokens=2, num_sequences=2)  # predicted 14 ms
    mixed = dataclasses.replace(decode, ft_forward_tokens=100, ft_pieces=1)  # predicted 14 + 50 + 4 = 68 ms
    run = RunRecord("coserve", 1.0, 1.0, [], [
        _at(0.0, 0.020, 0.015, decode, held=HoldKind.NOT_BANKED),
        _at(0.020, 0.080, 0.075, mixed, tokens=100),  # 7 ms over the model, 5 ms of host time
        _at(0.100, 0.014, 0.014, decode, held=HoldKind.TTFT_GUARD),
    ], num_layers=2)
    alone_step = PlanFeatures(ft_forward_tokens=1000, ft_pieces=1)  # predicted 514 ms
    alone = RunRecord("coserve", 0.0, 1.0, [], [_at(0.0, 0.5, 0.5, alone_step, tokens=800),
                                                 _at(0.5, 0.5, 0.5, alone_step, tokens=800)], num_layers=2)
    split = split_window(run, model)
    assert split.inference_s == pytest.approx(3 * 0.004)
    assert split.without_finetune_s == pytest.approx({"not_banked": 0.016, "ttft_guard": 0.010})
    assert (split.constant_s, split.pieces_s, split.finetune_s) == pytest.approx((0.010, 0.004, 0.050))
    assert (split.error_s, split.host_s) == pytest.approx((0.007, 0.005))
    assert split.idle_s == pytest.approx(1.0 - 0.114) and split.total_s == pytest.approx(1.0)
    cut = split_window(RunRecord("coserve", 1.0, 0.06, [], run.iterations, num_layers=2), model)
    # the window ends half-way through the second iteration: half of each of its parts counts
    assert (cut.constant_s, cut.finetune_s, cut.host_s) == pytest.approx((0.005, 0.025, 0.0025))
    assert cut.idle_s == pytest.approx(0.0) and cut.total_s == pytest.approx(0.06)

    r = 1600.0  # fine-tuning alone: 1600 trained tokens in its 1 s window
    gap = gap_breakdown(run, alone, model, r)
    assert gap.bound_tokens_per_s == pytest.approx(headroom(run, model, r, None).finetune_bound_tokens_per_s)
    assert gap.trained_tokens_per_s == 100.0
    assert gap.tokens_per_s(gap.gap_s) == pytest.approx(gap.bound_tokens_per_s - gap.trained_tokens_per_s)
    terms = gap.terms_s
    # alone paid 2 x 10 ms of constant for 1600 tokens: 1.25 ms for this run's 100; this run paid 10
    assert terms["iteration constants (with fine-tuning)"] == pytest.approx(0.010 - 0.00125)
    assert terms["iterations without fine-tuning: not_banked"] == pytest.approx(0.016)
    # engine time over the model: the decodes ran 29 for 28 ms predicted, the mixed one 75 for 68
    assert measured_over_predicted(run, model, with_finetune=False) == pytest.approx(0.029 / 0.028)
    assert measured_over_predicted(run, model, with_finetune=True) == pytest.approx(0.075 / 0.068)
    assert gap.speed["fine-tuning alone"] == pytest.approx(1.0 / 1.028)
    assert measured_over_predicted(RunRecord("x", 1.0, 1.0, [], [], 2), model, with_finetune=True) is None
    assert terms["idle (no iteration)"] == pytest.approx(1.0 - 0.114)
    # alone's 1 s of token work trained 1600 tokens: this run's 50 ms of it are worth 80 tokens/s
    assert gap.work_tokens_per_s == pytest.approx(0.050 / 1.0 * 1600)
    assert work_per_token_s(alone, model) == pytest.approx(1.0 / 1600)
    # the edges: 50 ms of token work where alone's 1600-token rate spends 100 / 1600 s on it
    assert terms[WINDOW_EDGES] == pytest.approx(0.050 - 100 / 1600)
    faster = gap_breakdown(run, alone, model, 2000.0)  # a steady estimate above the window's
    assert faster.terms_s[WINDOW_EDGES] - terms[WINDOW_EDGES] == pytest.approx(100 * (1 / 1600 - 1 / 2000))


def test_a_simulated_run_records_why_fine_tuning_sat_iterations_out() -> None:
    window = 6.0
    sim = simulated_rate(3.0, window)
    run = simulate(make_factory("coserve", sim.setup), sim.trace, RunLimits(window, 3.0), sim.latency, SHAPE,
                   job_spec=_job("co"), policy_name="coserve")
    held = {it.held for it in run.iterations if it.start_s < window}
    assert HoldKind.NOT_BANKED in held  # bursts wait for banked slack
    gap = gap_breakdown(run, sim.solo, sim.latency, sim.finetune_only)
    assert gap.tokens_per_s(gap.gap_s) == pytest.approx(gap.bound_tokens_per_s - gap.trained_tokens_per_s)
    assert gap.terms_s["iterations without fine-tuning: not_banked"] > 0
    assert gap.trained_tokens_per_s < gap.bound_tokens_per_s


def test_a_loaded_machine_s_zero_bound_is_reported_not_divided_by() -> None:
    """Under load (inference alone took the whole window), the bound is 0: the gap's console lines say so
    and print every share as n/a, where they once raised ZeroDivisionError and lost the whole run."""
    from coserve.bench.coserving_rows import gap_rows

    gap = GapBreakdown(rate=4.0, window_s=10.0, finetune_alone_tokens_per_s=0.0, bound_tokens_per_s=0.0,
                       trained_tokens_per_s=0.0, work_tokens_per_s=0.0, terms_s={"idle (no iteration)": 0.0},
                       speed={"fine-tuning alone": None})
    text = gap_rows(gap, best_baseline_work=0.0, slo_bound=0.0)
    assert "(n/a of the bound)" in text and "WARNING: the bound is 0" in text
