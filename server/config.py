"""Server configuration: one pydantic model, loaded from flags or a TOML file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from chunkline.client.codec import CodecLimits

__all__ = ["PolicyConfig", "ServerConfig", "load_config"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyConfig(_Strict):
    """One served policy.

    Args:
        ref: what to load: an embedded name, an ``.npz`` path or ``module:factory``.
        name: the model name clients ask for (defaults to ``ref``).
        device: ``cpu``, ``cuda``, ``cuda:1``, ...
        backend: ``torch``, ``jax`` or ``numpy`` for embedded policies; ``None`` picks one.
        default_deadline_ms: deadline for requests that carry none; ``None`` uses the policy's own.
        max_queue: most requests waiting for this policy; more are refused with ``overloaded``.
    """

    ref: str
    name: str | None = None
    device: str = "cpu"
    backend: str | None = None
    default_deadline_ms: Annotated[float, Field(gt=0)] | None = None
    max_queue: Annotated[int, Field(ge=1)] = 256

    @property
    def model_name(self) -> str:
        return self.name or self.ref


class ServerConfig(_Strict):
    """Everything ``chunkline serve`` can be told.

    Args:
        host, port: where to listen (port 0 picks a free one; the bound port is logged and
            written to ``port_file`` if set).
        policies: the policies to serve; the first is the default model.
        max_message_bytes: largest WebSocket message accepted; larger ones close the
            session with 1009 before they are buffered.
        max_arrays, max_dims, max_elements: codec caps on each message.
        max_in_flight_per_session: native-mode requests one session may have pending.
        shutdown_grace_s: how long SIGTERM waits for in-flight requests before closing.
        open_timeout_s: handshake timeout (cuts slow-loris handshakes).
        ping_interval_s: keepalive ping period (``None`` disables).
    """

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    port_file: Path | None = None
    policies: list[PolicyConfig] = Field(default_factory=lambda: [PolicyConfig(ref="loadtest")], min_length=1)
    max_message_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    max_arrays: Annotated[int, Field(ge=1)] = 64
    max_dims: Annotated[int, Field(ge=1)] = 8
    max_elements: Annotated[int, Field(ge=1)] = 1 << 26
    max_in_flight_per_session: Annotated[int, Field(ge=1)] = 32
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 10.0
    open_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    ping_interval_s: Annotated[float, Field(gt=0)] | None = 20.0

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
