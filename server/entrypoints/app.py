"""The server: loads policies, listens, authenticates at the handshake, routes HTTP probes and
WebSocket sessions, records usage, and shuts down gracefully.

Everything here is I/O glue. Decisions are made by the sans-I/O cores: :mod:`.auth`,
:mod:`.quotas`, :mod:`.admission`, :mod:`.batching`; durable accounting by :mod:`.ledger`.
"""

from __future__ import annotations

import asyncio
import gc
import http
import logging
import signal
import ssl
import time
import urllib.parse
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import websockets
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from chunkline.client.exceptions import ErrorCode
from chunkline.client.protocol import SUBPROTOCOL, CloseCode
from chunkline.policies.base import Policy, example_observation, stack_observations
from chunkline.policies.registry import load_policy
from chunkline.server.config import PolicyConfig, ServerConfig
from chunkline.server.core.accounting import Accounting
from chunkline.server.core.admission import AdmissionConfig, ServiceTimeModel, resolve_deadline
from chunkline.server.core.auth import NO_AUTH_WARNING, Authenticator, AuthFailure, AuthResult, NoAuth
from chunkline.server.core.ledger import Ledger, LedgerRow, RowSink
from chunkline.server.core.metrics import Metrics
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry, load_registry
from chunkline.server.entrypoints.sessions import CompatSession, NativeSession
from chunkline.server.robot.batching import BatchPolicy
from chunkline.server.robot.runner import ModelRunner, Refusal, WorkItem

if TYPE_CHECKING:
    from chunkline.server.entrypoints.http import HttpServer
    from chunkline.server.text import TextService

__all__ = ["ChunklineServer", "run_server", "VERSION"]

VERSION = "0.1.0"
log = logging.getLogger("chunkline.server")


def _plain(status: http.HTTPStatus | int, text: str, extra: list[tuple[str, str]] | None = None,
           content_type: str = "text/plain; charset=utf-8", body: bytes | None = None) -> Response:
    status = http.HTTPStatus(status)
    payload = body if body is not None else (text + "\n").encode()
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(payload)))])
    for k, v in extra or []:
        headers[k] = v
    return Response(status.value, status.phrase, headers, payload)


def _measure_service(policy: Policy, sizes: tuple[int, ...], budget_s: float = 1.0) -> dict[int, float]:
    """Median time of a forward pass per batch size, to seed admission before real traffic.

    Up to three passes per size within ``budget_s``; a slow policy gets a single pass at batch 1
    (admission then extrapolates proportionally, the cautious direction)."""
    rng = np.random.default_rng(0)
    out: dict[int, float] = {}
    spent = 0.0
    for size in sizes:
        batch = stack_observations(policy.spec, [example_observation(policy.spec, rng) for _ in range(size)])
        times: list[float] = []
        while len(times) < 3 and (not times or spent < budget_s):
            t = time.perf_counter()
            policy.infer_batch(batch)
            times.append(time.perf_counter() - t)
            spent += times[-1]
        out[size] = float(np.median(times))
        if spent >= budget_s:
            break
    return out


def _placement_token(path: str) -> str | None:
    """The ``placement`` query parameter of a handshake's path, if any."""
    query = urllib.parse.urlsplit(path).query
    if "placement=" not in query:
        return None
    values = urllib.parse.parse_qs(query, max_num_fields=8).get("placement")
    return values[0] if values else None


