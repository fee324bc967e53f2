"""The native session's robot class: ``infer`` -> one ``chunk`` (or one ``error``).

Refusing before decoding: while a model is refusing, the session is full or it holds a retry
window, an ``infer`` is first peeked at (its ``type``, ``id``, ``deadline_ms`` and ``model``); if
admission would refuse it whatever its observation holds, it is answered at once, never decoded.
Anything the peek is unsure of takes the full path. Every request answered at the door with an
error is recorded with its ``server_ms`` (arrival to the error written); admitted work dropped
later is not (its time is the queue's). Replies are written by one writer task per session, fed
by the requests' listeners (``WorkItem.on_answered``), in answer order; a request answered during admission is
replied to at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from websockets.exceptions import ConnectionClosed

from chunkline.client.timing import ms
from chunkline.client.wire.codec import CodecLimits, Encoder
from chunkline.client.wire.errors import CloseCode, ErrorCode
from chunkline.client.wire.protocol import MAX_DEADLINE_MS, MAX_MODEL_NAME_LENGTH, Infer, error_message, valid_request_id
from chunkline.server.core.admission.retry_holds import RetryHolds
from chunkline.server.entrypoints.handler import RequestId, SessionPort, owned
from chunkline.server.errors import Refusal
from chunkline.server.robot.service import (
    InferenceResult,
    ModelRunner,
    RobotActions,
    Skipped,
    WorkItem,
    encoded_fields,
    observation_map,
    peek_map,
    result_timing,
)

__all__ = ["RobotHandler", "RobotSession", "InferHeader", "IGNORED_RETRY_HINTS_BEFORE_CLOSE", "SENT_EARLY"]

#: ``infer`` messages sent inside their retry window after which the session is closed (1013).
IGNORED_RETRY_HINTS_BEFORE_CLOSE = 64
#: What the answer to an ``infer`` sent inside its retry window says (benchmarks look for it).
SENT_EARLY = "before the retry time given"

log = logging.getLogger("chunkline.server")

_INFER_KEYS = frozenset({"type", "id", "obs", "obs_time", "deadline_ms", "model", "prefix", "prefix_delay", "urgency", "replaces"})


class RobotSession(SessionPort, Protocol):
    """What the robot handler uses of its session beyond :class:`SessionPort`."""

    encoder: Encoder
    clock: Callable[[], float]
    #: its robot's service weight, or the refusal every ``infer`` gets (a weight it asked for and may not have)
    robot_weight: float | Refusal

    async def send(self, data: bytes | str) -> None: ...

    def send_now(self, data: bytes) -> bool: ...

    def full(self) -> bool: ...

    async def close(self, code: CloseCode, reason: str) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class InferHeader:
    """What a peek read of a message that is plainly an ``infer``."""

    id: RequestId
    deadline_ms: float | None
    model: str | None


def _number(value: Any) -> bool:
    return (type(value) is float or type(value) is int) and math.isfinite(value)


def infer_header(fields: dict[str, Any]) -> InferHeader | None:
    """The header of a peeked message that is plainly an ``infer`` (every field of the right
    type and within the protocol's bounds, the observation a map), else ``None``: the message
    then takes the full path, which says exactly what is wrong with it."""
    if fields.get("type") != "infer" or not fields.keys() <= _INFER_KEYS:
        return None
    request_id = fields.get("id")
    if not valid_request_id(request_id) or fields.get("obs") is not Skipped.MAP:
        return None
    obs_time, deadline_ms, model = fields.get("obs_time"), fields.get("deadline_ms"), fields.get("model")
    if obs_time is not None and not _number(obs_time):
        return None
    if deadline_ms is not None and not (_number(deadline_ms) and 0 < deadline_ms <= MAX_DEADLINE_MS):
        return None
    if model is not None and not (type(model) is str and 1 <= len(model) <= MAX_MODEL_NAME_LENGTH):
        return None
    if fields.get("prefix") not in (None, Skipped.MAP) or fields.get("urgency") not in (None, Skipped.MAP):
        return None
    prefix_delay = fields.get("prefix_delay")
    if prefix_delay is not None and not (type(prefix_delay) is int and prefix_delay >= 0):
        return None
    replaces = fields.get("replaces")
    if replaces is not None and not (valid_request_id(replaces) and replaces != request_id):
        return None
    assert isinstance(request_id, (int, str))  # checked by valid_request_id above
    return InferHeader(request_id, None if deadline_ms is None else float(deadline_ms), model)


@dataclasses.dataclass(slots=True)
class PendingInfer:
    """An admitted ``infer`` until its reply is written: its entry in the session's in-flight
    map and in the reply writer's queue."""

    handler: RobotHandler
    msg: Infer
    runner: ModelRunner
    item: WorkItem
    received: float
    decoded: float
    image_decode_s: float | None
    #: the chunk's stage times (ms), once it is built
    timing: dict[str, float] | None = None
    #: its chunk, encoded, when writing it at once found no room (the writer sends it)
    data: bytes | None = None

    def answered(self) -> None:
        """Its request was answered (the runner calls it as it resolves the future): written at
        once when the session's reply writer waits with nothing queued (answer order holds),
        else queued for the writer."""
        handler = self.handler
        try:
            written = not handler.answered_queue and handler.writer_waiting and handler.write_now(self)
        except Exception:  # the writer tries again, and logs and records what fails
            written = False
        if not written:
            handler.answered_queue.append(self)
            handler.wake()


class RobotHandler:
    """The robot class's ``infer`` messages on one native session (see the module docstring).

    Args:
        session: the session.
        robot: the robot class's service.
        codec_limits: the caps of the session's decoder (the peek applies them too).
        is_ready: whether the server takes work (else the full path says why not).
        offered_encodings: the client's handshake header of compressed encodings.
    """

    def __init__(self, session: RobotSession, robot: RobotActions, codec_limits: CodecLimits, is_ready: Callable[[], bool],
                 offered_encodings: str | None) -> None:
        self._session = session
        self._robot = robot
        self._limits = codec_limits
        self._is_ready = is_ready
        self._holds = RetryHolds(IGNORED_RETRY_HINTS_BEFORE_CLOSE)  # retry windows given, per model
        #: array encodings this session uses: raw, and the compressed ones both ends speak
        self.encodings = robot.agree_encodings(offered_encodings)
        self._agreed = frozenset(self.encodings)
        #: answered requests waiting for the writer, in answer order
        self.answered_queue: collections.deque[PendingInfer] = collections.deque()
        self._wake_writer: asyncio.Future[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._closing = False

    # ------------------------------------------------------------------ the door

    async def refuse(self, runner: ModelRunner | None, code: ErrorCode, message: str, request_id: Any, received: float,
                     retry_after_ms: float | None = None, hold: bool = True) -> None:
        """Answer a request with an error and record it against ``runner`` (``None``: the
        default model), with ``server_ms`` from its arrival to the error written. A retry time
        opens a window (``hold``: the door's own answers repeat the window they are in)."""
        if runner is None:
            runner = self._robot.default
        if hold:
            self._holds.hold(runner.name, code, retry_after_ms, received)
        session = self._session
        try:
            await session.send_message(error_message(code, message, request_id, retry_after_ms))
        except ConnectionClosed:
            pass
        finally:
            self._robot.record(runner, session.tenant, session.id, code.value, {"server_ms": ms(session.clock() - received)}, None)

    def may_refuse_early(self, full: bool) -> bool:
        """Whether peeking before decoding may pay: a model is refusing, the session is
        ``full``, or it was asked to wait before sending again."""
        return full or bool(self._holds) or self._robot.refusing

    async def refuse_early(self, message: bytes | memoryview, received: float) -> bool:
        """Answer an ``infer`` that admission would refuse whatever its observation holds,
        without decoding it. Returns whether it was answered (else the full path takes it)."""
        fields = peek_map(message, self._limits)
        header = infer_header(fields) if fields is not None else None
        if header is None or not self._is_ready():  # draining, ledger down, ...: the full path says so
            return False
        session, robot = self._session, self._robot
        if header.id in session.in_flight:
            return False
        if session.full():
            await self.refuse(None, ErrorCode.OVERLOADED, "too many requests in flight on this session", header.id, received, 10.0)
            return True
        runner = robot.runner_for(session.tenant, header.model)
        if runner is None:
            return False
        if await self._held_back(runner, header.id, received):
            return True
        deadline = robot.deadline_for(runner, session.tenant, header.deadline_ms, received)
        refusal = robot.precheck(runner, session.tenant, session.id, deadline)
        if refusal is None:
            return False
        await self.refuse(runner, refusal.code, refusal.message, header.id, received, refusal.retry_after_ms)
        return True

    async def _held_back(self, runner: ModelRunner, request_id: RequestId, received: float) -> bool:
        """Refuse, without decoding it, an ``infer`` sent before the retry time this session was
        given for its model; close the session once it has ignored too many such hints.
        Returns whether the message was answered."""
        held = self._holds.check(runner.name, received)
        if held is None:
            return False
        session = self._session
        if held.first:
            self._robot.sent_early(runner, session.id)  # its place in the retry line no longer protects it
        if held.close:
            log.info("session %s: closing after %d requests sent inside their retry window", session.id, self._holds.in_a_row)
            await session.close(CloseCode.TRY_AGAIN_LATER, "retry_after_ms ignored: reconnect later")
            return True
        await self.refuse(runner, held.code, f"sent {held.wait_ms:.0f} ms {SENT_EARLY}; wait retry_after_ms",
                          request_id, received, held.wait_ms, hold=False)
        return True

    # ------------------------------------------------------------------ requests

    def handle(self, msg: Infer, received: float, decoded: float) -> Awaitable[None] | None:
        session, robot = self._session, self._robot
        runner = robot.runner_for(session.tenant, msg.model)
        if runner is None:
            # A model the tenant may not use is reported as unknown: tenants do not learn each other's models.
            return self.refuse(None, ErrorCode.UNKNOWN_MODEL, f"no model named {msg.model!r}", msg.id, received)
        try:
            obs = observation_map(msg.obs)
            compressed = encoded_fields(obs)
            if compressed:
                return self._decode_then_admit(msg, runner, obs, compressed, received)
            item = robot.admit(runner, obs, session.tenant, session.id, received, msg, session.robot_weight,
                               self._replaced(msg, runner))
        except Refusal as exc:
            return self.refuse(runner, exc.code, exc.message, msg.id, received, exc.retry_after_ms)
        self._admitted(PendingInfer(self, msg, runner, item, received, decoded, None))
        return None

    async def _decode_then_admit(self, msg: Infer, runner: ModelRunner, obs: dict[str, Any], compressed: dict[str, Any],
                                 received: float) -> None:
        """Checked against the spec and the session first, then decoded on the pool: this
        session waits, the loop serves everyone else meanwhile."""
        session, robot = self._session, self._robot
        try:
            image_decode_s = await robot.decode_fields(runner, self._agreed, obs, compressed, session.tenant)
            decoded = session.clock()
            item = robot.admit(runner, obs, session.tenant, session.id, received, msg, session.robot_weight,
                               self._replaced(msg, runner))
        except Refusal as exc:
            await self.refuse(runner, exc.code, exc.message, msg.id, received, exc.retry_after_ms)
            return
        self._admitted(PendingInfer(self, msg, runner, item, received, decoded, image_decode_s))

    def _replaced(self, msg: Infer, runner: ModelRunner) -> WorkItem | None:
        """The request of this session ``msg`` replaces (``None``: it replaces none). Raises
        Refusal: ``replace_missed``, that request is not one of this session's queued ``infer``
        for the same model (other sessions' ids are never looked up)."""
        if msg.replaces is None:
            return None
        entry = self._session.in_flight.get(msg.replaces)
        if type(entry) is not PendingInfer or entry.runner is not runner or entry.item.started is not None:
            raise Refusal(ErrorCode.REPLACE_MISSED, f"request {msg.replaces!r} is not queued: its answer stands")
        return entry.item

    def _admitted(self, entry: PendingInfer) -> None:
        self._session.in_flight[entry.msg.id] = entry
        entry.item.on_answered = entry.answered
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_replies())

    def cancel(self, request_id: RequestId) -> None:
        entry = self._session.in_flight.get(request_id)
        if type(entry) is PendingInfer:
            self._robot.cancel(entry.runner, entry.item)  # the writer answers it `cancelled`

    @property
    def in_flight(self) -> int:
        return len(owned(self._session, self))

    def close(self) -> Awaitable[None] | None:
        """Queued work is withdrawn; running work finishes and is discarded."""
        self._closing = True
        for entry in owned(self._session, self):
            assert isinstance(entry, PendingInfer)
            self._robot.cancel(entry.runner, entry.item)
        self.wake()  # the writer answers what is left (the peer has gone: nothing is sent) and ends
        return self._writer

    # ------------------------------------------------------------------ replies

    @property
    def writer_waiting(self) -> bool:
        """Whether the reply writer waits for answers (it is not inside a reply)."""
        wake = self._wake_writer
        return wake is not None and not wake.done()

    def wake(self) -> None:
        """Wake the reply writer (answers are queued, or the session is closing)."""
        wake = self._wake_writer
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _write_replies(self) -> None:
        """Each answered request's chunk or error, in answer order, until the session closes
        with nothing left in flight."""
        loop = asyncio.get_running_loop()
        while True:
            while self.answered_queue:
                await self._reply(self.answered_queue.popleft())
            if self._closing and not owned(self._session, self):
                return
            self._wake_writer = loop.create_future()
            try:
                await self._wake_writer
            finally:
                self._wake_writer = None

    def write_now(self, entry: PendingInfer) -> bool:
        """The first step of every reply: an answered request's chunk written straight to the
        transport (``send_now``) and recorded. Returns whether it was; if not (an error to send,
        no room for the chunk: it is kept in ``entry.data``), nothing was written or recorded."""
        future = entry.item.future
        if not future.done() or future.cancelled() or future.exception() is not None:
            return False
        result: InferenceResult = future.result()
        data = self._chunk(entry, result)
        session = self._session
        if not session.send_now(data):
            entry.data = data
            return False
        session.in_flight.pop(entry.msg.id, None)
        self._robot.record(entry.runner, session.tenant, session.id, "late" if result.late else "ok", entry.timing or {},
                           entry.item)
        return True

    async def _reply(self, entry: PendingInfer) -> None:
        """Write an answered request's chunk, or its error, and record it: at once where nothing
        needs waiting for (:meth:`write_now`), else waiting for the answer or for room to send."""
        session, msg, runner = self._session, entry.msg, entry.runner
        timing: dict[str, float] | None = None  # a chunk's full timing; without one (an error), decode_ms alone
        outcome = ErrorCode.INTERNAL.value
        future = entry.item.future
        written = False
        try:
            try:
                if entry.data is None and self.write_now(entry):
                    written = True
                    return
                try:
                    result = future.result() if future.done() else await future
                except Refusal as exc:
                    outcome = exc.code.value
                    try:
                        await session.send_message(error_message(exc.code, exc.message, msg.id, exc.retry_after_ms))
                    except ConnectionClosed:
                        pass
                    return
                data = entry.data if entry.data is not None else self._chunk(entry, result)
                timing = entry.timing
                outcome = "late" if result.late else "ok"
                if not session.send_now(data):
                    try:
                        await session.send(data)
                    except ConnectionClosed:
                        outcome = ErrorCode.CANCELLED.value  # nobody left to receive it
            finally:
                if not written:
                    session.in_flight.pop(msg.id, None)
                    if timing is None:
                        timing = {"decode_ms": ms(entry.decoded - entry.received)}
                    self._robot.record(runner, session.tenant, session.id, outcome, timing, entry.item)
        except Exception:  # one reply's bug must not end the session or leave later requests unanswered
            log.exception("session %s: writing a reply failed", session.id)

    def _chunk(self, entry: PendingInfer, result: InferenceResult) -> bytes:
        """An answered request's ``chunk`` message, encoded; its stage times (ms) go to ``entry.timing``."""
        msg, received, clock, encoder = entry.msg, entry.received, self._session.clock, self._session.encoder
        model = self._robot.chunk_fields[entry.runner]
        t0 = None if msg.obs_time is None else msg.obs_time + model.action_offset
        head = {  # the scalar fields first: the encoder packs them in one call
            "type": "chunk",
            "id": msg.id,
            "t0": t0,
            "dt": model.dt,
            "expires": None if t0 is None else t0 + model.validity,
            "model": model.name,
            "fingerprint": model.fingerprint,
            "late": result.late,
            "actions": result.actions,
        }
        encode_start = clock()
        # Encode the bulk first, time it, then append the timing entry to the same map.
        body = encoder.encode_map_prefix(len(head) + 1, head)
        timing = result_timing(result, entry.decoded - received, entry.image_decode_s)
        encoded = clock()  # one reading ends both spans
        timing["encode_ms"] = ms(encoded - encode_start)
        timing["server_ms"] = ms(encoded - received)
        entry.timing = timing
        return body + encoder.encode_map_entries({"timing": timing})
