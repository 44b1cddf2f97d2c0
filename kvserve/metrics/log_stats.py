"""A periodic one-line summary of the engine in the server log (throughput, queue, KV usage, cache hits)."""

from __future__ import annotations

import logging
import time

from kvserve.core.outputs import SchedulerStats
from kvserve.metrics.stats import IterationStats

logger = logging.getLogger("kvserve.stats")


class LoggingStatLogger:
    """Logs at most every `interval_s`, and only while there is work (an idle server stays quiet)."""

    def __init__(self, interval_s: float = 10.0, label: str = "") -> None:
        """`label` starts each line (which API process's requests the throughput counts, when several)."""
        self.interval_s = interval_s
        self.label = label
        self._last_log = time.monotonic()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_stats: SchedulerStats | None = None
        self._last_queries = self._last_hits = 0

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        now = time.monotonic()
        if now >= self._last_log + self.interval_s:
            # The interval has ended, and what was counted came within it (before this output): its line is the
            # interval's, as a timer's would be. Not counted up to now: only outputs call this, and after an idle spell
            # (outputs stopped) the tokens of a busy spell's last seconds, or of the first step after it, were spread
            # over the idle time as well. The next interval starts with this output.
            self._log(self.interval_s)
            self._last_log = now
        self._num_prompt_tokens += iteration.num_prompt_tokens
        self._num_generation_tokens += iteration.num_generation_tokens
        if scheduler_stats is not None:
            self._last_stats = scheduler_stats

    def _log(self, elapsed: float) -> None:
        """The line of what was counted over the last `elapsed` seconds (none while idle); the counts restart."""
        stats = self._last_stats
        busy = stats is not None and (stats.num_running_reqs or stats.num_waiting_reqs)
        if not (busy or self._num_prompt_tokens or self._num_generation_tokens):
            return
        hit_rate = 0.0
        if stats is not None:
            queries = stats.prefix_cache_queries - self._last_queries
            hits = stats.prefix_cache_hits - self._last_hits
            hit_rate = hits / queries if queries > 0 else 0.0
            self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        logger.info(
            "%sprompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d reqs, "
            "waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
            self.label,
            self._num_prompt_tokens / elapsed,
            self._num_generation_tokens / elapsed,
            stats.num_running_reqs if stats else 0,
            stats.num_waiting_reqs if stats else 0,
            100 * (stats.kv_cache_usage if stats else 0.0),
            100 * hit_rate,
        )
        self._num_prompt_tokens = self._num_generation_tokens = 0
