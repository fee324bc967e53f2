"""The server: loads policies, listens, routes HTTP probes and WebSocket sessions, shuts down gracefully."""

from __future__ import annotations

import asyncio
import collections
import http
import logging
import signal
import time
from typing import Any

import websockets
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from chunkline.client.protocol import SUBPROTOCOL
from chunkline.policies.registry import load_policy

from .config import ServerConfig
from .runner import ModelRunner
from .sessions import CompatSession, NativeSession

__all__ = ["ChunklineServer", "run_server", "VERSION"]

VERSION = "0.1.0"
log = logging.getLogger("chunkline.server")


def _plain(status: http.HTTPStatus, text: str, extra: dict[str, str] | None = None) -> Response:
    body = (text + "\n").encode()
    headers = Headers([("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
    for k, v in (extra or {}).items():
        headers[k] = v
    return Response(status.value, status.phrase, headers, body)


class ChunklineServer:
    """A running chunkline server.

    Args:
        config: the validated configuration.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.codec_limits = config.codec_limits()
        self.version_string = f"chunkline/{VERSION} websockets/{websockets.__version__}"
        self.runners: dict[str, ModelRunner] = {}
        self.ready = False
        self.draining = False
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.sessions: set[ServerConnection] = set()
        self._server: Server | None = None
        self._stopped = asyncio.Event()

    # ------------------------------------------------------------------ helpers used by sessions

    @property
    def default_runner(self) -> ModelRunner:
        return self.runners[self.config.policies[0].model_name]

    def default_deadline_ms(self, runner: ModelRunner) -> float:
        for pc in self.config.policies:
            if pc.model_name == runner.name and pc.default_deadline_ms is not None:
                return pc.default_deadline_ms
        return runner.policy.spec.default_deadline_ms

    def count_outcome(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    @property
    def in_flight(self) -> int:
        return sum(r.queued + r.running for r in self.runners.values())

    # ------------------------------------------------------------------ HTTP and handshake

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            return _plain(http.HTTPStatus.OK, "ok")
        if path == "/readyz":
            if self.ready and not self.draining:
                return _plain(http.HTTPStatus.OK, "ready")
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "draining" if self.draining else "loading")
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return _plain(http.HTTPStatus.NOT_FOUND, "not found")
        if self.draining:
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "shutting down", {"Retry-After": "1"})
        if not self.ready:
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "policy loading", {"Retry-After": "1"})
        return None

    @staticmethod
    def _select_subprotocol(connection: ServerConnection, subprotocols: Any) -> Any:
        # No subprotocol offered: openpi-compatible mode. chunkline.v1 offered: native mode.
        return SUBPROTOCOL if SUBPROTOCOL in subprotocols else None

    async def _handle(self, ws: ServerConnection) -> None:
        self.sessions.add(ws)
        try:
            session = NativeSession(self, ws) if ws.subprotocol == SUBPROTOCOL else CompatSession(self, ws)
            await session.run()
        except websockets.ConnectionClosed:
            pass
        finally:
            self.sessions.discard(ws)

    # ------------------------------------------------------------------ life cycle

    def _load(self) -> dict[str, Any]:
        """Worker thread: load and warm every policy (nothing here may touch the loop)."""
        loaded = {}
        for pc in self.config.policies:
            t = time.perf_counter()
            policy = load_policy(pc.ref, device=pc.device, backend=pc.backend)
            policy.warmup()
            log.info("loaded %s (%s) in %.2f s, fingerprint %s", pc.model_name, pc.ref, time.perf_counter() - t, policy.fingerprint)
            loaded[pc.model_name] = (pc, policy)
        return loaded

    async def start(self) -> None:
        """Listen at once (``/healthz`` answers while loading), then load and warm the policies."""
        self._server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=self._process_request,
            select_subprotocol=self._select_subprotocol,
            subprotocols=[SUBPROTOCOL],
            max_size=self.config.max_message_bytes,
            open_timeout=self.config.open_timeout_s,
            ping_interval=self.config.ping_interval_s,
            compression=None,  # camera frames barely compress; deflate would cost milliseconds
        )
        port = self.port
        log.info("listening on %s:%d", self.config.host, port)
        if self.config.port_file is not None:
            self.config.port_file.write_text(str(port))
        loaded = await asyncio.get_running_loop().run_in_executor(None, self._load)
        for name, (pc, policy) in loaded.items():
            self.runners[name] = ModelRunner(name, policy, max_queue=pc.max_queue)
        self.ready = True
        log.info("ready")

    @property
    def port(self) -> int:
        assert self._server is not None
        return next(iter(self._server.sockets)).getsockname()[1]

    async def shutdown(self) -> None:
        """Graceful stop: readiness off, no new sessions, in-flight work finished (bounded by the
        grace period), then every connection closed with 1001 so clients reconnect elsewhere."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: %d requests in flight", self.in_flight)
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._server is not None:
            self._server.close(close_connections=True)  # closes sessions with 1001 going away
            await self._server.wait_closed()
        for runner in self.runners.values():
            await runner.stop()
            runner.policy.close()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def _serve_until_signal(config: ServerConfig) -> None:
    server = ChunklineServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: loop.create_task(server.shutdown()))
    try:
        await server.start()
    except Exception as exc:  # a policy that cannot load or warm up is never served
        log.error("could not start: %s: %s", type(exc).__name__, exc)
        await server.shutdown()
        raise SystemExit(1) from exc
    await server.wait_stopped()
    log.info("stopped: %s", dict(server.outcomes))


def run_server(config: ServerConfig) -> None:
    """Run until SIGTERM/SIGINT, on uvloop where installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve_until_signal(config))
    else:
        uvloop.run(_serve_until_signal(config))
