"""The live fuzzer: fuzzed frames sent to a real ``chunkline serve``, each answer checked by the oracle."""

from __future__ import annotations

import struct
import time
from typing import Any

from chunkline.client.wire.codec import CodecLimits, decode
from chunkline.client.wire.errors import CodecError, ProtocolError
from chunkline.client.wire.protocol import SUBPROTOCOL, Chunk, Error, Hello, parse_server_message
from chunkline.policies.base import PolicySpec

from .errors import FuzzFailure
from .oracle import DocumentedCodes, Expect, documented_codes, expect_compat, expect_native, request_key, sentinel_frame, valid_request_id
from .policy import CANARY, FUZZ_MAX_MESSAGE_BYTES, FUZZ_POLICY_REF, FUZZ_SPEC, fuzz_limits
from .rawws import RawFrame, RawWebSocket
from .strategies import native_frames, ws_scenarios

__all__ = ["check_compat", "NativeProbe", "check_ws_scenario", "run_live"]


def check_compat(uri: str, frame: bytes, spec: PolicySpec = FUZZ_SPEC, limits: CodecLimits | None = None,
                 codes: DocumentedCodes | None = None, timeout: float = 10.0) -> Expect:
    """Send one frame on a fresh openpi-compatible session and check the answer against
    :func:`expect_compat`.

    Raises:
        FuzzFailure: any departure from the documented behaviour.
    """
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    limits = limits or fuzz_limits()
    codes = codes or documented_codes()
    expect = expect_compat(frame, limits, spec)
    with connect(uri, max_size=None, compression=None, open_timeout=timeout) as ws:
        first = ws.recv(timeout=timeout)
        meta = decode(first) if isinstance(first, bytes) else None
        if not isinstance(meta, dict) or "action_horizon" not in meta:
            raise FuzzFailure("compat session did not start with the metadata map")
        try:
            ws.send(frame)
            answer = ws.recv(timeout=timeout)
        except TimeoutError:
            raise FuzzFailure("no answer: the compat session hangs", frame) from None
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            if expect.kind != "close" or code not in expect.closes or code not in codes.closes:
                raise FuzzFailure(f"closed with {code}; expected {expect}", frame) from None
            return expect
        if isinstance(answer, bytes):
            reply = decode(answer)
            if expect.kind != "reply" or not isinstance(reply, dict) or getattr(reply.get("actions"), "shape", None) != (
                    spec.horizon, spec.action_dim):
                raise FuzzFailure(f"unexpected binary answer; expected {expect}", frame)
            return expect
        error_code, _, message = answer.partition(": ")
        if error_code not in codes.errors or error_code not in expect.codes:
            raise FuzzFailure(f"text answer {answer[:120]!r}; expected {expect}", frame)
        if CANARY in message:
            raise FuzzFailure("an error message repeats observation content", frame)
        try:
            extra = ws.recv(timeout=timeout)
            raise FuzzFailure(f"compat session stayed open after an error (sent {type(extra).__name__})", frame)
        except ConnectionClosed as exc:
            closed = exc.rcvd.code if exc.rcvd is not None else None
        except TimeoutError:
            raise FuzzFailure("compat session not closed after an error", frame) from None
        if closed not in expect.closes:
            raise FuzzFailure(f"closed with {closed} after an error; expected {sorted(expect.closes)}", frame)
    return expect


# ---------------------------------------------------------------------------------- live native session


