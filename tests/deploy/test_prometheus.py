"""deploy/prometheus and deploy/grafana against promtool and a real Prometheus server.

The story: ``promtool`` accepts the scrape config and the alert rules, and the rules' own
unit tests pass. Then a real ``statetier serve`` (a subprocess) is scraped every second by
a real ``prometheus`` whose job is the one in deploy/prometheus/prometheus.yml with only
the target replaced. The SDK puts five objects, loads six and makes one load that must be
refused (another namespace). Prometheus' HTTP API then shows exactly that traffic, the
configured capacities, the rejection by its reason, the rejection alert firing and no
other, and every query of the Grafana dashboard evaluating (the main panels with data).

Skips with the reason when prometheus/promtool are not installed (``make test`` installs
them where apt-get is usable: ``scripts/ensure_prometheus.sh``).
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from statetier.clients import Client
from statetier.launch import DaemonProcess
from statetier.protocol.errors import NamespaceMismatch
from statetier.protocol.identity import NamespaceSpec
from tests.support.deploy_files import DEPLOY, REPO, exported_metric_names, metric_names_in
from tests.support.prometheus_proc import PROMETHEUS, PROMTOOL, SKIP_REASON, PrometheusServer
from tests.support.waiting import wait_until

SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
KUBERNETES_SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus-kubernetes.yml"
RULES = DEPLOY / "prometheus" / "statetier-alerts.yml"
RULE_TESTS = Path(__file__).resolve().parent / "statetier-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "statetier-dashboard.json"
HOST_CAPACITY, DISK_CAPACITY = 256 << 20, 1 << 30
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=SKIP_REASON)
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None, reason=SKIP_REASON)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def rule_expressions() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]


# -- static: names and promtool ---------------------------------------------------------


def test_rules_and_dashboard_name_only_metrics_the_daemon_exports() -> None:
    exported = exported_metric_names()
    for name, expr in [*rule_expressions().items(), *dashboard_queries()]:
        assert metric_names_in(expr) <= exported, f"{name}: {sorted(metric_names_in(expr) - exported)}"
    used = set().union(*(metric_names_in(expr) for _, expr in dashboard_queries()))
    for needed in ("statetier_bytes_total", "statetier_hits_total", "statetier_misses_total",
                   "statetier_rejections_total", "statetier_tier_used_bytes", "statetier_tier_capacity_bytes",
                   "statetier_operation_seconds_bucket"):
        assert needed in used, f"the dashboard lacks {needed}"
    assert set(rule_expressions()) >= {"StatetierStateRejected", "StatetierDown", "StatetierRedisUnavailable",
                                       "StatetierDiskAboveHighWatermark", "StatetierCompactionsBlocked",
                                       "StatetierLeasesExpiring"}


@needs_promtool
def test_promtool_accepts_the_scrape_config_and_the_rules() -> None:
    checked = promtool("check", "config", str(SCRAPE_CONFIG))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout and "1 rule files found" in checked.stdout
    rules = promtool("check", "rules", str(RULES))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(rule_expressions())} rules found" in rules.stdout


@needs_promtool
def test_the_alert_rules_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_accepts_the_kubernetes_scrape_config() -> None:
    checked = promtool("check", "config", str(KUBERNETES_SCRAPE_CONFIG))
    if "field kubernetes_sd_configs not found" in checked.stdout + checked.stderr:
        pytest.skip("this promtool is built without Kubernetes service discovery (Debian's is)")
    assert checked.returncode == 0, checked.stdout + checked.stderr


# -- live: a daemon scraped by Prometheus -----------------------------------------------


@dataclass(frozen=True)
class Stack:
    prometheus: PrometheusServer
    job: str
    load_bytes: dict[str, int]  # payload bytes loaded, by kind


def scrape_config_for(metrics_port: int) -> dict:
    """deploy/prometheus/prometheus.yml with the target replaced, 1 s scrapes and evaluations."""
    deployed = yaml.safe_load(SCRAPE_CONFIG.read_text())
    (job,) = [copy.deepcopy(j) for j in deployed["scrape_configs"] if j["job_name"] == "statetier"]
    labels = job["static_configs"][0].get("labels", {})
    job.update(scrape_interval="1s", scrape_timeout="1s",
               static_configs=[{"targets": [f"127.0.0.1:{metrics_port}"], "labels": labels}])
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)], "scrape_configs": [job]}


@pytest.fixture(scope="module")
def daemon() -> Iterator[tuple[str, int]]:
    with DaemonProcess(name="prom", host_capacity=str(HOST_CAPACITY),
                       settings={"disk.capacity_bytes": DISK_CAPACITY}) as daemon:
        yield daemon.url, daemon.metrics_port


@pytest.fixture(scope="module")
def stack(daemon: tuple[str, int], tmp_path_factory) -> Iterator[Stack]:
    if PROMETHEUS is None or PROMTOOL is None:
        pytest.skip(SKIP_REASON)
    url, metrics_port = daemon
    with PrometheusServer(scrape_config_for(metrics_port), tmp_path_factory.mktemp("prometheus")) as prometheus:
        job = 'job="statetier"'
        # Scraped once before any traffic: every rejection reason is already there at 0.
        wait_until(lambda: prometheus.value(f'statetier_rejections_total{{{job},reason="namespace"}}') == 0,
                 "a first scrape of the idle daemon")
        load_bytes = drive_traffic(url, prometheus)
        yield Stack(prometheus, job, load_bytes)


def drive_traffic(url: str, prometheus: PrometheusServer) -> dict[str, int]:
    """Five puts (3 KV pages, 2 SSM snapshots) and five loads; once Prometheus has scraped
    those, a sixth load (by key) and one refused load (another namespace). Two rounds, so
    that rates over the window see counters move, as they do on a long-running daemon."""
    producer_ns = NamespaceSpec(model_id="prometheus-test/producer", kv_block_size=16)
    consumer_ns = NamespaceSpec(model_id="prometheus-test/consumer", kv_block_size=16)
    loaded = {"kv": 0, "ssm": 0}
    with Client(url, namespace=producer_ns) as client:
        pages = [{"kv": torch.full((2, 4, 16, 64), float(i))} for i in range(3)]
        snapshots = [{"ssm": torch.full((64, 16), float(i))} for i in range(2)]
        kv_refs = [client.put_kv(layer, bytes([layer]) * 32, 0, 16, page, request_id="prom")
                   for layer, page in enumerate(pages)]
        ssm_refs = [client.put_ssm(10 + layer, bytes([9]) * 32, 16, snap, request_id="prom")
                    for layer, snap in enumerate(snapshots)]
        for ref, tensors in [*zip(kv_refs, pages), *zip(ssm_refs, snapshots)]:
            got = client.load(ref)
            assert torch.equal(got[ref.key.kind.name.lower()], tensors[ref.key.kind.name.lower()])
            loaded[ref.key.kind.name.lower()] += tensors[ref.key.kind.name.lower()].nbytes
        wait_until(lambda: prometheus.value('sum(statetier_hits_total{job="statetier"})') == 5, "the first round scraped")
        assert torch.equal(client.load(kv_refs[0].key)["kv"], pages[0]["kv"])  # by key: prefix reuse
        loaded["kv"] += pages[0]["kv"].nbytes
    with Client(url, namespace=consumer_ns) as consumer, pytest.raises(NamespaceMismatch):
        consumer.load(kv_refs[1])
    return loaded


@needs_prometheus
def test_the_series_arrive_with_the_values_of_the_traffic(stack: Stack) -> None:
    prom, job = stack.prometheus, stack.job
    wait_until(lambda: prom.value(f'sum(statetier_rejections_total{{{job}}})') == 1, "the refused load scraped")
    assert prom.by_label(f'sum by (tier, kind) (statetier_operations_total{{{job},tier!="daemon",op="put"}})',
                         "tier", "kind") == {("host", "kv"): 3, ("host", "ssm"): 2}
    assert prom.by_label(f'sum by (tier, kind) (statetier_operations_total{{{job},tier!="daemon",op="load"}})',
                         "tier", "kind") == {("host", "kv"): 4, ("host", "ssm"): 2}
    assert prom.by_label(f'sum by (kind) (statetier_bytes_total{{{job},tier="host",op="load"}})', "kind") == {
        (kind,): nbytes for kind, nbytes in stack.load_bytes.items()}
    assert prom.value(f'sum(statetier_operations_total{{{job},tier="daemon",op="load"}})') == 6
    assert prom.value(f'sum(statetier_hits_total{{{job}}})') == 6
    assert prom.value(f'sum(statetier_misses_total{{{job}}})') == 0  # no load missed; kv and ssm at 0
    rejections = prom.by_label(f'statetier_rejections_total{{{job}}}', "reason")
    assert rejections[("namespace",)] == 1 and sum(rejections.values()) == 1
    assert len(rejections) == 12  # every reason exported, the other eleven at 0
    assert prom.value(f'statetier_errors_total{{{job},reason="namespace"}}') == 1
    assert prom.by_label(f'statetier_tier_capacity_bytes{{{job}}}', "tier") == {
        ("host",): HOST_CAPACITY, ("disk",): DISK_CAPACITY}
    assert prom.value(f'statetier_tier_objects{{{job},tier="host"}}') == 5
    wait_until(lambda: prom.value(f'statetier_tier_objects{{{job},tier="disk"}}') == 5, "write-behind to disk")
    assert prom.value(f'statetier_leases_expired_total{{{job},tier="host"}}') == 0
    assert prom.value(f'statetier_client_leases{{{job}}}') == 0
    # what STATS knew, exported too (issue 27 item 10)
    assert prom.value(f'sum(statetier_build_info{{{job}}})') == 1
    assert prom.value(f'statetier_recovery_dropped_objects{{{job},tier="disk"}}') == 0
    assert prom.value(f'statetier_checkpoint_failures_total{{{job},tier="disk"}}') == 0
    assert prom.value(f'statetier_write_behind_capacity{{{job}}}') == 256
    assert prom.value(f'process_resident_memory_bytes{{{job}}}') > 0
    assert prom.value(f'statetier_lookup_requested_tokens_total{{{job}}}') == 0
    # The deploy job's relabelling: instance without the port; _created series dropped.
    assert {item["metric"]["instance"] for item in prom.query(f'up{{{job}}}')} == {"127.0.0.1"}
    assert prom.query('count({__name__=~"statetier_.*_created"})') == []


@needs_prometheus
def test_the_rejection_alert_fires_with_its_reason_and_nothing_else_does(stack: Stack) -> None:
    prom = stack.prometheus

    def firing() -> dict[str, dict]:
        return {a["labels"]["alertname"]: a["labels"] for a in prom.api("alerts")["alerts"] if a["state"] == "firing"}

    wait_until(lambda: "StatetierStateRejected" in firing(), "StatetierStateRejected firing", timeout=60)
    alerts = firing()
    assert set(alerts) == {"StatetierStateRejected"}
    assert alerts["StatetierStateRejected"] == {"alertname": "StatetierStateRejected", "severity": "page",
                                                "job": "statetier", "instance": "127.0.0.1", "reason": "namespace",
                                                "fault": "identity_mixup"}
    rules = [rule for group in prom.api("rules")["groups"] for rule in group["rules"]]
    assert {rule["name"] for rule in rules} == set(rule_expressions())
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]


@needs_prometheus
def test_every_dashboard_query_evaluates_and_the_main_panels_have_data(stack: Stack) -> None:
    prom = stack.prometheus
    variables = {"$job": "statetier", "$instance": ".*", "$__rate_interval": "1m", "$__range": "5m"}
    results = {}
    for title, expr in dashboard_queries():
        for name, value in sorted(variables.items(), key=lambda item: -len(item[0])):
            expr = expr.replace(name, value)
        assert "$" not in expr, f"{title}: unknown variable in {expr}"
        results.setdefault(title, []).append(prom.query(expr))  # raises unless the query is valid
    for title in ("Throughput per tier", "Hit rate", "Rejections by reason", "Tier usage", "Operation latency p99",
                  "Hits by tier", "Tier bytes used"):
        assert any(results[title]), f"panel {title!r} has no data"
    (hit_rate,) = results["Hit rate"][0]
    assert float(hit_rate["value"][1]) == 1.0  # six loads, no miss; the refused load is not a hit
    (rejected,) = results["Rejections in range"][0]
    assert float(rejected["value"][1]) > 0
