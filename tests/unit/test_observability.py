"""Alert rules and the dashboard: valid PromQL, only metric names the code exports, rules that fire
and stay silent as their promtool unit tests say."""

import json
import re
import subprocess
from pathlib import Path

import yaml
from prometheus_client import Counter, Gauge, Histogram

from streams import metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMQL_WORDS = {"sum", "max", "min", "avg", "by", "without", "rate", "increase", "deriv", "histogram_quantile",
                "time", "absent", "and", "or", "unless", "le", "count", "irate"}


def exported_names() -> set[str]:
    names = set()
    for value in vars(metrics).values():
        if isinstance(value, Counter):
            names |= {f"{value._name}_total", f"{value._name}_created"}
        elif isinstance(value, Histogram):
            names |= {f"{value._name}_{s}" for s in ("bucket", "sum", "count", "created")}
        elif isinstance(value, Gauge):
            names.add(value._name)
    return names


def metric_names(expr: str) -> set[str]:
    without_labels = re.sub(r"\{[^}]*\}", "", expr)
    without_strings = re.sub(r'"[^"]*"', "", without_labels)
    tokens = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_strings))
    return {t for t in tokens if t not in PROMQL_WORDS and not re.fullmatch(r"\d+[smhd]?", t)
            and t.startswith(("dispatch_", "webhook_"))}


def dashboard_exprs() -> list[str]:
    """The panels' queries as Prometheus gets them (Grafana puts at least four scrape intervals for
    `$__rate_interval`, so that a rate never rests on fewer than two samples)."""
    dash = json.loads((DEPLOY / "grafana/dashboards/dispatch.json").read_text())
    return [t["expr"].replace("$__rate_interval", "1m") for p in dash["panels"] for t in p.get("targets", [])]


def test_rates_on_the_dashboard_follow_the_scrape_interval():
    """A rate over a fixed 1 m window is empty when Prometheus scrapes every 30 s or more (k8s defaults):
    the panels use Grafana's `$__rate_interval`."""
    dash = (DEPLOY / "grafana/dashboards/dispatch.json").read_text()
    assert "[1m]" not in dash and "$__rate_interval" in dash


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_alert_rules_pass_their_promtool_unit_tests():
    out = subprocess.run(["promtool", "test", "rules", "alerts_test.yml"], cwd=DEPLOY / "prometheus",
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_dashboard_expression_is_valid_promql(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{i}", "expr": e} for i, e in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_and_alerts_use_only_exported_metrics():
    exported = exported_names()
    used = set().union(*(metric_names(e) for e in dashboard_exprs() + alert_exprs()))
    assert used, "no metric names found: the parser is broken"
    assert used <= exported, f"not exported by streams/metrics.py: {sorted(used - exported)}"


def test_dashboard_shows_what_operators_watch():
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    for required in ("dispatch_lane_lag_messages", "dispatch_lane_paused", "dispatch_sends_total",
                     "dispatch_end_to_end_seconds_bucket", "dispatch_provider_429_total",
                     "dispatch_dead_letters_total", "webhook_endpoints", "webhook_endpoint_alerts_total",
                     "webhook_deliveries_skipped_total", "webhook_endpoint_consecutive_failures_bucket"):
        assert required in used


def test_the_dashboard_shows_every_metric_an_alert_reads_and_seconds_as_seconds():
    """An operator paged by an alert finds what it read on the dashboard; a panel of a `_seconds` gauge is
    labelled in seconds (before: the retry tiers' overdue seconds were shown as a plain number)."""
    on_dashboard = set().union(*(metric_names(e) for e in dashboard_exprs()))
    read_by_alerts = set().union(*(metric_names(e) for e in alert_exprs()))
    assert read_by_alerts <= on_dashboard, f"alerts read, the dashboard lacks: {sorted(read_by_alerts - on_dashboard)}"
    for panel in json.loads((DEPLOY / "grafana/dashboards/dispatch.json").read_text())["panels"]:
        exprs = [t["expr"] for t in panel.get("targets", [])]
        if exprs and all(e.startswith(("max by", "clamp_min(max by")) and "_seconds" in e for e in exprs):
            assert panel["fieldConfig"]["defaults"]["unit"] == "s", panel["title"]



def test_end_to_end_latency_is_measured_up_to_the_longest_max_age():
    """A send may reach its provider as late as its policy's max age (2 days for marketing and webhooks, through
    retry tiers of up to 12 h): the latency histogram has buckets up to there, so the dashboard's p99 says hours
    when sends are hours late (before: the last bucket was 300 s, and every later send read as 5 minutes)."""
    from streams.retry.policy import RETRY_TIERS, load_policies

    registered = metrics.END_TO_END.labels("email", "marketing")
    finite = [b for b in registered._upper_bounds if b != float("inf")]
    longest = max(max(p.max_age_s for p in load_policies().values()), max(RETRY_TIERS.values()))
    assert finite[-1] >= longest
