"""Metrics: names and units, private registries, buckets, exposition formats."""

from __future__ import annotations

import json
import re

import pytest
import repo_paths
from prometheus_client.parser import text_string_to_metric_families

from chunkline.server.core.admission import ServiceTimeModel
from chunkline.server.core.metrics import CODEC_BUCKETS, LATENCY_BUCKETS, Metrics

DOCS = repo_paths.ROOT / "docs"


def _families(m: Metrics) -> dict[str, object]:
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def _sample(m: Metrics, name: str, labels: dict[str, str]) -> float | None:
    body, _ = m.render()
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def _one_of_each() -> Metrics:
    """Metrics where every metric has a child (every recording method called once)."""
    m = Metrics()
    m.observe_request("policy", "pi0", "acme", "ok", {"decode_ms": 0.2, "queue_ms": 3.0, "infer_ms": 12.0, "encode_ms": 0.1, "server_ms": 16.0})
    m.observe_refusal("policy", "pi0", "overloaded")
    m.observe_deadline_miss("policy", "pi0")
    m.observe_auth_failure("invalid")
    m.observe_batch("pi0", 4)
    m.set_queue("pi0", 3, 4)
    m.set_sessions("acme", 2)
    m.set_ledger(True, 5, 0)
    m.set_model_info("policy", "pi0", "f")
    m.observe_text("llm", "acme", 0.05, 12, 30, 0.29)
    svc = ServiceTimeModel()
    svc.observe(1, 0.01)
    m.set_service_times("pi0", svc.snapshot())
    return m


def test_every_metric_is_exposed_with_conventional_names() -> None:
    m = _one_of_each()
    names = set(_families(m))
    expected = {
        "chunkline_requests",
        "chunkline_decode_seconds",
        "chunkline_queue_wait_seconds",
        "chunkline_inference_seconds",
        "chunkline_encode_seconds",
        "chunkline_server_latency_seconds",
        "chunkline_batch_size",
        "chunkline_queue_depth",
        "chunkline_in_flight",
        "chunkline_sessions",
        "chunkline_refusals",
        "chunkline_deadline_misses",
        "chunkline_auth_failures",
        "chunkline_service_time_seconds",
        "chunkline_ledger_healthy",
        "chunkline_ledger_pending_rows",
        "chunkline_text_time_to_first_token_seconds",
        "chunkline_text_time_per_output_token_seconds",
        "chunkline_text_input_tokens",
        "chunkline_text_output_tokens",
        "chunkline_ledger_dropped_rows",
        "chunkline_build_info",
    }
    assert expected <= names, expected - names
    assert all(n.startswith("chunkline_") for n in names)
    assert _sample(m, "chunkline_requests_total", {"class": "policy", "model": "pi0", "tenant": "acme", "outcome": "ok"}) == 1.0
    # milliseconds in, seconds out
    assert _sample(m, "chunkline_inference_seconds_sum", {"model": "pi0"}) == 0.012
    assert _sample(m, "chunkline_text_time_per_output_token_seconds_sum", {"model": "llm"}) == pytest.approx(0.01)
    assert _sample(m, "chunkline_text_output_tokens_total", {"tenant": "acme"}) == 30.0
    assert _sample(m, "chunkline_queue_depth", {"model": "pi0"}) == 3.0
    assert _sample(m, "chunkline_service_time_seconds", {"model": "pi0", "batch_size": "1"}) == 0.01


def test_buckets_fit_control_loops() -> None:
    assert LATENCY_BUCKETS[0] == 0.001 and LATENCY_BUCKETS[-1] == 2.0
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)
    assert CODEC_BUCKETS[-1] == 2.0 and CODEC_BUCKETS[0] < 0.001
    m = Metrics()
    m.observe_request("policy", "pi0", "acme", "ok", {"server_ms": 15.0})
    assert _sample(m, "chunkline_server_latency_seconds_bucket", {"le": "0.01"}) == 0.0
    assert _sample(m, "chunkline_server_latency_seconds_bucket", {"le": "0.015"}) == 1.0
    assert _sample(m, "chunkline_server_latency_seconds_bucket", {"le": "2.0"}) == 1.0


def test_registries_are_private() -> None:
    a, b = Metrics(), Metrics()
    a.observe_refusal("text", "llm", "quota_exceeded", "rate")
    assert _sample(a, "chunkline_refusals_total", {"class": "text", "model": "llm", "reason": "quota_exceeded:rate"}) == 1.0
    assert _sample(b, "chunkline_refusals_total", {"reason": "quota_exceeded:rate"}) is None


