"""Synchronous client for the native protocol, for robot code that is not asyncio.

One request at a time per client (a lock serialises callers); replies to requests that timed
out earlier are recognised by id and discarded. Reconnects lazily with backoff, like
:class:`~chunkline.client.asyncio_client.AsyncClient`.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import numpy as np
import websockets
from websockets.sync.client import ClientConnection, connect

from ._shared import auth_headers, handshake_refusal, infer_message, ms
from .backoff import Backoff
from .codec import DEFAULT_LIMITS, CodecLimits, Encoder, decode
from .exceptions import CodecError, ConnectionLost, ProtocolError, RequestTimeout, ServerError
from .protocol import SUBPROTOCOL, Chunk, Error, Hello, parse_server_message
from .replies import ChunkReply

__all__ = ["Client"]


class Client:
    """Blocking native-protocol client. Arguments as for :class:`AsyncClient`."""

    def __init__(
        self,
        uri: str,
        *,
        api_key: str | None = None,
        open_timeout: float = 10.0,
        connect_timeout: float = 30.0,
        request_timeout: float | None = None,
        backoff: Backoff | None = None,
        limits: CodecLimits = DEFAULT_LIMITS,
        ssl: Any = None,
    ) -> None:
        self.uri = uri
        self._api_key = api_key
        self._open_timeout = open_timeout
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._backoff = backoff or Backoff()
        self._limits = limits
        self._ssl = ssl
        self._encoder = Encoder()
        self._ids = itertools.count(1)
        self._ws: ClientConnection | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.hello: Hello | None = None

    @classmethod
    def connect(cls, uri: str, **kwargs: Any) -> Client:
        """Create a client and connect it (retrying within ``connect_timeout``)."""
        client = cls(uri, **kwargs)
        with client._lock:
            client._ensure_connected(client._connect_timeout)
        return client

    def _ensure_connected(self, timeout: float) -> ClientConnection:
        if self._closed:
            raise ConnectionLost("client is closed")
        if self._ws is not None:
            return self._ws
        give_up = time.monotonic() + timeout
        last: BaseException | None = None
        while True:
            try:
                self._ws = self._open()
                self._backoff.reset()
                return self._ws
            except ServerError:
                raise
            except (OSError, TimeoutError, websockets.InvalidHandshake, ProtocolError, CodecError,
                    websockets.ConnectionClosed) as exc:
                last = exc
            delay = self._backoff.next_delay()
            if time.monotonic() + delay > give_up:
                raise ConnectionLost(f"could not connect to {self.uri}: {last!r}") from last
            time.sleep(delay)

    def _open(self) -> ClientConnection:
        try:
            # connect(...).__enter__() opens the connection on every websockets version
            # (a bare connect() is deprecated from 17.1 on).
            ws = connect(
                self.uri,
                subprotocols=[SUBPROTOCOL],  # type: ignore[list-item]
                additional_headers=auth_headers(self._api_key),
                open_timeout=self._open_timeout,
                max_size=self._limits.max_message_bytes,
                compression=None,
                ssl=self._ssl,
            ).__enter__()
        except websockets.InvalidStatus as exc:
            refusal = handshake_refusal(exc)
            if refusal is not None:
                raise refusal from None
            raise
        try:
            hello = parse_server_message(decode(ws.recv(timeout=self._open_timeout), self._limits))  # type: ignore[arg-type]
            if not isinstance(hello, Hello):
                raise ProtocolError("the server did not start with hello")
        except BaseException:
            ws.close()
            raise
        self.hello = hello
        return ws

    def close(self) -> None:
        self._closed = True
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def infer(
        self,
        obs: dict[str, Any],
        *,
        obs_time: float | None = None,
        deadline_ms: float | None = None,
        model: str | None = None,
        prefix: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> ChunkReply:
        """Ask for an action chunk; see :meth:`AsyncClient.infer`."""
        if timeout is None:
            timeout = self._request_timeout
        if timeout is None:
            timeout = 30.0 if deadline_ms is None else deadline_ms / 1000.0 + 1.0
        with self._lock:
            start = time.monotonic()
            ws = self._ensure_connected(timeout)
            request_id = next(self._ids)
            msg = infer_message(request_id, obs, obs_time, deadline_ms, model, prefix)
            t_enc = time.monotonic()
            data = self._encoder.encode(msg)
            timing = {"encode_ms": ms(time.monotonic() - t_enc)}
            t_send = time.monotonic()
            try:
                ws.send(data)
                timing["send_ms"] = ms(time.monotonic() - t_send)
                while True:
                    remaining = timeout - (time.monotonic() - start)
                    if remaining <= 0:
                        self._send_cancel(ws, request_id)
                        raise RequestTimeout(f"no reply to request {request_id} within {timeout:.3f} s")
                    try:
                        raw = ws.recv(timeout=remaining)
                    except TimeoutError:
                        continue
                    received = time.monotonic()
                    try:
                        reply = parse_server_message(decode(raw, self._limits))  # type: ignore[arg-type]
                    except (CodecError, ProtocolError):
                        continue
                    if isinstance(reply, Hello) or reply.id != request_id:
                        continue  # a late reply to a request this client already gave up on
                    timing["decode_ms"] = ms(time.monotonic() - received)
                    if isinstance(reply, Error):
                        raise ServerError(reply.code, reply.message, reply.retry_after_ms, reply.id)
                    assert isinstance(reply, Chunk)
                    if reply.actions.ndim != 2:
                        raise ProtocolError(f"chunk actions must be 2-D, got shape {reply.actions.shape}")
                    timing["round_trip_ms"] = ms(received - t_send)
                    return ChunkReply.from_chunk(reply, timing, received)
            except websockets.ConnectionClosed as exc:
                self._ws = None
                raise ConnectionLost(f"connection closed ({exc})") from None

    def _send_cancel(self, ws: ClientConnection, request_id: int) -> None:
        try:
            ws.send(self._encoder.encode({"type": "cancel", "id": request_id}))
        except websockets.ConnectionClosed:
            self._ws = None
