"""Means of the server's histograms between two scrapes of its /metrics: what the server saw of the requests
a load test sent between them (TTFT from the request's arrival after tokenization to its first token in the
API process; queue and prefill time; end-to-end), to set beside the client's own numbers.

  curl -s localhost:8000/metrics > before.txt; <load>; curl -s localhost:8000/metrics > after.txt
  python benchmarks/metrics_delta.py before.txt after.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.bench.server_metrics import histogram_means  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f0, open(argv[1]) as f1:
        means = histogram_means(f0.read(), f1.read())
    for name, (mean, count) in sorted(means.items()):
        shown = f"{mean * 1e3:9.2f} ms" if name.endswith("_seconds") else f"{mean:12.2f}"
        print(f"{name:56s} mean {shown}  ({count} observations)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
