"""One WebSocket connection: what every session shares (:class:`Session`, :class:`SessionContext`)
and the native ``chunkline.v1`` session; the openpi-compatible one is in :mod:`.openpi_session`.

A session only moves bytes: it decodes a message, checks it against the session's one id space
and in-flight limit (every class counts), and hands it to the handler of its type
(:mod:`.handler`); each handler sees its class only through the class's service. Every error a
session answers carries the request's id whenever one can be read from the message, even one
that does not decode (:func:`readable_id`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from websockets.exceptions import ConnectionClosed

from chunkline.client.wire.codec import CodecLimits, Encoder, decode
from chunkline.client.wire.encodings import ENCODINGS_HEADER
from chunkline.client.wire.errors import CloseCode, CodecError, ErrorCode, ProtocolError
from chunkline.client.wire.format import LAYOUT_MSGPACK, LAYOUT_OOB
from chunkline.client.wire.protocol import (
    ROBOT_WEIGHT_HEADER,
    SUBPROTOCOL,
    Cancel,
    Generate,
    Infer,
    Plan,
    parse_client_message,
    valid_request_id,
)
from chunkline.server.config import ServerConfig
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.entrypoints.connection import BudgetedConnection
from chunkline.server.entrypoints.handler import Handler, InFlight, RequestId, TaskHandler, Unserved
from chunkline.server.entrypoints.robot_native import IGNORED_RETRY_HINTS_BEFORE_CLOSE, SENT_EARLY, RobotHandler
from chunkline.server.robot.service import RobotActions, observation_map, peek_map

if TYPE_CHECKING:
    from chunkline.server.planner.service import PlannerService
    from chunkline.server.text.service import TextService

__all__ = ["Session", "NativeSession", "SessionContext", "new_session_id", "observation_map", "readable_id",
           "IGNORED_RETRY_HINTS_BEFORE_CLOSE", "SENT_EARLY"]

log = logging.getLogger("chunkline.server")

# asyncio.timeout (Python 3.11+) bounds a send without the task asyncio.wait_for creates for it.
_timeout = getattr(asyncio, "timeout", None)


def new_session_id() -> str:
    return secrets.token_hex(8)


def readable_id(message: bytes | memoryview, limits: CodecLimits) -> RequestId | None:
    """The id of a message that did not decode, where its top-level map can still be read
    (over-long strings, deep nesting and bad arrays are stepped over, not built), else ``None``.
    Only a valid id is returned: an error must itself be a valid message."""
    lenient = dataclasses.replace(limits, max_depth=4 * limits.max_depth, max_str_bytes=limits.max_message_bytes)
    fields = peek_map(message, lenient)
    request_id = fields.get("id") if fields is not None else None
    if valid_request_id(request_id):
        assert isinstance(request_id, (int, str))
        return request_id
    return None


@dataclass(frozen=True)
class SessionContext:
    """What a session needs from the server process: the core, the request classes and the limits.

    Sessions are typed against this, not against the server object, so the listener and the
    sessions do not import each other.
    """

    core: ServingCore
    robot: RobotActions
    text: TextService | None
    config: ServerConfig
    codec_limits: CodecLimits
    version_string: str
    is_ready: Callable[[], bool]
    planner: PlannerService | None = None


class Session:
    def __init__(self, ctx: SessionContext, ws: BudgetedConnection, tenant: TenantInfo, key_id: str | None = None) -> None:
        self.ctx = ctx
        self.robot = ctx.robot
        self.ws = ws
        self.id = new_session_id()
        self.tenant = tenant
        request = getattr(ws, "request", None)
        weight = request.headers.get(ROBOT_WEIGHT_HEADER) if request is not None else None
        self.robot_weight = ctx.robot.session_weight(tenant, key_id, weight)
        self.encoder = Encoder()  # one packer per session: the loop thread is its only user
        self.clock = time.perf_counter

    async def send(self, data: bytes | str) -> None:
        """Send one message; a peer that does not read it within ``send_timeout_s`` (its buffer,
        bounded by ``write_limit_bytes``, stays full) is disconnected.

        Raises:
            ConnectionClosed: the connection is gone (or was just cut for not reading).
        """
        if type(data) is bytes and self.send_now(data):
            return
        ws = self.ws
        if ws.transport.get_write_buffer_size() + len(data) <= self.ctx.config.write_limit_bytes:
            # Room in the buffer: this send cannot wait on the peer, so it needs no timer
            # (arming and cancelling one per reply is a measurable share of a request's cost).
            await ws.send(data)
            return
        try:
            if _timeout is not None:
                async with _timeout(self.ctx.config.send_timeout_s):
                    await self.ws.send(data)
            else:  # Python 3.10
                await asyncio.wait_for(self.ws.send(data), self.ctx.config.send_timeout_s)
        except asyncio.TimeoutError:
            log.warning("session %s: peer is not reading its replies; disconnecting", self.id)
            self.ws.transport.abort()
            raise ConnectionClosed(None, None) from None

    def send_now(self, data: bytes) -> bool:
        """:meth:`send` without a coroutine where it cannot wait: ``data`` written straight to
        the transport as one binary frame when there is room for it in the write buffer and the
        connection is open (:meth:`BudgetedConnection.send_now`). Returns whether it was written; if
        not, nothing was (:meth:`send` it)."""
        return self.ws.send_now(data)


class NativeSession(Session):
    """``chunkline.v1``: typed messages with ids, several requests in flight, structured errors."""

    def __init__(self, ctx: SessionContext, ws: BudgetedConnection, tenant: TenantInfo, key_id: str | None = None) -> None:
        super().__init__(ctx, ws, tenant, key_id)
        #: every request in flight on this session, whatever its class, by its id
        self.in_flight: dict[RequestId, InFlight] = {}
        request = getattr(ws, "request", None)
        self.infers = RobotHandler(self, ctx.robot, ctx.codec_limits, ctx.is_ready,
                                   request.headers.get(ENCODINGS_HEADER) if request is not None else None)
        self.encodings = self.infers.encodings
        self.handlers: dict[type, Handler] = {Infer: self.infers}
        self._hello: dict[str, Any] = {
            "type": "hello",
            "protocol": SUBPROTOCOL,
            "server": ctx.version_string,
            "session": self.id,
            "default_model": self.robot.default_name,
            # A tenant sees only the models it may use.
            "models": dict(self.robot.models_for(self.tenant)),
            "robot_weight": self.robot_weight if isinstance(self.robot_weight, float) else None,
        }
        self._register_classes()

    def _register_classes(self) -> None:
        """The entrypoint's handler registration: the handler of each other class's message type
        and what the class adds to the hello (a class this server does not serve answers
        ``unknown_model``). Each exchange module is loaded only where its class is served."""
        text, planner = self.ctx.text, self.ctx.planner
        if text is not None:
            from chunkline.server.entrypoints.text_native import handle_generate

            self.handlers[Generate] = TaskHandler(self, functools.partial(handle_generate, text))
        else:
            self.handlers[Generate] = Unserved(self, "this server serves no text models")
        self._hello["text_models"] = text.models_for(self.tenant) if text is not None else []
        self._hello["layouts"] = [LAYOUT_MSGPACK, LAYOUT_OOB]
        self._hello["encodings"] = self.encodings
        if planner is not None:
            from chunkline.server.entrypoints.planner_native import PlanDoor, handle_plan

            self.handlers[Plan] = TaskHandler(self, functools.partial(handle_plan, planner, door=PlanDoor(self.ws)))
            self._hello["planners"] = planner.metadata_for(self.tenant)
        else:
            self.handlers[Plan] = Unserved(self, "this server serves no planners")

    @property
    def replies_pending(self) -> bool:
        """Whether a request of this session still waits for its reply to be written."""
        return bool(self.in_flight)

    async def send_message(self, message: dict[str, Any]) -> None:
        await self.send(self.encoder.encode(message))

    async def close(self, code: CloseCode, reason: str) -> None:
        await self.ws.close(code, reason)

    def full(self) -> bool:
        """Whether requests of every class in flight on this session (one limit counts them
        all) fill it."""
        return len(self.in_flight) >= self.ctx.config.max_in_flight_per_session

    async def run(self) -> None:
        await self.send(self.encoder.encode(self._hello))
        try:
            async for message in self.ws.messages():
                received = self.clock()
                if isinstance(message, str):
                    await self.ws.close(CloseCode.UNSUPPORTED_DATA, "chunkline.v1 carries binary msgpack frames only")
                    return
                await self._on_message(message, received)
                del message  # its buffer is free for the next message (see frame_reader.BufferPool)
        finally:
            # Disconnect: every handler withdraws what it has in flight at once, then its tasks end.
            closing = [waiting for handler in self.handlers.values() if (waiting := handler.close()) is not None]
            if closing:
                await asyncio.gather(*closing, return_exceptions=True)

    async def _on_message(self, message: bytes | memoryview, received: float) -> None:
        # One reading of "full" serves both checks of this message: until the second, nothing
        # suspends (an early refusal that suspends returns) and no request is added or removed.
        full = self.full()
        infers = self.infers
        if infers.may_refuse_early(full) and await infers.refuse_early(message, received):
            return
        try:
            obj = decode(message, self.ctx.codec_limits)
        except CodecError as exc:
            await infers.refuse(None, ErrorCode.INVALID_MESSAGE, str(exc), readable_id(message, self.ctx.codec_limits), received)
            return
        decoded = self.clock()
        try:
            msg = parse_client_message(obj)
        except ProtocolError as exc:
            raw_id = obj.get("id") if isinstance(obj, dict) else None
            # Echo the id only when it is a valid one: an error must itself be a valid message.
            await infers.refuse(None, ErrorCode.INVALID_MESSAGE, str(exc), raw_id if valid_request_id(raw_id) else None, received)
            return
        # parse_client_message makes exact classes: a dispatch on type() (no isinstance calls).
        kind = type(msg)
        if kind is Cancel:
            entry = self.in_flight.get(msg.id)
            if entry is not None:
                entry.handler.cancel(msg.id)  # its handler answers it `cancelled`
            return
        if msg.id in self.in_flight:
            await infers.refuse(None, ErrorCode.DUPLICATE_ID, "a request with this id is already in flight", msg.id, received)
            return
        if full:
            await infers.refuse(None, ErrorCode.OVERLOADED, "too many requests in flight on this session", msg.id, received, 10.0)
            return
        handler = self.handlers.get(kind)
        if handler is None:
            raise AssertionError(f"unexpected client message {kind.__name__}")
        waiting = handler.handle(msg, received, decoded)
        if waiting is not None:
            await waiting
