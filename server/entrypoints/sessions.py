"""One WebSocket connection: what every session shares (:class:`Session`, :class:`SessionContext`)
and the native ``chunkline.v1`` session; the openpi-compatible one is in :mod:`.openpi_session`.

Both only move bytes and call the cores: decode (codec), validate (policy spec), submit
(admission), encode the reply, record the outcome. Inference runs in the model's lane threads.

Refusing before decoding (native mode): while a model is refusing work (its latest admission
decision was a refusal) or the session has its most requests in flight, an ``infer`` is first
*peeked at* (:func:`~chunkline.server.robot.peek.peek_map`: its ``type``, ``id``, ``deadline_ms`` and
``model``, without building the observation). If admission would refuse it whatever its
observation holds (queue full, quota, deadline unmeetable given the work ahead; see
:meth:`~chunkline.server.robot.runner.ModelRunner.precheck`), it is answered at once and never
decoded. Anything else, including every message the peek is unsure of, takes the full path
with all its validation. The one visible difference: while refusing, an ``infer`` whose
observation is also invalid is answered with the admission refusal rather than
``invalid_observation`` (both end the request).

In native mode every request answered at the door with an error (refused by admission, or
invalid) is recorded with its ``server_ms``: from the message's arrival to the error written to
the connection. Admitted work dropped later (``deadline_exceeded``, ``cancelled``) is not: its
time is the queue's, which the chunk timings already show.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from websockets.exceptions import ConnectionClosed

from chunkline.client.codec import CodecLimits, Encoder, decode
from chunkline.client.encodings import ENCODINGS_HEADER
from chunkline.client.exceptions import CodecError, ErrorCode, ProtocolError
from chunkline.client.protocol import (
    MAX_DEADLINE_MS,
    MAX_MODEL_NAME_LENGTH,
    SUBPROTOCOL,
    Cancel,
    CloseCode,
    Generate,
    Infer,
    Plan,
    error_message,
    parse_client_message,
    valid_request_id,
)
from chunkline.client.timing import ms
from chunkline.client.wire_format import LAYOUT_MSGPACK, LAYOUT_OOB
from chunkline.policies.base import ObservationError, flatten_observation, validate_observation
from chunkline.policies.prefix import ActionPrefix, PrefixError
from chunkline.server.config import ServerConfig
from chunkline.server.core.admission.retry_holds import RetryHolds
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.entrypoints.connection import BudgetedConnection
from chunkline.server.errors import Refusal
from chunkline.server.robot.field_decode import encoded_fields
from chunkline.server.robot.peek import Skipped, peek_map
from chunkline.server.robot.runner import InferenceResult, ModelRunner, WorkItem
from chunkline.server.robot.service import RobotActions, result_timing

if TYPE_CHECKING:
    from chunkline.server.planner import PlannerService
    from chunkline.server.text import TextService

__all__ = ["Session", "NativeSession", "SessionContext", "new_session_id", "observation_map", "IGNORED_RETRY_HINTS_BEFORE_CLOSE"]

#: ``infer`` messages sent inside their retry window after which the session is closed (1013).
IGNORED_RETRY_HINTS_BEFORE_CLOSE = 64
#: What the answer to an ``infer`` sent inside its retry window says (benchmarks look for it).
SENT_EARLY = "before the retry time given"

log = logging.getLogger("chunkline.server")

# asyncio.timeout (Python 3.11+) bounds a send without the task asyncio.wait_for creates for it.
_timeout = getattr(asyncio, "timeout", None)

#: An answered ``infer`` waiting for its reply: the request, its runner, its work item, when it
#: arrived, when its decode ended, its compressed fields' decode time.
_Answered = tuple[Infer, ModelRunner, WorkItem, float, float, "float | None"]

_INFER_KEYS = frozenset({"type", "id", "obs", "obs_time", "deadline_ms", "model", "prefix", "prefix_delay"})


def _number(value: Any) -> bool:
    return (type(value) is float or type(value) is int) and math.isfinite(value)


def _infer_header(fields: dict[str, Any]) -> tuple[int | str, float | None, str | None] | None:
    """``(id, deadline_ms, model)`` of a peeked message that is plainly an ``infer`` (every
    field of the right type and within the protocol's bounds, the observation a map), else
    ``None``: the message then takes the full path, which says exactly what is wrong with it."""
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
    if fields.get("prefix") not in (None, Skipped.MAP):
        return None
    prefix_delay = fields.get("prefix_delay")
    if prefix_delay is not None and not (type(prefix_delay) is int and prefix_delay >= 0):
        return None
    assert isinstance(request_id, (int, str))  # checked by _valid_id above
    return request_id, None if deadline_ms is None else float(deadline_ms), model


def _prefix_of(msg: Infer, runner: ModelRunner) -> ActionPrefix | None:
    """The request's prefix, checked against the policy, for a policy that uses one (others
    never see it, so a prefix they could not use is not a reason to refuse). Raises Refusal."""
    if msg.prefix is None or not runner.policy.accepts_prefix:
        return None
    spec = runner.policy.spec
    try:
        return ActionPrefix.from_wire(msg.prefix, t0=msg.obs_time, dt=spec.dt, action_dim=spec.action_dim,
                                      horizon=spec.horizon, delay_steps=msg.prefix_delay)
    except PrefixError as exc:
        raise Refusal(ErrorCode.INVALID_MESSAGE, str(exc)) from None


def observation_map(raw_obs: Any) -> dict[str, Any]:
    """A decoded observation as the flat map policy specs name (nested maps' keys joined with
    ``/``). Raises Refusal: it is not a map."""
    if not isinstance(raw_obs, dict):
        raise Refusal(ErrorCode.INVALID_OBSERVATION, "the observation must be a map")
    return flatten_observation(raw_obs)


def new_session_id() -> str:
    return secrets.token_hex(8)


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
    def __init__(self, ctx: SessionContext, ws: BudgetedConnection, tenant: TenantInfo) -> None:
        self.ctx = ctx
        self.robot = ctx.robot
        self.ws = ws
        self.id = new_session_id()
        self.tenant = tenant
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

    def _admit(self, runner: ModelRunner, flat_obs: dict[str, Any], deadline_ms: float | None, received: float,
               request: Infer | None = None) -> WorkItem:
        """Validate an observation (an :func:`observation_map`) and a native request's prefix, and
        offer it to admission. Raises Refusal."""
        try:
            obs = validate_observation(runner.policy.spec, flat_obs)
        except ObservationError as exc:
            raise Refusal(ErrorCode.INVALID_OBSERVATION, str(exc)) from None
        prefix = None if request is None else _prefix_of(request, runner)
        deadline = self.robot.deadline_for(runner, self.tenant, deadline_ms, received)
        return self.robot.submit(runner, obs, self.tenant, self.id, deadline, prefix)


class NativeSession(Session):
    """``chunkline.v1``: typed messages with ids, several requests in flight, structured errors."""

    def __init__(self, ctx: SessionContext, ws: BudgetedConnection, tenant: TenantInfo) -> None:
        super().__init__(ctx, ws, tenant)
        self.pending: dict[int | str, tuple[ModelRunner, WorkItem]] = {}
        self.generating: dict[int | str, asyncio.Task[None]] = {}  # text requests in flight
        self.planning: dict[int | str, asyncio.Task[None]] = {}  # plan requests in flight
        self._tasks: set[asyncio.Task[None]] = set()  # strong references: the loop keeps only weak ones
        # Answered infer requests waiting for their reply to be written, in the order they were
        # answered, and the one task that writes them (started with the first infer): a reply
        # costs a done-callback and a queue entry rather than a task of its own.
        self._answered: collections.deque[_Answered] = collections.deque()
        self._wake_writer: asyncio.Future[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._closing = False
        # Retry windows this session was given, per model, on the session's clock.
        self._holds = RetryHolds(IGNORED_RETRY_HINTS_BEFORE_CLOSE)
        # Array encodings this session uses: raw, and the compressed ones both ends speak.
        request = getattr(ws, "request", None)
        self.encodings = self.robot.fields.agree(request.headers.get(ENCODINGS_HEADER) if request is not None else None)
        self._agreed = frozenset(self.encodings)

    async def run(self) -> None:
        hello = {
            "type": "hello",
            "protocol": SUBPROTOCOL,
            "server": self.ctx.version_string,
            "session": self.id,
            "default_model": self.robot.default_name,
            # A tenant sees only the models it may use.
            "models": dict(self.robot.models_for(self.tenant)),
            "text_models": self.ctx.text.models_for(self.tenant) if self.ctx.text is not None else [],
            "layouts": [LAYOUT_MSGPACK, LAYOUT_OOB],
            "encodings": self.encodings,
        }
        if self.ctx.planner is not None:
            hello["planners"] = self.ctx.planner.metadata_for(self.tenant)
        await self.send(self.encoder.encode(hello))
        try:
            async for message in self.ws.messages():
                received = self.clock()
                if isinstance(message, str):
                    await self.ws.close(CloseCode.UNSUPPORTED_DATA, "chunkline.v1 carries binary msgpack frames only")
                    return
                await self._on_message(message, received)
                del message  # its buffer is free for the next message (see frame_reader.BufferPool)
        finally:
            # Disconnect: queued work is withdrawn, running work finishes and is discarded.
            self._closing = True
            for runner, item in list(self.pending.values()):
                runner.cancel(item)
            self._wake()  # the writer answers what is left (the peer has gone: nothing is sent) and ends
            for task in [*self.generating.values(), *self.planning.values()]:
                task.cancel()  # frees the text slot at the engine's next step; withdraws a plan
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _send_error(self, code: ErrorCode, message: str, request_id: Any = None, retry_after_ms: float | None = None) -> None:
        try:
            await self.send(self.encoder.encode(error_message(code, message, request_id, retry_after_ms)))
        except ConnectionClosed:
            pass

    async def _refuse(self, runner: ModelRunner, code: ErrorCode, message: str, request_id: Any, received: float,
                      retry_after_ms: float | None = None, hold: bool = True) -> None:
        """Answer a request with an error and record it, with the time from the message's
        arrival to the error written (``server_ms``). A retry time opens a window (``hold``:
        the door's own answers repeat the window they are in)."""
        if hold:
            self._holds.hold(runner.name, code, retry_after_ms, received)
        try:
            await self._send_error(code, message, request_id, retry_after_ms)
        finally:
            self.robot.record(runner, self.tenant, self.id, code.value, {"server_ms": ms(self.clock() - received)}, None)

    def _busy(self, request_id: int | str) -> bool:
        """Whether ``request_id`` is in flight: one id space per session, across classes."""
        return request_id in self.pending or request_id in self.generating or request_id in self.planning

    def _full(self) -> bool:
        """Whether requests of every class in flight on this session (one limit counts them
        all) fill it."""
        return len(self.pending) + len(self.generating) + len(self.planning) >= self.ctx.config.max_in_flight_per_session

    def _may_refuse_early(self, full: bool) -> bool:
        """Whether peeking before decoding may pay: a model is refusing, this session is
        ``full``, or it was asked to wait before sending again."""
        if full or self._holds:
            return True
        for runner in self.robot.runners.values():
            if runner.refusing:
                return True
        return False

    async def _refuse_early(self, message: bytes | memoryview, received: float) -> bool:
        """Answer an ``infer`` that admission would refuse whatever its observation holds,
        without decoding it. Returns whether it was answered (else the full path takes it)."""
        fields = peek_map(message, self.ctx.codec_limits)
        header = _infer_header(fields) if fields is not None else None
        if header is None or not self.ctx.is_ready():  # draining, ledger down, ...: the full path says so
            return False
        request_id, deadline_ms, model = header
        if self._busy(request_id):
            return False
        default = self.robot.default
        if self._full():
            await self._refuse(default, ErrorCode.OVERLOADED, "too many requests in flight on this session",
                               request_id, received, 10.0)
            return True
        runner = self.robot.runner_for(self.tenant, model)
        if runner is None:
            return False
        if await self._held_back(runner, request_id, received):
            return True
        deadline = self.robot.deadline_for(runner, self.tenant, deadline_ms, received)
        refusal = self.robot.precheck(runner, self.tenant, self.id, deadline)
        if refusal is None:
            return False
        await self._refuse(runner, refusal.code, refusal.message, request_id, received, refusal.retry_after_ms)
        return True

    async def _held_back(self, runner: ModelRunner, request_id: int | str, received: float) -> bool:
        """Refuse, without decoding it, an ``infer`` sent before the retry time this session was
        given for its model; close the session once it has ignored too many such hints.
        Returns whether the message was answered."""
        held = self._holds.check(runner.name, received)
        if held is None:
            return False
        if held.first:
            runner.sent_early(self.id)  # its place in the retry line no longer protects it
        if held.close:
            log.info("session %s: closing after %d requests sent inside their retry window", self.id, self._holds.in_a_row)
            await self.ws.close(CloseCode.TRY_AGAIN_LATER, "retry_after_ms ignored: reconnect later")
            return True
        await self._refuse(runner, held.code, f"sent {held.wait_ms:.0f} ms {SENT_EARLY}; wait retry_after_ms",
                           request_id, received, held.wait_ms, hold=False)
        return True

    async def _on_message(self, message: bytes | memoryview, received: float) -> None:
        # One reading of "full" serves both checks of this message: until the second, nothing
        # suspends (an early refusal that suspends returns) and no request is added or removed.
        full = self._full()
        if self._may_refuse_early(full) and await self._refuse_early(message, received):
            return
        try:
            obj = decode(message, self.ctx.codec_limits)
        except CodecError as exc:
            await self._refuse(self.robot.default, ErrorCode.INVALID_MESSAGE, str(exc), None, received)
            return
        decoded = self.clock()
        try:
            msg = parse_client_message(obj)
        except ProtocolError as exc:
            raw_id = obj.get("id") if isinstance(obj, dict) else None
            # Echo the id only when it is a valid one: an error must itself be a valid message.
            safe_id = raw_id if valid_request_id(raw_id) else None
            await self._refuse(self.robot.default, ErrorCode.INVALID_MESSAGE, str(exc), safe_id, received)
            return
        # parse_client_message makes exact classes: a dispatch on type() (no isinstance calls).
        if type(msg) is Cancel:
            entry = self.pending.get(msg.id)
            if entry is not None:
                entry[0].cancel(entry[1])  # the reply task answers with `cancelled`
            # Cancelled on the loop's next turn: a task cancelled before its first step (its request
            # and the cancel in one read) would end without entering handle_*, answering nothing.
            loop = asyncio.get_running_loop()
            generation = self.generating.get(msg.id)
            if generation is not None:
                loop.call_soon(generation.cancel)  # handle_generate answers `cancelled`
            planning = self.planning.get(msg.id)
            if planning is not None:
                loop.call_soon(planning.cancel)  # handle_plan answers `cancelled`
            return
        if self._busy(msg.id):
            await self._refuse(self.robot.default, ErrorCode.DUPLICATE_ID, "a request with this id is already in flight", msg.id, received)
            return
        if full:
            await self._refuse(self.robot.default, ErrorCode.OVERLOADED, "too many requests in flight on this session", msg.id,
                               received, 10.0)
            return
        if type(msg) is Generate:
            await self._on_generate(msg)
            return
        if type(msg) is Plan:
            await self._on_plan(msg)
            return
        if type(msg) is not Infer:
            raise AssertionError(f"unexpected client message {type(msg).__name__}")
        runner = self.robot.runner_for(self.tenant, msg.model)
        if runner is None:
            # A model the tenant may not use is reported as unknown: tenants do not learn each other's models.
            await self._refuse(self.robot.default, ErrorCode.UNKNOWN_MODEL, f"no model named {msg.model!r}", msg.id, received)
            return
        image_decode_s: float | None = None
        try:
            obs = observation_map(msg.obs)
            compressed = encoded_fields(obs)
            if compressed:
                # Checked against the spec and the session first, then decoded on the pool:
                # this session waits, the loop serves everyone else meanwhile.
                fields = self.robot.fields
                image_decode_s = await fields.decode(obs, fields.check(runner.policy.spec, self._agreed, compressed))
                decoded = self.clock()
            item = self._admit(runner, obs, msg.deadline_ms, received, msg)
        except Refusal as exc:
            await self._refuse(runner, exc.code, exc.message, msg.id, received, exc.retry_after_ms)
            return
        self.pending[msg.id] = (runner, item)
        if item.future.done() and not self._answered:
            # Answered during submit (an inline policy) with no earlier answer waiting: reply
            # now, without a trip through the writer.
            await self._reply(msg, runner, item, received, decoded, image_decode_s)
            return
        item.future.add_done_callback(functools.partial(self._on_answered, (msg, runner, item, received, decoded, image_decode_s)))
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_replies())
            self._tasks.add(self._writer)

    def _on_answered(self, answered: _Answered, _future: object) -> None:
        self._answered.append(answered)
        self._wake()

    def _wake(self) -> None:
        wake = self._wake_writer
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _write_replies(self) -> None:
        """The session's reply writer: each answered request's chunk or error, in answer order,
        until the session closes with nothing left pending."""
        loop = asyncio.get_running_loop()
        while True:
            while self._answered:
                await self._reply(*self._answered.popleft())
            if self._closing and not self.pending:
                return
            self._wake_writer = loop.create_future()
            try:
                await self._wake_writer
            finally:
                self._wake_writer = None

    async def _on_generate(self, msg: Generate) -> None:
        from chunkline.server.entrypoints.text_native import handle_generate  # text only: not loaded for robot-only servers

        text = self.ctx.text
        if text is None:
            await self._send_error(ErrorCode.UNKNOWN_MODEL, "this server serves no text models", msg.id)
            return

        async def send(message: dict[str, Any]) -> None:
            await self.send(self.encoder.encode(message))

        async def run() -> None:
            try:
                await handle_generate(text, msg, self.tenant, self.id, send)
            except (asyncio.CancelledError, ConnectionClosed):
                pass
            finally:
                self.generating.pop(msg.id, None)

        task = asyncio.get_running_loop().create_task(run())
        self.generating[msg.id] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_plan(self, msg: Plan) -> None:
        from chunkline.server.entrypoints.planner_native import handle_plan  # planner only: not loaded without planners

        planner = self.ctx.planner
        if planner is None:
            await self._send_error(ErrorCode.UNKNOWN_MODEL, "this server serves no planners", msg.id)
            return

        async def send(message: dict[str, Any]) -> None:
            await self.send(self.encoder.encode(message))

        async def run() -> None:
            try:
                await handle_plan(planner, msg, self.tenant, self.id, send)
            except (asyncio.CancelledError, ConnectionClosed):
                pass
            finally:
                self.planning.pop(msg.id, None)

        task = asyncio.get_running_loop().create_task(run())
        self.planning[msg.id] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, msg: Infer, runner: ModelRunner, item: WorkItem, received: float, decoded: float,
                     image_decode_s: float | None = None) -> None:
        """Write an infer request's chunk, or its error, once it is answered, and record it.

        A request answered before this is called (a policy run on the loop) usually goes through
        without suspending: its result read off its future, its chunk written straight to the
        transport (:meth:`send_now`), and no coroutine entered but this one, on the critical
        path of every such request (5.5 us of it, in-process A/B)."""
        timing: dict[str, float] | None = None  # a chunk's full timing; without one (an error), decode_ms alone
        outcome = ErrorCode.INTERNAL.value
        future = item.future
        try:
            try:
                try:
                    result = future.result() if future.done() else await future
                except Refusal as exc:
                    outcome = exc.code.value
                    await self._send_error(exc.code, exc.message, msg.id, exc.retry_after_ms)
                    return
                data, timing = self._chunk(msg, runner, result, received, decoded, image_decode_s)
                outcome = "late" if result.late else "ok"
                if not self.send_now(data):
                    try:
                        await self.send(data)
                    except ConnectionClosed:
                        outcome = ErrorCode.CANCELLED.value  # nobody left to receive it
            finally:
                self.pending.pop(msg.id, None)
                if timing is None:
                    timing = {"decode_ms": ms(decoded - received)}
                self.robot.record(runner, self.tenant, self.id, outcome, timing, item)
        except Exception:  # one reply's bug must not end the session or leave later requests unanswered
            log.exception("session %s: writing a reply failed", self.id)

    def _chunk(self, msg: Infer, runner: ModelRunner, result: InferenceResult, received: float, decoded: float,
               image_decode_s: float | None) -> tuple[bytes, dict[str, float]]:
        """An answered request's ``chunk`` message, encoded, and its stage times (ms)."""
        spec = runner.policy.spec
        t0 = None if msg.obs_time is None else msg.obs_time + spec.action_offset
        head = {  # the scalar fields first: the encoder packs them in one call
            "type": "chunk",
            "id": msg.id,
            "t0": t0,
            "dt": spec.dt,
            "expires": None if t0 is None else t0 + spec.validity,
            "model": runner.name,
            "fingerprint": runner.policy.fingerprint,
            "late": result.late,
            "actions": result.actions,
        }
        encode_start = self.clock()
        # Encode the bulk first, time it, then append the timing entry to the same map.
        body = self.encoder.encode_map_prefix(len(head) + 1, head)
        timing = result_timing(result, decoded - received, image_decode_s)
        encoded = self.clock()  # one reading ends both spans
        timing["encode_ms"] = ms(encoded - encode_start)
        timing["server_ms"] = ms(encoded - received)
        return body + self.encoder.encode_map_entries({"timing": timing}), timing
