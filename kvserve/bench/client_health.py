"""Is the benchmark client itself the bottleneck? CPU use of this process and event-loop lag during a run.

The client is one asyncio event loop: when it is busy (parsing thousands of SSE chunks a second), chunks
wait in socket buffers and every latency it reports grows although the server did nothing slower. Two
signals catch that: the process's CPU time over the run as a share of one core, and the lag of a timer that
should fire every `interval_s` (how long a ready chunk can wait for the loop). The monitor also times the
garbage collector's collections in this process during the run (each one stops the loop), and keeps when
the long collections and lags happened, on the run's clock, so that a latency tail can be checked against
the client's own stalls (benchmarks/itl_stalls.py does).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvserve.engine.heap import CollectionTimer

# Past these the client's own delays are large enough to distort what it measures.
SATURATED_CPU_PERCENT = 90.0
SATURATED_LAG_P99_MS = 50.0
# Collections and lags at least this long are listed with their times (run clock).
LONG_GC_PAUSE_S = 0.010
LONG_LOOP_LAG_S = 0.050

Events = tuple[tuple[float, float], ...]  # (start on the run clock in s, duration in ms)


@dataclass(frozen=True)
class ClientHealthReport:
    cpu_percent: float
    loop_lag_p50_ms: float
    loop_lag_p99_ms: float
    loop_lag_max_ms: float
    gc_collections: int = 0  # during the run, every generation
    gc_pause_max_ms: float = 0.0
    long_gc_pauses: Events = ()
    long_loop_lags: Events = ()

    @property
    def saturated(self) -> bool:
        return self.cpu_percent >= SATURATED_CPU_PERCENT or self.loop_lag_p99_ms >= SATURATED_LAG_P99_MS

    def warning(self) -> str | None:
        if not self.saturated:
            return None
        return (f"WARNING: the benchmark client may be the bottleneck (CPU {self.cpu_percent:.0f}% of one core, "
                f"event-loop lag P99 {self.loop_lag_p99_ms:.1f} ms): its latencies include its own delays. "
                f"Lower the concurrency or split the load over several client processes.")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saturated": self.saturated}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClientHealthReport:
        fields = ("cpu_percent", "loop_lag_p50_ms", "loop_lag_p99_ms", "loop_lag_max_ms", "gc_collections",
                  "gc_pause_max_ms")
        values = {k: data[k] for k in fields if k in data}  # (files of earlier versions lack the later ones)
        for key in ("long_gc_pauses", "long_loop_lags"):
            values[key] = tuple((float(t), float(ms)) for t, ms in data.get(key, ()))
        return cls(**values)


class ClientHealthMonitor:
    """`start()` before a run and `stop()` after it (both on the event loop that runs the requests)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._lags_s: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._cpu0 = self._wall0 = self._t0 = 0.0
        self.collections = CollectionTimer()
        self._long_lags: list[tuple[float, float]] = []

    def start(self, run_start: float | None = None) -> None:
        """`run_start`: the run's clock origin (`time.perf_counter()`) for the events' times; default now."""
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()
        self._t0 = self._wall0 if run_start is None else run_start
        self.collections.start()
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - before - self.interval_s)
            self._lags_s.append(lag)
            if lag >= LONG_LOOP_LAG_S:
                self._long_lags.append((before + self.interval_s - self._t0, lag * 1e3))

    async def stop(self) -> ClientHealthReport:
        assert self._task is not None, "stop() before start()"
        self.collections.stop()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        wall = max(time.perf_counter() - self._wall0, 1e-9)
        cpu_percent = 100.0 * (time.process_time() - self._cpu0) / wall
        lags_ms = np.array(self._lags_s or [0.0]) * 1e3
        pauses = self.collections.collections
        return ClientHealthReport(
            cpu_percent=float(cpu_percent),
            loop_lag_p50_ms=float(np.percentile(lags_ms, 50)),
            loop_lag_p99_ms=float(np.percentile(lags_ms, 99)),
            loop_lag_max_ms=float(lags_ms.max()),
            gc_collections=len(pauses),
            gc_pause_max_ms=1e3 * max((s for _, _, s in pauses), default=0.0),
            long_gc_pauses=tuple((t - self._t0, s * 1e3) for t, _, s in pauses if s >= LONG_GC_PAUSE_S),
            long_loop_lags=tuple(self._long_lags),
        )
