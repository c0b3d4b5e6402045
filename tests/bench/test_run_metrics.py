"""Benchmark metrics on hand-built runs: the SLO rule, throughput windows, percentiles."""

from __future__ import annotations

import pytest

from coserve.bench.replay import IterationRecord, RequestRecord, RunRecord
from coserve.bench.run_metrics import SLO, finetune_tokens_per_s, relative_error, slo_attainment, summarize
from coserve.planner.latency_features import PlanFeatures

SLO_ = SLO(ttft_s=1.0, tpot_s=0.1)


def _request(rid: str, arrival: float, times: list[float], finished: bool = True,
             prompt: int = 10) -> RequestRecord:
    return RequestRecord(rid, arrival, prompt, len(times), token_times=times, finished=finished)


def _run(requests: list[RequestRecord], iterations: list[IterationRecord] | None = None,
         window: float = 10.0) -> RunRecord:
    return RunRecord("p", 1.0, window, requests, iterations or [], num_layers=2)


def test_slo_rule_ttft_and_mean_tpot_both_needed() -> None:
    run = _run([
        _request("ok", 0.0, [0.5, 0.5625, 0.625]),  # TTFT 0.5, TPOT 0.0625: meets both
        _request("slow-first", 0.0, [1.5, 1.55]),  # TTFT 1.5 > 1.0
        _request("slow-decode", 0.0, [0.2, 0.5, 0.8]),  # TPOT 0.3 > 0.1
        _request("stall-amortized", 0.0, [0.1, 0.12, 0.14, 0.36]),  # mean gap 0.0867: meets
        _request("one-token", 2.0, [2.9]),  # no TPOT: judged on TTFT alone
        _request("never-started", 9.0, [], finished=False),  # no first token: a miss
    ])
    assert slo_attainment(run, SLO_) == pytest.approx(3 / 6)


def test_running_request_is_judged_on_its_tokens_so_far() -> None:
    run = _run([_request("late", 9.5, [9.625, 9.6875, 9.75], finished=False),
                _request("late-slow", 9.5, [9.7, 10.5], finished=False)])
    assert slo_attainment(run, SLO_) == pytest.approx(0.5)


def test_throughputs_count_only_the_window() -> None:
    requests = [_request("a", 0.0, [1.0, 2.0, 3.0], prompt=10),
                _request("b", 8.0, [9.0, 11.0], prompt=20),  # one output after the window
                _request("c", 9.9, [10.5], prompt=30)]  # first token after the window
    iterations = [IterationRecord(0.0, 4.0, 4.0, PlanFeatures(), 100),
                  IterationRecord(4.0, 10.0, 6.0, PlanFeatures(), 50),
                  IterationRecord(10.0, 10.5, 0.5, PlanFeatures(), 1000)]  # after the window
    run = _run(requests, iterations)
    metrics = summarize(run, SLO_)
    assert metrics.inference_tokens_per_s == pytest.approx((10 + 3 + 20 + 1) / 10.0)
    assert finetune_tokens_per_s(run) == pytest.approx(150 / 10.0)
    assert metrics.finetune_steady_tokens_per_s == pytest.approx(50 / (10.0 - 4.0))
    assert metrics.num_requests == 3 and metrics.num_finished == 3 and metrics.num_iterations == 3


def test_percentiles_in_ms_and_missing_values() -> None:
    run = _run([_request(f"r{i}", 0.0, [0.1 * (i + 1), 0.1 * (i + 1) + 0.02]) for i in range(5)])
    metrics = summarize(run, SLO_)
    assert metrics.ttft_p50_ms == pytest.approx(300.0)
    assert metrics.tpot_p50_ms == pytest.approx(20.0)
    assert metrics.ttft_p99_ms == pytest.approx(496.0)
    empty = summarize(_run([]), SLO_)
    assert empty.slo_attainment is None and empty.ttft_p50_ms is None and empty.tpot_p99_ms is None
    assert empty.finetune_steady_tokens_per_s is None


def test_relative_error_and_slo_validation() -> None:
    assert relative_error(110.0, 100.0) == pytest.approx(0.1)
    assert relative_error(None, None) == 0.0 and relative_error(1.0, None) == float("inf")
    with pytest.raises(ValueError):
        SLO(ttft_s=0.0, tpot_s=0.1)
