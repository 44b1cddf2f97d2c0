"""Run `kvserve bench` with every garbage collection of its client process logged.

For each collection: when it started (seconds since the probe started), its generation, its wall time, the
CPU time the collecting thread got meanwhile (a wall time far above it means the process was not running,
not that the collector worked that long), and how many objects it freed. Also how many objects were frozen
(`gc.freeze`) when the probe started and when it ended, and the cgroup's CPU throttling counters before and
after (`cpu.stat`), when the host has them. The callback does no more than read two clocks: an earlier
version also read `gc.get_freeze_count()` there, which walks the whole frozen list (3.4 ms a call with
428,000 frozen objects on the CPU machine), and so stalled every collection of a frozen run.

    python benchmarks/bench_gc_probe.py --log gc.json -- bench --endpoint ... (the kvserve CLI's arguments)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

CPU_STATS = (Path("/sys/fs/cgroup/cpu.stat"), Path("/sys/fs/cgroup/cpu/cpu.stat"))  # cgroup v2, v1


def cpu_stat() -> dict[str, int]:
    for path in CPU_STATS:
        try:
            return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}
        except (OSError, ValueError):
            continue
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True, help="JSON file for the collections")
    parser.add_argument("cli", nargs=argparse.REMAINDER, help="-- then the kvserve CLI's arguments")
    args = parser.parse_args()
    cli = args.cli[1:] if args.cli[:1] == ["--"] else args.cli
    t0 = time.perf_counter()
    events: list[dict[str, Any]] = []
    state: dict[str, float] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            state["wall"], state["cpu"] = time.perf_counter(), time.thread_time()
            return
        wall, cpu = time.perf_counter(), time.thread_time()
        events.append({"t_s": round(state["wall"] - t0, 4), "gen": info["generation"],
                       "wall_ms": round((wall - state["wall"]) * 1e3, 3),
                       "cpu_ms": round((cpu - state["cpu"]) * 1e3, 3), "collected": info["collected"]})

    before = cpu_stat()
    frozen_at_start = gc.get_freeze_count()
    gc.callbacks.append(on_gc)
    from kvserve.entrypoints.cli import main as kvserve_main

    try:
        return kvserve_main(cli)
    finally:
        gc.callbacks.remove(on_gc)
        after = cpu_stat()
        throttle = {k: after[k] - before.get(k, 0) for k in after if k.startswith(("nr_", "throttled"))}
        frozen = {"at_start": frozen_at_start, "at_end": gc.get_freeze_count()}
        Path(args.log).write_text(json.dumps({"collections": events, "cgroup_cpu_stat_delta": throttle,
                                              "frozen": frozen}))
        slow = sorted(events, key=lambda e: e["wall_ms"])[-5:]
        print(f"gc probe: {len(events)} collections; frozen objects {frozen}; cgroup cpu.stat delta {throttle}; "
              f"slowest: {slow}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
