"""The sans-I/O core both clients share: request ids, messages, reply matching, reconnect decisions.

:class:`ClientCore` never touches a socket, never sleeps and reads time only from its injected
clock. The shells (:class:`~chunkline.client.sync_client.Client` over ``websockets.sync`` and
:class:`~chunkline.client.asyncio_client.AsyncClient` over ``websockets.asyncio``) move bytes
and wait; everything they decide, they ask the core::

    give_up = core.connect_deadline(timeout)
    loop:   open with core.connect_options(); core.on_connected(first message) -> Hello
            on a refused handshake: core.refusal(exc) -> ServerError (final) or None (retry)
            on a failure in RETRYABLE: sleep core.retry_delay(give_up, exc) (raises ConnectionLost)
    out = core.start_infer(...)          # id + encoded bytes; the request is now pending
    core.sending(out.request_id); send out.data; core.sent(out.request_id)
    for each message: answer = core.receive(data)  # None, or the outcome of a pending request
    core.forget(out.request_id)          # done or given up: a late reply is then dropped
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any, TypedDict

import numpy as np
import websockets
from websockets.typing import Subprotocol

from .backoff import Backoff
from .compression import AdaptiveChooser, Compressed, Compression, UploadPlan, iter_arrays, plan_fields
from .environment import resolve_api_key, resolve_uri
from .exceptions import ConnectionLost, RequestTimeout, ServerError, server_error
from .timing import ms
from .wire.codec import DEFAULT_LIMITS, CodecLimits, Encoder, decode
from .wire.encodings import ENCODINGS_HEADER, JPEG, RAW
from .wire.errors import ChunklineError, CodecError, ProtocolError
from .wire.format import LAYOUT_OOB
from .wire.protocol import ROBOT_WEIGHT_HEADER, SUBPROTOCOL, Chunk, Done, Error, Hello, PlanReply, Token, Urgency, parse_server_message

__all__ = ["RETRYABLE", "Answer", "ClientCore", "ClientOptions", "Outgoing", "auth_headers"]

log = logging.getLogger("chunkline.client")

#: connection failures worth another attempt (a refused handshake is a :class:`ServerError`, not one of these)
RETRYABLE: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, websockets.InvalidHandshake, ProtocolError, CodecError, websockets.ConnectionClosed,
)

#: handshake refusals that retrying cannot fix, as the error codes the server would send
_REFUSALS = {401: "unauthenticated", 403: "forbidden", 429: "quota_exceeded"}


def auth_headers(api_key: str | None) -> dict[str, str] | None:
    """The ``Authorization`` header chunkline (and openpi-client) sends."""
    return {"Authorization": f"Api-Key {api_key}"} if api_key else None


class ClientOptions(TypedDict, total=False):
    """The keyword arguments both clients take (and hand to :class:`ClientCore`, which documents them)."""

    api_key: str | None
    open_timeout: float
    connect_timeout: float
    request_timeout: float | None
    backoff: Backoff | None
    limits: CodecLimits
    ssl: Any
    honour_retry_after: bool
    compression: Compression | None
    robot_weight: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class Outgoing:
    """A request (``infer`` or ``plan``) ready to send: its id and its encoded bytes."""

    request_id: int
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """How a pending request ended: a chunk (an ``infer``), a plan (a ``plan``), or the error
    to raise to its caller."""

    request_id: int | str
    chunk: Chunk | None = None
    error: ChunklineError | None = None
    plan: PlanReply | None = None

    def result(self) -> Chunk:
        """The chunk, or raise the error."""
        if self.error is not None:
            raise self.error
        assert self.chunk is not None  # an infer's Answer holds a chunk or an error
        return self.chunk

    def plan_result(self) -> PlanReply:
        """The plan, or raise the error."""
        if self.error is not None:
            raise self.error
        assert self.plan is not None  # a plan's Answer holds a plan or an error
        return self.plan

    def value(self) -> Chunk | PlanReply:
        """Whichever reply it holds, or raise the error (for shells that keep one future type)."""
        if self.error is not None:
            raise self.error
        reply = self.chunk if self.chunk is not None else self.plan
        assert reply is not None
        return reply


@dataclasses.dataclass(slots=True)
class _Pending:
    timing: dict[str, float]
    send_started: float = math.nan
    model: str | None = None
    upload: UploadPlan | None = None  # what the adaptive mode learns from once the reply is in
    compressed: Compressed | None = None
    size: int = 0
    kind: str = "infer"  # or "plan": which reply answers it


class ClientCore:
    """Protocol state of one client: what to send, what a reply means, when to retry.

    Args:
        uri: ``ws://host:port`` or ``wss://host:port``; ``None``: ``$CHUNKLINE_URI``, else ``ws://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Api-Key <key>``; ``None``: ``$CHUNKLINE_API_KEY``, if set.
        open_timeout: seconds for one connection attempt (TCP + TLS + handshake + hello).
        connect_timeout: seconds to keep retrying before a call gives up with :class:`ConnectionLost`.
        request_timeout: default seconds to wait for a reply (``None``: the deadline plus a
            margin when a deadline is given, else 30 s).
        backoff: reconnection delays (a default :class:`Backoff` if omitted).
        limits: caps on replies (the client distrusts the network too).
        ssl: an ``ssl.SSLContext`` for ``wss://`` with a private CA (handed to the shell's connect).
        clock: the monotonic clock every timestamp and deadline is read from.
        honour_retry_after: after a refusal that carries ``retry_after_ms``, refuse new requests
            for the same model locally (a :class:`ServerError` with the same code and the time
            still to wait) instead of uploading an observation the server asked not to send yet.
        compression: how image fields travel (:class:`~chunkline.client.compression.Compression`:
            raw by default, JPEG at a fixed quality, or adaptive to the measured uplink).
        robot_weight: the service weight this robot asks for among its tenant's robots (sent at
            the handshake; the server bounds it and says in ``hello`` what it granted);
            ``None``: its key's or its tenant's.
    """

    def __init__(
        self,
        uri: str | None = None,
        *,
        api_key: str | None = None,
        open_timeout: float = 10.0,
        connect_timeout: float = 30.0,
        request_timeout: float | None = None,
        backoff: Backoff | None = None,
        limits: CodecLimits = DEFAULT_LIMITS,
        ssl: Any = None,
        clock: Callable[[], float] = time.monotonic,
        honour_retry_after: bool = True,
        compression: Compression | None = None,
        robot_weight: float | None = None,
    ) -> None:
        self.uri = resolve_uri(uri)
        self.open_timeout = open_timeout
        self.connect_timeout = connect_timeout
        self.limits = limits
        self.clock = clock
        self.hello: Hello | None = None
        self.closed = False
        self._api_key = resolve_api_key(api_key)
        self._request_timeout = request_timeout
        self._backoff = backoff or Backoff()
        self._ssl = ssl
        self._encoder = Encoder()
        self._ids = itertools.count(1)
        self._pending: dict[int | str, _Pending] = {}
        self.honour_retry_after = honour_retry_after
        #: per model asked for (None: the default), until when the server asked not to send, and why
        self._held: dict[str | None, tuple[float, str, str]] = {}
        self.compression = compression or Compression()
        self._warned_raw: set[str | None] = set()  # models (None: the session) already warned about sending raw
        self.robot_weight = robot_weight
        self.chooser = (AdaptiveChooser(self.compression.latency_budget_ms / 1000.0, self.compression.qualities)
                        if self.compression.mode == "adaptive" else None)

    # ------------------------------------------------------------------ connecting

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``websockets``' ``connect`` (the same for its sync and asyncio versions)."""
        headers = auth_headers(self._api_key) or {}
        offered = self.compression.offered
        if offered:
            headers[ENCODINGS_HEADER] = ", ".join(offered)
        if self.robot_weight is not None:
            headers[ROBOT_WEIGHT_HEADER] = repr(float(self.robot_weight))
        return {
            "subprotocols": [Subprotocol(SUBPROTOCOL)],
            "additional_headers": headers or None,
            "open_timeout": self.open_timeout,
            "max_size": self.limits.max_message_bytes,
            "compression": None,
            "ssl": self._ssl,
        }

    def check_open(self) -> None:
        """Raise :class:`ConnectionLost` once the client is closed."""
        if self.closed:
            raise ConnectionLost("client is closed")

    def connect_deadline(self, timeout: float | None = None) -> float:
        """When to stop retrying a connection started now (``timeout`` defaults to ``connect_timeout``)."""
        return self.clock() + (self.connect_timeout if timeout is None else timeout)

    def refusal(self, exc: websockets.InvalidStatus) -> ServerError | None:
        """The :class:`ServerError` for a handshake refused for good (HTTP 401, 403, 429), else ``None``."""
        status = exc.response.status_code
        if status not in _REFUSALS:
            return None
        body = bytes(exc.response.body or b"").decode(errors="replace").strip()[:200]
        retry = exc.response.headers.get("Retry-After")
        return ServerError(_REFUSALS[status], f"handshake refused: HTTP {status}: {body}",
                           float(retry) * 1000.0 if retry and retry.isdigit() else None)

    def retry_delay(self, give_up: float, failure: BaseException) -> float:
        """How long to wait before the next attempt after ``failure``.

        Raises:
            ConnectionLost: the next attempt would start after ``give_up``.
        """
        delay = self._backoff.next_delay()
        if self.clock() + delay > give_up:
            raise ConnectionLost(f"could not connect to {self.uri}: {failure!r}") from failure
        return delay

    def on_connected(self, first_message: bytes | str) -> Hello:
        """Check the server's first message (it must be ``hello``) and reset the backoff.

        Raises:
            ProtocolError, CodecError: the server did not start with a valid ``hello``.
        """
        hello = self._parse(first_message)
        if not isinstance(hello, Hello):
            raise ProtocolError("the server did not start with hello")
        self.hello = hello
        self._backoff.reset()
        return hello

    # ------------------------------------------------------------------ requests

    def reply_timeout(self, deadline_ms: float | None, timeout: float | None) -> float:
        """Seconds to wait for a reply: ``timeout``, else ``request_timeout``, else the deadline
        plus a second when there is one, else 30 s."""
        if timeout is None:
            timeout = self._request_timeout
        if timeout is None:
            timeout = 30.0 if deadline_ms is None else deadline_ms / 1000.0 + 1.0
        return timeout

    def plan_upload(self, obs: dict[str, Any], model: str | None) -> UploadPlan | None:
        """Which fields of ``obs`` to compress and how (``None``: send it as it is), from the
        compression mode, the session's agreed encodings and the model's spec; the adaptive mode
        picks the JPEG quality (or raw) from the measured uplink here."""
        hello = self.hello
        if self.compression.mode == "raw" or hello is None:
            return None
        if len(hello.encodings) < 2:
            self._warn_raw(None, "the session agreed no compressed encoding (the server lacks the codecs, or this client "
                                 "has none: pip install -e '.[jpeg]')")
            return None
        name = model or hello.default_model
        meta = hello.models.get(name)
        spec = meta.get("observation") if isinstance(meta, dict) else None
        if not isinstance(spec, dict):
            return None
        quality: int | None = self.compression.quality if self.chooser is None else self.compression.qualities[0]
        plans = plan_fields(obs, spec, hello.encodings, quality)
        if not plans:
            self._warn_raw(name, f"model {name!r} allows no compressed field (serve it with --policy-arg jpeg=QUALITY "
                                 "to let its cameras travel as JPEG)")
            return None
        arrays = dict(iter_arrays(obs))
        eligible = sum(int(arrays[name].nbytes) for name, plan in plans.items() if plan.encoding == JPEG)
        if self.chooser is not None and eligible:
            choice = self.chooser.choose(eligible)
            if choice != quality:
                plans, quality = plan_fields(obs, spec, hello.encodings, choice), choice
        return UploadPlan(plans, quality if eligible else None, eligible)

    def _warn_raw(self, model: str | None, why: str) -> None:
        """Once per model (and once for the session): compression was asked for, raw is sent."""
        if model in self._warned_raw:
            return
        self._warned_raw.add(model)
        log.warning("compression %r asked for, sending raw: %s", self.compression.mode, why)

    def start_infer(self, obs: dict[str, Any], obs_time: float | None, deadline_ms: float | None,
                    model: str | None, prefix: np.ndarray | None, upload: UploadPlan | None = None,
                    compressed: Compressed | None = None, prefix_delay: int | None = None,
                    urgency: Urgency | None = None, replaces: int | str | None = None,
                    request_id: int | None = None) -> Outgoing:
        """A new ``infer`` (optional fields only when set), encoded; it is pending from now on.

        ``upload``: the plan :meth:`plan_upload` gave for ``obs``; ``compressed``: the observation
        with the plan's fields compressed (``obs`` is then what it was made from); ``urgency``: the
        scheduling key (validated when built: :class:`~.protocol.Urgency`); ``replaces``: the id of
        a request of this session still queued that this one refreshes (docs/protocol.md);
        ``request_id``: the id it goes by (default: the client's next), for a caller that must
        name it before it is sent (a later one ``replaces`` it).

        Raises:
            ServerError: the server refused this model's last request with a ``retry_after_ms``
                that has not passed yet (with ``honour_retry_after``): nothing is sent.
            ValueError: ``request_id`` is already pending.
        """
        self._check_hold(model)
        if request_id is None:
            request_id = next(self._ids)
        elif request_id in self._pending:
            raise ValueError(f"request id {request_id} is already pending")
        msg: dict[str, Any] = {"type": "infer", "id": request_id, "obs": obs if compressed is None else compressed.obs,
                               "obs_time": obs_time}
        if deadline_ms is not None:
            msg["deadline_ms"] = float(deadline_ms)
        if model is not None:
            msg["model"] = model
        if prefix is not None:
            msg["prefix"] = prefix
            if prefix_delay is not None:
                msg["prefix_delay"] = int(prefix_delay)
        if urgency is not None:
            msg["urgency"] = urgency.wire()
        if replaces is not None:
            msg["replaces"] = replaces
        started = self.clock()
        out_of_band = self.hello is not None and LAYOUT_OOB in self.hello.layouts
        data = self._encoder.encode_oob(msg) if out_of_band else self._encoder.encode(msg)
        timing = {"encode_ms": ms(self.clock() - started), "uplink_bytes": float(len(data))}
        if upload is not None:
            timing["compress_ms"] = ms(compressed.seconds) if compressed is not None else 0.0
            timing["jpeg_quality"] = float(upload.quality or 0)  # 0: the camera fields went raw
        self._pending[request_id] = _Pending(timing, model=model, upload=upload, compressed=compressed, size=len(data))
        return Outgoing(request_id, data)

    def start_plan(self, obs: dict[str, Any], obs_time: float | None, instruction: str, context: dict[str, Any] | None,
                   deadline_ms: float | None, planner: str | None) -> Outgoing:
        """A new ``plan`` (optional fields only when set), encoded; it is pending from now on.

        Raises:
            ServerError: the server refused this planner's last request with a ``retry_after_ms``
                that has not passed yet (with ``honour_retry_after``): nothing is sent.
        """
        key = _plan_hold_key(planner)
        self._check_hold(key)
        request_id = next(self._ids)
        msg: dict[str, Any] = {"type": "plan", "id": request_id, "obs": obs, "instruction": instruction}
        if obs_time is not None:
            msg["obs_time"] = float(obs_time)
        if context:
            msg["context"] = context
        if deadline_ms is not None:
            msg["deadline_ms"] = float(deadline_ms)
        if planner is not None:
            msg["planner"] = planner
        data = self._encoder.encode(msg)
        self._pending[request_id] = _Pending({"uplink_bytes": float(len(data))}, model=key, size=len(data), kind="plan")
        return Outgoing(request_id, data)

    def _check_hold(self, key: str | None) -> None:
        """Refuse locally while the server's ``retry_after_ms`` for ``key`` has not passed."""
        held = self._held.get(key)
        if held is not None:
            until, code, message = held
            wait = until - self.clock()
            if wait > 0:
                raise ServerError(code, f"{message} (not sent: the server asked to retry in {wait * 1000.0:.0f} ms)", wait * 1000.0)
            del self._held[key]

    def sending(self, request_id: int) -> None:
        """The shell starts sending the request now (the round trip counts from here)."""
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.send_started = self.clock()

    def sent(self, request_id: int) -> None:
        """The shell finished sending the request."""
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.timing["send_ms"] = ms(self.clock() - pending.send_started)

    def forget(self, request_id: int) -> None:
        """The request is over (answered or given up): a reply that comes later is dropped."""
        self._pending.pop(request_id, None)

    def pending_ids(self) -> list[int | str]:
        """The requests still waiting for a reply."""
        return list(self._pending)

    def cancel_message(self, request_id: int) -> bytes:
        """The encoded ``cancel`` for a request the caller gave up on."""
        return self._encoder.encode({"type": "cancel", "id": request_id})

    def timed_out(self, request_id: int, timeout: float) -> RequestTimeout:
        """The error for a request with no reply within ``timeout`` seconds."""
        return RequestTimeout(f"no reply to request {request_id} within {timeout:.3f} s")

    def receive(self, data: bytes | str) -> Answer | None:
        """Take one message from the server.

        Returns:
            The outcome of the pending request it answers, or ``None`` for anything else
            (an invalid message, a ``hello``, a session-level error, a late reply), which is
            logged where it matters and dropped.
        """
        received = self.clock()
        try:
            msg = self._parse(data)
        except (CodecError, ProtocolError) as exc:
            log.warning("dropping an invalid message from the server: %s", exc)
            return None
        if isinstance(msg, Hello):
            return None
        request_id = msg.id
        if request_id is None:  # only an error lacks an id: the session's, not a request's
            if isinstance(msg, Error):
                log.warning("server error on the session: %s %s", msg.code, msg.message)
            return None
        pending = self._pending.get(request_id)
        if pending is None:
            return None  # a reply to a request this client already gave up on
        timing = pending.timing
        timing["decode_ms"] = ms(self.clock() - received)
        if isinstance(msg, Error):
            if msg.retry_after_ms is not None and self.honour_retry_after:
                self._held[pending.model] = (received + msg.retry_after_ms / 1000.0, msg.code, msg.message)
            return Answer(request_id, error=server_error(msg.code, msg.message, msg.retry_after_ms, request_id))
        if pending.kind == "plan":
            if not isinstance(msg, PlanReply):
                return Answer(request_id, error=ProtocolError(f"plan {request_id!r} was answered with a {msg.type!r} message"))
            msg.timing["round_trip_ms"] = ms(received - pending.send_started)
            return Answer(request_id, plan=msg)
        if not isinstance(msg, Chunk):  # a text or plan message (token, done, plan_reply) cannot answer an infer
            return Answer(request_id, error=ProtocolError(f"request {request_id!r} was answered with a {msg.type!r} message"))
        if msg.actions.ndim != 2:
            return Answer(request_id, error=ProtocolError(f"chunk actions must be 2-D, got shape {msg.actions.shape}"))
        timing["round_trip_ms"] = ms(received - pending.send_started)
        msg.record_arrival(timing, received, RAW if pending.compressed is None else pending.compressed.label)
        self._learn(pending, received - pending.send_started, msg.timing)
        return Answer(request_id, chunk=msg)

    def _learn(self, pending: _Pending, round_trip_s: float, server_timing: dict[str, float]) -> None:
        """Feed the adaptive mode what a finished request cost."""
        upload, compressed = pending.upload, pending.compressed
        if self.chooser is None or upload is None or not upload.eligible_bytes:
            return
        server_s = server_timing.get("server_ms", 0.0) / 1000.0
        codec_s = (compressed.seconds if compressed is not None else 0.0) + server_timing.get("image_decode_ms", 0.0) / 1000.0
        payload = compressed.payload_bytes if compressed is not None and upload.quality is not None else upload.eligible_bytes
        self.chooser.observe(upload.quality, upload.eligible_bytes, payload, pending.size, max(round_trip_s - server_s, 0.0), codec_s)

    def connection_lost(self, detail: str) -> ConnectionLost:
        """The error for requests whose connection closed under them."""
        return ConnectionLost(f"connection closed ({detail})")

    def close(self) -> None:
        """No connection may be opened any more."""
        self.closed = True

    def _parse(self, data: bytes | str) -> Hello | Chunk | Error | Token | Done | PlanReply:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProtocolError("a text frame where binary msgpack is expected")
        return parse_server_message(decode(data, self.limits))


def _plan_hold_key(planner: str | None) -> str:
    """The key a planner's retry hold is kept under: apart from the models' (a planner and a
    policy may share a name), and the default planner apart from the default model."""
    return f"plan\0{planner or ''}"
