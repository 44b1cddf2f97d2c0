"""deploy/: the Prometheus config, alert rules and Grafana dashboard agree with what a server exports.

Every query parses as PromQL (promql-parser, the Prometheus parser's Rust port), every kvserve series and
label it names is on a live server's /metrics, the committed dashboard is what its generator writes, and the
rules and panels have what Prometheus and Grafana need to load them.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from .conftest import ServerProcess, scrape

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvserve-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
SERIES = re.compile(r"\bkvserve:[a-z0-9_]+")
ROUTER_SERIES = re.compile(r"\bkvserve_router:[a-z0-9_]+")
# Labels Prometheus adds at scrape time (the server does not export them) and the histogram bucket label.
SCRAPE_LABELS = {"instance", "job", "le"}


def _dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def _as_promql(expr: str) -> str:
    """Grafana's variables as Prometheus would see them after substitution."""
    return expr.replace("$__rate_interval", "1m")


def test_the_committed_dashboard_is_what_the_generator_writes() -> None:
    generator = runpy.run_path(str(DEPLOY / "grafana" / "dashboard.py"))
    assert DASHBOARD.read_text() == generator["render"](), "run: python deploy/grafana/dashboard.py"


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_query_parses(source: str) -> None:
    exprs = _dashboard_exprs() if source == "dashboard" else [r["expr"] for r in _rules()]
    assert exprs
    for expr in exprs:
        if expr.startswith("label_values("):  # Grafana's own function around a selector
            expr = expr[len("label_values("):expr.rindex(",")]
        promql_parser.parse(_as_promql(expr))  # raises on a syntax error


def test_every_series_and_label_is_exported(tiny_server: ServerProcess) -> None:
    samples = scrape(tiny_server.base_url)
    exported = {name for name, _ in samples}
    labels = {key for _, pairs in samples for key, _ in pairs}
    # The server's queries (the router row's are checked against the router: below).
    queries = [q for q in _dashboard_exprs() + [r["expr"] for r in _rules()] if "kvserve_router:" not in q]
    named = {m for q in queries for m in SERIES.findall(q)}
    assert len(named) >= 10
    missing = sorted(named - exported)
    assert not missing, f"queried but not on /metrics: {missing}"
    used_labels = {label for q in queries
                   for group in re.findall(r"\bby \(([^)]*)\)|\{([^}]*)\}", q)
                   for part in group for label in re.findall(r"([a-z_]+)\s*(?:=~|!=|=|,|$)", part)}
    unknown = sorted(used_labels - labels - SCRAPE_LABELS)
    assert not unknown, f"labels queried but not exported: {unknown}"
    # and each label value a query matches exactly (finished_reason="abort", ...) is one a series carries
    matched = {(name, label, value) for q in queries for name, matchers in re.findall(r"(kvserve:[a-z0-9_]+)\{([^}]*)\}", q)
               for label, value in re.findall(r'([a-z_]+)\s*=\s*"([^"$]*)"', matchers)}
    assert any(label == "finished_reason" for _, label, _ in matched)
    absent = sorted(m for m in matched if not any(name == m[0] and (m[1], m[2]) in pairs for name, pairs in samples))
    assert not absent, f"label values queried but on no exported series: {absent}"


def test_rules_have_what_prometheus_and_receivers_need() -> None:
    rules = _rules()
    assert {r["alert"] for r in rules} >= {"KvserveDown", "KvserveKVCacheFull", "KvserveBacklog"}
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        for text in rule["annotations"].values():  # only the templating Prometheus provides
            for ref in re.findall(r"\{\{([^}]*)\}\}", text):
                assert re.fullmatch(r"\s*\$(labels\.[a-z_]+|value)(\s*\|\s*humanize\w*)?\s*", ref), ref
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert [(PROMETHEUS.parent / f).resolve() for f in config["rule_files"]] == [ALERTS.resolve()]
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert all(f'job="{job}"' not in r["expr"] or job in jobs for r in rules for job in re.findall(r'job="([^"]+)"', r["expr"]))


def test_dashboard_panels_fit_the_grid_and_use_the_variables() -> None:
    board = json.loads(DASHBOARD.read_text())
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        for target in panel.get("targets", []):
            if "kvserve_router:" in target["expr"]:
                assert "$router" in target["expr"], panel["title"]
            else:
                assert '$instance' in target["expr"] and '$model_name' in target["expr"], panel["title"]
            assert target["datasource"]["uid"] == "${datasource}"
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "instance", "model_name", "router"}


def test_the_router_row_queries_what_the_router_exports() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.router.app import RouterApp
    from kvserve.router.policies import Router

    app = RouterApp(Router(["http://a:1", "http://b:2"], "prefix"))
    app.requests.labels("http://a:1", "200").inc()
    samples = [s for family in text_string_to_metric_families(generate_latest(app.registry).decode())
               for s in family.samples]
    exported = {s.name for s in samples}
    labels = {key for s in samples for key in s.labels}
    exprs = [e for e in _dashboard_exprs() if "kvserve_router:" in e]
    named = {m for e in exprs for m in ROUTER_SERIES.findall(e)}
    assert len(named) == 4 and not named - exported, sorted(named - exported)
    used = {label for e in exprs for group in re.findall(r"\bby \(([^)]*)\)", e) for label in re.split(r",\s*", group)}
    assert used and not used - labels - SCRAPE_LABELS
