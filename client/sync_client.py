"""Synchronous client for the native protocol, for robot code that is not asyncio.

A thin shell over :class:`~chunkline.client.core.ClientCore`, like
:class:`~chunkline.client.asyncio_client.AsyncClient`: one request at a time per client (a lock
serialises callers); replies to requests that timed out earlier are recognised by id and
discarded. Reconnects lazily with backoff.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+; the annotations are never evaluated at run time
    from typing_extensions import Unpack

import numpy as np
import websockets
from websockets.sync.client import ClientConnection, connect

from .core import RETRYABLE, Answer, ClientOptions, Outgoing
from .shell import ClientShell
from .wire.protocol import Chunk, PlanReply, Urgency

__all__ = ["Client"]


class Client(ClientShell):
    """Blocking native-protocol client. Arguments as for :class:`AsyncClient`."""

    def __init__(self, uri: str | None = None, **options: Unpack[ClientOptions]) -> None:
        super().__init__(uri, **options)
        self._ws: ClientConnection | None = None
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, uri: str | None = None, **options: Unpack[ClientOptions]) -> Client:
        """Create a client and connect it (retrying within ``connect_timeout``)."""
        client = cls(uri, **options)
        with client._lock:
            client._ensure_connected(None)
        return client

    def _ensure_connected(self, timeout: float | None) -> ClientConnection:
        self._core.check_open()
        if self._ws is not None:
            return self._ws
        give_up = self._core.connect_deadline(timeout)
        while True:
            try:
                self._ws = self._open()
                return self._ws
            except RETRYABLE as exc:
                delay = self._core.retry_delay(give_up, exc)
            time.sleep(delay)

    def _open(self) -> ClientConnection:
        try:
            # connect(...).__enter__() opens the connection on every websockets version
            # (a bare connect() is deprecated from 17.1 on).
            ws: ClientConnection = connect(self.uri, **self._core.connect_options()).__enter__()
        except websockets.InvalidStatus as exc:
            refusal = self._core.refusal(exc)
            if refusal is not None:
                raise refusal from None
            raise
        try:
            self._core.on_connected(ws.recv(timeout=self._core.open_timeout))
        except BaseException:
            ws.close()
            raise
        return ws

    def close(self) -> None:
        self._core.close()
        if self._ws is not None:
            self._ws.close()
            self._ws = None
        if self._compressor is not None:
            self._compressor.close()

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
        prefix_delay: int | None = None,
        urgency: Urgency | None = None,
        replaces: int | str | None = None,
        request_id: int | None = None,
    ) -> Chunk:
        """Ask for an action chunk; see :meth:`AsyncClient.infer`."""
        core = self._core
        with self._connected(deadline_ms, timeout) as (ws, start, timeout):
            upload = core.plan_upload(obs, model)
            # The fields compress on the worker threads, in parallel; this thread waits for them.
            compressed = self._compressor.compress(obs, upload.fields) if upload is not None and self._compressor is not None else None
            out = core.start_infer(obs, obs_time, deadline_ms, model, prefix, upload, compressed, prefix_delay=prefix_delay,
                                   urgency=urgency, replaces=replaces, request_id=request_id)
            return self._exchange(ws, out, start, timeout).result()

    def plan(
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
        """Ask a served planner for a plan; see :meth:`AsyncClient.plan`."""
        with self._connected(deadline_ms, timeout) as (ws, start, timeout):
            out = self._core.start_plan(obs, obs_time, instruction, context, deadline_ms, planner)
            return self._exchange(ws, out, start, timeout).plan_result()

    @contextlib.contextmanager
    def _connected(self, deadline_ms: float | None, timeout: float | None) -> Iterator[tuple[ClientConnection, float, float]]:
        """A request's start, as :meth:`AsyncClient._connected`, holding the lock (one request at a
        time) until the block ends: the connection, the time it started, its reply timeout."""
        timeout = self._core.reply_timeout(deadline_ms, timeout)
        with self._lock:
            start = self._core.clock()
            yield self._ensure_connected(timeout), start, timeout

    def _exchange(self, ws: ClientConnection, out: Outgoing, start: float, timeout: float) -> Answer:
        """Send a pending request and read until its answer (the caller holds the lock); on a
        timeout the server is told to drop it."""
        core = self._core
        try:
            core.sending(out.request_id)
            ws.send(out.data)
            core.sent(out.request_id)
            while True:
                remaining = timeout - (core.clock() - start)
                if remaining <= 0:
                    self._send_cancel(ws, out.request_id)
                    raise core.timed_out(out.request_id, timeout)
                try:
                    raw = ws.recv(timeout=remaining)
                except TimeoutError:
                    continue
                answer = core.receive(raw)
                if answer is not None and answer.request_id == out.request_id:
                    return answer
        except websockets.ConnectionClosed as exc:
            self._ws = None
            raise core.connection_lost(str(exc)) from None
        finally:
            core.forget(out.request_id)

    def _send_cancel(self, ws: ClientConnection, request_id: int) -> None:
        try:
            ws.send(self._core.cancel_message(request_id))
        except websockets.ConnectionClosed:
            self._ws = None