def test_ledger_health_and_service_sizes_follow_state() -> None:
    m = Metrics()
    assert _sample(m, "chunkline_ledger_healthy", {}) == 1.0
    m.set_ledger(False, 12, 3)
    assert _sample(m, "chunkline_ledger_healthy", {}) == 0.0
    assert _sample(m, "chunkline_ledger_pending_rows", {}) == 12.0
    m.set_service_times("pi0", {1: (0.01, 0.0), 8: (0.02, 0.0)})
    m.set_service_times("pi0", {8: (0.03, 0.0)})
    assert _sample(m, "chunkline_service_time_seconds", {"batch_size": "1"}) is None
    assert _sample(m, "chunkline_service_time_seconds", {"batch_size": "8"}) == 0.03


def test_negative_or_missing_timings_are_ignored() -> None:
    m = Metrics()
    m.observe_request("policy", "pi0", "acme", "deadline_exceeded", {"queue_ms": -1.0, "other": 5.0})
    m.observe_text("llm", "acme", None, 0, 0)
    assert _sample(m, "chunkline_queue_wait_seconds_count", {}) is None
    assert _sample(m, "chunkline_requests_total", {"outcome": "deadline_exceeded"}) == 1.0


def test_openmetrics_on_request() -> None:
    m = Metrics()
    m.observe_refusal("policy", "pi0", "overloaded")
    body, ctype = m.render("application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_no_created_series_in_either_format() -> None:
    m = Metrics()
    m.observe_request("policy", "pi0", "acme", "ok", {"server_ms": 3.0, "decode_ms": 0.1})
    m.observe_refusal("policy", "pi0", "overloaded")
    m.observe_text("llm", "acme", 0.05, 12, 30, 0.29)
    for accept in (None, "application/openmetrics-text; version=1.0.0"):
        body, _ = m.render(accept)
        assert b"_created" not in body
        assert b"chunkline_requests_total" in body
    # the private registry still has them: only this exposition leaves them out
    assert any(s.name.endswith("_created") for fam in m.registry.collect() for s in fam.samples)


def test_ledger_dropped_rows_is_a_counter_fed_by_the_ledgers_running_count() -> None:
    m = Metrics()
    family = _families(m)["chunkline_ledger_dropped_rows"]
    assert family.type == "counter"  # type: ignore[attr-defined]
    m.set_ledger(False, 0, 3)
    m.set_ledger(False, 0, 3)  # the same count again adds nothing
    m.set_ledger(True, 0, 5)
    assert _sample(m, "chunkline_ledger_dropped_rows_total", {}) == 5.0


def test_build_and_model_info() -> None:
    from chunkline.server.version import VERSION

    m = Metrics()
    m.set_model_info("policy", "pi0", "abc123")
    info = _sample(m, "chunkline_build_info", {"version": VERSION})
    assert info == 1.0
    assert _sample(m, "chunkline_model_info", {"class": "policy", "model": "pi0", "fingerprint": "abc123"}) == 1.0


def _exposed_names() -> set[str]:
    """Every sample name a server exposes once each metric has a child."""
    body, _ = _one_of_each().render()
    return {s.name for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_dashboard_filters_every_query_by_job_and_instance_and_reads_only_real_metrics() -> None:
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"job", "instance", "model"} <= variables.keys()
    assert variables["job"]["includeAll"] is False  # one job at a time: jobs are never summed together
    exposed = _exposed_names()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs
    for expr in exprs:
        selectors = re.findall(r"\b(chunkline_[a-z_]+)(\{[^}]*\})?", expr)
        assert selectors, expr
        for name, matchers in selectors:
            assert name in exposed, f"{name} is not a metric the server exposes"
            assert 'job="$job"' in matchers and 'instance=~"$instance"' in matchers, expr


def test_rules_read_only_real_metrics() -> None:
    exposed = _exposed_names()
    rules = (DOCS / "prometheus" / "rules.yml").read_text()
    used = set(re.findall(r"\b(chunkline_[a-z_]+)\b", rules))
    assert used and used <= exposed, used - exposed


def test_top_sums_refusals_of_every_class_and_model_by_reason() -> None:
    from chunkline.bench.top import parse_metrics

    m = Metrics()
    m.observe_refusal("policy", "pi0", "overloaded")
    m.observe_refusal("text", "llm", "overloaded")
    m.observe_refusal("policy", "(unknown)", "unknown_model")
    body, _ = m.render()
    assert parse_metrics(body.decode(), 0.0).refusals == {"overloaded": 2.0, "unknown_model": 1.0}
