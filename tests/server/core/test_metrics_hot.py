"""The lock-free accumulator exposes exactly what prometheus-client's own Counter and Histogram
expose when fed the same observations, in both formats, from one thread or several."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from chunkline.server.core.metrics import CODEC_BUCKETS, Metrics
from chunkline.server.core.metrics_hot import HotAccumulator

BUCKETS = (0.001, 0.0025, 0.01, 0.5, 2.0)
LABELS = st.tuples(st.sampled_from(["policy", "text"]), st.sampled_from(["pi0", "act", "a b\"c"]))
VALUES = st.one_of(st.floats(min_value=-1.0, max_value=5.0), st.sampled_from([0.0, *BUCKETS, float("inf"), float("nan")]))
EVENTS = st.lists(st.tuples(st.sampled_from(["count", "time"]), LABELS, VALUES), max_size=60)


def _pair() -> tuple[CollectorRegistry, Counter, Histogram, CollectorRegistry, HotAccumulator]:
    theirs = CollectorRegistry()
    counter = Counter("x_requests_total", "Requests.", ("class", "model"), registry=theirs)
    histogram = Histogram("x_latency_seconds", "Latency.", ("class", "model"), buckets=BUCKETS, registry=theirs)
    ours_registry = CollectorRegistry()
    ours = HotAccumulator()
    ours.counter("x_requests_total", "Requests.", ("class", "model"))
    ours.histogram("x_latency_seconds", "Latency.", ("class", "model"), BUCKETS)
    ours_registry.register(ours)
    return theirs, counter, histogram, ours_registry, ours


def _parsed(text: str) -> dict[tuple[str, str, str], list[tuple[str, tuple[tuple[str, str], ...], str]]]:
    """Family (name, type, help) to its samples, ``_created`` left out, in a comparable order."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith("_created"):  # the text parser makes a family of them; the server drops them
            continue
        samples = sorted((s.name, tuple(sorted(s.labels.items())), repr(float(s.value)))
                         for s in fam.samples if not s.name.endswith("_created"))
        out[(fam.name, fam.type, fam.documentation)] = samples
    return out


def _feed(events, counter: Counter, histogram: Histogram, ours: HotAccumulator) -> None:
    count, latency = ours._families
    for kind, labels, value in events:
        if kind == "count":
            amount = abs(value) if value == value and value != float("inf") else 1.0
            counter.labels(*labels).inc(amount)
            count.inc(labels, amount)
        else:
            histogram.labels(*labels).observe(value)
            latency.observe(labels, value)


@settings(max_examples=150, deadline=None)
@given(EVENTS)
def test_exposition_equals_prometheus_clients_own_for_the_same_observations(events) -> None:
    theirs, counter, histogram, ours_registry, ours = _pair()
    _feed(events, counter, histogram, ours)
    assert _parsed(generate_latest(ours_registry).decode()) == _parsed(generate_latest(theirs).decode())
    om_ours = generate_openmetrics(ours_registry).decode()
    om_theirs = generate_openmetrics(theirs).decode()
    assert sorted(line for line in om_ours.splitlines() if "_created" not in line) == \
        sorted(line for line in om_theirs.splitlines() if "_created" not in line)


@settings(max_examples=25, deadline=None)
@given(st.lists(EVENTS, min_size=2, max_size=4))
def test_threads_record_into_their_own_shards_and_a_scrape_adds_them_up(per_thread) -> None:
    theirs, counter, histogram, ours_registry, ours = _pair()
    threads = [threading.Thread(target=_feed, args=(events, counter, histogram, ours)) for events in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mine, expected = _parsed(generate_latest(ours_registry).decode()), _parsed(generate_latest(theirs).decode())
    assert mine.keys() == expected.keys()
    for family, samples in expected.items():
        assert [s[:2] for s in mine[family]] == [s[:2] for s in samples]
        # Sums may differ in their last bits: the threads' observations were added in another order.
        assert [float(s[2]) for s in mine[family]] == pytest.approx([float(s[2]) for s in samples], nan_ok=True)
    assert len(ours._shards) == sum(1 for events in per_thread if events)  # one per thread that recorded


def test_a_counter_refuses_a_negative_increment_and_buckets_must_ascend() -> None:
    acc = HotAccumulator()
    with pytest.raises(ValueError):
        acc.counter("c_total", "c", ()).inc((), -1)
    with pytest.raises(ValueError):
        acc.histogram("h", "h", (), (0.2, 0.1))


def test_metrics_requests_and_stage_times_come_out_as_before() -> None:
    m = Metrics()
    m.observe_request("policy", "pi0", "acme", "ok", {"decode_ms": 0.2, "server_ms": 16.0, "nope_ms": 1.0})
    m.observe_request("policy", "pi0", "acme", "ok", {"decode_ms": float("nan"), "server_ms": -1.0})
    body, _ = m.render()
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    (total,) = [s for s in fams["chunkline_requests"].samples if s.name == "chunkline_requests_total"]
    assert total.value == 2 and total.labels == {"class": "policy", "model": "pi0", "tenant": "acme", "outcome": "ok"}
    decode = {s.labels.get("le"): s.value for s in fams["chunkline_decode_seconds"].samples if s.name.endswith("_bucket")}
    assert len(decode) == len(CODEC_BUCKETS) + 1 and decode["0.00025"] == 1 and decode["0.0001"] == 0  # NaN dropped
    counts = {s.name: s.value for s in fams["chunkline_server_latency_seconds"].samples if not s.name.endswith("_bucket")}
    assert counts == {"chunkline_server_latency_seconds_count": 1, "chunkline_server_latency_seconds_sum": 0.016}