class ChunklineServer:
    """A running chunkline server.

    Args:
        config: the validated configuration.
        placement: when this server is a fleet replica, checks the signed placement token a
            robot redirected by the fleet's directory brings in the handshake URI
            (``?placement=...``; redirects drop the ``Authorization`` header) and returns the
            tenant it was issued to; raises on an invalid, expired, reused or foreign token.
        ledger_sink: where the ledger writes its batches instead of the local SQLite file (a
            fleet's one shared ledger).
    """

    def __init__(self, config: ServerConfig, placement: Callable[[str], str] | None = None,
                 ledger_sink: Callable[[], RowSink] | None = None) -> None:
        self.config = config
        self.placement = placement
        self.codec_limits = config.codec_limits()
        self.version_string = f"chunkline/{VERSION} websockets/{websockets.__version__}"
        self.runners: dict[str, ModelRunner] = {}
        self.ready = False
        self.draining = False
        self.metrics = Metrics()
        registry = TenantRegistry.anonymous() if config.no_auth else load_registry(config.tenants)  # type: ignore[arg-type]
        self.auth: Authenticator | NoAuth = NoAuth() if config.no_auth else Authenticator(registry, time.monotonic)
        self.quotas = QuotaManager(self.auth.registry)
        self.ledger: Ledger | None = None
        if config.ledger is not None or ledger_sink is not None:
            self.ledger = Ledger(config.ledger or Path("chunkline-ledger.db"), on_write=self._on_ledger_write,
                                 store_factory=ledger_sink)
        # Every class counts its outcomes here (metrics, ledger rows, what a fleet reads in stats()).
        self.accounting = Accounting(self.metrics, self.ledger)
        # The tenant each connection authenticated as, from the handshake to the end of the session.
        self._tenant_of: weakref.WeakKeyDictionary[ServerConnection, TenantInfo] = weakref.WeakKeyDictionary()
        self._sessions_per_tenant: dict[str, int] = {}
        self._address_of: weakref.WeakKeyDictionary[ServerConnection, str] = weakref.WeakKeyDictionary()
        self._key_of: weakref.WeakKeyDictionary[ServerConnection, str | None] = weakref.WeakKeyDictionary()
        self._per_address: dict[str, int] = {}
        self.text: TextService | None = None  # text-LLM request class, when configured
        self._text_http: HttpServer | None = None  # its OpenAI-compatible API, when configured
        self._server: Server | None = None
        self._metrics_server: Server | None = None
        self._stopped = asyncio.Event()

    # ------------------------------------------------------------------ used by sessions

    @property
    def default_runner(self) -> ModelRunner:
        return self.runners[self.config.policies[0].model_name]

    def tenant_of(self, ws: ServerConnection) -> TenantInfo:
        return self._tenant_of[ws]

    def policy_config(self, name: str) -> PolicyConfig:
        return next(pc for pc in self.config.policies if pc.model_name == name)

    def deadline_for(self, runner: ModelRunner, tenant: TenantInfo, deadline_ms: float | None, received: float) -> float:
        """The absolute deadline: the request's budget, else the tenant's, the config's, the policy's."""
        configured = self.policy_config(runner.name).default_deadline_ms
        return resolve_deadline(received, deadline_ms, tenant=tenant,
                                policy_default_ms=configured if configured is not None else runner.policy.spec.default_deadline_ms)

    def submit(self, runner: ModelRunner, obs: dict[str, Any], tenant: TenantInfo, session: str, deadline: float) -> WorkItem:
        """Admission for one validated observation. Raises :class:`Refusal`."""
        if self.draining:
            raise Refusal(ErrorCode.SHUTTING_DOWN, "the server is shutting down; reconnect", retry_after_ms=1000.0)
        if not tenant.may_use(runner.name, "policy"):
            raise Refusal(ErrorCode.FORBIDDEN, f"tenant may not use model {runner.name!r}")
        if self.ledger is not None and self.config.ledger_fail_closed and not self.ledger.healthy:
            raise Refusal(ErrorCode.NOT_READY, "usage ledger unavailable: refusing unrecorded work", retry_after_ms=1000.0)
        return runner.submit(obs, tenant=tenant, session=session, deadline=deadline)

    def record(self, runner: ModelRunner, tenant: TenantInfo, session: str, outcome: str,
               timing_ms: dict[str, float], item: WorkItem | None) -> None:
        """Count one request's outcome (metrics) and, if it was admitted, write its ledger row."""
        if item is None:
            self.accounting.refused("policy", runner.name, tenant.name, outcome, timing_ms=timing_ms)
            return
        row = None
        if self.ledger is not None:
            row = LedgerRow(
                request_id=f"{session}:{item.request.id if item.request else 0}", tenant=tenant.name, cls="policy",
                model=runner.name, outcome=outcome, ts=time.time(), session=session, fingerprint=runner.policy.fingerprint,
                decode_ms=timing_ms.get("decode_ms"), queue_ms=timing_ms.get("queue_ms"), infer_ms=timing_ms.get("infer_ms"),
                encode_ms=timing_ms.get("encode_ms"), server_ms=timing_ms.get("server_ms"),
                batch_size=int(timing_ms["batch_size"]) if "batch_size" in timing_ms else None,
                chunks=1 if outcome in ("ok", "late") else 0,
            )
        self.accounting.finished("policy", runner.name, tenant.name, outcome, timing_ms, row)

    def _on_ledger_write(self, *_: Any) -> None:
        if self.ledger is not None:  # called from the ledger's thread: gauges are thread-safe
            self.metrics.set_ledger(self.ledger.healthy, self.ledger.pending, self.ledger.dropped)

    def _on_batch(self, runner_name: str, size: int, seconds: float) -> None:
        self.metrics.observe_batch(runner_name, size)

    # ------------------------------------------------------------------ HTTP and handshake

    @property
    def is_ready(self) -> bool:
        ledger_ok = self.ledger is None or self.ledger.healthy or not self.config.ledger_fail_closed
        lanes_ok = all(r.healthy for r in self.runners.values())
        return self.ready and not self.draining and ledger_ok and lanes_ok

    def _metrics_response(self, request: Request) -> Response:
        for name, runner in self.runners.items():  # gauges of state, refreshed when scraped
            self.metrics.set_queue(name, runner.queued, runner.running)
            self.metrics.set_service_times(name, runner.core.service.snapshot())
        body, content_type = self.metrics.render(request.headers.get("Accept"))
        return _plain(http.HTTPStatus.OK, "", content_type=content_type, body=body)

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        # Probes are open (orchestrators carry no keys) and reveal nothing about tenants.
        if path == "/healthz":
            return _plain(http.HTTPStatus.OK, "ok")
        if path == "/readyz":
            if self.is_ready:
                return _plain(http.HTTPStatus.OK, "ready")
            reason = ("draining" if self.draining else "loading" if not self.ready
                      else "a policy lane is hung" if not all(r.healthy for r in self.runners.values()) else "ledger unavailable")
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, reason)
        # Everything else is authenticated first, before any payload is read.
        peer = connection.remote_address[0] if connection.remote_address else "?"
        result = self._authenticate(request, str(peer))
        if not result.ok:
            self.metrics.observe_auth_failure(result.failure.value if result.failure else "invalid")
            return _plain(result.http_status, result.message, result.headers())
        assert result.tenant is not None
        if path == "/metrics" and not self.auth.enabled:
            return self._metrics_response(request)
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return _plain(http.HTTPStatus.NOT_FOUND, "not found")
        if self.draining:
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "shutting down", [("Retry-After", "1")])
        if not self.ready:
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "policy loading", [("Retry-After", "1")])
        if len(self._tenant_of) >= self.config.max_connections:
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections", [("Retry-After", "1")])
        if self._per_address.get(peer, 0) >= self.config.max_connections_per_address:
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections from this address", [("Retry-After", "1")])
        refusal = self.quotas.open_session(result.tenant.name, time.monotonic())
        if refusal is not None:
            self.metrics.observe_refusal(ErrorCode.QUOTA_EXCEEDED.value, "max_sessions")
            return _plain(http.HTTPStatus.TOO_MANY_REQUESTS, f"quota_exceeded: {refusal.message}", [("Retry-After", "1")])
        self._tenant_of[connection] = result.tenant
        self._key_of[connection] = result.key_id
        self._address_of[connection] = peer
        self._per_address[peer] = self._per_address.get(peer, 0) + 1
        self._count_session(result.tenant.name, +1)
        return None

    def _authenticate(self, request: Request, peer: str) -> AuthResult:
        token = _placement_token(request.path) if self.placement is not None else None
        if token is None:
            return self.auth.authenticate(request.headers.get("Authorization"), peer)
        assert self.placement is not None
        try:
            tenant = self.auth.registry.get(self.placement(token))
        except Exception as exc:  # any invalid token is a 401, whatever the verifier raised
            log.info("placement token refused from %s: %s", peer, exc)
            tenant = None
        return AuthResult(tenant) if tenant is not None else AuthResult(None, failure=AuthFailure.INVALID)

    def stats(self) -> dict[str, Any]:
        """A snapshot for a fleet controller: cumulative outcomes, sessions per tenant, recent
        queue waits (taken: each wait is reported once), load and the service curves."""
        runners = {
            name: {"service_s": r.core.service.snapshot(), "max_batch_size": self.policy_config(name).max_batch_size,
                   "lanes": self.policy_config(name).lanes, "fingerprint": r.policy.fingerprint,
                   "queued": r.queued, "running": r.running, "healthy": r.healthy}
            for name, r in self.runners.items()
        }
        return {**self.accounting.snapshot(), "sessions": dict(self._sessions_per_tenant), "runners": runners,
                "ready": self.is_ready, "draining": self.draining}

    def _process_response(self, connection: ServerConnection, request: Request, response: Response) -> None:
        # A handshake that failed after the session was opened never reaches the handler.
        if response.status_code != 101 and connection in self._tenant_of:
            self._close_session(connection)

    def _count_session(self, tenant: str, delta: int) -> None:
        n = self._sessions_per_tenant.get(tenant, 0) + delta
        self._sessions_per_tenant[tenant] = n
        self.metrics.set_sessions(tenant, n)

    def _close_session(self, ws: ServerConnection) -> None:
        peer = self._address_of.pop(ws, None)
        if peer is not None:
            left = self._per_address.get(peer, 1) - 1
            if left:
                self._per_address[peer] = left
            else:
                self._per_address.pop(peer, None)
        tenant = self._tenant_of.pop(ws, None)
        if tenant is not None:
            self.quotas.close_session(tenant.name)
            self._count_session(tenant.name, -1)

    @staticmethod
    def _select_subprotocol(connection: ServerConnection, subprotocols: Any) -> Any:
        # No subprotocol offered: openpi-compatible mode. chunkline.v1 offered: native mode.
        return SUBPROTOCOL if SUBPROTOCOL in subprotocols else None

    async def _handle(self, ws: ServerConnection) -> None:
        session: NativeSession | CompatSession | None = None
        try:
            session = NativeSession(self, ws) if ws.subprotocol == SUBPROTOCOL else CompatSession(self, ws)
            await session.run()
        except websockets.ConnectionClosed:
            pass
        finally:
            self._close_session(ws)
            if session is not None:
                for runner in self.runners.values():
                    runner.release_session(session.id)

    # ------------------------------------------------------------------ life cycle

    def _load(self) -> dict[str, tuple[PolicyConfig, Policy, dict[int, float]]]:
        """Worker thread: load, warm and time every policy (nothing here may touch the loop)."""
        loaded = {}
        for pc in self.config.policies:
            t = time.perf_counter()
            policy = load_policy(pc.ref, device=pc.device, backend=pc.backend)
            policy.warmup()
            gc.collect()  # not during the timing below: a collection pause would seed admission badly
            sizes = (1,) if pc.max_batch_size == 1 else (1, pc.max_batch_size)
            service = _measure_service(policy, sizes)
            log.info("loaded %s (%s) in %.2f s, fingerprint %s, service time %s", pc.model_name, pc.ref,
                     time.perf_counter() - t, policy.fingerprint, {k: f"{v * 1000:.2f} ms" for k, v in service.items()})
            loaded[pc.model_name] = (pc, policy, service)
        return loaded

    def _make_runner(self, pc: PolicyConfig, policy: Policy, service: dict[int, float]) -> ModelRunner:
        fifo = pc.admission == "fifo"
        admission = AdmissionConfig(
            max_queue=1_000_000 if fifo else pc.max_queue,
            max_batch_size=pc.max_batch_size,
            workers=pc.lanes,
            drop_late=not fifo,
        )
        return ModelRunner(
            pc.model_name, policy, quotas=self.quotas, admission=admission,
            batching=BatchPolicy(max_batch_size=pc.max_batch_size, max_batch_wait=pc.max_batch_wait_ms / 1000.0),
            service=ServiceTimeModel(initial=service), fifo=fifo,
            on_batch=lambda size, seconds, name=pc.model_name: self._on_batch(name, size, seconds),
            hang_timeout=pc.hang_timeout_s,
        )

    async def start(self) -> None:
        """Listen at once (``/healthz`` answers while loading), then load and warm the policies."""
        if not self.auth.enabled:
            for line in NO_AUTH_WARNING.splitlines():
                log.warning(line)
        self._server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=self._process_request,
            process_response=self._process_response,
            select_subprotocol=self._select_subprotocol,
            subprotocols=[SUBPROTOCOL],
            max_size=self.config.max_message_bytes,
            open_timeout=self.config.open_timeout_s,
            ping_interval=self.config.ping_interval_s,
            compression=None,  # camera frames barely compress; deflate would cost milliseconds
            server_header=None,
            write_limit=self.config.write_limit_bytes,
            ssl=self._ssl_context(),
        )
        log.info("listening on %s:%d", self.config.host, self.port)
        if self.config.metrics_port is not None:
            self._metrics_server = await serve(
                self._handle_metrics_only, self.config.metrics_host, self.config.metrics_port,
                process_request=lambda conn, req: self._metrics_response(req) if req.path.split("?")[0] == "/metrics"
                else _plain(http.HTTPStatus.NOT_FOUND, "not found"),
            )
            metrics_port = next(iter(self._metrics_server.sockets)).getsockname()[1]
            log.info("metrics on http://%s:%d/metrics", self.config.metrics_host, metrics_port)
            if self.config.port_file is not None:
                Path(f"{self.config.port_file}.metrics").write_text(str(metrics_port))
        if self.config.port_file is not None:
            self.config.port_file.write_text(str(self.port))
        loaded = await asyncio.get_running_loop().run_in_executor(None, self._load)
        # Everything loaded so far (torch, weights, ...) lives as long as the server: move it out
        # of the collector's reach, so full collections do not pause the loop for 100+ ms.
        gc.collect()
        gc.freeze()
        for name, (pc, policy, service) in loaded.items():
            self.runners[name] = self._make_runner(pc, policy, service)
            self.metrics.set_service_times(name, self.runners[name].core.service.snapshot())
        if self.config.text:
            await self._start_text()
        self.ready = True
        log.info("ready")

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.config.tls_cert is None or self.config.tls_key is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        return context

    async def _start_text(self) -> None:
        """The text request class on the same auth, quotas, metrics and ledger as the robots, and
        its OpenAI-compatible HTTP API (uvicorn on this loop, with this server's limits and TLS)."""
        from chunkline.server.core.serving import ServingCore
        from chunkline.server.entrypoints.http import HttpLimits, HttpServer, OpenAIApi
        from chunkline.server.text import PolicyPriorityGate, TextService

        # Until this server builds one ServingCore for every class: one sharing its parts.
        core = ServingCore(self.auth.registry, authenticate=False, ledger_fail_closed=self.config.ledger_fail_closed)
        core.auth, core.quotas, core.metrics, core.ledger, core.accounting = self.auth, self.quotas, self.metrics, self.ledger, self.accounting
        self.text = TextService(
            core, models=self.config.text,
            # Robots first: text decode steps pause while higher-priority policy work waits.
            yield_to=PolicyPriorityGate(lambda: [r.core for r in self.runners.values()], lambda: self.quotas.registry),
        )
        await self.text.start()
        if self.config.http_port is not None:
            self._text_http = HttpServer(OpenAIApi(self.text, ready=lambda: self.is_ready), HttpLimits.from_server_config(self.config))
            port = await self._text_http.start(self.config.host, self.config.http_port)
            log.info("OpenAI-compatible API on %s://%s:%d/v1", self._text_http.scheme, self.config.host, port)
            if self.config.port_file is not None:
                Path(f"{self.config.port_file}.http").write_text(str(port))

    @staticmethod
    async def _handle_metrics_only(ws: ServerConnection) -> None:
        await ws.close(1008, "metrics port: no WebSocket sessions")

    @property
    def port(self) -> int:
        assert self._server is not None
        return next(iter(self._server.sockets)).getsockname()[1]

    def reload_tenants(self) -> None:
        """SIGHUP: re-read the tenants file and swap it in; sessions stay connected."""
        if self.config.tenants is None:
            return
        try:
            registry = load_registry(self.config.tenants)
        except Exception as exc:  # a broken file must not take the server down: keep the old one
            log.error("tenants file not reloaded (keeping the previous one): %s", exc)
            return
        self.auth.swap(registry)
        self.quotas.update_registry(registry, time.monotonic())
        log.info("tenants file reloaded: %d tenants", len(registry.tenants))
        # Sessions whose key was revoked (or whose tenant was removed) end now, with 1008.
        for ws, tenant in list(self._tenant_of.items()):
            key_id = self._key_of.get(ws)
            if tenant.name not in registry.tenants or (key_id is not None and not registry.key_active(tenant.name, key_id)):
                log.info("closing a session of tenant %s: its key is no longer valid", tenant.name)
                asyncio.get_running_loop().create_task(ws.close(CloseCode.POLICY_VIOLATION, "API key revoked"))

    @property
    def in_flight(self) -> int:
        text = self.text.in_flight if self.text is not None else 0
        return text + sum(r.queued + r.running for r in self.runners.values())

    async def shutdown(self) -> None:
        """Graceful stop: readiness off, no new sessions, in-flight work finished (bounded by the
        grace period), then every connection closed with 1001 so clients reconnect elsewhere."""
        if self.draining:
            return
        self.draining = True
        if self.text is not None:
            self.text.core.draining = True  # new text requests are refused from now on (HTTP: 503)
        log.info("draining: %d requests in flight", self.in_flight)
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for server in (self._server, self._metrics_server):
            if server is not None:
                server.close(close_connections=True)  # closes sessions with 1001 going away
                await server.wait_closed()
        if self._text_http is not None:
            await self._text_http.close()  # responses still streaming finish (within the grace period)
        if self.text is not None:
            await self.text.stop()
        for runner in self.runners.values():
            await runner.stop()
            runner.policy.close()
        if self.ledger is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.ledger.close)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def _serve_until_signal(config: ServerConfig) -> None:
    server = ChunklineServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: loop.create_task(server.shutdown()))
    loop.add_signal_handler(signal.SIGHUP, server.reload_tenants)
    try:
        await server.start()
    except Exception as exc:  # a policy that cannot load or warm up is never served
        log.error("could not start: %s: %s", type(exc).__name__, exc)
        await server.shutdown()
        raise SystemExit(1) from exc
    await server.wait_stopped()


def run_server(config: ServerConfig) -> None:
    """Run until SIGTERM/SIGINT, on uvloop where installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve_until_signal(config))
    else:
        uvloop.run(_serve_until_signal(config))
