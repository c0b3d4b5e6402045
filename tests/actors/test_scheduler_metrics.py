"""SchedulerMetrics: the fine-tuning throughput gauge over its sliding window."""

from __future__ import annotations

import re

from coserve.actors.metrics import FINETUNE_RATE_WINDOW_S, SchedulerMetrics


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
    assert _rate(metrics.render(None)) == 0.0
    metrics.count_tokens("finetune", "acme", 600)
    metrics.count_tokens("completion", "acme", 5000)  # inference tokens are not fine-tuning progress
    clock.now += 10
    metrics.count_tokens("finetune", "globex", 1200)
    assert _rate(metrics.render(None)) == (600 + 1200) / FINETUNE_RATE_WINDOW_S
    clock.now += FINETUNE_RATE_WINDOW_S - 5  # the first step has left the window
    assert _rate(metrics.render(None)) == 1200 / FINETUNE_RATE_WINDOW_S
    clock.now += 10
    assert _rate(metrics.render(None)) == 0.0
    # The counter keeps the totals (Prometheus' rate() over it gives any other window).
    assert 'coserve_tokens_total{kind="finetune",tenant="acme"} 600.0' in metrics.render(None)