class NativeProbe:
    """One native session that sends a fuzzed frame and a sentinel, then checks every answer.

    Reconnects after a close. Counts what it did (``frames``, ``closes``, ``reconnects``).

    Args:
        uri: the server.
        spec: the served policy's spec.
        limits: the server's codec limits.
        codes: the documented codes.
        recv_timeout: longest wait for any one answer (a session that stays silent longer is hung).
        strict_ids: an error must never carry an invalid request id; when false, such an error
            is counted in ``invalid_id_echoes`` and matched as if its id were null.
    """

    def __init__(self, uri: str, spec: PolicySpec = FUZZ_SPEC, limits: CodecLimits | None = None,
                 codes: DocumentedCodes | None = None, recv_timeout: float = 10.0, strict_ids: bool = True) -> None:
        self.uri = uri
        self.spec = spec
        self.limits = limits or fuzz_limits()
        self.codes = codes or documented_codes()
        self.recv_timeout = recv_timeout
        self.models: set[str] = set()
        self.text_models: set[str] = set()
        self.frames = 0
        self.closes: dict[int, int] = {}
        self.errors: dict[str, int] = {}
        self.chunks = 0
        self.streams = 0
        self.reconnects = 0
        self.strict_ids = strict_ids
        self.invalid_id_echoes = 0
        self._ws: Any = None
        self._n = 0

    def _connect(self) -> Any:
        from websockets.sync.client import connect
        from websockets.typing import Subprotocol

        if self._ws is None:
            self._ws = connect(self.uri, subprotocols=[Subprotocol(SUBPROTOCOL)], max_size=None, compression=None,
                               open_timeout=self.recv_timeout).__enter__()
            hello = parse_server_message(decode(self._ws.recv(timeout=self.recv_timeout)))
            if not isinstance(hello, Hello):
                raise FuzzFailure("a native session must start with hello")
            self.models = set(hello.models)
            self.text_models = set(getattr(hello, "text_models", ()) or ())
            self.reconnects += 1
        return self._ws

    def close(self) -> None:
        """Close the session (with a close handshake)."""
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def _recv(self, ws: Any, frame: bytes) -> Any:
        from websockets.exceptions import ConnectionClosed

        try:
            data = ws.recv(timeout=self.recv_timeout)
        except TimeoutError:
            raise FuzzFailure(f"no answer within {self.recv_timeout} s: the session hangs", frame) from None
        except ConnectionClosed:
            raise
        if not isinstance(data, bytes):
            raise FuzzFailure(f"a native session sent a text frame: {data[:80]!r}", frame)
        obj: Any = None
        try:
            obj = decode(data)
            return parse_server_message(obj)
        except (CodecError, ProtocolError) as exc:
            if (not self.strict_ids and isinstance(obj, dict) and obj.get("type") == "error"
                    and not valid_request_id(obj.get("id")) and obj.get("id") is not None):
                # Known server bug (see tests/live/test_fuzz_protocol.py): an invalid id echoed back.
                self.invalid_id_echoes += 1
                return parse_server_message({**obj, "id": None})
            raise FuzzFailure(f"the server sent an invalid message: {exc}", frame) from None

    def _check_error(self, msg: Error, allowed: frozenset[str], frame: bytes) -> None:
        if msg.code not in self.codes.errors:
            raise FuzzFailure(f"undocumented error code {msg.code!r}: {msg.message}", frame)
        if msg.code not in allowed:
            raise FuzzFailure(f"error {msg.code!r} ({msg.message}), expected one of {sorted(allowed)}", frame)
        if CANARY in msg.message:
            raise FuzzFailure("an error message repeats observation content", frame)
        self.errors[msg.code] = self.errors.get(msg.code, 0) + 1

    def check(self, frame: bytes) -> Expect:
        """Send ``frame`` and a sentinel; check the answers against :func:`expect_native`.

        Raises:
            FuzzFailure: any departure from the protocol.
        """
        try:
            return self._check(frame)
        except BaseException:
            # A failed check leaves answers unread: start the next one on a clean session.
            self._drop()
            raise

    def _drop(self) -> None:
        if self._ws is not None:
            self._ws.close_socket() if hasattr(self._ws, "close_socket") else self._ws.socket.close()
            self._ws = None

    def _check(self, frame: bytes) -> Expect:
        from websockets.exceptions import ConnectionClosed

        ws = self._connect()
        expect = expect_native(frame, self.limits, self.spec, self.models, self.text_models)
        self._n += 1
        self.frames += 1
        sentinel = f"~sentinel-{self._n}"
        if expect.request_id == sentinel:  # never in practice; keep the two answers apart
            sentinel += "-b"
        try:
            ws.send(frame)
            if expect.kind == "close":
                while True:  # answers to nothing: the next event must be the close
                    msg = self._recv(ws, frame)
                    raise FuzzFailure(f"expected close {sorted(expect.closes)}, got {msg!r}", frame)
            ws.send(sentinel_frame(sentinel))
            waiting = {request_key(sentinel): "chunk"}
            if expect.kind in ("error", "reply", "stream"):
                waiting[request_key(expect.request_id)] = expect.kind
            while waiting:
                msg = self._recv(ws, frame)
                rid = request_key(msg.id)
                if rid not in waiting:
                    raise FuzzFailure(f"an answer nobody waits for (lost, duplicated or misrouted): {msg!r}", frame)
                if getattr(msg, "type", None) == "token":
                    if waiting[rid] != "stream":
                        raise FuzzFailure(f"tokens where {waiting[rid]} was due", frame)
                    continue
                kind = waiting.pop(rid)
                if getattr(msg, "type", None) == "done":
                    if kind != "stream":
                        raise FuzzFailure(f"a done where {kind} was due", frame)
                    self.streams += 1
                    continue
                if isinstance(msg, Chunk):
                    if kind != "chunk" and kind != "reply":
                        raise FuzzFailure(f"a chunk where error {sorted(expect.codes)} was due", frame)
                    if msg.actions.shape != (self.spec.horizon, self.spec.action_dim):
                        raise FuzzFailure(f"chunk of shape {msg.actions.shape}", frame)
                    self.chunks += 1
                elif isinstance(msg, Error):
                    if kind == "chunk":
                        raise FuzzFailure(f"the sentinel failed after this frame: {msg.code} {msg.message}", frame)
                    self._check_error(msg, expect.codes, frame)
                else:
                    raise FuzzFailure(f"unexpected {msg!r}", frame)
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            self._ws = None
            if expect.kind != "close":
                raise FuzzFailure(f"the session closed ({code}) on a frame that must not close it", frame) from None
            if code not in expect.closes or code not in self.codes.closes:
                raise FuzzFailure(f"closed with {code}, expected {sorted(expect.closes)}", frame) from None
            self.closes[code] = self.closes.get(code, 0) + 1
        return expect


