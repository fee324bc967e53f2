"""The server process: builds the shared serving core and the request classes, listens on the
WebSocket port (handshake, authentication before any payload, HTTP probes and metrics), hands each
connection to a session, and shuts down gracefully.

Everything here is I/O glue. Decisions are made by the sans-I/O cores in :mod:`chunkline.server.core`
(auth, quotas, admission, accounting); requests are served by the request classes
(:mod:`chunkline.server.robot`, :mod:`chunkline.server.text`). Nothing in the core or the classes
imports this module.
"""

from __future__ import annotations

import asyncio
import gc
import http
import logging
import signal
import ssl
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import websockets
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.version import version as websockets_version

from chunkline.client.wire.errors import CloseCode
from chunkline.client.wire.protocol import SUBPROTOCOL
from chunkline.server.config import ServerConfig
from chunkline.server.core.auth import NO_AUTH_WARNING, AuthFailure, AuthResult
from chunkline.server.core.fair_pool import DEFAULT_CPU_THREADS, FairPool
from chunkline.server.core.ledger import RowSink
from chunkline.server.core.metrics import NO_MODEL, SESSION_CLASS
from chunkline.server.core.serving import RequestClass, ServingCore
from chunkline.server.core.tenants import TenantInfo, TenantRegistry, load_registry
from chunkline.server.entrypoints.connection import BudgetedConnection, ConnectionSettings
from chunkline.server.entrypoints.listener import Listener, ListenerCallbacks
from chunkline.server.entrypoints.openpi_session import CompatSession
from chunkline.server.entrypoints.receive_budget import RECEIVE_BUDGET_REASON, ReceiveBudget
from chunkline.server.entrypoints.sessions import NativeSession, SessionContext
from chunkline.server.robot.field_decode import DecodeLimits
from chunkline.server.robot.service import RobotActions, StartAborted
from chunkline.server.version import VERSION

if TYPE_CHECKING:
    from chunkline.server.entrypoints.http import HttpServer
    from chunkline.server.planner import PlannerService
    from chunkline.server.text import TextService

__all__ = ["ChunklineServer", "StartFailed", "run_server", "VERSION"]

log = logging.getLogger("chunkline.server")


class StartFailed(Exception):
    """Start-up failed (a policy that cannot load or warm up is never served); the cause is chained."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")


def _plain(status: http.HTTPStatus | int, text: str, extra: list[tuple[str, str]] | None = None,
           content_type: str = "text/plain; charset=utf-8", body: bytes | None = None) -> Response:
    status = http.HTTPStatus(status)
    payload = body if body is not None else (text + "\n").encode()
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(payload)))])
    for k, v in extra or []:
        headers[k] = v
    return Response(status.value, status.phrase, headers, payload)


def _placement_token(path: str) -> str | None:
    """The ``placement`` query parameter of a handshake's path, if any."""
    query = urllib.parse.urlsplit(path).query
    if "placement=" not in query:
        return None
    values = urllib.parse.parse_qs(query, max_num_fields=8).get("placement")
    return values[0] if values else None


