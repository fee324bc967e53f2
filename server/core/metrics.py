"""Prometheus metrics for ``/metrics``: base units, ``_seconds`` and ``_total``, a ``chunkline_`` prefix.

:class:`Metrics` owns its registry (never the global one), so a process or a test can hold several.
Per-request records (outcome, stage times, batch sizes) go to the lock-free
:class:`~chunkline.server.core.metrics_hot.HotAccumulator`, folded in at scrape time; the rest is
prometheus-client's own. Labels are low-cardinality only: class, model, tenant (set by the
operator), outcome and reason (stable codes); never content or ids, and a model a client named but
that is not served counts as :data:`UNKNOWN_MODEL`. No ``_created`` series (they double the series
count, nothing reads them). Latency buckets fit control loops, 1 ms .. 2 s, with finer ones below
1 ms for decode and encode."""

from __future__ import annotations

import platform
import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from chunkline.server.core.metrics_hot import HotAccumulator
from chunkline.server.version import VERSION

__all__ = ["Metrics", "LATENCY_BUCKETS", "CODEC_BUCKETS", "BATCH_BUCKETS", "TIMING_FIELDS", "UNKNOWN_MODEL", "NO_MODEL",
           "SESSION_CLASS"]

#: The ``model`` label of a request naming a model that is not served (never the client's text).
UNKNOWN_MODEL = "(unknown)"
#: The ``model`` label of a refusal that concerns no model (a session refused at the handshake).
NO_MODEL = "(none)"
#: The ``class`` label of a refusal at the handshake, before any request class is involved.
SESSION_CLASS = "session"

#: Seconds, 1 ms .. 2 s (a 50 Hz loop's period is 20 ms; a chunk's horizon is about 1 s).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
)
#: Decode/encode: 100 us .. 2 s.
CODEC_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005) + LATENCY_BUCKETS
#: Requests per batch.
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)

#: Timing keys (milliseconds, as in a chunk's ``timing``) and the histogram each one feeds.
TIMING_FIELDS: Mapping[str, str] = {
    "decode_ms": "decode",
    "queue_ms": "queue_wait",
    "infer_ms": "inference",
    "encode_ms": "encode",
    "server_ms": "server_latency",
}


