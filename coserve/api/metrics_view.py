"""The public view of the scheduler's Prometheus text: the same series with a label summed away.

`/metrics` names tenants (tokens, TTFT, requests by tenant). An operator who exposes metrics without an
admin key (`--public-metrics`) gets every series with the `tenant` label removed and the samples that
then coincide added up: totals, histograms and queue gauges stay right, who did what is not shown.
Parsing and writing go through `prometheus_client` (the library that wrote the text), so the output is
valid exposition format.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# `_created` series are the time a labelled child was created (the text format writes them as gauge
# families of their own): adding them up means nothing, and they are optional, so the view drops them.
_DROPPED_SUFFIX = "_created"


def without_label(text: str, label: str) -> str:
    """`text` (Prometheus text exposition) with `label` removed from every sample and the samples that
    then share a name and labels summed."""
    families = [_merge(family, label) for family in text_string_to_metric_families(text)
                if not family.name.endswith(_DROPPED_SUFFIX)]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode("utf-8")


def _merge(family: Metric, label: str) -> Metric:
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        labels = tuple((k, v) for k, v in sample.labels.items() if k != label)
        key = (sample.name, labels)
        merged[key] = merged.get(key, 0.0) + sample.value
    result = Metric(family.name, family.documentation, family.type, family.unit)
    result.samples = [Sample(name, dict(labels), value) for (name, labels), value in merged.items()]
    return result


class _Families:
    """A collector that yields fixed metric families (what `generate_latest` reads)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self._families
