"""Asyncio client for the native ``chunkline.v1`` protocol.

Several requests may be in flight on one connection; a reader task matches replies to
requests by id. Every wait has a timeout. A lost connection fails the requests in flight
with :class:`ConnectionLost` (they are never silently re-sent: the robot decides), and the
next call reconnects with capped exponential backoff and jitter.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection, connect

from ._shared import auth_headers, handshake_refusal, infer_message, ms
from .backoff import Backoff
from .codec import DEFAULT_LIMITS, CodecLimits, Encoder, decode
from .exceptions import ChunklineError, CodecError, ConnectionLost, ProtocolError, RequestTimeout, ServerError
from .protocol import SUBPROTOCOL, Chunk, Error, Hello, parse_server_message
from .replies import ChunkReply

__all__ = ["AsyncClient", "auth_headers"]

log = logging.getLogger("chunkline.client")


class AsyncClient:
    """Native-protocol client.

    Args:
        uri: ``ws://host:port`` or ``wss://host:port``.
        api_key: sent as ``Authorization: Api-Key <key>``.
        open_timeout: seconds for one connection attempt (TCP + TLS + handshake).
        connect_timeout: seconds to keep retrying before a call gives up with :class:`ConnectionLost`.
        request_timeout: default seconds to wait for a reply (``None``: the deadline plus a
            margin when a deadline is given, else 30 s).
        backoff: reconnection delays (a default :class:`Backoff` if omitted).
        limits: caps on replies (the client distrusts the network too).
        ssl: an ``ssl.SSLContext`` for ``wss://`` with a private CA.
    """

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
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int | str, tuple[asyncio.Future[Chunk], dict[str, float]]] = {}
        self._connect_lock = asyncio.Lock()
        self._closed = False
        self.hello: Hello | None = None

    # ------------------------------------------------------------------ connection

    @classmethod
    async def connect(cls, uri: str, **kwargs: Any) -> AsyncClient:
        """Create a client and connect it (retrying within ``connect_timeout``)."""
        client = cls(uri, **kwargs)
        await client.ensure_connected()
        return client

    @property
    def connected(self) -> bool:
        return self._ws is not None and self._reader is not None and not self._reader.done()

    async def ensure_connected(self, timeout: float | None = None) -> None:
        """Connect if needed, retrying with backoff until ``timeout`` (default ``connect_timeout``).

        Raises:
            ConnectionLost: no connection could be made in time.
            ServerError: the server refused the handshake (e.g. HTTP 401: ``unauthenticated``).
        """
        if self._closed:
            raise ConnectionLost("client is closed")
        if self.connected:
            return
        async with self._connect_lock:
            if self.connected:
                return
            give_up = time.monotonic() + (self._connect_timeout if timeout is None else timeout)
            last: BaseException | None = None
            while True:
                try:
                    await self._open()
                    self._backoff.reset()
                    return
                except ServerError:
                    raise
                except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake, ProtocolError, CodecError,
                    websockets.ConnectionClosed) as exc:
                    last = exc
                delay = self._backoff.next_delay()
                if time.monotonic() + delay > give_up:
                    raise ConnectionLost(f"could not connect to {self.uri}: {last!r}") from last
                await asyncio.sleep(delay)

    async def _open(self) -> None:
        try:
            ws = await connect(
                self.uri,
                subprotocols=[SUBPROTOCOL],  # type: ignore[list-item]
                additional_headers=auth_headers(self._api_key),
                open_timeout=self._open_timeout,
                max_size=self._limits.max_message_bytes,
                compression=None,
                ssl=self._ssl,
            )
        except websockets.InvalidStatus as exc:
            refusal = handshake_refusal(exc)
            if refusal is not None:
                raise refusal from None
            raise
        try:
            first = await asyncio.wait_for(ws.recv(), self._open_timeout)
            hello = parse_server_message(decode(first, self._limits))  # type: ignore[arg-type]
            if not isinstance(hello, Hello):
                raise ProtocolError("the server did not start with hello")
        except BaseException:
            await ws.close()
            raise
        self._ws, self.hello = ws, hello
        self._reader = asyncio.get_running_loop().create_task(self._read(ws), name="chunkline-reader")

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for message in ws:
                received = time.monotonic()
                try:
                    msg = parse_server_message(decode(message, self._limits))  # type: ignore[arg-type]
                except (CodecError, ProtocolError) as exc:
                    log.warning("dropping an invalid message from the server: %s", exc)
                    continue
                if isinstance(msg, Hello):
                    continue
                entry = self._pending.get(msg.id) if msg.id is not None else None
                if entry is None:
                    if isinstance(msg, Error) and msg.id is None:
                        log.warning("server error on the session: %s %s", msg.code, msg.message)
                    continue  # a reply to a request we gave up on
                future, timing = entry
                timing["received_at"] = received
                timing["decode_ms"] = ms(time.monotonic() - received)
                if future.done():
                    continue
                if isinstance(msg, Chunk):
                    future.set_result(msg)
                else:
                    future.set_exception(ServerError(msg.code, msg.message, msg.retry_after_ms, msg.id))
        except websockets.ConnectionClosed:
            pass
        finally:
            if self._ws is ws:
                self._ws = None
            closed = ws.close_code, ws.close_reason
            for future, _ in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionLost(f"connection closed ({closed[0]} {closed[1]})"))

    async def close(self) -> None:
        """Close the connection; requests in flight fail with :class:`ConnectionLost`."""
        self._closed = True
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def __aenter__(self) -> AsyncClient:
        await self.ensure_connected()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ requests

    async def infer(
        self,
        obs: dict[str, Any],
        *,
        obs_time: float | None = None,
        deadline_ms: float | None = None,
        model: str | None = None,
        prefix: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> ChunkReply:
        """Ask for an action chunk.

        Args:
            obs: field name to array (or string).
            obs_time: robot-clock (``time.monotonic()``) time the observation was taken.
            deadline_ms: how long the robot can wait; the server refuses what it cannot meet.
            model: which served policy (default: the server's).
            prefix: actions to be executed while this request is in flight.
            timeout: seconds to wait for the reply (see ``request_timeout``).

        Raises:
            ServerError: the server answered with an error code.
            RequestTimeout: no reply in time (a ``cancel`` is sent).
            ConnectionLost: the connection dropped before the reply.
        """
        if timeout is None:
            timeout = self._request_timeout
        if timeout is None:
            timeout = 30.0 if deadline_ms is None else deadline_ms / 1000.0 + 1.0
        start = time.monotonic()
        await self.ensure_connected(timeout)
        ws = self._ws
        if ws is None:
            raise ConnectionLost("connection dropped while connecting")
        request_id = next(self._ids)
        msg = infer_message(request_id, obs, obs_time, deadline_ms, model, prefix)
        t_enc = time.monotonic()
        data = self._encoder.encode(msg)
        timing = {"encode_ms": ms(time.monotonic() - t_enc)}
        future: asyncio.Future[Chunk] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, timing)
        try:
            t_send = time.monotonic()
            try:
                await ws.send(data)
            except websockets.ConnectionClosed as exc:
                raise ConnectionLost(f"connection closed while sending ({exc})") from None
            timing["send_ms"] = ms(time.monotonic() - t_send)
            remaining = max(0.0, timeout - (time.monotonic() - start))
            try:
                chunk = await asyncio.wait_for(asyncio.shield(future), remaining)
            except asyncio.TimeoutError:
                await self._cancel_remote(ws, request_id)
                raise RequestTimeout(f"no reply to request {request_id} within {timeout:.3f} s") from None
            except asyncio.CancelledError:
                await self._cancel_remote(ws, request_id)
                raise
        finally:
            self._pending.pop(request_id, None)
            # A reply that lands after we gave up is dropped, never left unretrieved.
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()
        if chunk.actions.ndim != 2:
            raise ProtocolError(f"chunk actions must be 2-D, got shape {chunk.actions.shape}")
        received = timing.pop("received_at")
        timing["round_trip_ms"] = ms(received - t_send)
        return ChunkReply.from_chunk(chunk, timing, received)

    async def _cancel_remote(self, ws: ClientConnection, request_id: int) -> None:
        try:
            await asyncio.wait_for(ws.send(self._encoder.encode({"type": "cancel", "id": request_id})), 1.0)
        except (websockets.ConnectionClosed, asyncio.TimeoutError, ChunklineError):
            pass