class Metrics:
    """Every chunkline metric, in a private registry.

    One attribute per metric family.

    Args:
        registry: the registry to register into (a new one by default).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        cm = ("class", "model")
        # The families every request or batch records go to the lock-free accumulator (folded in
        # at scrape time); the rest, recorded rarely, are prometheus-client's own.
        self.hot = HotAccumulator()
        hot = self.hot
        self.requests = hot.counter(
            "chunkline_requests_total",
            "Requests answered, by request class, model, tenant and outcome (ok or an error code).",
            ("class", "model", "tenant", "outcome"),
        )
        self.decode = hot.histogram("chunkline_decode_seconds", "Time to decode and validate a request.", cm, CODEC_BUCKETS)
        self.queue_wait = hot.histogram("chunkline_queue_wait_seconds", "Time from admission to the start of its batch.", cm,
                                        LATENCY_BUCKETS)
        self.inference = hot.histogram("chunkline_inference_seconds", "Time the backend ran the request's batch.", cm,
                                       LATENCY_BUCKETS)
        self.encode = hot.histogram("chunkline_encode_seconds", "Time to encode a reply.", cm, CODEC_BUCKETS)
        self.server_latency = hot.histogram(
            "chunkline_server_latency_seconds", "Time from receipt of a request to its reply being sent.", cm, LATENCY_BUCKETS
        )
        self.batch_size = hot.histogram("chunkline_batch_size", "Requests per batch.", ("model",), BATCH_BUCKETS)
        # Families, in TIMING_FIELDS' order, and the timing keys that feed them.
        self._timed = tuple((key, getattr(self, attr)) for key, attr in TIMING_FIELDS.items())
        r.register(hot)
        self.queue_depth = Gauge("chunkline_queue_depth", "Requests waiting.", ("model",), registry=r)
        self.in_flight = Gauge("chunkline_in_flight", "Requests running.", ("model",), registry=r)
        self.sessions = Gauge("chunkline_sessions", "Open sessions.", ("tenant",), registry=r)
        self.refusals = Counter(
            "chunkline_refusals_total",
            "Requests refused before admission, or admitted and then dropped without an answer (deadline_exceeded, "
            "overloaded, shutting_down), and sessions refused at the handshake (class session, model (none)); "
            "by class, model and reason (an error code, or quota_exceeded:<limit>).",
            ("class", "model", "reason"),
            registry=r,
        )
        self.deadline_misses = Counter(
            "chunkline_deadline_misses_total",
            "Admitted requests that missed their deadline: answered late (outcome late) or dropped or failed once it "
            "passed (outcome deadline_exceeded). Requests refused at the door (deadline_unmeetable) are not counted.",
            cm,
            registry=r,
        )
        self.auth_failures = Counter("chunkline_auth_failures_total", "Failed authentications, by reason.", ("reason",), registry=r)
        self.connections_refused = Counter(
            "chunkline_connections_refused_total",
            "TCP connections closed as soon as they were accepted, by port and reason (fd_reserve: the port's share of "
            "the open-files limit is full).", ("port", "reason"), registry=r)
        self.service_time = Gauge(
            "chunkline_service_time_seconds",
            "Moving estimate of a batch's run time, per batch size (what admission plans with).",
            ("model", "batch_size"),
            registry=r,
        )
        self.ledger_healthy = Gauge(
            "chunkline_ledger_healthy", "1 while the usage ledger is being written, 0 after a write failure.", registry=r
        )
        self.ledger_pending = Gauge("chunkline_ledger_pending_rows", "Ledger rows waiting to be written.", registry=r)
        self.ledger_dropped = Counter("chunkline_ledger_dropped_rows_total", "Ledger rows that could not be kept.", registry=r)
        self._ledger_dropped_seen = 0
        self._ledger_lock = threading.Lock()
        self.text_ttft = Histogram(
            "chunkline_text_time_to_first_token_seconds",
            "Text: time from receipt to the first token.",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.text_tpot = Histogram(
            "chunkline_text_time_per_output_token_seconds",
            "Text: mean time per output token after the first.",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.text_tokens_in = Counter(
            "chunkline_text_input_tokens_total", "Text: prompt tokens processed.", ("model", "tenant"), registry=r
        )
        self.text_tokens_out = Counter("chunkline_text_output_tokens_total", "Text: tokens generated.", ("model", "tenant"), registry=r)
        self.build_info = Info("chunkline_build", "The server's version and Python (value 1).", registry=r)
        self.build_info.info({"version": VERSION, "python": platform.python_version()})
        self.model_info = Gauge(
            "chunkline_model_info", "A model served, with its fingerprint (value 1).", ("class", "model", "fingerprint"), registry=r
        )
        self.ledger_healthy.set(1)
        self._service_sizes: dict[str, set[int]] = {}

    # ------------------------------------------------------------------ recording

    def observe_request(self, cls: str, model: str, tenant: str, outcome: str, timings_ms: Mapping[str, float] | None = None) -> None:
        """Count one answered request and record its timings.

        Args:
            cls: request class.
            model: model name.
            tenant: tenant name.
            outcome: ``ok`` or its error code.
            timings_ms: any of ``decode_ms``, ``queue_ms``, ``infer_ms``, ``encode_ms``, ``server_ms``
                (milliseconds, as in a chunk's ``timing``); other keys are ignored.
        """
        shard = self.hot.shard()  # this thread's: plain list arithmetic, no lock
        shard.inc(self.requests, (cls, model, tenant, outcome))
        if timings_ms:
            labels = (cls, model)
            for key, family in self._timed:
                v = timings_ms.get(key)
                # NaN fails `v >= 0` too: a broken timing is dropped, not poured into the sum
                if v is not None and v >= 0:
                    shard.observe(family, labels, v / 1000.0)

    def observe_refusal(self, cls: str, model: str, reason: str, limit: str | None = None) -> None:
        """Count a refusal or drop (``reason`` an error code; ``limit`` for ``quota_exceeded``)."""
        self.refusals.labels(cls, model, f"{reason}:{limit}" if limit else reason).inc()

    def observe_deadline_miss(self, cls: str, model: str) -> None:
        """Count an admitted request that missed its deadline."""
        self.deadline_misses.labels(cls, model).inc()

    def observe_auth_failure(self, reason: str) -> None:
        """Count a failed authentication (``missing``, ``invalid``, ``rate_limited``)."""
        self.auth_failures.labels(reason).inc()

    def observe_connection_refused(self, port: str, reason: str) -> None:
        """Count a connection closed at accept time."""
        self.connections_refused.labels(port, reason).inc()

    def observe_batch(self, model: str, size: int) -> None:
        """Record a dispatched batch's size."""
        self.batch_size.observe((model,), size)

    def set_queue(self, model: str, queued: int, running: int) -> None:
        """Set a model's queue depth and requests running."""
        self.queue_depth.labels(model).set(queued)
        self.in_flight.labels(model).set(running)

    def set_sessions(self, tenant: str, count: int) -> None:
        """Set a tenant's open sessions."""
        self.sessions.labels(tenant).set(count)

    def set_service_times(self, model: str, snapshot: Mapping[int, tuple[float, float]]) -> None:
        """Export a service-time model's estimates (``ServiceTimeModel.snapshot()``: size to (mean, dev)).

        Only the mean is exported; sizes that disappear are removed.
        """
        seen = self._service_sizes.setdefault(model, set())
        for size in seen - set(snapshot):
            self.service_time.remove(model, str(size))
        for size, (mean, _dev) in snapshot.items():
            self.service_time.labels(model, str(size)).set(mean)
        self._service_sizes[model] = set(snapshot)

    def set_model_info(self, cls: str, model: str, fingerprint: str) -> None:
        """Export a model served and its fingerprint."""
        self.model_info.labels(cls, model, fingerprint).set(1)

    def set_ledger(self, healthy: bool, pending: int = 0, dropped: int = 0) -> None:
        """Export the ledger's state (``dropped``: the ledger's own count since start)."""
        self.ledger_healthy.set(1 if healthy else 0)
        self.ledger_pending.set(pending)
        with self._ledger_lock:  # called from the ledger's thread and the loop
            new = dropped - self._ledger_dropped_seen
            if new > 0:
                self.ledger_dropped.inc(new)
                self._ledger_dropped_seen = dropped

    def observe_text(
        self, model: str, tenant: str, ttft_s: float | None, tokens_in: int, tokens_out: int, decode_s: float | None = None
    ) -> None:
        """Record one finished text request.

        Args:
            model: model name.
            tenant: tenant name.
            ttft_s: time to first token, if any token was produced.
            tokens_in: prompt tokens.
            tokens_out: generated tokens.
            decode_s: time from the first token to the last; gives time per output token.
        """
        if ttft_s is not None and ttft_s >= 0:
            self.text_ttft.labels(model).observe(ttft_s)
        if decode_s is not None and decode_s >= 0 and tokens_out > 1:
            self.text_tpot.labels(model).observe(decode_s / (tokens_out - 1))
        if tokens_in > 0:
            self.text_tokens_in.labels(model, tenant).inc(tokens_in)
        if tokens_out > 0:
            self.text_tokens_out.labels(model, tenant).inc(tokens_out)

    # ------------------------------------------------------------------ exposition

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition for ``/metrics``.

        Args:
            accept: the request's ``Accept`` header; OpenMetrics is served when asked for,
                the Prometheus text format otherwise.

        Returns:
            ``(body, content_type)``.
        """
        encoder, content_type = choose_encoder(accept or "")
        return encoder(_WithoutCreated(self.registry)), content_type


class _WithoutCreated:
    """A registry's families without their ``_created`` samples.

    prometheus_client's own switch (``disable_created_metrics``) is process-wide; this keeps the
    choice to this server's registry.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():  # fresh families on every collection: safe to edit
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