class ChunklineServer:
    """A running chunkline server: one serving core, its request classes, the WebSocket listener.

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
        registry = TenantRegistry.anonymous() if config.no_auth else load_registry(config.tenants)  # type: ignore[arg-type]
        self.core = ServingCore(registry, authenticate=not config.no_auth, ledger_path=config.ledger,
                                ledger_sink=ledger_sink, ledger_fail_closed=config.ledger_fail_closed,
                                cpu_pool=FairPool(config.cpu_threads or DEFAULT_CPU_THREADS, config.max_cpu_jobs_per_tenant))
        self.robot = RobotActions(self.core, list(config.policies), decode_limits=DecodeLimits(
            config.max_decoded_bytes_per_request, config.max_decoded_bytes_per_tenant))
        self.text: TextService | None = None  # text-LLM request class, when configured
        self.planner: PlannerService | None = None  # planner request class, when configured
        self.ready = False
        # The tenant each connection authenticated as, from the handshake to the end of the session.
        self._tenant_of: weakref.WeakKeyDictionary[BudgetedConnection, TenantInfo] = weakref.WeakKeyDictionary()
        self._sessions_per_tenant: dict[str, int] = {}
        self._address_of: weakref.WeakKeyDictionary[BudgetedConnection, str] = weakref.WeakKeyDictionary()
        self._key_of: weakref.WeakKeyDictionary[BudgetedConnection, str | None] = weakref.WeakKeyDictionary()
        self._per_address: dict[str, int] = {}
        #: the sessions open now (the drain waits for their replies to be written)
        self._sessions: weakref.WeakSet[NativeSession | CompatSession] = weakref.WeakSet()
        self._text_http: HttpServer | None = None  # the text class's OpenAI-compatible API, when configured
        self._server: Listener | None = None
        self._metrics_server: Server | None = None
        self._stopped = asyncio.Event()
        self._start_done: asyncio.Future[None] | None = None  # resolved when start() returns or raises
        # Bytes held in messages still being received, across every session (and per tenant).
        self.receive_budget = ReceiveBudget(
            config.max_receive_buffer_bytes, config.tenant_receive_buffer_share,
            on_refused=lambda: self.core.metrics.observe_refusal(SESSION_CLASS, NO_MODEL, RECEIVE_BUDGET_REASON))

    @property
    def classes(self) -> list[RequestClass]:
        """The request classes this process serves."""
        extra: list[RequestClass] = [c for c in (self.text, self.planner) if c is not None]
        return [self.robot, *extra]

    @property
    def draining(self) -> bool:
        return self.core.draining

    @property
    def is_ready(self) -> bool:
        return self.ready and not self.core.draining and self.core.ledger_ok and all(c.healthy for c in self.classes)

    def _not_ready_reason(self) -> str:
        if self.core.draining:
            return "draining"
        if not self.ready:
            return "loading"
        return "a policy lane is hung" if not self.robot.healthy else "ledger unavailable"

    def _session_context(self) -> SessionContext:
        return SessionContext(core=self.core, robot=self.robot, text=self.text, config=self.config,
                              codec_limits=self.config.codec_limits(),
                              version_string=f"chunkline/{VERSION} websockets/{websockets_version}",
                              is_ready=lambda: self.is_ready, planner=self.planner)

    # ------------------------------------------------------------------ HTTP and handshake

    def _metrics_response(self, request: Request) -> Response:
        self.robot.refresh_gauges()
        body, content_type = self.core.metrics.render(request.headers.get("Accept"))
        return _plain(http.HTTPStatus.OK, "", content_type=content_type, body=body)

    def _probe_response(self, path: str) -> Response | None:
        """``/healthz`` and ``/readyz``, the same on the request port and the metrics port; ``None``
        for any other path. Probes are open (orchestrators carry no keys) and reveal nothing about
        tenants."""
        if path == "/healthz":
            return _plain(http.HTTPStatus.OK, "ok")
        if path == "/readyz":
            if self.is_ready:
                return _plain(http.HTTPStatus.OK, "ready")
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, self._not_ready_reason())
        return None

    def _process_metrics_port_request(self, connection: ServerConnection, request: Request) -> Response:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            return self._metrics_response(request)
        return self._probe_response(path) or _plain(http.HTTPStatus.NOT_FOUND, "not found")

    def _process_request(self, connection: BudgetedConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        probe = self._probe_response(path)
        if probe is not None:
            return probe
        # Everything else is authenticated first, before any payload is read.
        peer = connection.remote_address[0] if connection.remote_address else "?"
        result = self._authenticate(request, str(peer))
        if not result.ok:
            self.core.metrics.observe_auth_failure(result.failure.value if result.failure else "invalid")
            return _plain(result.http_status, result.message, result.headers())
        assert result.tenant is not None
        if path == "/metrics" and not self.core.auth.enabled:
            return self._metrics_response(request)
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return _plain(http.HTTPStatus.NOT_FOUND, "not found")
        if self.core.draining:
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "shutting down", [("Retry-After", "1")])
        if not self.ready:
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "policy loading", [("Retry-After", "1")])
        if len(self._tenant_of) >= self.config.max_connections:
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections", [("Retry-After", "1")])
        if self._per_address.get(peer, 0) >= self.config.max_connections_per_address:
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections from this address", [("Retry-After", "1")])
        refusal = self.core.quotas.open_session(result.tenant.name, time.monotonic())
        if refusal is not None:
            self.core.metrics.observe_refusal(SESSION_CLASS, NO_MODEL, refusal.code.value, refusal.limit.value if refusal.limit else None)
            return _plain(http.HTTPStatus.TOO_MANY_REQUESTS, f"{refusal.code.value}: {refusal.message}", [("Retry-After", "1")])
        self._tenant_of[connection] = result.tenant
        connection.tenant = result.tenant.name  # from now on what it holds counts for its tenant
        self._key_of[connection] = result.key_id
        self._address_of[connection] = peer
        self._per_address[peer] = self._per_address.get(peer, 0) + 1
        self._count_session(result.tenant.name, +1)
        return None

    def _authenticate(self, request: Request, peer: str) -> AuthResult:
        token = _placement_token(request.path) if self.placement is not None else None
        if token is None:
            # Every value: two Authorization headers are a counted failure (400), never a 500.
            return self.core.auth.authenticate_headers(request.headers.get_all("Authorization"), peer)
        assert self.placement is not None
        try:
            tenant = self.core.registry.get(self.placement(token))
        except Exception as exc:  # any invalid token is a 401, whatever the verifier raised
            log.info("placement token refused from %s: %s", peer, exc)
            tenant = None
        return AuthResult(tenant) if tenant is not None else AuthResult(None, failure=AuthFailure.INVALID)

    def stats(self) -> dict[str, Any]:
        """A snapshot for a fleet controller: cumulative outcomes, sessions per tenant, recent
        queue waits (taken: each wait is reported once), load and the service curves."""
        return {**self.core.accounting.snapshot(), "sessions": dict(self._sessions_per_tenant), "runners": self.robot.stats(),
                "ready": self.is_ready, "draining": self.core.draining}

    def _process_response(self, connection: BudgetedConnection, request: Request, response: Response) -> None:
        # A handshake that failed after the session was opened never reaches the handler.
        if response.status_code != 101 and connection in self._tenant_of:
            self._close_session(connection)

    def _count_session(self, tenant: str, delta: int) -> None:
        n = self._sessions_per_tenant.get(tenant, 0) + delta
        self._sessions_per_tenant[tenant] = n
        self.core.metrics.set_sessions(tenant, n)

    def _close_session(self, ws: BudgetedConnection) -> None:
        peer = self._address_of.pop(ws, None)
        if peer is not None:
            left = self._per_address.get(peer, 1) - 1
            if left:
                self._per_address[peer] = left
            else:
                self._per_address.pop(peer, None)
        tenant = self._tenant_of.pop(ws, None)
        if tenant is not None:
            self.core.quotas.close_session(tenant.name)
            self._count_session(tenant.name, -1)

    @staticmethod
    def _select_subprotocol(connection: BudgetedConnection, subprotocols: list[str]) -> str | None:
        # No subprotocol offered: openpi-compatible mode. chunkline.v1 offered: native mode.
        return SUBPROTOCOL if SUBPROTOCOL in subprotocols else None

    async def _handle(self, ws: BudgetedConnection) -> None:
        session: NativeSession | CompatSession | None = None
        opened = time.monotonic()
        fields: dict[str, Any] = {}
        try:
            context, tenant = self._session_context(), self._tenant_of[ws]
            key_id = self._key_of.get(ws)
            session = (NativeSession(context, ws, tenant, key_id) if ws.subprotocol == SUBPROTOCOL
                       else CompatSession(context, ws, tenant, key_id))
            self._sessions.add(session)
            fields = self._session_fields(session, tenant, ws)
            log.info("session %s open: tenant %s, mode %s, model %s, peer %s", session.id, tenant.name, fields["mode"],
                     fields.get("model", "per request"), fields["peer"], extra=fields)
            await session.run()
        except websockets.ConnectionClosed:
            pass
        finally:
            self._close_session(ws)
            if session is not None:
                for cls in self.classes:
                    cls.release_session(session.id)
                duration = time.monotonic() - opened
                log.info("session %s closed: tenant %s, mode %s, peer %s, %.1f s, close code %s", session.id, fields["tenant"],
                         fields["mode"], fields["peer"], duration, ws.close_code,
                         extra={**fields, "duration_s": round(duration, 3), "close_code": ws.close_code})

    def _session_fields(self, session: NativeSession | CompatSession, tenant: TenantInfo, ws: BudgetedConnection) -> dict[str, Any]:
        """What a session's open and close log lines say: never a key or anything the robot sent."""
        fields: dict[str, Any] = {"session": session.id, "tenant": tenant.name, "peer": self._address_of.get(ws, "?")}
        if isinstance(session, NativeSession):
            fields["mode"] = "native"  # a native session names its model in each request
        else:
            fields["mode"], fields["model"] = "openpi", self.robot.default_name
        return fields

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Listen at once (``/healthz`` answers while loading), then load and warm the policies.

        A drain that begins meanwhile (:meth:`shutdown`) stops start-up at its next step with
        :class:`StartAborted`; ``ready`` is set and logged only when no drain has begun."""
        self._start_done = asyncio.get_running_loop().create_future()
        try:
            await self._start_steps()
        finally:
            self._start_done.set_result(None)

    def _abort_if_draining(self) -> None:
        if self.core.draining:
            raise StartAborted("draining: start-up stopped")

    async def _start_steps(self) -> None:
        if not self.core.auth.enabled:
            for line in NO_AUTH_WARNING.splitlines():
                log.warning(line)
        config = self.config
        self._server = Listener(
            ListenerCallbacks(handler=self._handle, process_request=self._process_request,
                              process_response=self._process_response, select_subprotocol=self._select_subprotocol),
            ConnectionSettings(max_message_bytes=config.max_message_bytes, max_queued_messages=config.max_queued_messages,
                               open_timeout_s=config.open_timeout_s, ping_interval_s=config.ping_interval_s,
                               write_limit_bytes=config.write_limit_bytes, subprotocols=(SUBPROTOCOL,)),
            self.receive_budget)
        await self._server.start(config.host, config.port, self._ssl_context())
        log.info("listening on %s:%d", self.config.host, self.port)
        self._abort_if_draining()
        if self.config.metrics_port is not None:
            self._metrics_server = await serve(
                self._handle_metrics_only, self.config.metrics_host, self.config.metrics_port,
                process_request=self._process_metrics_port_request,
            )
            metrics_port = next(iter(self._metrics_server.sockets)).getsockname()[1]
            log.info("metrics on http://%s:%d/metrics", self.config.metrics_host, metrics_port)
            if self.config.port_file is not None:
                Path(f"{self.config.port_file}.metrics").write_text(str(metrics_port))
        if self.config.port_file is not None:
            self.config.port_file.write_text(str(self.port))
        self._abort_if_draining()
        await self.robot.start()
        self._abort_if_draining()
        for name, runner in self.robot.runners.items():
            self.core.metrics.set_model_info(self.robot.name, name, runner.policy.fingerprint)
        if self.config.planners:
            await self._start_planner()
            self._abort_if_draining()
        if self.config.text:
            await self._start_text()
            self._abort_if_draining()
        # Everything start-up loaded (torch, weights, the planners, the text models and every
        # library they import) lives as long as the server: out of the collector's reach, so the
        # full collections that a flood of short-lived connections triggers scan only what the
        # connections hold, not the whole process.
        gc.collect()
        gc.freeze()
        self.ready = True  # no await since the check above: a drain cannot begin in between
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
        from chunkline.server.entrypoints.http import HttpLimits, HttpServer, OpenAIApi
        from chunkline.server.text import PolicyPriorityGate, TextService

        core = self.core
        self.text = TextService(
            core, models=self.config.text,
            # Robots first: text decode steps pause while higher-priority policy work waits.
            yield_to=self._text_yield(PolicyPriorityGate(lambda: [r.core for r in self.robot.runners.values()], lambda: core.registry)),
        )
        await self.text.start()
        if self.config.http_port is not None:
            self._text_http = HttpServer(OpenAIApi(self.text, ready=lambda: self.is_ready), HttpLimits.from_server_config(self.config),
                                         on_refused=lambda reason: self.core.metrics.observe_connection_refused("http", reason))
            port = await self._text_http.start(self.config.host, self.config.http_port)
            log.info("OpenAI-compatible API on %s://%s:%d/v1", self._text_http.scheme, self.config.host, port)
            if self.config.port_file is not None:
                Path(f"{self.config.port_file}.http").write_text(str(port))

    async def _start_planner(self) -> None:
        """The planner request class on the same auth, quotas, metrics and ledger (class ``plan``)."""
        from chunkline.server.entrypoints.planner_models import planner_factory
        from chunkline.server.planner import PlannerService

        self.planner = PlannerService(self.core, planners=list(self.config.planners), factory=planner_factory)
        await self.planner.start()
        for pc in self.config.planners:
            log.info("planner %r: backend %s", pc.name, pc.backend)

    def _text_yield(self, policy_gate: Callable[[int], bool]) -> Callable[[int], bool]:
        """Text decode steps pause while policy work, or plan work, of a higher priority is active:
        with ``class_priority = {policy = 20, plan = 10, text = 0}`` plans come below robot actions
        and above best-effort text."""
        planner = self.planner
        if planner is None:
            return policy_gate
        return lambda priority: policy_gate(priority) or planner.busy_above(priority)

    @staticmethod
    async def _handle_metrics_only(ws: ServerConnection) -> None:
        await ws.close(1008, "metrics port: no WebSocket sessions")

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.port

    def reload_tenants(self) -> None:
        """SIGHUP: re-read the tenants file and swap it in; sessions stay connected."""
        if self.config.tenants is None:
            return
        try:
            registry = load_registry(self.config.tenants)
        except Exception as exc:  # a broken file must not take the server down: keep the old one
            log.error("tenants file not reloaded (keeping the previous one): %s", exc)
            return
        self.core.reload(registry)
        log.info("tenants file reloaded: %d tenants", len(registry.tenants))
        # Sessions whose key was revoked (or whose tenant was removed) end now, with 1008.
        for ws, tenant in list(self._tenant_of.items()):
            key_id = self._key_of.get(ws)
            if tenant.name not in registry.tenants or (key_id is not None and not registry.key_active(tenant.name, key_id)):
                log.info("closing a session of tenant %s: its key is no longer valid", tenant.name)
                asyncio.get_running_loop().create_task(ws.close(CloseCode.POLICY_VIOLATION, "API key revoked"))

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self.classes)

    async def shutdown(self, start_failed: bool = False) -> None:
        """Graceful stop: readiness off and new work of every class refused at once, in-flight
        work finished (bounded by the grace period), then every connection closed with 1001 so
        clients reconnect elsewhere. ``start_failed``: no signal asked for it, start-up failed
        (the log says so, not that a drain began)."""
        if self.core.draining:
            return
        with self.core.drain_lock:
            self.core.draining = True
            if start_failed:
                log.info("start-up failed: closing the port")
            else:
                log.info("draining: %d requests in flight%s", self.in_flight, "" if self.ready else " (during start-up)")
        deadline = time.monotonic() + self.config.shutdown_grace_s
        await self._wait_for_start(deadline)
        # Work in flight, then the replies of what finished: a request's class forgets it when it is
        # answered, its session when its reply is written.
        while (self.in_flight or any(s.replies_pending for s in self._sessions)) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._server is not None:
            self._server.close()  # closes sessions with 1001 going away
            await self._server.wait_closed()
        if self._metrics_server is not None:
            self._metrics_server.close(close_connections=True)
            await self._metrics_server.wait_closed()
        if self._text_http is not None:
            await self._text_http.close()  # responses still streaming finish (within the grace period)
        if self.text is not None:
            await self.text.stop()
        if self.planner is not None:
            await self.planner.stop()
        await self.robot.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.core.close)
        self._stopped.set()

    async def _wait_for_start(self, deadline: float) -> None:
        """Start-up stops at its next step once draining; whatever it started is stopped after.
        A step inside a native call (a checkpoint read, a warm-up pass) cannot be interrupted
        safely, so this waits for it, saying so once the grace period is over."""
        if self._start_done is None or self._start_done.done():
            return
        done, _ = await asyncio.wait({self._start_done}, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            log.warning("draining: waiting for the start-up step in progress (a policy load or warm-up) to finish")
            await asyncio.shield(self._start_done)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def _serve_until_signal(config: ServerConfig, stop_requested: threading.Event | None = None) -> None:
    """One life cycle: starting, serving, draining, stopped. A signal at any moment (during the
    policies' load and warm-up too) leads to one drain; ``ready`` is never logged after it."""
    server = ChunklineServer(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload_tenants)
    if stop_requested is not None and stop_requested.is_set():
        stop.set()  # a signal before the loop took them over
    starting = loop.create_task(server.start())
    stopping = loop.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    failure = starting.exception() if starting.done() and not stop.is_set() else None
    if failure is None:
        await stopping
    await server.shutdown(start_failed=failure is not None)
    if not starting.done() or starting.exception() is None or isinstance(starting.exception(), StartAborted):
        return
    exc = starting.exception()
    assert exc is not None
    raise StartFailed(exc) from exc


def run_server(config: ServerConfig, stop_requested: threading.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or until start-up fails: :class:`StartFailed`), on uvloop where
    installed. ``stop_requested``: set by a signal caught before the loop installed its handlers."""
    main = _serve_until_signal(config, stop_requested)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