def check_ws_scenario(host: str, port: int, scenario: tuple[str, list[RawFrame | bytes], tuple[str, Any]],
                      codes: DocumentedCodes | None = None) -> None:
    """Run one :func:`ws_scenarios` scenario on a fresh raw connection and check the outcome:
    the expected reaction, and a close code that ``docs/protocol.md`` documents.

    Raises:
        FuzzFailure: the server's reaction differs from the expectation.
    """
    codes = codes or documented_codes()
    name, frames, (what, arg) = scenario
    ws = RawWebSocket(host, port)
    try:
        if ws.status != 101:
            raise FuzzFailure(f"{name}: handshake answered {ws.status}")
        opcode, payload = ws.read_frame()
        if opcode != 2 or not isinstance(parse_server_message(decode(payload)), Hello):
            raise FuzzFailure(f"{name}: no hello")
        ws.send(*frames)
        if what == "pong":
            opcode, payload = ws.read_frame()
            if (opcode, payload) != (10, arg):
                raise FuzzFailure(f"{name}: expected a pong echoing the ping, got opcode {opcode}")
            return
        if what == "answer":
            for _ in range(arg):
                opcode, payload = ws.read_frame()
                while opcode == 10:  # pongs for interleaved pings
                    opcode, payload = ws.read_frame()
                msg = parse_server_message(decode(payload))
                if not isinstance(msg, Chunk):
                    raise FuzzFailure(f"{name}: expected a chunk, got {msg!r}")
            return
        frames_left, code = ws.read_messages()
        if code not in arg:
            raise FuzzFailure(f"{name}: closed with {code}, expected {sorted(arg)} (frames before: {len(frames_left)})")
        if code not in codes.closes and not (name == "close" and code == _client_close_code(frames)):
            raise FuzzFailure(f"{name}: closed with {code}, which docs/protocol.md does not document")
    except (ConnectionError, TimeoutError) as exc:
        raise FuzzFailure(f"{name}: {type(exc).__name__}: {exc}") from None
    finally:
        ws.close()


