"""Several Prometheus text expositions made into one: how `kvserve serve --data-parallel-size N` shows every
replica's metrics on its one /metrics.

Each part's samples get the part's extra labels (`engine="<i>"` for replica i, as vLLM labels its
data-parallel engines' series), and families of the same name from different parts become one family, so
the result keeps one HELP and one TYPE line per family (the first part's) with every part's samples under
them. A family that clashes with an earlier part's family of another type is left out of the later part (two
TYPE lines of one name would make the exposition invalid). Families clash when their names as written match
(prometheus_client's parser names a counter's family without the `_total` its TYPE line is written with, and
a gauge's as written) or their parsed names do (a gauge `x` and a counter `x_total`).
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
    0.0.4). Where a sample has a label of its own of an added label's name (a backend that is itself a
    `kvserve serve -dp N`, whose series carry `engine="<j>"`), the label becomes "<added>.<own>": replaced,
    its replicas' series would become one series given twice, which Prometheus keeps only one of. A part that
    does not parse is left out."""
    merged: dict[str, Metric] = {}  # by the family's name as its TYPE line is written
    parsed_names: set[str] = set()
    for extra, text in parts:
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:  # not an exposition (a backend that is no kvserve): left out, not the whole answer
            continue
        for family in families:
            written = _written_name(family)
            into = merged.get(written)
            if into is None:
                if family.name in parsed_names:  # a family of another type wrote another name for it
                    continue
                into = merged[written] = Metric(family.name, family.documentation, family.type, family.unit)
                parsed_names.add(family.name)
            elif into.type != family.type:
                continue
            for sample in family.samples:
                added = {name: value if name not in sample.labels else f"{value}.{sample.labels[name]}"
                         for name, value in extra.items()}
                into.samples.append(sample._replace(labels={**sample.labels, **added}))
    return generate_latest(_Families(list(merged.values())))  # type: ignore[arg-type]


def _written_name(family: Metric) -> str:
    """The name `generate_latest` writes in the family's HELP and TYPE lines."""
    return family.name + "_total" if family.type == "counter" else family.name
