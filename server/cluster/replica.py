"""One fleet replica: a full chunkline server (its own port, batcher and lanes) inside a Ray actor.

:class:`ReplicaHost` is plain Python (no Ray import) so that it can be driven directly in tests;
the fleet wraps it with ``ray.remote`` and places it with Ray resources. The server runs on its
own event loop thread (uvloop where installed), exactly as ``chunkline serve`` runs it: robots
talk to it over a direct WebSocket, never through Ray. The actor's methods, called by the fleet
manager, reach into that loop with ``run_coroutine_threadsafe``; they are the replica's control
plane (state reports, quota leases, drain), far from the robot path.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from chunkline.server.cluster.tokens import PlacementSigner
from chunkline.server.config import ServerConfig
from chunkline.server.core.ledger import LedgerError, LedgerRow, RowSink
from chunkline.server.core.loopthread import LoopThread
from chunkline.server.core.tenants import TenantLimits

__all__ = ["ReplicaHost", "RemoteLedgerSink", "advertised_host"]

log = logging.getLogger("chunkline.cluster.replica")


def advertised_host(bind_host: str) -> str:
    """The address robots should dial: the bind address, or this node's address for a wildcard."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray: the host's own name resolution
        return socket.gethostbyname(socket.gethostname())


class RemoteLedgerSink:
    """A :class:`~chunkline.server.core.ledger.RowSink` that sends batches to the fleet's one ledger.

    Args:
        write: sends ``(source, offset, rows)`` and blocks until the fleet ledger committed them
            (raises on failure or timeout); the fleet's ledger skips rows it already holds, so a
            retried batch is written exactly once.
        source: this replica incarnation's name in the fleet ledger.
    """

    def __init__(self, write: Callable[[str, int, list[LedgerRow]], Any], source: str) -> None:
        self._write = write
        self.source = source

    def write(self, rows: Iterable[LedgerRow], offset: int | None = None) -> int:
        batch = list(rows)
        try:
            self._write(self.source, int(offset or 0), batch)
        except Exception as exc:  # unreachable manager, timeout, refused write: all fail the batch
            raise LedgerError(f"fleet ledger: {type(exc).__name__}: {exc}") from None
        return len(batch)

    def close(self) -> None:
        """Nothing to close: the fleet ledger belongs to the manager."""


class ReplicaHost:
    """Runs one :class:`~chunkline.server.entrypoints.app.ChunklineServer` on a background event loop.

    Args:
        name: the replica's name in the fleet.
        version: the label of the configuration it runs (rolling updates compare versions).
        config: the server configuration (``ServerConfig`` fields); its port is ignored (a free
            one is picked) and its ledger is the fleet's (``ledger_write``).
        tenants_text: the fleet's tenants file (TOML), written to a private temporary file so
            that a replica on another host uses the same tenants and keys.
        secret: the fleet's placement-token key (tokens from the directory authenticate robots).
        ledger_write: see :class:`RemoteLedgerSink`; ``None`` when the fleet keeps no ledger.
    """

    def __init__(self, name: str, version: str, config: dict[str, Any], tenants_text: str | None, secret: bytes,
                 ledger_write: Callable[[str, int, list[LedgerRow]], Any] | None = None) -> None:
        self.name = name
        self.version = version
        self.incarnation = f"{name}/{uuid.uuid4().hex[:12]}"
        self._tmp = tempfile.TemporaryDirectory(prefix="chunkline-replica-")
        fields = dict(config)
        fields["port"] = 0
        fields["port_file"] = None
        if tenants_text is not None:
            path = Path(self._tmp.name) / "tenants.toml"
            path.write_text(tenants_text)
            path.chmod(0o600)
            fields["tenants"] = str(path)
            fields["no_auth"] = False
        fields["ledger"] = None  # the fleet keeps one ledger (ledger_write), never one per replica
        self.config = ServerConfig.model_validate(fields)
        self._signer = PlacementSigner(secret)
        self._ledger_write = ledger_write
        self._loop: LoopThread | None = None
        self._server: Any = None
        self._placed: list[str] = []
        self._stopped = False
        self.uri: str | None = None

    # ------------------------------------------------------------------ life cycle

    def _verify(self, token: str) -> str:
        claims = self._signer.verify(token, self.name, time.time())
        self._placed.append(claims.session)  # reported once, so the fleet quota stops counting it pending
        return claims.tenant

    def start(self, timeout_s: float = 600.0) -> dict[str, str]:
        """Start the server, load and warm its policies; return once it is ready for sessions.

        Returns:
            ``{"name", "uri", "version", "incarnation"}``.
        """
        from chunkline.server.entrypoints.app import ChunklineServer

        self._loop = LoopThread(f"chunkline-{self.name}")
        sink: Callable[[], RowSink] | None = None
        if self._ledger_write is not None:
            write = self._ledger_write
            sink = lambda: RemoteLedgerSink(write, self.incarnation)  # noqa: E731 - a factory
        self._server = ChunklineServer(self.config, placement=self._verify, ledger_sink=sink)
        self._call(self._server.start(), timeout_s)
        scheme = "wss" if self.config.tls_cert is not None else "ws"
        self.uri = f"{scheme}://{advertised_host(self.config.host)}:{self._server.port}"
        log.info("replica %s (%s) ready at %s", self.name, self.version, self.uri)
        return {"name": self.name, "uri": self.uri, "version": self.version, "incarnation": self.incarnation}

    def _call(self, coro: Any, timeout_s: float) -> Any:
        assert self._loop is not None
        return self._loop.run(coro, timeout_s)

    async def _stats(self) -> dict[str, Any]:
        placed, self._placed = self._placed, []
        return {**self._server.stats(), "placed_sessions": placed}

    def state(self) -> dict[str, Any]:
        """What the fleet manager needs: sessions per tenant, outcomes, recent queue waits,
        service curves, readiness (see :meth:`ChunklineServer.stats`)."""
        stats = self._call(self._stats(), 5.0)
        return {"name": self.name, "uri": self.uri, "version": self.version, "incarnation": self.incarnation,
                "at": time.time(), **stats}

    async def _set_leases(self, leases: dict[str, TenantLimits]) -> None:
        self._server.core.quotas.set_overrides(leases, time.monotonic())

    def set_leases(self, leases: dict[str, TenantLimits]) -> None:
        """This replica's share of each tenant's fleet-wide limits (replaces the previous ones)."""
        self._call(self._set_leases(dict(leases)), 5.0)

    def drain(self, grace_s: float | None = None) -> None:
        """Take no new sessions, finish in-flight work (at most the grace period), then close
        every session with 1001 so that robots re-ask the directory and land elsewhere."""
        if self._server is None:
            return
        if grace_s is not None:
            self._server.config = self._server.config.model_copy(update={"shutdown_grace_s": grace_s})
        self._call(self._server.shutdown(), (grace_s or self._server.config.shutdown_grace_s) + 60.0)

    def stop(self) -> None:
        """Drain with no grace and stop the loop thread (once; later calls do nothing)."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            self.drain(0.0)
        if self._loop is not None:
            self._loop.close()
        self._tmp.cleanup()

    def ping(self) -> str:
        """Liveness of the actor itself (the manager's health check)."""
        return self.name