def _client_close_code(frames: list[RawFrame | bytes]) -> int | None:
    """The close code a client's own close frame carried (the server echoes it back)."""
    for f in frames:
        if isinstance(f, RawFrame) and f.opcode == 8 and len(f.payload) >= 2:
            return int(struct.unpack("!H", f.payload[:2])[0])
    return None


def run_live(examples: int, seconds: float = 0.0) -> dict[str, Any]:
    """The live run: native frames, openpi-compatible frames, WebSocket-level scenarios, each
    phase to its first failure (hypothesis shrinks it and the report shows it); rounds of fresh
    examples until ``seconds`` have passed (one round at least), on one server.

    Args:
        examples: hypothesis examples of native frames per round (a tenth as many compat frames,
            a fifth as many WebSocket scenarios).
        seconds: the least time to fuzz for.
    """
    from hypothesis import HealthCheck, given, settings

    from chunkline.bench.serverproc import ServerProcess, http_get

    report: dict[str, Any] = {"failures": {}}
    with ServerProcess(["--policy", FUZZ_POLICY_REF, "--max-message-bytes", str(FUZZ_MAX_MESSAGE_BYTES)]) as server:
        probe = NativeProbe(server.uri, strict_ids=True)
        common = settings(max_examples=examples, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
        compat_kinds: dict[str, int] = {}
        ws_counts: dict[str, int] = {}

        @common
        @given(native_frames())
        def native(frame: bytes) -> None:
            probe.check(frame)

        @settings(common, max_examples=max(1, examples // 10))
        @given(native_frames())
        def compat(frame: bytes) -> None:
            kind = check_compat(server.uri, frame).kind
            compat_kinds[kind] = compat_kinds.get(kind, 0) + 1

        @settings(common, max_examples=max(1, examples // 5))
        @given(ws_scenarios())
        def websocket(scenario: tuple[str, list[RawFrame | bytes], tuple[str, Any]]) -> None:
            check_ws_scenario(server.host, server.port, scenario)
            ws_counts[scenario[0]] = ws_counts.get(scenario[0], 0) + 1

        t = time.monotonic()
        rounds = 0
        while rounds == 0 or (time.monotonic() - t < seconds and not report["failures"]):
            rounds += 1
            for name, phase in (("native", native), ("compat", compat), ("websocket", websocket)):
                try:
                    phase()
                except Exception as exc:  # a finding: record it and go on with the next phase
                    report["failures"][name] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        probe.close()
        alive = server.proc is not None and server.proc.poll() is None and http_get(server.host, server.port, "/healthz")[0] == 200
        log = server.log_path.read_text(errors="replace")
        report.update({
            "native_frames": probe.frames,
            "native_chunks": probe.chunks,
            "native_errors": probe.errors,
            "native_closes": {str(k): v for k, v in probe.closes.items()},
            "invalid_id_echoes": probe.invalid_id_echoes,
            "compat_frames": sum(compat_kinds.values()),
            "compat_answers": compat_kinds,
            "ws_scenarios": ws_counts,
            "seconds": round(time.monotonic() - t, 1),
            "rounds": rounds,
            "server_alive": alive,
            "server_tracebacks": log.count("Traceback"),
        })
    return report
