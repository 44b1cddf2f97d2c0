"""benchmarks/metrics_delta.py: histogram means between two /metrics scrapes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from metrics_delta import deltas  # noqa: E402

BEFORE = """# HELP kvserve:time_to_first_token_seconds Arrival to first output token.
# TYPE kvserve:time_to_first_token_seconds histogram
kvserve:time_to_first_token_seconds_bucket{le="0.01",model_name="m"} 1.0
kvserve:time_to_first_token_seconds_sum{model_name="m"} 0.5
kvserve:time_to_first_token_seconds_count{model_name="m"} 10.0
kvserve:request_queue_time_seconds_sum{model_name="m"} 0.1
kvserve:request_queue_time_seconds_count{model_name="m"} 10.0
kvserve:num_requests_running{model_name="m"} 3.0
"""

AFTER = """kvserve:time_to_first_token_seconds_sum{model_name="m"} 0.8
kvserve:time_to_first_token_seconds_count{model_name="m"} 20.0
kvserve:request_queue_time_seconds_sum{model_name="m"} 0.1
kvserve:request_queue_time_seconds_count{model_name="m"} 10.0
kvserve:e2e_request_latency_seconds_sum{model_name="a"} 2.0
kvserve:e2e_request_latency_seconds_count{model_name="a"} 1.0
kvserve:e2e_request_latency_seconds_sum{model_name="b"} 4.0
kvserve:e2e_request_latency_seconds_count{model_name="b"} 1.0
kvserve:num_requests_running{model_name="m"} 5.0
"""


def test_means_of_what_was_observed_between_the_scrapes() -> None:
    result = deltas(BEFORE, AFTER)
    # 10 new TTFT observations summing to 0.3 s; no new queue observations; a histogram that first
    # appears after the first scrape counts from zero, its labelled series summed.
    assert set(result) == {"kvserve:time_to_first_token_seconds", "kvserve:e2e_request_latency_seconds"}
    mean, count = result["kvserve:time_to_first_token_seconds"]
    assert count == 10 and abs(mean - 0.03) < 1e-12
    assert result["kvserve:e2e_request_latency_seconds"] == (3.0, 2)
