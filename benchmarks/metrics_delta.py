"""Means of the server's latency histograms between two scrapes of its /metrics: what the server saw of the
requests a load test sent between them (TTFT from the request's arrival after tokenization to its first
token in the API process; queue and prefill time; end-to-end), to set beside the client's own numbers.

  curl -s localhost:8000/metrics > before.txt; <load>; curl -s localhost:8000/metrics > after.txt
  python benchmarks/metrics_delta.py before.txt after.txt
"""

from __future__ import annotations

import re
import sys

_SAMPLE = re.compile(r"^(?P<name>[^\s{]+)(?:\{[^}]*\})?\s+(?P<value>\S+)$")


def histogram_sums(text: str) -> dict[str, tuple[float, float]]:
    """{histogram name: (sum, count)} of every `*_seconds` histogram in a Prometheus text scrape (series of
    one name summed over their labels)."""
    sums: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        name = match.group("name")
        for suffix, slot in (("_sum", 0), ("_count", 1)):
            if name.endswith("_seconds" + suffix):
                entry = sums.setdefault(name[: -len(suffix)], [0.0, 0.0])
                entry[slot] += float(match.group("value"))
    return {name: (s, c) for name, (s, c) in sums.items()}


def deltas(before: str, after: str) -> dict[str, tuple[float, int]]:
    """{histogram name: (mean seconds, observations)} of what was observed between the two scrapes."""
    a, b = histogram_sums(before), histogram_sums(after)
    out = {}
    for name, (total, count) in b.items():
        total0, count0 = a.get(name, (0.0, 0.0))
        if count > count0:
            out[name] = ((total - total0) / (count - count0), int(count - count0))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f0, open(argv[1]) as f1:
        result = deltas(f0.read(), f1.read())
    for name, (mean_s, count) in sorted(result.items()):
        print(f"{name:56s} mean {mean_s * 1e3:9.2f} ms  ({count} observations)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
