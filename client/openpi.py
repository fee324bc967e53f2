"""A drop-in for openpi-client's ``WebsocketClientPolicy``.

Change ``from openpi_client.websocket_client_policy import WebsocketClientPolicy`` to
``from chunkline.client.openpi import WebsocketClientPolicy``: same constructor, same
``infer(obs) -> dict`` and ``get_server_metadata()``, but over the native protocol, so the
robot also gets structured errors, deadlines, timestamps (``t0``, ``expires``) and reconnection.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .environment import URI_ENV
from .sync_client import Client

__all__ = ["WebsocketClientPolicy"]


class WebsocketClientPolicy:
    """openpi's client interface over chunkline's native protocol.

    Args:
        host: host name, or a full ``ws://`` / ``wss://`` URI (as openpi accepts); ``None``:
            ``$CHUNKLINE_URI``, else ``0.0.0.0`` (openpi's default).
        port: port, appended to the URI when given.
        api_key: sent as ``Authorization: Api-Key <key>``; ``None``: ``$CHUNKLINE_API_KEY``, if set.
        deadline_ms: deadline sent with every request (``None``: the server's default).
        timeout: seconds to wait for each reply.

    A refusal or failure the server reports raises :class:`~chunkline.client.ServerError`, a
    ``RuntimeError`` as openpi-client's own errors are, so openpi code catching that still works.
    """

    def __init__(
        self,
        host: str | None = None,
        port: int | None = None,
        api_key: str | None = None,
        *,
        deadline_ms: float | None = None,
        timeout: float | None = None,
    ) -> None:
        if host is None:
            host = os.environ.get(URI_ENV) or "0.0.0.0"
        uri = host if host.startswith("ws") else f"ws://{host}"
        if port is not None:
            uri += f":{port}"
        self._deadline_ms = deadline_ms
        self._client = Client.connect(uri, api_key=api_key, request_timeout=timeout)

    def get_server_metadata(self) -> dict[str, Any]:
        hello = self._client.hello
        assert hello is not None
        return dict(hello.models[hello.default_model])

    def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        """Send ``obs`` (taken now, on this machine's monotonic clock) and return openpi's result map."""
        reply = self._client.infer(obs, obs_time=time.monotonic(), deadline_ms=self._deadline_ms)
        return reply.as_openpi()

    def reset(self) -> None:
        """openpi's policies may keep episode state; the remote server keeps none per client."""

    def close(self) -> None:
        self._client.close()
