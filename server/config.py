"""Server configuration: one pydantic model, loaded from flags or a TOML file.

Each request class owns the settings of its models (:class:`~chunkline.server.robot.config.PolicyConfig`,
:class:`~chunkline.server.text.config.TextModelConfig`); this module adds the process-wide ones
(listeners, limits, tenants, ledger) and is read by the entrypoints only."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from pydantic import BaseModel, ConfigDict, Field, model_validator

from chunkline.client.wire.codec import CodecLimits
from chunkline.server.planner.config import PlannerConfig
from chunkline.server.robot.config import PolicyConfig
from chunkline.server.text.config import TextModelConfig

__all__ = ["PolicyConfig", "ServerConfig", "load_config"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    """Everything ``chunkline serve`` can be told.

    One field per key of the settings file.

    Args:
        host, port: where to listen (port 0 picks a free one; the bound port is logged and
            written to ``port_file`` if set).
        policies: the policies to serve; the first is the default model.
        max_message_bytes: largest WebSocket message accepted; larger ones close the
            session with 1009 before they are buffered. 16 MiB: an ALOHA observation (four
            224x224 cameras) is 441 KiB, three raw 480x640 RGB cameras 2.7 MiB.
        max_receive_buffer_bytes, tenant_receive_buffer_share: most bytes all sessions (and one
            tenant's, as a fraction) may hold in messages still being received; beyond, the
            session holding the most is closed with 1013.
        max_queued_messages: complete messages one connection may queue for its session; at this
            many (or at ``max_message_bytes`` of them) the server stops reading it (TCP flow control)
            until the session takes one.
        max_arrays, max_dims, max_elements: codec caps on each message.
        max_decoded_bytes_per_request, max_decoded_bytes_per_tenant: what a request's compressed
            fields may declare they decode into (refused before decoding), and what one tenant's
            decoded arrays may hold at once (beyond: ``overloaded`` with a retry time).
        cpu_threads, max_cpu_jobs_per_tenant: the pool that decodes and encodes images (default:
            the cores but one, two to four; a tenant running a job never takes the last free
            one) and the jobs one tenant may have queued on it.
        max_in_flight_per_session: native-mode requests one session may have pending.
        shutdown_grace_s: how long SIGTERM waits for in-flight requests before closing.
        open_timeout_s: handshake timeout (cuts slow-loris handshakes).
        ping_interval_s: keepalive ping period (``None`` disables).
        tenants: the tenants file (keys, grants, limits); required unless ``no_auth``.
        no_auth: serve everyone as one anonymous, unlimited tenant (local use only).
        ledger: the usage ledger (SQLite); ``None`` disables it (not recommended).
        ledger_fail_closed: refuse new work while the ledger cannot be written.
        metrics_port: also serve ``/metrics`` on this port (``0``: a free one) of ``metrics_host``;
            ``/metrics`` on the request port is served only without authentication, so tenants
            never see each other's usage.
        max_connections, max_connections_per_address: further handshakes get HTTP 503.
        fd_headroom: open files the HTTP port leaves to the rest of the process (the robot port
            above all): it holds at most the open-files limit (raised to the hard limit at
            start) minus this many connections; more are closed as soon as accepted.
        send_timeout_s: a reply that cannot be written within this (a client that does not read)
            closes the session; the buffer it may hold is ``write_limit_bytes``.
        tls_cert, tls_key: PEM files; with both set the server speaks ``wss://`` and ``https://``.
        text: text-LLM models (OpenAI-compatible HTTP API and native ``generate``), sharing
            the robot path's auth, admission, quotas, metrics and ledger.
        planners: planners served to native ``plan`` messages (the first is the default), on the
            same auth, admission, quotas, metrics and ledger (class ``plan``).
        http_port: the OpenAI-compatible HTTP API's port on ``host`` (``0``: a free one); without
            it text is served on the WebSocket (native ``generate``) only.
    """

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    port_file: Path | None = None
    policies: list[PolicyConfig] = Field(default_factory=lambda: [PolicyConfig(ref="loadtest")], min_length=1)
    max_message_bytes: Annotated[int, Field(ge=1024)] = 16 * 1024 * 1024
    max_receive_buffer_bytes: Annotated[int, Field(ge=1024)] = 256 * 1024 * 1024
    tenant_receive_buffer_share: Annotated[float, Field(gt=0, le=1)] = 0.5
    max_queued_messages: Annotated[int, Field(ge=1)] = 16
    max_arrays: Annotated[int, Field(ge=1)] = 64
    max_dims: Annotated[int, Field(ge=1)] = 8
    max_elements: Annotated[int, Field(ge=1)] = 1 << 26
    max_in_flight_per_session: Annotated[int, Field(ge=1)] = 32
    max_decoded_bytes_per_request: Annotated[int, Field(ge=1024)] = 32 * 1024 * 1024
    max_decoded_bytes_per_tenant: Annotated[int, Field(ge=1024)] = 128 * 1024 * 1024
    cpu_threads: Annotated[int, Field(ge=1, le=256)] | None = None
    max_cpu_jobs_per_tenant: Annotated[int, Field(ge=1)] = 32
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 10.0
    open_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    ping_interval_s: Annotated[float, Field(gt=0)] | None = 20.0
    tenants: Path | None = None
    no_auth: bool = False
    ledger: Path | None = Path("chunkline-ledger.db")
    ledger_fail_closed: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    max_connections: Annotated[int, Field(ge=1)] = 1024
    max_connections_per_address: Annotated[int, Field(ge=1)] = 64
    fd_headroom: Annotated[int, Field(ge=0)] = 512
    send_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    write_limit_bytes: Annotated[int, Field(ge=1024)] = 4 * 1024 * 1024
    tls_cert: Path | None = None
    tls_key: Path | None = None
    text: list[TextModelConfig] = Field(default_factory=list)
    http_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    planners: list[PlannerConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _auth_is_explicit(self) -> ServerConfig:
        if self.tenants is None and not self.no_auth:
            raise ValueError("give a tenants file (--tenants) or, for local use only, --no-auth")
        if self.tenants is not None and self.no_auth:
            raise ValueError("--tenants and --no-auth exclude each other")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both --tls-cert and --tls-key")
        names = [p.model_name for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError(f"two policies share a model name: {names}")
        return self

    def codec_limits(self) -> CodecLimits:
        return CodecLimits(
            max_message_bytes=self.max_message_bytes,
            max_arrays=self.max_arrays,
            max_dims=self.max_dims,
            max_elements=self.max_elements,
        )


def load_config(path: Path) -> ServerConfig:
    """Read a TOML server config file (the same fields as :class:`ServerConfig`)."""
    with open(path, "rb") as f:
        return ServerConfig.model_validate(tomllib.load(f))
