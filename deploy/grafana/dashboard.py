"""Writes kvserve-dashboard.json, the Grafana dashboard of kvserve's /metrics (run from the repository root:
`python deploy/grafana/dashboard.py`; tests/deploy checks that the committed file is what this writes).

Rows: traffic (requests and tokens a second), latency (TTFT, inter-token latency, end-to-end, queue time
quantiles), engine (running / waiting requests, KV cache use, prefix cache hit rate, preemptions),
requests (prompt and output lengths) and the router (`kvserve route`: requests and in-flight by backend,
healthy backends, retries). Server queries are filtered by the `instance` and `model_name` variables, so one
dashboard shows one server, a replica set behind a router, or all; router queries by `router`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvserve-dashboard.json")
SEL = '{instance=~"$instance", model_name=~"$model_name"}'
ROUTER = '{instance=~"$router"}'  # kvserve route's own series (no model_name label)
RATE = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}


def _quantiles(metric: str, legend: str) -> list[dict[str, str]]:
    return [
        {"expr": f"histogram_quantile({q}, sum by (le) (rate(kvserve:{metric}_bucket{SEL}[{RATE}])))",
         "legend": f"{legend} p{int(q * 100)}"}
        for q in (0.5, 0.95, 0.99)
    ]


# (title, unit, description, [(expr, legend)]) per panel, by row.
ROWS: list[tuple[str, list[tuple[str, str, str, list[dict[str, str]]]]]] = [
    ("Traffic", [
        ("Output tokens / s", "short", "Tokens generated a second (all requests).",
         [{"expr": f"sum(rate(kvserve:generation_tokens_total{SEL}[{RATE}]))", "legend": "output"}]),
        ("Prompt tokens / s", "short", "Prompt tokens a second, counted when a prompt's prefill completes (whole "
         "prompts: tokens found in the prefix cache count too).",
         [{"expr": f"sum(rate(kvserve:prompt_tokens_total{SEL}[{RATE}]))", "legend": "prompt"}]),
        ("Finished requests / s", "reqps", "Requests finished a second, by finish reason (per sample: n=2 "
         "counts twice).",
         [{"expr": f"sum by (finished_reason) (rate(kvserve:request_success_total{SEL}[{RATE}]))",
           "legend": "{{finished_reason}}"}]),
    ]),
    ("Latency", [
        ("Time to first token", "s", "Arrival to first output token.",
         _quantiles("time_to_first_token_seconds", "TTFT")),
        ("Inter-token latency", "s", "Time between two consecutive tokens of a request.",
         _quantiles("inter_token_latency_seconds", "ITL")),
        ("End-to-end latency", "s", "Arrival to finish.", _quantiles("e2e_request_latency_seconds", "E2E")),
        ("Queue time", "s", "Arrival to first scheduled: time spent waiting for a slot or KV blocks.",
         _quantiles("request_queue_time_seconds", "queue")),
    ]),
    ("Engine", [
        ("Requests running / waiting", "short", "Requests in the running batch, and waiting to be scheduled "
         "(incl. preempted). A waiting queue that keeps growing means the server is past its capacity.",
         [{"expr": f"sum(kvserve:num_requests_running{SEL})", "legend": "running"},
          {"expr": f"sum(kvserve:num_requests_waiting{SEL})", "legend": "waiting"}]),
        ("KV cache usage", "percentunit", "Fraction of KV cache blocks in use, per server. Near 1 the scheduler "
         "admits fewer requests and may preempt.",
         [{"expr": f"max by (instance) (kvserve:kv_cache_usage_perc{SEL})", "legend": "{{instance}}"}]),
        ("Prefix cache hit rate", "percentunit", "Prompt tokens found in the prefix cache, of those looked up.",
         [{"expr": f"sum(rate(kvserve:prefix_cache_hits_total{SEL}[{RATE}])) / "
                   f"clamp_min(sum(rate(kvserve:prefix_cache_queries_total{SEL}[{RATE}])), 1e-9)",
           "legend": "hit rate"}]),
        ("Preemptions / s", "short", "Requests whose KV blocks were freed to make room (recomputed later). "
         "Sustained preemptions: lower --max-num-seqs, or give the KV cache more memory.",
         [{"expr": f"sum(rate(kvserve:num_preemptions_total{SEL}[{RATE}]))", "legend": "preemptions"}]),
    ]),
    ("Requests", [
        ("Prompt tokens per request", "short", "Quantiles of prompt lengths (finished requests).",
         _quantiles("request_prompt_tokens", "prompt")),
        ("Output tokens per request", "short", "Quantiles of generated lengths (finished requests).",
         _quantiles("request_generation_tokens", "output")),
    ]),
    ("Router (kvserve route)", [
        ("Requests / s by backend", "reqps", "Requests the router finished a second, by backend and outcome (the "
         "status sent, client_closed, stream_error; backend none: the router's own answers).",
         [{"expr": f"sum by (backend, code) (rate(kvserve_router:requests_total{ROUTER}[{RATE}]))",
           "legend": "{{backend}} {{code}}"}]),
        ("Requests in flight by backend", "short", "Requests the router has sent to each backend and not "
         "finished: the load each replica sees through the router.",
         [{"expr": f"sum by (backend) (kvserve_router:requests_in_flight{ROUTER})", "legend": "{{backend}}"}]),
        ("Healthy backends", "short", "Backends whose /health answered 200 at the last check.",
         [{"expr": f"sum(kvserve_router:backend_healthy{ROUTER})", "legend": "healthy"},
          {"expr": f"count(kvserve_router:backend_healthy{ROUTER})", "legend": "all"}]),
        ("Retries / s", "short", "Requests sent on to another backend after one refused them (down or draining).",
         [{"expr": f"sum(rate(kvserve_router:retries_total{ROUTER}[{RATE}]))", "legend": "retries"}]),
    ]),
]


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0
    for row_title, row_panels in ROWS:
        panels.append({"id": next_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id += 1
        y += 1
        width = 24 // len(row_panels) if len(row_panels) <= 4 else 6
        for i, (title, unit, description, targets) in enumerate(row_panels):
            panels.append({
                "id": next_id,
                "type": "timeseries",
                "title": title,
                "description": description,
                "datasource": DS,
                "gridPos": {"h": 8, "w": width, "x": (i * width) % 24, "y": y + 8 * (i * width // 24)},
                "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}},
                "targets": [{"datasource": DS, "expr": t["expr"], "legendFormat": t["legend"],
                             "refId": chr(ord("A") + j)} for j, t in enumerate(targets)],
            })
            next_id += 1
        y += 8 * -(-len(row_panels) * width // 24)

    def variable(name: str, label: str, query: str) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "query": {"query": query, "refId": f"{name}-values"}, "definition": query, "refresh": 2,
                "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "sort": 1}

    return {
        "title": "kvserve",
        "uid": "kvserve-overview",
        "description": "kvserve servers: traffic, latency, engine state, request shapes (from /metrics).",
        "tags": ["kvserve", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            variable("instance", "Server", "label_values(kvserve:num_requests_running, instance)"),
            variable("model_name", "Model", 'label_values(kvserve:num_requests_running{instance=~"$instance"}, '
                     "model_name)"),
            variable("router", "Router", "label_values(kvserve_router:backend_healthy, instance)"),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
