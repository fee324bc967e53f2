"""The openpi-compatible session: metadata frame, then bare observations in, ``{"actions", ...}`` out.

One request at a time. Its reply is written by the request's listener (``WorkItem.on_answered``)
in the loop turn the runner answers it, as the native session's are; the session's coroutine, which
awaits the answer before reading the next message, sends only a reply that found no room in the
transport, and the errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from websockets.exceptions import ConnectionClosed

from chunkline.client.timing import ms
from chunkline.client.wire.codec import decode
from chunkline.client.wire.errors import CloseCode, CodecError, ErrorCode
from chunkline.server.entrypoints.sessions import Session
from chunkline.server.errors import Refusal
from chunkline.server.robot.service import InferenceResult, ModelRunner, WorkItem, observation_map, result_timing

__all__ = ["CompatSession", "CompatReply"]

log = logging.getLogger("chunkline.server")


@dataclasses.dataclass(slots=True)
class CompatReply:
    """The one admitted request of a compat session until its reply is written.

    Args:
        session: its session. runner, item: where it was admitted, and the request.
        received, decoded: when it arrived and when it was decoded (session clock).
        prev_total_ms: the previous reply's ``server_ms`` (openpi's ``prev_total_ms``).
        fingerprint: the model's.
    """

    session: CompatSession
    runner: ModelRunner
    item: WorkItem
    received: float
    decoded: float
    prev_total_ms: float | None
    fingerprint: str
    #: its stage times (ms) once its reply is built, and its ``server_ms`` once recorded
    timing: dict[str, float] | None = None
    server_ms: float | None = None
    #: its reply, encoded, when writing it at once found no room (the coroutine sends it)
    data: bytes | None = None
    written: bool = False

    def answered(self) -> None:
        """Its request was answered (the runner calls it as it resolves the future): the reply
        is written in that same loop turn where the transport has room."""
        try:
            self.session.write_now(self)
        except Exception:  # the session's coroutine sends it, and logs what fails
            log.exception("compat session %s: writing a reply at once failed", self.session.id)


class CompatSession(Session):
    """openpi-compatible: metadata frame, then bare observation in, ``{"actions", ...}`` out.

    Errors mirror openpi's server: a text frame describing the error, then close 1011.
    """

    _in_flight: CompatReply | None = None  # the one request admitted and not yet answered
    _replying = False  # its reply is being written by the session's coroutine

    @property
    def replies_pending(self) -> bool:
        """Whether the request in flight still waits for its reply to be written."""
        return self._in_flight is not None or self._replying

    async def run(self) -> None:
        runner = self.robot.runner_for(self.tenant, None)
        if runner is None:
            await self._fail(f"{ErrorCode.FORBIDDEN.value}: tenant may not use model {self.robot.default_name!r}")
            return
        await self.send(self.encoder.encode(self.robot.metadata(runner)))
        # openpi's protocol has one request at a time and the handler waits on it, so the close
        # of the connection is watched separately: one callback for the session's life, which
        # withdraws the request in flight (a robot that leaves has its request withdrawn).
        closed = asyncio.ensure_future(self.ws.wait_closed())
        closed.add_done_callback(lambda _: self._withdraw(runner))
        try:
            await self._serve(runner, closed)
        finally:
            closed.cancel()
            self._withdraw(runner)

    def _withdraw(self, runner: ModelRunner) -> None:
        if self._in_flight is not None:
            self.robot.cancel(runner, self._in_flight.item)

    async def _serve(self, runner: ModelRunner, closed: asyncio.Future[None]) -> None:
        prev_total_ms: float | None = None
        fingerprint = self.robot.chunk_fields[runner].fingerprint
        async for message in self.ws.messages():
            received = self.clock()
            if isinstance(message, str):
                await self._fail(f"{ErrorCode.INVALID_MESSAGE.value}: expected a binary msgpack observation, got a text frame")
                return
            item: WorkItem | None = None
            try:
                obs = decode(message, self.ctx.codec_limits)
                decoded = self.clock()
                item = self.robot.admit(runner, observation_map(obs), self.tenant, self.id, received,
                                        robot_weight=self.robot_weight)
                reply = self._in_flight = CompatReply(self, runner, item, received, decoded, prev_total_ms, fingerprint)
                item.on_answered = reply.answered
                try:
                    result: InferenceResult = await item.future
                except asyncio.CancelledError:  # the server is stopping this handler
                    self.robot.cancel(runner, item)
                    raise
                finally:
                    self._in_flight = None
            except Refusal as exc:
                if closed.done() and exc.code is ErrorCode.CANCELLED:  # the client left while its request waited
                    self.robot.record(runner, self.tenant, self.id, ErrorCode.CANCELLED.value, {}, item)
                    return
                self.robot.record(runner, self.tenant, self.id, exc.code.value, {}, item)
                await self._fail(f"{exc.code.value}: {exc.message}")
                return
            except CodecError as exc:
                self.robot.record(runner, self.tenant, self.id, ErrorCode.INVALID_MESSAGE.value, {}, None)
                await self._fail(f"{ErrorCode.INVALID_MESSAGE.value}: {exc}")
                return
            if not reply.written:
                await self._send_reply(reply, result)
            prev_total_ms = reply.server_ms
            del message  # its buffer is free for the next message (see frame_reader.BufferPool)

    def _reply_bytes(self, reply: CompatReply, result: InferenceResult) -> bytes:
        """The encoded ``{"actions", "server_timing", "fingerprint"}`` reply; its timing goes to ``reply.timing``."""
        timing = result_timing(result, reply.decoded - reply.received)
        if reply.prev_total_ms is not None:
            timing["prev_total_ms"] = reply.prev_total_ms
        reply.timing = timing
        return self.encoder.encode({"actions": result.actions, "server_timing": timing, "fingerprint": reply.fingerprint})

    def write_now(self, reply: CompatReply) -> None:
        """An answered request's reply written straight to the transport (``send_now``) and
        recorded, if the request has a result and the transport has room; else nothing is
        written or recorded (the session's coroutine sends it once it resumes)."""
        future = reply.item.future
        if not future.done() or future.cancelled() or future.exception() is not None:
            return
        result: InferenceResult = future.result()
        data = self._reply_bytes(reply, result)
        if not self.send_now(data):
            reply.data = data
            return
        reply.written = True
        self._in_flight = None
        self._recorded(reply, "late" if result.late else "ok")

    async def _send_reply(self, reply: CompatReply, result: InferenceResult) -> None:
        """Send a reply :meth:`write_now` could not write, waiting for room, and record it."""
        data = reply.data if reply.data is not None else self._reply_bytes(reply, result)
        outcome = "late" if result.late else "ok"
        self._replying = True  # no await since the answer: a drain sees it pending throughout
        try:
            await self.send(data)
        except ConnectionClosed:
            outcome = ErrorCode.CANCELLED.value
            raise
        finally:
            self._replying = False
            self._recorded(reply, outcome)

    def _recorded(self, reply: CompatReply, outcome: str) -> None:
        timing = reply.timing if reply.timing is not None else {}
        reply.server_ms = timing["server_ms"] = ms(self.clock() - reply.received)
        self.robot.record(reply.runner, self.tenant, self.id, outcome, timing, reply.item)

    async def _fail(self, text: str) -> None:
        log.info("compat session %s: %s", self.id, text)
        try:
            await self.send(text)
            await self.ws.close(CloseCode.INTERNAL_ERROR, "request failed")
        except ConnectionClosed:
            pass
