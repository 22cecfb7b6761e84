"""The Grafana dashboard only queries metrics the server exports, covers the panels the issue
lists, and docker-compose provisions it together with Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry, generate_latest

from dspark_serve.scheduler.metrics import EngineMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "dspark.json"

KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "atan2",
}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, label names, ranges,
    strings and Grafana variables are not names)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', "", expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = GROUPING.sub(" ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)
    names = set()
    for m in IDENT.finditer(e):
        word = m.group(1)
        if word.lower() in KEYWORDS or re.match(r"\s*\(", e[m.end() :]):
            continue
        names.add(word)
    return names


def exported_names() -> set[str]:
    """Every series name a real EngineMetrics registry can export (from its TYPE lines)."""
    text = generate_latest(_registry()).decode()
    names = set()
    for name, typ in re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M):
        if typ == "histogram":
            names |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
        elif typ == "counter":
            names |= {name, re.sub(r"_total$", "_created", name)}
        else:
            names.add(name)
    return names


def _registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    EngineMetrics(reg, "tiny")
    return reg


def dashboard_queries(dash: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and templating query."""
    out = []
    for p in dash["panels"]:
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        out += [(p["title"], t["expr"]) for t in p["targets"]]
    for v in dash.get("templating", {}).get("list", []):
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q)
        out.append((f"variable {v['name']}", m.group(1) if m else q))
    return out


def unknown_metrics(dash: dict, exported: set[str]) -> list[str]:
    bad = []
    for where, expr in dashboard_queries(dash):
        names = promql_metric_names(expr)
        if not names:
            bad.append(f"{where}: no metric in {expr!r}")
        bad += [f"{where}: {n}" for n in sorted(names - exported)]
    return bad


def test_promql_name_extraction():
    e = (
        'histogram_quantile(0.99, sum by (le) (rate(dspark:x_bucket{model_name=~"$m", le!="+Inf"}'
        "[$__rate_interval]))) / ignoring(position) group_left sum without (a) (foo_total offset 5m) "
        "+ 1e3 * scalar(bar)"
    )
    assert promql_metric_names(e) == {"dspark:x_bucket", "foo_total", "bar"}
    assert promql_metric_names("sum(rate(abc[5m])) > bool 0 and on (x) y") == {"abc", "y"}


def test_dashboard_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    assert (
        "vllm:num_requests_waiting" in exported and "dspark:spec_decode_acceptance_length_bucket" in exported
    )
    assert unknown_metrics(dash, exported) == []
    # the check can fail: a misspelt name is caught
    dash["panels"][0]["targets"][0]["expr"] = "rate(dspark:spec_decode_num_acepted_tokens_total[1m])"
    assert unknown_metrics(dash, exported) == [
        f"{dash['panels'][0]['title']}: dspark:spec_decode_num_acepted_tokens_total"
    ]


def test_dashboard_has_the_expected_panels():
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for want in (
        "acceptance rate",
        "acceptance length",
        "acceptance by draft position",
        "proposed / accepted / rejected",
        "verify budget vs load",
        "time to first token",
        "inter-token latency",
        "kv cache usage",
        "throughput",
    ):
        assert want in titles, want
    exprs = [e for _, e in dashboard_queries(dash)]
    assert any("histogram_quantile(0.99" in e and "time_to_first_token" in e for e in exprs)
    assert any("by (position)" in e for e in exprs)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "prometheus"


def test_compose_provisions_grafana_with_prometheus():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"dspark", "prometheus", "grafana"} <= set(services)
    assert services["grafana"]["image"].startswith("grafana/grafana")
    mounts = {}
    for v in services["grafana"]["volumes"] + services["prometheus"]["volumes"]:
        src, dst = v.split(":")[:2]
        assert (ROOT / src).exists(), src
        mounts[dst] = ROOT / src
    prov = mounts["/etc/grafana/provisioning"]
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["uid"] == "prometheus"
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", ds["url"]).groups()
    assert host in services and f"{port}:{port}" in services[host]["ports"]
    providers = yaml.safe_load((prov / "dashboards" / "dspark.yml").read_text())["providers"]
    path = providers[0]["options"]["path"]
    assert (mounts[path] / DASHBOARD.name).is_file()
    scrape = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    target = scrape["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert target.split(":")[0] in services and services["dspark"]["ports"][0].endswith(
        ":" + target.split(":")[1]
    )
