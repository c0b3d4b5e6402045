"""The SLO bound (`slo_bound`): the iterations the SLO forces, exactly as a brute force finds them, and no
simulated policy keeping the SLO training faster than the bound that charges their constants."""

from __future__ import annotations

import itertools
import random

import pytest
from test_headroom import simulated_rate
from test_simulator import SHAPE, _job

from coserve.bench.headroom import headroom
from coserve.bench.policy_set import make_factory
from coserve.bench.replay import RequestRecord, RunLimits
from coserve.bench.run_metrics import SLO, summarize
from coserve.bench.simulator import simulate
from coserve.bench.slo_bound import (
    ForcedConstants,
    feasible_interval,
    forced_constants,
    forced_iterations,
    heaviest_disjoint,
    slo_bound_tokens_per_s,
)

SLO_1 = SLO(ttft_s=1.0, tpot_s=0.1)


def _done(request_id: str, arrival_s: float, tokens: int, finished: bool = True) -> RequestRecord:
    return RequestRecord(request_id, arrival_s, prompt_len=8, output_len=tokens,
                         token_times=[arrival_s + 0.01 * (i + 1) for i in range(tokens)], finished=finished)


def test_a_request_s_tokens_fall_between_its_arrival_and_its_slo_deadline() -> None:
    assert feasible_interval(_done("a", 2.0, 11), SLO_1) == pytest.approx((2.0, 2.0 + 1.0 + 10 * 0.1, 11))
    assert feasible_interval(_done("a", 2.0, 11, finished=False), SLO_1) is None
    assert feasible_interval(_done("a", 2.0, 0), SLO_1) is None


def test_disjoint_windows_add_and_overlapping_ones_share() -> None:
    assert heaviest_disjoint([]) == 0
    assert heaviest_disjoint([(0.0, 1.0, 10), (2.0, 3.0, 20)]) == 30  # disjoint: their iterations add up
    assert heaviest_disjoint([(0.0, 2.0, 10), (1.0, 3.0, 20)]) == 20  # overlapping: one may serve both
    # The heaviest disjoint set, not the most windows: 5 + 5 < 12, and 12 + 4 beats both.
    assert heaviest_disjoint([(0.0, 1.0, 5), (1.5, 2.5, 5), (0.5, 2.0, 12), (3.0, 4.0, 4)]) == 16
    assert heaviest_disjoint([(0.0, 1.0, 5), (1.0, 2.0, 7)]) == 7  # touching at 1.0: one iteration there


def test_forced_iterations_sum_disjoint_requests_and_pick_the_heavier_of_overlapping_ones() -> None:
    # a: [0, 2.0] 11 tokens; b: [2.5, 3.8] 4 tokens (disjoint from a); c: [1.0, 4.0] 21 tokens overlaps both.
    a, b, c = _done("a", 0.0, 11), _done("b", 2.5, 4), _done("c", 1.0, 21)
    assert forced_iterations([a], SLO_1, 10.0) == 11  # a lone request: exactly its tokens
    assert forced_iterations([a, b], SLO_1, 10.0) == 15
    assert forced_iterations([a, b, c], SLO_1, 10.0) == 21
    assert forced_iterations([a, b, c], SLO_1, 3.9) == 15  # c's deadline is past the window: not counted
    assert forced_iterations([], SLO_1, 10.0) == 0


def test_forced_iterations_equal_a_brute_force_over_every_subset() -> None:
    rng = random.Random(7)
    for _ in range(40):
        requests = [_done(f"r{i}", rng.uniform(0.0, 8.0), rng.randint(1, 30)) for i in range(rng.randint(1, 9))]
        intervals = [iv for iv in (feasible_interval(r, SLO_1) for r in requests) if iv and iv[1] <= 10.0]
        best = 0
        for size in range(len(intervals) + 1):
            for subset in itertools.combinations(sorted(intervals), size):
                if all(x[1] < y[0] for x, y in zip(subset, subset[1:])):
                    best = max(best, sum(iv[2] for iv in subset))
        assert forced_iterations(requests, SLO_1, 10.0) == best


def test_the_slo_bound_charges_the_forced_constants_at_fine_tuning_s_own_cost_per_token() -> None:
    # 100 forced iterations of 10 ms in a 10 s window (10%); fine-tuning alone spent 5% on constants.
    forced = ForcedConstants(iterations=100, constant_s=0.01, window_s=10.0, solo_constant_share=0.05)
    assert forced.share == pytest.approx(0.1)
    assert slo_bound_tokens_per_s(400.0, 0.2, forced) == pytest.approx(400.0 * 0.7 / 0.95)
    assert slo_bound_tokens_per_s(400.0, 0.95, forced) == 0.0


@pytest.mark.parametrize(("rate", "tighter"), [(1.0, False), (6.0, True)])
def test_no_policy_keeping_the_slo_trains_faster_than_the_slo_bound(rate: float, tighter: bool) -> None:
    """At rate 1 few iterations are forced (fewer constants than fine-tuning alone pays): the SLO bound
    is `headroom`'s; at rate 6 it is tighter, so the check can fail."""
    window = 10.0
    sim = simulated_rate(rate, window)
    latency, setup = sim.latency, sim.setup
    slo_bound = None
    kept = 0
    for name in ("coserve", "coserve-strict", "temporal-n8", "temporal-n64", "dynamic-temporal",
                 "static-split-0.2"):
        run = simulate(make_factory(name, setup), sim.trace, RunLimits(window, 3.0), latency, SHAPE,
                       job_spec=_job(name), policy_name=name)
        if slo_bound is None:  # from coserve's run, as the benchmark does
            forced = forced_constants(run, sim.solo, setup.slo, latency.coefficients["constant"])
            bound = headroom(run, latency, sim.finetune_only, None, forced=forced)
            assert bound.forced_iterations and bound.forced_iterations > 0
            slo_bound = bound.slo_bound_tokens_per_s
            assert slo_bound is not None
            assert (slo_bound < bound.finetune_bound_tokens_per_s) is tighter
        metrics = summarize(run, setup.slo)
        if metrics.slo_attainment == 1.0:  # the bound holds for schedules keeping every request's SLO
            kept += 1
            assert metrics.finetune_tokens_per_s <= slo_bound, name
    assert kept >= 2
