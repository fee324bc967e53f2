"""The openpi-compatible session: metadata frame, then bare observations in, ``{"actions", ...}`` out."""

from __future__ import annotations

import asyncio
import logging

from websockets.exceptions import ConnectionClosed

from chunkline.client.timing import ms
from chunkline.client.wire.codec import decode
from chunkline.client.wire.errors import CloseCode, CodecError, ErrorCode
from chunkline.server.entrypoints.sessions import Session
from chunkline.server.errors import Refusal
from chunkline.server.robot.service import InferenceResult, ModelRunner, WorkItem, observation_map, result_timing

__all__ = ["CompatSession"]

log = logging.getLogger("chunkline.server")


class CompatSession(Session):
    """openpi-compatible: metadata frame, then bare observation in, ``{"actions", ...}`` out.

    Errors mirror openpi's server: a text frame describing the error, then close 1011.
    """

    _in_flight: WorkItem | None = None  # the one request admitted and not yet answered
    _replying = False  # its reply is being written

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
            self.robot.cancel(runner, self._in_flight)

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
                item = self._in_flight = self.robot.admit(runner, observation_map(obs), self.tenant, self.id, received,
                                                               robot_weight=self.robot_weight)
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
            timing = result_timing(result, decoded - received)
            if prev_total_ms is not None:
                timing["prev_total_ms"] = prev_total_ms
            reply = {"actions": result.actions, "server_timing": timing, "fingerprint": fingerprint}
            outcome = "late" if result.late else "ok"
            self._replying = True  # no await since the answer: a drain sees it pending throughout
            try:
                await self.send(self.encoder.encode(reply))
            except ConnectionClosed:
                outcome = ErrorCode.CANCELLED.value
                raise
            finally:
                self._replying = False
                timing["server_ms"] = ms(self.clock() - received)
                self.robot.record(runner, self.tenant, self.id, outcome, timing, item)
            prev_total_ms = timing["server_ms"]
            del message  # its buffer is free for the next message (see frame_reader.BufferPool)

    async def _fail(self, text: str) -> None:
        log.info("compat session %s: %s", self.id, text)
        try:
            await self.send(text)
            await self.ws.close(CloseCode.INTERNAL_ERROR, "request failed")
        except ConnectionClosed:
            pass
