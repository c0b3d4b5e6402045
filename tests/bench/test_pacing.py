"""`pacing`: a run's iterations while requests were live, against one per TPOT SLO; and the simulated
policies that keep the SLO iterate at that pace or faster (the constant share the SLO bound leaves out)."""

from __future__ import annotations

import pytest
from test_headroom import simulated_rate
from test_simulator import SHAPE, _job

from coserve.bench.pacing import live_periods, pacing
from coserve.bench.policy_set import make_factory
from coserve.bench.replay import IterationRecord, RequestRecord, RunLimits, RunRecord
from coserve.bench.run_metrics import summarize
from coserve.bench.simulator import simulate
from coserve.planner.latency import PlanFeatures


def _request(request_id: str, token_times: list[float]) -> RequestRecord:
    return RequestRecord(request_id, token_times[0] - 0.1, prompt_len=8, output_len=len(token_times),
                         token_times=token_times, finished=True)


def _ending_at(*ends: float) -> list[IterationRecord]:
    return [IterationRecord(end - 0.01, end, 0.01, PlanFeatures(decode_tokens=1), trained_tokens=0) for end in ends]


def test_live_periods_merge_overlapping_spans_and_stop_at_the_window() -> None:
    requests = [_request("a", [1.0, 2.0, 3.0]), _request("b", [2.5, 4.0]), _request("c", [6.0, 7.0]),
                _request("d", [5.0]),  # one token: never live between two
                _request("e", [9.0, 12.0]),  # runs past the window's end
                _request("f", [10.5, 11.0])]  # starts after it
    record = RunRecord("coserve", 1.0, 10.0, requests, [], num_layers=2)
    assert live_periods(record) == [(1.0, 4.0), (6.0, 7.0), (9.0, 10.0)]


def test_pacing_counts_iterations_ending_inside_live_periods() -> None:
    # Live (1, 4] and (6, 7]; an iteration ending at 1.0 sampled a's first token: not inside.
    requests = [_request("a", [1.0, 2.0, 3.0]), _request("b", [2.5, 4.0]), _request("c", [6.0, 7.0])]
    iterations = _ending_at(0.5, 1.0, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)
    result = pacing(RunRecord("coserve", 1.0, 10.0, requests, iterations, num_layers=2), tpot_s=1.0,
                    constant_s=0.01)
    assert result.live_s == pytest.approx(4.0)
    assert result.iterations == 5  # 2.0, 2.5, 3.0, 4.0 and 7.0
    assert result.per_tpot == pytest.approx(5 * 1.0 / 4.0)
    assert result.constant_share == pytest.approx(5 * 0.01 / 10.0)
    assert result.paced_constant_share == pytest.approx(4.0 / 1.0 * 0.01 / 10.0)
    idle = pacing(RunRecord("coserve", 1.0, 10.0, [], iterations, num_layers=2), tpot_s=1.0, constant_s=0.01)
    assert idle.per_tpot is None and idle.iterations == 0


@pytest.mark.parametrize("name", ["coserve", "coserve-strict"])
def test_policies_keeping_the_slo_iterate_at_least_once_per_tpot_while_requests_are_live(name: str) -> None:
    window = 10.0
    sim = simulated_rate(6.0, window)
    run = simulate(make_factory(name, sim.setup), sim.trace, RunLimits(window, 3.0), sim.latency, SHAPE,
                   job_spec=_job(name), policy_name=name)
    assert summarize(run, sim.setup.slo).slo_attainment == 1.0
    result = pacing(run, sim.setup.slo.tpot_s, sim.latency.coefficients["constant"])
    assert result.live_s > 0.5 * window
    assert result.per_tpot is not None and result.per_tpot >= 1.0
    assert result.constant_share >= result.paced_constant_share
