"""Where a `kvserve bench` run's long inter-token gaps came from.

Reads the JSON that `kvserve bench --json FILE` writes (gzip too), rebuilds the time each streamed token
reached the client, and groups the gaps of `--min-gap-ms` or more that end together (one slow server step
delays every running request at once; so does a stall of the client itself). For each group it prints when
it ended, how many requests waited, how long, and how many other requests got their first token within 2 ms
of those ends, and the longest stall of the client itself that overlaps the group's gaps (a collection of
its garbage collector, `gc`, or an event-loop lag, `lag`; in JSONs that list them). A group that ends with
first tokens and no client stall is most likely a step that prefilled new prompts while the waiting
requests decoded: a stalled client reads everything that arrived meanwhile at once, first tokens included.

    python benchmarks/itl_stalls.py run.json [more.json ...] [--min-gap-ms 50]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stall:
    start_s: float  # when the earliest of the group's gaps began (run clock)
    end_s: float  # when the waiting requests' next token arrived
    waiting: int  # requests whose gap ended there
    longest_ms: float
    first_tokens: int  # other requests whose first token arrived with it


def token_times(record: dict[str, Any]) -> list[float]:
    """Arrival times of a completed request's streamed tokens on the run clock: start + TTFT, then each ITL
    gap. Empty for a failed request (its TTFT may be a stand-in) and one that got no token."""
    if record.get("error_kind") is not None or record.get("ttft_s") is None:
        return []
    times = [record["start_s"] + record["ttft_s"]]
    for gap in record.get("itl_s") or []:
        times.append(times[-1] + gap)
    return times


def find_stalls(records: list[dict[str, Any]], min_gap_s: float, window_s: float = 0.005,
                first_window_s: float = 0.002) -> list[Stall]:
    """Gaps of at least `min_gap_s`, grouped while each end falls within `window_s` of the previous one;
    first tokens are counted within `first_window_s` of the group's ends."""
    ends: list[tuple[float, float]] = []  # (end, gap)
    firsts: list[float] = []
    for record in records:
        times = token_times(record)
        if times:
            firsts.append(times[0])
        for before, after in zip(times, times[1:], strict=False):
            if after - before >= min_gap_s:
                ends.append((after, after - before))
    ends.sort()
    firsts.sort()
    groups: list[list[tuple[float, float]]] = []
    for end, gap in ends:
        if groups and end - groups[-1][-1][0] <= window_s:
            groups[-1].append((end, gap))
        else:
            groups.append([(end, gap)])
    stalls = []
    for group in groups:
        start, stop = group[0][0], group[-1][0]
        first = sum(1 for t in firsts if start - first_window_s <= t <= stop + first_window_s)
        stalls.append(Stall(start_s=min(e - g for e, g in group), end_s=start, waiting=len(group),
                            longest_ms=max(g for _, g in group) * 1e3, first_tokens=first))
    return stalls


def client_stall(stall: Stall, client: dict[str, Any] | None) -> str:
    """The longest client collection or loop lag overlapping the stall's gaps ("gc 245", "lag 230"), or "-"."""
    best = ("-", 0.0)
    for key, name in (("long_gc_pauses", "gc"), ("long_loop_lags", "lag")):
        for start, ms in (client or {}).get(key, ()):
            if start < stall.end_s and start + ms / 1e3 > stall.start_s and ms > best[1]:
                best = (f"{name} {ms:.0f}", ms)
    return best[0]


def load_runs(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["runs"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="kvserve bench JSON files (.json or .json.gz)")
    parser.add_argument("--min-gap-ms", type=float, default=50.0, help="shortest gap reported (default 50)")
    args = parser.parse_args(argv)
    for path in args.paths:
        for run in load_runs(path):
            records = run["records"]
            stalls = find_stalls(records, args.min_gap_ms / 1e3)
            itl = run["summary"]["itl"]
            tail = (f"ITL P99 {itl['p99_ms']:.1f} ms, max {itl['max_ms']:.1f} ms" if itl.get("count")
                    else "no inter-token gaps")
            print(f"== {path} [{run['label']}]: {len(records)} requests, {tail}; "
                  f"{len(stalls)} stalls of {args.min_gap_ms:g} ms or more")
            client = run["summary"].get("client")
            print(f"{'ends at s':>9} {'waiting':>7} {'longest ms':>10} {'first tokens':>12} {'client stall':>12}")
            marks = [client_stall(s, client) for s in stalls]
            for s, mark in zip(stalls, marks, strict=True):
                print(f"{s.end_s:9.3f} {s.waiting:7d} {s.longest_ms:10.1f} {s.first_tokens:12d} {mark:>12}")
            with_prefill = sum(1 for s in stalls if s.first_tokens)
            print(f"stalls that ended with other requests' first tokens: {with_prefill} of {len(stalls)}")
            if client is not None and "long_gc_pauses" in client:
                print(f"stalls overlapping a client stall: {sum(m != '-' for m in marks)} of {len(stalls)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
