"""What the asyncio and the sync client share: headers, handshake refusals, message building."""

from __future__ import annotations

from typing import Any

import numpy as np
import websockets

from .exceptions import ServerError

__all__ = ["auth_headers", "handshake_refusal", "infer_message", "ms"]

#: handshake refusals that retrying cannot fix, as the error codes the server would send
_REFUSALS = {401: "unauthenticated", 403: "forbidden", 429: "quota_exceeded"}


def auth_headers(api_key: str | None) -> dict[str, str] | None:
    """The ``Authorization`` header chunkline (and openpi-client) sends."""
    return {"Authorization": f"Api-Key {api_key}"} if api_key else None


def handshake_refusal(exc: websockets.InvalidStatus) -> ServerError | None:
    """The :class:`ServerError` for a handshake the server refused for good (401, 403, 429), else ``None``."""
    status = exc.response.status_code
    if status not in _REFUSALS:
        return None
    body = bytes(exc.response.body or b"").decode(errors="replace").strip()[:200]
    retry = exc.response.headers.get("Retry-After")
    return ServerError(_REFUSALS[status], f"handshake refused: HTTP {status}: {body}",
                       float(retry) * 1000.0 if retry and retry.isdigit() else None)


def infer_message(request_id: int, obs: dict[str, Any], obs_time: float | None, deadline_ms: float | None,
                  model: str | None, prefix: np.ndarray | None) -> dict[str, Any]:
    """The wire form of an ``infer`` (optional fields only when set)."""
    msg: dict[str, Any] = {"type": "infer", "id": request_id, "obs": obs, "obs_time": obs_time}
    if deadline_ms is not None:
        msg["deadline_ms"] = float(deadline_ms)
    if model is not None:
        msg["model"] = model
    if prefix is not None:
        msg["prefix"] = prefix
    return msg


def ms(seconds: float) -> float:
    """Seconds as milliseconds, rounded for the wire and for reports."""
    return round(seconds * 1000.0, 4)
