"""SchedulerMetrics: the fine-tuning throughput gauge over its sliding window; the per-engine series."""

from __future__ import annotations

import re

from coserve.actors.metrics import FINETUNE_RATE_WINDOW_S, QueueState, SchedulerMetrics, Slo


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _rate(text: str) -> float:
    match = re.search(r"^coserve_finetune_tokens_per_second (\S+)$", text, re.M)
    assert match is not None, text
    return float(match.group(1))


def test_finetune_tokens_per_second_is_the_trained_tokens_of_the_last_window() -> None:
    clock = Clock()
    metrics = SchedulerMetrics(clock=clock)
    assert _rate(metrics.render({})) == 0.0
    metrics.count_tokens("finetune", "acme", 600, "engine-0")
    metrics.count_tokens("completion", "acme", 5000, "engine-0")  # inference tokens are not fine-tuning progress
    clock.now += 10
    metrics.count_tokens("finetune", "globex", 1200, "engine-1")
    assert _rate(metrics.render({})) == (600 + 1200) / FINETUNE_RATE_WINDOW_S
    clock.now += FINETUNE_RATE_WINDOW_S - 5  # the first step has left the window
    assert _rate(metrics.render({})) == 1200 / FINETUNE_RATE_WINDOW_S
    clock.now += 10
    assert _rate(metrics.render({})) == 0.0
    # The counter keeps the totals (Prometheus' rate() over it gives any other window).
    assert 'coserve_tokens_total{engine="engine-0",kind="finetune",tenant="acme"} 600.0' in metrics.render({})


def _samples(text: str, name: str) -> dict[str, float]:
    return {labels: float(value) for labels, value in re.findall(rf"^{name}{{(.*)}} (\S+)$", text, re.M)}


def test_engine_series_carry_the_engine_label() -> None:
    metrics = SchedulerMetrics(Slo(ttft_s=0.5, tpot_s=0.1))
    for engine, ttft_s, tpot_s in (("engine-0", 0.1, 0.05), ("engine-1", 0.9, 0.05), ("engine-1", 0.2, 0.3)):
        metrics.iteration(engine)
        metrics.count_tokens("completion", "acme", 3, engine)
        metrics.first_token("acme", ttft_s, engine)
        metrics.finished("acme", "stop", tpot_s, engine)
    metrics.finished("acme", "rejected", None)  # never reached an engine
    text = metrics.render({"engine-0": QueueState(2, 1, 10, 100), "engine-1": QueueState(0, 4, 60, 80)})
    assert _samples(text, "coserve_engine_iterations_total") == {'engine="engine-0"': 1.0, 'engine="engine-1"': 2.0}
    assert _samples(text, "coserve_tokens_total") == {'engine="engine-0",kind="completion",tenant="acme"': 3.0,
                                                      'engine="engine-1",kind="completion",tenant="acme"': 6.0}
    assert _samples(text, "coserve_slo_requests_total") == {  # attainment per engine
        'engine="engine-0",met="true",slo="ttft"': 1.0, 'engine="engine-0",met="true",slo="tpot"': 1.0,
        'engine="engine-1",met="false",slo="ttft"': 1.0, 'engine="engine-1",met="true",slo="ttft"': 1.0,
        'engine="engine-1",met="true",slo="tpot"': 1.0, 'engine="engine-1",met="false",slo="tpot"': 1.0}
    assert _samples(text, "coserve_kv_blocks_in_use") == {'engine="engine-0"': 10.0, 'engine="engine-1"': 60.0}
    assert _samples(text, "coserve_queue_requests")['engine="engine-1",state="running"'] == 4.0
    # An engine that is gone (lost, not back yet) has no queue or KV numbers; its counters stay.
    text = metrics.render({"engine-0": QueueState(0, 0, 0, 100)})
    assert _samples(text, "coserve_kv_blocks_total") == {'engine="engine-0"': 100.0}
    assert set(_samples(text, "coserve_queue_requests")) == {'engine="engine-0",state="waiting"',
                                                             'engine="engine-0",state="running"'}
    assert _samples(text, "coserve_engine_iterations_total")['engine="engine-1"'] == 2.0
