"""Several Prometheus text expositions made into one: how `kvserve serve --data-parallel-size N` shows every
replica's metrics on its one /metrics.

Each part's samples get the part's extra labels (`engine="<i>"` for replica i, as vLLM labels its
data-parallel engines' series), and families of the same name from different parts become one family, so
the result keeps one HELP and one TYPE line per family (the first part's) with every part's samples under
them. A family whose type differs from the first part's is left out of the later part (two TYPE lines of one
name would make the exposition invalid).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    """What `generate_latest` reads: an object whose collect() yields metric families."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_expositions(parts: Sequence[tuple[Mapping[str, str], str]]) -> bytes:
    """`parts`: (labels to add to every sample, exposition text) -> one exposition (Prometheus text format
    0.0.4). The added labels replace a sample's own label of the same name."""
    merged: dict[str, Metric] = {}
    for extra, text in parts:
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            elif into.type != family.type:
                continue
            for sample in family.samples:
                into.samples.append(sample._replace(labels={**sample.labels, **extra}))
    return generate_latest(_Families(list(merged.values())))  # type: ignore[arg-type]
