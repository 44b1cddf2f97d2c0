"""The periodic log line's throughput (`LoggingStatLogger`), on a fake clock."""

from __future__ import annotations

import logging

import pytest

from kvserve.core.outputs import SchedulerStats
from kvserve.metrics import log_stats
from kvserve.metrics.log_stats import LoggingStatLogger
from kvserve.metrics.stats import IterationStats


def test_throughput_after_an_idle_gap_counts_the_interval_not_the_gap(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The logger runs only when outputs come. Tokens of a busy spell's last seconds, and those of the first step
    after an idle hour, were divided by the whole hour (a soak showed "generation throughput: 1.6 tokens/s" as load
    resumed at 300 tokens/s): a line's throughput is over its interval, as vLLM's timer-driven line is."""
    now = [1000.0]
    monkeypatch.setattr(log_stats.time, "monotonic", lambda: now[0])
    stat_logger = LoggingStatLogger(interval_s=10.0)
    busy = SchedulerStats(num_running_reqs=1)
    with caplog.at_level(logging.INFO, logger="kvserve.stats"):
        for i in range(12):  # 300 generated tokens a second for 12 s: an output each second, half a second in
            now[0] = 1000.5 + i
            stat_logger.record(busy, IterationStats(num_generation_tokens=300))
        now[0] += 3600.0  # idle for an hour: nothing calls the logger
        stat_logger.record(busy, IterationStats(num_generation_tokens=300))
        for _ in range(10):
            now[0] += 1.0
            stat_logger.record(busy, IterationStats(num_generation_tokens=300))
    rates = [float(r.getMessage().split("generation throughput: ")[1].split(" ")[0]) for r in caplog.records]
    # 3000 tokens in the first 10 s; the 600 of its last 2 s over a 10-s interval (not over the hour); then the
    # 3000 of the 10 s after the hour (the interval starts with its first output).
    assert rates == [300.0, 60.0, 300.0], caplog.text
