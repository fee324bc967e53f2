"""Asyncio client for the native ``chunkline.v1`` protocol: a thin shell over :class:`ClientCore`.

Several requests may be in flight on one connection; a reader task hands every message to the
core, which says which request it answers. Every wait has a timeout. A lost connection fails the
requests in flight with :class:`ConnectionLost` (they are never silently re-sent: the robot
decides), and the next call reconnects with capped exponential backoff and jitter.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+; the annotations are never evaluated at run time
    from typing_extensions import Unpack

import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection, connect

from .compression import Compressed, UploadPlan
from .core import RETRYABLE, ClientOptions, Outgoing
from .exceptions import ConnectionLost
from .shell import ClientShell
from .wire.errors import ChunklineError
from .wire.protocol import Chunk, PlanReply, Urgency

__all__ = ["AsyncClient"]


class AsyncClient(ClientShell):
    """Native-protocol client.

    Args:
        uri: ``ws://host:port`` or ``wss://host:port``; ``None``: ``$CHUNKLINE_URI``, else ``ws://127.0.0.1:8000``.
        options: ``api_key`` (``None``: ``$CHUNKLINE_API_KEY``), ``open_timeout``, ``connect_timeout``, ``request_timeout``,
            ``backoff``, ``limits``, ``ssl``, ``compression``; see :class:`~chunkline.client.core.ClientCore`.
    """

    def __init__(self, uri: str | None = None, **options: Unpack[ClientOptions]) -> None:
        super().__init__(uri, **options)
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._futures: dict[int | str, asyncio.Future[Chunk | PlanReply]] = {}
        self._connect_lock = asyncio.Lock()

    # ------------------------------------------------------------------ connection

    @classmethod
    async def connect(cls, uri: str | None = None, **options: Unpack[ClientOptions]) -> AsyncClient:
        """Create a client and connect it (retrying within ``connect_timeout``)."""
        client = cls(uri, **options)
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
        self._core.check_open()
        if self.connected:
            return
        async with self._connect_lock:
            if self.connected:
                return
            give_up = self._core.connect_deadline(timeout)
            while True:
                try:
                    await self._open()
                    return
                except RETRYABLE as exc:
                    delay = self._core.retry_delay(give_up, exc)
                await asyncio.sleep(delay)

    async def _open(self) -> None:
        try:
            ws = await connect(self.uri, **self._core.connect_options())
        except websockets.InvalidStatus as exc:
            refusal = self._core.refusal(exc)
            if refusal is not None:
                raise refusal from None
            raise
        try:
            self._core.on_connected(await asyncio.wait_for(ws.recv(), self._core.open_timeout))
        except BaseException:
            await ws.close()
            raise
        self._ws = ws
        self._reader = asyncio.get_running_loop().create_task(self._read(ws), name="chunkline-reader")

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for message in ws:
                answer = self._core.receive(message)
                future = None if answer is None else self._futures.get(answer.request_id)
                if answer is None or future is None or future.done():
                    continue
                if answer.error is not None:
                    future.set_exception(answer.error)
                else:
                    future.set_result(answer.value())
        except websockets.ConnectionClosed:
            pass
        finally:
            if self._ws is ws:
                self._ws = None
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(self._core.connection_lost(f"{ws.close_code} {ws.close_reason}"))

    async def close(self) -> None:
        """Close the connection; requests in flight fail with :class:`ConnectionLost`."""
        self._core.close()
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._compressor is not None:
            self._compressor.close()

    async def _compress(self, obs: dict[str, Any], upload: UploadPlan | None) -> Compressed | None:
        """The planned fields compressed on the worker threads, in parallel, while the loop runs on."""
        if upload is None or self._compressor is None:
            return None
        started = time.perf_counter()
        futures = self._compressor.submit(obs, upload.fields)
        values = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures.values()))
        return self._compressor.assemble(obs, upload.fields, dict(zip(futures, values, strict=True)), started)

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
        prefix_delay: int | None = None,
        urgency: Urgency | None = None,
        replaces: int | str | None = None,
        request_id: int | None = None,
    ) -> Chunk:
        """Ask for an action chunk.

        Args:
            obs: field name to array (or string).
            obs_time: robot-clock (``time.monotonic()``) time the observation was taken.
            deadline_ms: how long the robot can wait; the server refuses what it cannot meet.
            model: which served policy (default: the server's).
            prefix: actions to be executed from ``obs_time`` on (real-time chunking).
            prefix_delay: how many of them run before the answer can arrive (frozen).
            urgency: how urgent it is (the scheduling key, not a deadline: :class:`~.protocol.Urgency`).
            replaces: the id of a request of this client still queued that this one refreshes:
                it takes that one's place; that one raises :class:`~.exceptions.Superseded`, or
                this one :class:`~.exceptions.ReplaceMissed` when that one was no longer queued.
            request_id: the id this request goes by (default: the client's next), to name it in
                a later ``replaces``; unique among this client's requests in flight.
            timeout: seconds to wait for the reply (see ``request_timeout``).

        Returns:
            The chunk, with the client's measurements (``client_timing``, ``received_at``).

        Raises:
            ServerError: the server answered with an error code.
            RequestTimeout: no reply in time (a ``cancel`` is sent).
            ConnectionLost: the connection dropped before the reply.
        """
        core = self._core
        ws, start, timeout = await self._connected(deadline_ms, timeout)
        upload = core.plan_upload(obs, model)
        compressed = await self._compress(obs, upload)
        out = core.start_infer(obs, obs_time, deadline_ms, model, prefix, upload, compressed, prefix_delay=prefix_delay,
                               urgency=urgency, replaces=replaces, request_id=request_id)
        reply = await self._exchange(ws, out, start, timeout)
        assert isinstance(reply, Chunk)  # the core answers an infer with a chunk or an error
        return reply

    async def plan(
        self,
        obs: dict[str, Any],
        *,
        instruction: str = "",
        obs_time: float | None = None,
        context: dict[str, Any] | None = None,
        deadline_ms: float | None = None,
        planner: str | None = None,
        timeout: float | None = None,
    ) -> PlanReply:
        """Ask a served planner for a plan (docs/planner.md); it shares the connection, and the
        session's id space and in-flight limit, with ``infer``.

        Args:
            obs: what the planner reads of the observation (its metadata in ``hello`` names it).
            instruction: the task in words.
            obs_time: robot-clock time of ``obs``; the reply's ``expires`` derives from it.
            context: the robot's current plan: ``plan_id``, ``subtask``, ``progress``.
            deadline_ms: how long the robot will wait (seconds are usual for planners).
            planner: which served planner (default: the server's).
            timeout: seconds to wait for the reply (see ``request_timeout``).

        Returns:
            The plan (``timing`` gains the client's ``round_trip_ms``).

        Raises:
            ServerError, RequestTimeout, ConnectionLost: as for :meth:`infer`.
        """
        core = self._core
        ws, start, timeout = await self._connected(deadline_ms, timeout)
        out = core.start_plan(obs, obs_time, instruction, context, deadline_ms, planner)
        reply = await self._exchange(ws, out, start, timeout)
        assert isinstance(reply, PlanReply)  # the core answers a plan with a plan or an error
        return reply

    async def _connected(self, deadline_ms: float | None, timeout: float | None) -> tuple[ClientConnection, float, float]:
        """A request's start: its reply timeout, the time it started, the connection (made if needed)."""
        timeout = self._core.reply_timeout(deadline_ms, timeout)
        start = self._core.clock()
        await self.ensure_connected(timeout)
        ws = self._ws
        if ws is None:
            raise ConnectionLost("connection dropped while connecting")
        return ws, start, timeout

    async def _exchange(self, ws: ClientConnection, out: Outgoing, start: float, timeout: float) -> Chunk | PlanReply:
        """Send a pending request and wait for its answer; on a timeout or a cancellation, the
        server is told to drop it."""
        core = self._core
        future: asyncio.Future[Chunk | PlanReply] = asyncio.get_running_loop().create_future()
        self._futures[out.request_id] = future
        try:
            core.sending(out.request_id)
            try:
                await ws.send(out.data)
            except websockets.ConnectionClosed as exc:
                raise ConnectionLost(f"connection closed while sending ({exc})") from None
            core.sent(out.request_id)
            remaining = max(0.0, timeout - (core.clock() - start))
            try:
                return await asyncio.wait_for(asyncio.shield(future), remaining)
            except asyncio.TimeoutError:
                await self._cancel_remote(ws, out.request_id)
                raise core.timed_out(out.request_id, timeout) from None
            except asyncio.CancelledError:
                await self._cancel_remote(ws, out.request_id)
                raise
        finally:
            core.forget(out.request_id)
            self._futures.pop(out.request_id, None)
            # A reply that lands after we gave up is dropped, never left unretrieved.
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()

    async def _cancel_remote(self, ws: ClientConnection, request_id: int) -> None:
        try:
            await asyncio.wait_for(ws.send(self._core.cancel_message(request_id)), 1.0)
        except (websockets.ConnectionClosed, asyncio.TimeoutError, ChunklineError):
            pass
