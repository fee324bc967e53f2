"""Fuzzing the wire: structure-aware frames against a live server, and a coverage-guided run.

Two fuzzers share this module:

* **live, structure-aware** (hypothesis): msgpack trees, array maps with dtype/shape/length lies,
  deep nesting, huge claimed sizes, wrong types in every field, truncated, concatenated and
  bit-flipped frames, oversize frames, and WebSocket-level abuse (text frames, fragmented
  messages, reserved opcodes, unmasked frames, ...), sent to a real ``chunkline serve``. Each
  frame is checked against an oracle (:func:`expect_native`): the server answers with exactly
  the documented error or close code, every request id exactly once, never hangs a session, and
  a bystander session keeps being served.
* **coverage-guided** (atheris, libFuzzer): the codec and the message parser in-process
  (:func:`fuzz_one_input`), starting from the corpus kept in ``tests/fuzz_corpus/``.

``chunkline bench fuzz`` runs both at full size; the test suite runs them briefly
(``tests/test_fuzz_*.py``). hypothesis and atheris are imported only by the functions that need
them, so a server process can load :func:`fuzz_policy` without either installed.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import math
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from pydantic import TypeAdapter, ValidationError

from chunkline.client.codec import CodecLimits, Encoder, decode
from chunkline.client.exceptions import CodecError, ErrorCode, ProtocolError
from chunkline.client.protocol import (
    SUBPROTOCOL,
    Cancel,
    Chunk,
    CloseCode,
    Error,
    Hello,
    Infer,
    RequestId,
    parse_client_message,
    parse_server_message,
)
from chunkline.policies.base import ObservationError, PolicySpec, flatten_observation, validate_observation
from chunkline.policies.numpy_backend import NumpyPolicy

__all__ = [
    "FUZZ_SPEC",
    "make_fuzz_spec",
    "FUZZ_POLICY_REF",
    "FUZZ_MAX_MESSAGE_BYTES",
    "CANARY",
    "FuzzFailure",
    "Expect",
    "DocumentedCodes",
    "documented_codes",
    "fuzz_policy",
    "fuzz_limits",
    "expect_native",
    "expect_compat",
    "check_compat",
    "check_ws_scenario",
    "WS_KINDS",
    "valid_request_id",
    "embed_in_infer",
    "sentinel_frame",
    "NativeProbe",
    "RawWebSocket",
    "RawFrame",
    "frame_bytes",
    "check_decoded",
    "same_tree",
    "fuzz_one_input",
    "seed_corpus",
    "write_seed_corpus",
    "replay_corpus",
    "native_frames",
    "ws_scenarios",
    "run_atheris",
    "main",
]

def make_fuzz_spec(base: Any = None) -> PolicySpec:
    """The live fuzz server's policy spec: small arrays, an optional camera and a prompt.

    Args:
        base: the ``chunkline.policies.base`` module to build it from (the coverage-guided run
            re-imports that module under instrumentation, and its classes must match).
    """
    b = base if base is not None else sys.modules[PolicySpec.__module__]
    return b.PolicySpec(
        observation={
            "state": b.ArraySpec((14,), "float32"),
            "image": b.ArraySpec((8, 8, 3), "uint8", required=False),
            "prompt": b.TextSpec(max_chars=64),
        },
        action_dim=14,
        horizon=10,
        dt=0.02,
    )


FUZZ_SPEC = make_fuzz_spec()
FUZZ_POLICY_REF = "chunkline.bench.fuzz:fuzz_policy"
#: Small, so that oversize frames are cheap to send; larger frames must close with 1009.
FUZZ_MAX_MESSAGE_BYTES = 256 * 1024
#: Put into observation strings; no reply, log line or metric may ever contain it.
CANARY = "CANARY-7f3a9c"

_DOCS = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


class FuzzFailure(AssertionError):
    """The server broke a rule of the protocol for one fuzzed frame.

    Args:
        message: what went wrong.
        frame: the frame that caused it (shown shortened).
    """

    def __init__(self, message: str, frame: bytes | None = None) -> None:
        shown = "" if frame is None else f" (frame of {len(frame)} bytes: {frame[:64]!r}...)"
        super().__init__(message + shown)
        self.frame = frame


# ---------------------------------------------------------------------------------- the policy


def _zeros(obs: Mapping[str, Any]) -> np.ndarray:
    return np.zeros((len(obs["state"]), FUZZ_SPEC.horizon, FUZZ_SPEC.action_dim), np.float32)


def fuzz_policy() -> NumpyPolicy:
    """The live fuzz server's policy (``--policy chunkline.bench.fuzz:fuzz_policy``): zeros, fast."""
    return NumpyPolicy("fuzz", _zeros, FUZZ_SPEC)


def fuzz_limits(max_message_bytes: int = FUZZ_MAX_MESSAGE_BYTES) -> CodecLimits:
    """The codec limits a server started with ``--max-message-bytes`` applies (other caps default)."""
    return CodecLimits(max_message_bytes=max_message_bytes)


# ---------------------------------------------------------------------------------- documented codes


@dataclasses.dataclass(frozen=True)
class DocumentedCodes:
    """The error codes and close codes ``docs/protocol.md`` documents.

    Args:
        errors: every error code string.
        closes: every WebSocket close code.
    """

    errors: frozenset[str]
    closes: frozenset[int]


def documented_codes(path: Path = _DOCS) -> DocumentedCodes:
    """Read the error-code and close-code tables of ``docs/protocol.md``.

    The oracle checks the server against what the documentation promises, not against the
    enums in the code, so a code the server sends but the docs omit is caught. Without the docs
    (an installed package), the enums stand in.

    Args:
        path: the protocol document.
    """
    try:
        text = path.read_text()
    except OSError:
        return DocumentedCodes(frozenset(c.value for c in ErrorCode), frozenset(int(c) for c in CloseCode))

    def table(title: str) -> list[str]:
        section = text.split(title, 1)[1]
        rows = []
        for line in section.splitlines()[1:]:
            if line.startswith("#"):
                break
            if line.startswith("|") and not line.startswith("|--") and not line.startswith("| code"):
                rows.append(line.split("|")[1].strip().strip("`"))
        return rows

    return DocumentedCodes(frozenset(table("### error codes")), frozenset(int(c) for c in table("### close codes")))


# ---------------------------------------------------------------------------------- the oracle


@dataclasses.dataclass(frozen=True)
class Expect:
    """What the server must do with one frame on a native session.

    Args:
        kind: ``close`` (the session is closed with one of ``closes``), ``error`` (one error
            message with ``request_id`` and a code in ``codes``), ``reply`` (one ``chunk`` for
            ``request_id``, or an error with a code in ``codes``), ``stream`` (``token``
            messages ended by one ``done``, or one error with a code in ``codes``) or ``none``
            (no answer: a cancel).
        codes: the error codes allowed.
        request_id: the id the answer carries (``None``: the session-level error has none).
        closes: the close codes allowed for ``close``.
    """

    kind: str
    codes: frozenset[str] = frozenset()
    request_id: Any = None
    closes: frozenset[int] = frozenset()


# Refusals an otherwise valid infer may meet on an idle server: its own deadline.
_DEADLINE_CODES = frozenset({ErrorCode.DEADLINE_UNMEETABLE.value, ErrorCode.DEADLINE_EXCEEDED.value})


def expect_native(frame: bytes, limits: CodecLimits, spec: PolicySpec, models: Iterable[str],
                  text_models: Iterable[str] = ()) -> Expect:
    """Predict the server's answer to one binary frame on a native session.

    Args:
        frame: the message bytes.
        limits: the server's codec limits.
        spec: the served policy's spec.
        models: the model names the session may use.
        text_models: the text models it may ``generate`` with (``hello.text_models``).
    """
    if len(frame) > limits.max_message_bytes:
        return Expect("close", closes=frozenset({int(CloseCode.MESSAGE_TOO_BIG)}))
    try:
        obj = decode(frame, limits)
    except CodecError:
        return Expect("error", frozenset({ErrorCode.INVALID_MESSAGE.value}), None)
    raw_id = obj.get("id") if isinstance(obj, dict) else None
    # The error names the request only when its id is a valid one (else the client could not
    # parse the error at all): an invalid id is answered with ``id: null``.
    safe_id = raw_id if valid_request_id(raw_id) else None
    try:
        msg = parse_client_message(obj)
    except ProtocolError:
        return Expect("error", frozenset({ErrorCode.INVALID_MESSAGE.value}), safe_id)
    if isinstance(msg, Cancel):
        return Expect("none")
    if not isinstance(msg, Infer):  # a text `generate`
        if not set(text_models):
            return Expect("error", frozenset({ErrorCode.UNKNOWN_MODEL.value}), msg.id)
        # A stream of tokens ended by `done`, or one error (the text model's own limits, e.g.
        # max_tokens, are refused as invalid_message).
        return Expect("stream", _DEADLINE_CODES | {ErrorCode.UNKNOWN_MODEL.value, ErrorCode.INVALID_MESSAGE.value,
                                                   ErrorCode.OVERLOADED.value}, msg.id)
    if msg.model is not None and msg.model not in set(models):
        return Expect("error", frozenset({ErrorCode.UNKNOWN_MODEL.value}), msg.id)
    try:
        validate_observation(spec, flatten_observation(msg.obs))
    except ObservationError:
        return Expect("error", frozenset({ErrorCode.INVALID_OBSERVATION.value}), msg.id)
    return Expect("reply", _DEADLINE_CODES, msg.id)


_request_id = TypeAdapter(RequestId)


def valid_request_id(value: Any) -> bool:
    """Whether ``value`` is a valid request id (an int in [0, 2^63) or a 1-64 character string)."""
    if not isinstance(value, (int, str)) or isinstance(value, bool):
        return False
    try:
        _request_id.validate_python(value)
    except ValidationError:
        return False
    return True


def expect_compat(frame: bytes, limits: CodecLimits, spec: PolicySpec) -> Expect:
    """Predict the server's answer to one frame in openpi-compatible mode: ``reply`` (a map with
    ``actions``), ``error`` (a text frame ``"<code>: ..."`` then close 1011) or ``close``.

    Args:
        frame: the message bytes.
        limits: the server's codec limits.
        spec: the default policy's spec.
    """
    if len(frame) > limits.max_message_bytes:
        return Expect("close", closes=frozenset({int(CloseCode.MESSAGE_TOO_BIG)}))
    failed = frozenset({int(CloseCode.INTERNAL_ERROR)})
    try:
        obs = decode(frame, limits)
    except CodecError:
        return Expect("error", frozenset({ErrorCode.INVALID_MESSAGE.value}), closes=failed)
    if not isinstance(obs, dict):
        return Expect("error", frozenset({ErrorCode.INVALID_OBSERVATION.value}), closes=failed)
    try:
        validate_observation(spec, flatten_observation(obs))
    except ObservationError:
        return Expect("error", frozenset({ErrorCode.INVALID_OBSERVATION.value}), closes=failed)
    return Expect("reply", _DEADLINE_CODES, closes=failed)


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
        meta = decode(ws.recv(timeout=timeout))
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
        code, _, message = answer.partition(": ")
        if code not in codes.errors or code not in expect.codes:
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


def embed_in_infer(raw_obs: bytes, request_id: Any = 1) -> bytes:
    """An ``infer`` whose ``obs`` value is ``raw_obs``, spliced in as raw msgpack bytes
    (to carry headers that claim sizes no real encoder would write)."""
    head = msgpack.packb({"type": "infer", "id": request_id}, use_bin_type=True)
    assert head[0] == 0x82
    return b"\x83" + head[1:] + msgpack.packb("obs") + raw_obs


_encoder = Encoder()


def sentinel_frame(request_id: str) -> bytes:
    """A valid infer that must be answered with a chunk (sent after each fuzzed frame)."""
    return _encoder.encode({"type": "infer", "id": request_id, "obs": {"state": np.zeros(14, np.float32)},
                            "deadline_ms": 30_000.0})


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

        if self._ws is None:
            self._ws = connect(self.uri, subprotocols=[SUBPROTOCOL], max_size=None, compression=None,
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
                # Known server bug (see tests/test_fuzz_protocol.py): an invalid id echoed back.
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
            waiting = {_key(sentinel): "chunk"}
            if expect.kind in ("error", "reply", "stream"):
                waiting[_key(expect.request_id)] = expect.kind
            while waiting:
                msg = self._recv(ws, frame)
                rid = _key(msg.id)
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


def _key(request_id: Any) -> Any:
    # 1 and "1" are different ids; a tuple keeps them apart in one dict.
    return (type(request_id).__name__, request_id)


# ---------------------------------------------------------------------------------- raw WebSocket frames


@dataclasses.dataclass(frozen=True)
class RawFrame:
    """One WebSocket frame as a client would put it on the wire (RFC 6455 section 5.2).

    Args:
        opcode: 0 continuation, 1 text, 2 binary, 8 close, 9 ping, 10 pong; others are reserved.
        payload: the payload (unmasked).
        fin: last fragment of its message.
        rsv: the three reserved bits (0 without extensions).
        masked: clients must mask every frame.
        claimed_length: a length to put in the header instead of ``len(payload)`` (a lie).
    """

    opcode: int
    payload: bytes = b""
    fin: bool = True
    rsv: int = 0
    masked: bool = True
    claimed_length: int | None = None


def frame_bytes(frame: RawFrame, mask: bytes = b"\x1f\x2e\x3d\x4c") -> bytes:
    """Serialise a :class:`RawFrame`."""
    n = len(frame.payload) if frame.claimed_length is None else frame.claimed_length
    head = bytes([(0x80 if frame.fin else 0) | (frame.rsv & 7) << 4 | (frame.opcode & 0x0F)])
    m = 0x80 if frame.masked else 0
    if n < 126:
        head += bytes([m | n])
    elif n < 1 << 16:
        head += bytes([m | 126]) + struct.pack("!H", n)
    else:
        head += bytes([m | 127]) + struct.pack("!Q", n)
    if not frame.masked:
        return head + frame.payload
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(frame.payload)) if len(frame.payload) < 4096 else (
        np.bitwise_xor(np.frombuffer(frame.payload, np.uint8),
                       np.resize(np.frombuffer(mask, np.uint8), len(frame.payload))).tobytes())
    return head + mask + body


class RawWebSocket:
    """A deliberately naive client on a plain socket: it sends any frame, valid or not, and
    reads the server's frames back (servers never mask).

    Args:
        host, port: the server.
        subprotocol: offer this subprotocol (``None``: openpi-compatible mode).
        headers: extra handshake headers.
        timeout: socket timeout for every read.
        source: local address to connect from (to test per-address limits).
    """

    def __init__(self, host: str, port: int, *, subprotocol: str | None = SUBPROTOCOL,
                 headers: Mapping[str, str] | None = None, timeout: float = 10.0, source: str | None = None) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout,
                                             source_address=(source, 0) if source else None)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = ["GET / HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket", "Connection: Upgrade",
                 f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
        if subprotocol:
            lines.append(f"Sec-WebSocket-Protocol: {subprotocol}")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self._buf = b""
        head = self._read_until(b"\r\n\r\n")
        self.status = int(head.split(b" ", 2)[1])
        self.response_head = head.decode(errors="replace")
        self.close_code: int | None = None

    def _fill(self) -> bool:
        try:
            data = self.sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        self._buf += data
        return bool(data)

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._buf:
            if not self._fill():
                raise ConnectionError("closed during the handshake")
        head, self._buf = self._buf.split(marker, 1)
        return head

    def _read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._fill():
                raise ConnectionError("closed mid-frame")
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def send(self, *frames: RawFrame | bytes) -> None:
        """Send frames (or raw bytes) in one write, as one burst."""
        self.sock.sendall(b"".join(f if isinstance(f, bytes) else frame_bytes(f) for f in frames))

    def read_frame(self) -> tuple[int, bytes]:
        """The next frame from the server as ``(opcode, payload)``.

        Raises:
            ConnectionError: the connection ended.
            TimeoutError: nothing within the socket timeout.
        """
        b0, b1 = self._read_exact(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", self._read_exact(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self._read_exact(8))[0]
        if b1 & 0x80:
            raise ConnectionError("the server masked a frame")
        payload = self._read_exact(n)
        opcode = b0 & 0x0F
        if opcode == 8:
            self.close_code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
        return opcode, payload

    def read_messages(self, limit: int = 100) -> tuple[list[tuple[int, bytes]], int | None]:
        """Read frames until the server closes (or ``limit`` frames); returns the data frames and
        the close code (``None`` if the connection ended without a close frame)."""
        out: list[tuple[int, bytes]] = []
        for _ in range(limit):
            try:
                opcode, payload = self.read_frame()
            except ConnectionError:
                return out, self.close_code
            if opcode == 8:
                return out, self.close_code
            out.append((opcode, payload))
        return out, self.close_code

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------- in-process invariants


_OK_SCALARS = (str, bytes, int, float, bool, type(None))


def check_decoded(obj: Any, limits: CodecLimits, depth: int = 0) -> int:
    """Check what :func:`decode` returned obeys its own rules; returns the arrays counted.

    Raises:
        FuzzFailure: a decoded tree breaks a rule (a writable array, a refused dtype, ...).
    """
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf" or obj.flags.writeable:
            raise FuzzFailure(f"decoded array of dtype {obj.dtype}, writeable={obj.flags.writeable}")
        if obj.ndim > limits.max_dims or obj.size > limits.max_elements:
            raise FuzzFailure(f"decoded array of shape {obj.shape} beyond the caps")
        return 1
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in "biuf":
            raise FuzzFailure(f"decoded scalar of dtype {obj.dtype}")
        return 1
    if isinstance(obj, (dict, list)):
        if depth >= limits.max_depth:
            raise FuzzFailure("decoded tree deeper than max_depth")
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        n = 0
        for k, v in items:
            if isinstance(obj, dict) and not isinstance(k, str):
                raise FuzzFailure(f"decoded map key of type {type(k).__name__}")
            n += check_decoded(v, limits, depth + 1)
        return n
    if not isinstance(obj, _OK_SCALARS):
        raise FuzzFailure(f"decoded value of type {type(obj).__name__}")
    return 0


def same_tree(a: Any, b: Any) -> bool:
    """Structural equality where NaN equals NaN and arrays compare by dtype, shape and bytes."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, np.float64) or isinstance(b, np.float64):
        # np.float64 is a Python float: msgpack writes it as a plain float (as openpi's codec
        # does), so it comes back as one. Same value, same precision.
        return isinstance(a, float) and isinstance(b, float) and (a == b or (a != a and b != b))
    if isinstance(a, np.generic) or isinstance(b, np.generic):
        return (isinstance(a, np.generic) and isinstance(b, np.generic) and a.dtype == b.dtype
                and (a == b or (a != a and b != b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


_FUZZ_LIMITS = CodecLimits()


def fuzz_one_input(data: bytes, modules: Mapping[str, Any] | None = None) -> None:
    """One input of the coverage-guided fuzzer: decode, check, re-encode, parse, validate.

    Anything the codec or parser refuses must be refused with their own error
    (:class:`CodecError`, :class:`ProtocolError`, :class:`ObservationError`); anything else
    raised, or a decoded tree that breaks the codec's rules or does not survive a round trip,
    is a bug.

    Args:
        data: the input bytes.
        modules: the (instrumented) ``codec``, ``protocol`` and ``base`` modules to use, and the
            ``spec`` built from that ``base`` (default: the ones imported here).

    Raises:
        FuzzFailure: a broken invariant.
    """
    codec = modules["codec"] if modules else sys.modules["chunkline.client.codec"]
    protocol = modules["protocol"] if modules else sys.modules["chunkline.client.protocol"]
    base = modules["base"] if modules else sys.modules["chunkline.policies.base"]
    try:
        obj = codec.decode(data, _FUZZ_LIMITS)
    except CodecError:
        return
    check_decoded(obj, _FUZZ_LIMITS)
    try:
        again = codec.decode(codec.Encoder().encode(obj), _FUZZ_LIMITS)
    except CodecError as exc:
        raise FuzzFailure(f"a decoded message does not survive re-encoding: {exc}", data) from None
    if not same_tree(obj, again):
        raise FuzzFailure("decode(encode(decode(x))) differs from decode(x)", data)
    try:
        msg = protocol.parse_client_message(obj)
    except ProtocolError:
        return
    if isinstance(msg, protocol.Infer):
        try:
            base.validate_observation(modules.get("spec", FUZZ_SPEC) if modules else FUZZ_SPEC, base.flatten_observation(msg.obs))
        except base.ObservationError:
            pass


def seed_corpus() -> dict[str, bytes]:
    """Hand-made seeds: valid messages in both array layouts, each refusal the codec knows, and
    the shapes attackers use (claimed sizes, deep nesting, ext types). Named by content."""
    enc = Encoder()
    state = np.arange(14, dtype=np.float32)
    image = np.zeros((8, 8, 3), np.uint8)
    nd = lambda dtype, shape, data: {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}  # noqa: E731
    mn = {b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [14], b"data": state.tobytes()}
    pk = lambda o: msgpack.packb(o, use_bin_type=True)  # noqa: E731
    seeds = {
        "infer-minimal": enc.encode({"type": "infer", "id": 1, "obs": {"state": state}}),
        "infer-full": enc.encode({"type": "infer", "id": "r-1", "obs": {"state": state, "image": image, "prompt": "pick"},
                                  "obs_time": 12.5, "deadline_ms": 100.0, "model": "fuzz",
                                  "prefix": np.zeros((3, 14), np.float32)}),
        "infer-nested": enc.encode({"type": "infer", "id": 2, "obs": {"robot": {"state": state}, "images": {"cam": image}}}),
        "infer-msgpack-numpy": pk({"type": "infer", "id": 3, "obs": {"state": mn}}),
        "infer-npgeneric": pk({"type": "infer", "id": 4, "obs": {"state": nd("<f8", [14], state.astype("<f8").tobytes()),
                                                                   "s": {b"__npgeneric__": True, b"data": 1.5, b"dtype": "<f4"},
                                                                   "m": {b"nd": False, b"type": "<i4", b"data": b"\x01\0\0\0"}}}),
        "cancel": pk({"type": "cancel", "id": 1}),
        "big-endian": pk({"type": "infer", "id": 5, "obs": {"state": nd(">f4", [14], state.astype(">f4").tobytes())}}),
        "object-dtype": pk({"type": "infer", "id": 6, "obs": {"state": nd("|O", [1], b"\0" * 8)}}),
        "length-lie": pk({"type": "infer", "id": 7, "obs": {"state": nd("<f4", [14], b"\0" * 55)}}),
        "huge-shape": pk({"type": "infer", "id": 8, "obs": {"state": nd("<f4", [2**31, 2**31], b"")}}),
        "negative-shape": pk({"type": "infer", "id": 9, "obs": {"state": nd("<f4", [-1], b"")}}),
        "too-many-dims": pk({"type": "infer", "id": 10, "obs": {"state": nd("|u1", [1] * 9, b"\0")}}),
        "structured-mn": pk({"type": "infer", "id": 11, "obs": {"state": {b"nd": True, b"type": "<f4", b"kind": b"V", b"shape": [1], b"data": b"\0" * 4}}}),
        "ext-type": pk({"type": "infer", "id": 12, "obs": {"x": msgpack.ExtType(5, b"abc")}}),
        "timestamp": pk({"type": "infer", "id": 13, "obs": {"x": msgpack.Timestamp(1, 2)}}),
        "int-key": pk({"type": "infer", "id": 14, "obs": {1: state.tobytes()}}),
        "unknown-field": pk({"type": "infer", "id": 15, "obs": {}, "priority": 9}),
        "unknown-type": pk({"type": "launch", "id": 16}),
        "claimed-bin32": embed_in_infer(b"\xc6\xff\xff\xff\xff" + b"x" * 8),
        "claimed-map32": embed_in_infer(b"\xdf\xff\xff\xff\xff"),
        "claimed-array32": embed_in_infer(b"\x81" + pk("state") + b"\xdd\x7f\xff\xff\xff\xc0"),
        "claimed-str32": embed_in_infer(b"\x81" + pk("prompt") + b"\xdb\xff\xff\xff\xf0ab"),
        "deep-list": b"\x91" * 5000 + b"\xc0",
        "deep-map": b"\x81\xa1k" * 40 + b"\xc0",
        "trailing-bytes": enc.encode({"type": "cancel", "id": 1}) + b"\xc0",
        "truncated": enc.encode({"type": "infer", "id": 1, "obs": {"state": state}})[:40],
        "empty": b"",
        "nan-state": enc.encode({"type": "infer", "id": 17, "obs": {"state": np.full(14, np.nan, np.float32)}}),
        "bad-utf8": b"\x81\xa4type\xa2\xff\xfe",
        "pickle": b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.",
    }
    return seeds


def write_seed_corpus(folder: Path) -> int:
    """Write :func:`seed_corpus` into ``folder`` (file names are content digests, as libFuzzer's)."""
    folder.mkdir(parents=True, exist_ok=True)
    for data in seed_corpus().values():
        (folder / hashlib.sha1(data).hexdigest()).write_bytes(data)
    return len(seed_corpus())


def replay_corpus(folder: Path, target: Callable[[bytes], None] = fuzz_one_input) -> int:
    """Run ``target`` on every file in ``folder`` (sorted); returns how many."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    for path in files:
        try:
            target(path.read_bytes())
        except FuzzFailure as exc:
            raise FuzzFailure(f"{path.name}: {exc}") from None
    return len(files)


# ---------------------------------------------------------------------------------- hypothesis strategies

_FIELDS = ["type", "id", "obs", "obs_time", "deadline_ms", "model", "prefix", "state", "image", "prompt"]
_GOOD_DTYPES = ["<f4", ">f4", "<f8", ">f8", "<f2", "|u1", "|i1", "<i2", "<i4", "<i8", "<u8", "|b1", "=f4", "f4", "|f4"]
_BAD_DTYPES = ["|O", "O", "<c8", "<c16", "<U4", "|S3", "|V8", "<M8[s]", "<m8", "", "<f16", "float32", "<f3", "f", "<f4,<f4"]


def native_frames() -> Any:
    """A hypothesis strategy of native-mode frames (bytes), structure-aware.

    Mixes valid messages, messages with one field wrong, array maps that lie about dtype, shape
    or length, arbitrary msgpack trees, ext types, huge claimed sizes, deep nesting, truncated,
    concatenated and bit-flipped frames, and frames over the size limit.
    """
    from hypothesis import strategies as st

    pk = lambda o: msgpack.packb(o, use_bin_type=True)  # noqa: E731
    ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]))
    scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=12),
                        st.binary(max_size=24))
    # Mostly string keys (anything else is refused at once, so it says little about what follows).
    keys = st.one_of(st.text(max_size=8), st.sampled_from(_FIELDS), st.text(max_size=8), st.sampled_from(_FIELDS),
                     st.binary(max_size=6), st.integers(-3, 3))

    @st.composite
    def array_map(draw: Any) -> Any:
        dtype = draw(st.one_of(st.sampled_from(_GOOD_DTYPES), st.sampled_from(_BAD_DTYPES), st.text(max_size=5),
                               st.binary(max_size=4), ints, st.none()))
        shape = draw(st.one_of(st.lists(st.integers(0, 6), max_size=4), st.lists(ints, max_size=10),
                               st.just([14]), st.just([8, 8, 3]), st.just([2**31, 2**31]), st.just([1] * 12),
                               st.lists(st.floats(), max_size=2), scalars))
        try:
            itemsize = np.dtype(dtype).itemsize if isinstance(dtype, str) and dtype else 4
            count = math.prod(shape) if isinstance(shape, list) and all(type(d) is int for d in shape) else 0
        except (TypeError, ValueError):
            itemsize, count = 4, 0
        honest = max(0, count) * itemsize
        size = draw(st.one_of(st.just(honest), st.just(honest + 1), st.just(max(0, honest - 1)), st.integers(0, 64)))
        data = draw(st.one_of(st.just(bytes(min(size, 4096))), st.binary(min_size=min(size, 64), max_size=min(size, 64)),
                              scalars)) if size <= 4096 else b""
        layout = draw(st.sampled_from(["openpi", "mn", "generic", "mn-scalar"]))
        if layout == "openpi":
            return {b"__ndarray__": draw(st.one_of(st.just(True), scalars)), b"data": data, b"dtype": dtype, b"shape": shape}
        if layout == "mn":
            return {b"nd": True, b"type": dtype, b"kind": draw(st.sampled_from([b"", "", b"V", b"O", None])), b"shape": shape, b"data": data}
        if layout == "generic":
            return {b"__npgeneric__": True, b"data": draw(scalars), b"dtype": dtype}
        return {b"nd": False, b"type": dtype, b"data": data}

    trees = st.recursive(st.one_of(scalars, array_map()),
                         lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(keys, kids, max_size=4)),
                         max_leaves=12)

    @st.composite
    def observation(draw: Any) -> Any:
        state_dtype = draw(st.sampled_from(["<f4", "<f8", "<i4", ">f4", "|u1", "<f2"]))
        state = np.arange(14).astype(state_dtype)
        obs: dict[Any, Any] = {"state": {b"__ndarray__": True, b"data": state.tobytes(), b"dtype": state_dtype, b"shape": [14]}}
        if draw(st.booleans()):
            obs["image"] = {b"__ndarray__": True, b"data": bytes(192), b"dtype": "|u1", b"shape": [8, 8, 3]}
        if draw(st.booleans()):
            obs["prompt"] = draw(st.one_of(st.just(CANARY), st.just(CANARY * 10), st.text(max_size=70)))
        if draw(st.booleans()):  # openpi-style nesting
            obs = {"robot": {"state": obs.pop("state")}, **obs}
        if draw(st.integers(0, 2)) == 0:  # break one field, or add strangers
            for _ in range(draw(st.integers(1, 2))):
                key = draw(st.one_of(st.sampled_from(["state", "image", "prompt", "extra", "robot"]), keys))
                obs[key] = draw(st.one_of(trees, array_map(), st.just(CANARY)))
        return obs

    valid_ids = st.one_of(st.integers(0, 2**63 - 1), st.text(min_size=1, max_size=64))
    ids = st.one_of(ints, st.text(max_size=70), st.booleans(), st.floats(), st.none(), st.lists(ints, max_size=2))
    fields = {  # (a valid value, anything)
        "obs_time": (st.floats(allow_nan=False, allow_infinity=False), st.one_of(st.floats(), ints, st.text(max_size=4))),
        "deadline_ms": (st.sampled_from([1e-9, 0.001, 1.0, 5000.0, 3_600_000.0]),
                        st.one_of(st.floats(), st.sampled_from([0.0, -1.0, 3_600_001.0]), ints)),
        "model": (st.just("fuzz"), st.one_of(st.text(max_size=130), scalars)),
        "prefix": (st.builds(lambda n: {b"__ndarray__": True, b"data": bytes(n * 56), b"dtype": "<f4", b"shape": [n, 14]},
                             st.integers(0, 4)), st.one_of(array_map(), scalars)),
    }

    @st.composite
    def message(draw: Any) -> dict[Any, Any]:
        kind = draw(st.sampled_from(["infer", "infer", "infer", "infer", "cancel", "generate", "other"]))
        msg: dict[Any, Any] = {"type": kind if kind != "other" else draw(st.one_of(st.text(max_size=8), scalars))}
        msg["id"] = draw(valid_ids) if draw(st.integers(0, 3)) else draw(ids)
        if kind == "generate":
            for name, value in draw(st.fixed_dictionaries({}, optional={
                    "prompt": st.one_of(st.text(max_size=40), st.just(CANARY), scalars),
                    "messages": st.one_of(st.just([{"role": "user", "content": "hi"}]), trees),
                    "max_tokens": st.one_of(st.integers(1, 8), ints), "temperature": st.one_of(st.floats(0, 2), scalars),
                    "top_p": st.floats(), "seed": ints, "stop": st.one_of(st.lists(st.text(max_size=4), max_size=5), scalars),
                    "ignore_eos": st.booleans(), "deadline_ms": fields["deadline_ms"][1], "model": fields["model"][1]})).items():
                msg[name] = value
        elif kind != "cancel":
            msg["obs"] = draw(observation())
            for name, (good, anything) in fields.items():
                if draw(st.integers(0, 2)) == 0:
                    msg[name] = draw(good) if draw(st.integers(0, 3)) else draw(anything)
        if draw(st.integers(0, 5)) == 0:  # a wrong type in any field, or a missing or unknown one
            victim = draw(st.sampled_from([*msg.keys(), "extra"]))
            if draw(st.booleans()) and victim in msg:
                del msg[victim]
            else:
                msg[victim] = draw(trees)
        return msg

    def packs(obj: Any) -> bytes:
        try:
            return pk(obj)
        except (TypeError, ValueError, OverflowError):  # a tree msgpack itself cannot write
            return pk({"type": "infer", "id": 0, "obs": {}})

    claimed = st.sampled_from([b"\xc6\xff\xff\xff\xff", b"\xc5\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                               b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff", b"\xde\xff\xff"])

    @st.composite
    def frames(draw: Any) -> bytes:
        kind = draw(st.sampled_from(["message"] * 10 + ["tree", "truncated", "concat", "flip",
                                     "random", "deep", "claimed", "ext", "oversize"]))
        if kind == "message":
            return packs(draw(message()))
        if kind == "tree":
            return packs(draw(trees))
        if kind == "truncated":
            full = packs(draw(message()))
            return full[: draw(st.integers(0, max(0, len(full) - 1)))]
        if kind == "concat":
            return packs(draw(message())) + packs(draw(message()))
        if kind == "flip":
            full = bytearray(packs(draw(message())))
            for _ in range(draw(st.integers(1, 4))):
                i = draw(st.integers(0, len(full) - 1))
                full[i] ^= 1 << draw(st.integers(0, 7))
            return bytes(full)
        if kind == "random":
            return draw(st.binary(max_size=256))
        if kind == "deep":
            n = draw(st.integers(10, 20_000))
            return draw(st.sampled_from([b"\x91", b"\x81\xa1k", b"\x81\xa3obs"])) * n + b"\xc0"
        if kind == "claimed":
            tail = draw(claimed) + draw(st.binary(max_size=16))
            where = draw(st.sampled_from(["obs", "field", "top"]))
            if where == "obs":
                return embed_in_infer(tail, draw(st.integers(0, 100)))
            if where == "field":
                return embed_in_infer(b"\x81" + pk(draw(st.sampled_from(["state", "prompt", "image"]))) + tail)
            return tail
        if kind == "ext":
            value = draw(st.one_of(st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16)),
                                   st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1), st.integers(0, 999_999_999))))
            return packs({"type": "infer", "id": 1, "obs": {"state": value}})
        size = FUZZ_MAX_MESSAGE_BYTES + draw(st.integers(1, 4096))
        return b"\x00" * size

    return frames()


WS_KINDS = ("fragmented", "fragmented+ping", "concatenated", "ping", "text", "bad-utf8-text", "fragmented-text",
            "reserved-opcode", "rsv-bits", "unmasked", "orphan-continuation", "interleaved-data", "long-control",
            "fragmented-control", "oversize-header", "oversize-fragments", "close")


def ws_scenarios(kinds: Iterable[str] = WS_KINDS) -> Any:
    """A hypothesis strategy of WebSocket-level scenarios: ``(name, frames, expectation)``.

    ``expectation`` is ``("answer", n)`` (``n`` binary answers, the session stays open),
    ``("close", codes)`` or ``("pong", payload)``.

    Args:
        kinds: which scenarios to draw from (default: all of :data:`WS_KINDS`).
    """
    from hypothesis import strategies as st

    chosen = [k for k in WS_KINDS if k in set(kinds)]

    def valid(i: int) -> bytes:
        return sentinel_frame(f"ws-{i}")

    @st.composite
    def scenario(draw: Any) -> tuple[str, list[RawFrame | bytes], tuple[str, Any]]:
        kind = draw(st.sampled_from(chosen))
        i = draw(st.integers(0, 10**6))
        body = valid(i)
        if kind.startswith("fragmented") and kind != "fragmented-text" and kind != "fragmented-control":
            cuts = sorted(set(draw(st.lists(st.integers(1, len(body) - 1), min_size=1, max_size=6))))
            parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=False)]
            frames: list[RawFrame | bytes] = []
            for j, part in enumerate(parts):
                frames.append(RawFrame(2 if j == 0 else 0, part, fin=j == len(parts) - 1))
                if kind == "fragmented+ping" and j < len(parts) - 1:
                    frames.append(RawFrame(9, draw(st.binary(max_size=125))))
            return kind, frames, ("answer", 1)
        if kind == "concatenated":
            n = draw(st.integers(2, 5))
            return kind, [RawFrame(2, valid(i + j)) for j in range(n)], ("answer", n)
        if kind == "ping":
            payload = draw(st.binary(max_size=125))
            return kind, [RawFrame(9, payload)], ("pong", payload)
        if kind == "text":
            return kind, [RawFrame(1, draw(st.text(max_size=200)).encode())], ("close", {1003})
        if kind == "bad-utf8-text":
            return kind, [RawFrame(1, b"ok" + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])))], ("close", {1007})
        if kind == "fragmented-text":
            return kind, [RawFrame(1, b"he", fin=False), RawFrame(0, b"llo")], ("close", {1003})
        if kind == "reserved-opcode":
            return kind, [RawFrame(draw(st.sampled_from([3, 4, 5, 6, 7, 11, 12, 13, 14, 15])), b"x")], ("close", {1002})
        if kind == "rsv-bits":
            return kind, [RawFrame(2, body, rsv=draw(st.integers(1, 7)))], ("close", {1002})
        if kind == "unmasked":
            return kind, [RawFrame(2, body, masked=False)], ("close", {1002})
        if kind == "orphan-continuation":
            return kind, [RawFrame(0, body)], ("close", {1002})
        if kind == "interleaved-data":
            return kind, [RawFrame(2, body[:5], fin=False), RawFrame(2, body)], ("close", {1002})
        if kind == "long-control":
            return kind, [RawFrame(9, bytes(draw(st.integers(126, 300))))], ("close", {1002})
        if kind == "fragmented-control":
            return kind, [RawFrame(9, b"p", fin=False)], ("close", {1002})
        if kind == "oversize-header":
            n = FUZZ_MAX_MESSAGE_BYTES + draw(st.integers(1, 2**40))
            return kind, [RawFrame(2, b"\x00" * 16, claimed_length=n)], ("close", {1009})
        if kind == "oversize-fragments":
            chunk = FUZZ_MAX_MESSAGE_BYTES // 4 + 1
            return kind, [RawFrame(2, bytes(chunk), fin=False)] + [RawFrame(0, bytes(chunk), fin=False)] * 4, ("close", {1009})
        code = draw(st.sampled_from([1000, 1001, 4000]))
        return kind, [RawFrame(8, struct.pack("!H", code))], ("close", {code, 1000})

    return scenario()


# ---------------------------------------------------------------------------------- atheris


def run_atheris(corpus: list[Path], libfuzzer_args: list[str]) -> None:
    """Coverage-guided fuzzing of the codec and parser (never returns: libFuzzer exits).

    The codec, protocol and policy-base modules are re-imported under atheris' instrumentation
    so that coverage of exactly that code guides the search; numpy, msgpack (C) and pydantic
    (Rust) are not instrumented.

    Args:
        corpus: corpus folders; new interesting inputs go to the first.
        libfuzzer_args: e.g. ``["-runs=10000"]`` or ``["-max_total_time=600"]``.
    """
    import importlib

    import atheris

    names = ("chunkline.client.codec", "chunkline.client.protocol", "chunkline.policies.base")
    # The codec module re-exports its parts; they are instrumented (and re-imported) with it.
    parts = ("chunkline.client.wire_format", "chunkline.client.decoder", "chunkline.client.encoder")
    for name in (*parts, *names):
        sys.modules.pop(name, None)
    with atheris.instrument_imports(include=[*parts, *names]):
        modules = {short: importlib.import_module(name) for short, name in zip(("codec", "protocol", "base"), names, strict=False)}
    modules["spec"] = make_fuzz_spec(modules["base"])

    def target(data: bytes) -> None:
        fuzz_one_input(data, modules)

    atheris.Setup([sys.argv[0], *libfuzzer_args, *(str(c) for c in corpus)], target)
    atheris.Fuzz()


# ---------------------------------------------------------------------------------- CLI


def _default_corpus() -> Path:
    return Path(__file__).resolve().parents[1] / "tests" / "fuzz_corpus"


def _live(args: argparse.Namespace) -> dict[str, Any]:
    """The live run: native frames, openpi-compatible frames, WebSocket-level scenarios, each
    phase to its first failure (hypothesis shrinks it and the report shows it)."""
    from hypothesis import HealthCheck, given, settings

    from chunkline.bench.serverproc import ServerProcess, http_get

    report: dict[str, Any] = {"failures": {}}
    with ServerProcess(["--policy", FUZZ_POLICY_REF, "--max-message-bytes", str(FUZZ_MAX_MESSAGE_BYTES)]) as server:
        probe = NativeProbe(server.uri, strict_ids=True)
        common = settings(max_examples=args.examples, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
        compat_kinds: dict[str, int] = {}
        ws_counts: dict[str, int] = {}

        @common
        @given(native_frames())
        def native(frame: bytes) -> None:
            probe.check(frame)

        @settings(common, max_examples=max(1, args.examples // 10))
        @given(native_frames())
        def compat(frame: bytes) -> None:
            kind = check_compat(server.uri, frame).kind
            compat_kinds[kind] = compat_kinds.get(kind, 0) + 1

        @settings(common, max_examples=max(1, args.examples // 5))
        @given(ws_scenarios())
        def websocket(scenario: tuple[str, list[RawFrame | bytes], tuple[str, Any]]) -> None:
            check_ws_scenario(server.host, server.port, scenario)
            ws_counts[scenario[0]] = ws_counts.get(scenario[0], 0) + 1

        t = time.monotonic()
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
            "server_alive": alive,
            "server_tracebacks": log.count("Traceback"),
        })
    return report


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


def main(argv: list[str] | None = None) -> int:
    """``chunkline bench fuzz``: the coverage-guided run, then the live run; prints a JSON report."""
    p = argparse.ArgumentParser(prog="chunkline bench fuzz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=["all", "atheris", "live", "seed"], default="all")
    p.add_argument("--seconds", type=float, default=300.0, help="atheris: how long to fuzz (libFuzzer -max_total_time)")
    p.add_argument("--runs", type=int, default=None, help="atheris: stop after this many inputs instead")
    p.add_argument("--corpus", type=Path, default=_default_corpus(), help="the kept corpus (read; new inputs are not added to it)")
    p.add_argument("--new-corpus", type=Path, default=None, help="where atheris writes new interesting inputs (default: a temp folder)")
    p.add_argument("--examples", type=int, default=5000, help="live: hypothesis examples of native frames")
    args = p.parse_args(argv)
    if args.mode == "seed":
        print(f"wrote {write_seed_corpus(args.corpus)} seeds to {args.corpus}")
        return 0
    report: dict[str, Any] = {}
    if args.mode in ("all", "atheris"):
        new = args.new_corpus or Path(tempfile.mkdtemp(prefix="chunkline-fuzz-"))
        new.mkdir(parents=True, exist_ok=True)
        stop = [f"-runs={args.runs}"] if args.runs is not None else [f"-max_total_time={int(args.seconds)}"]
        cmd = [sys.executable, "-m", "chunkline.bench.fuzz", "_atheris", *stop, str(new), str(args.corpus)]
        t = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True)
        done = re.findall(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+)", out.stderr)
        report["atheris"] = {"exit": out.returncode, "seconds": round(time.monotonic() - t, 1),
                             "inputs": int(done[-1][0]) if done else None, "coverage_edges": int(done[-1][1]) if done else None,
                             "new_corpus": str(new), "new_inputs": sum(1 for _ in new.iterdir())}
        if out.returncode != 0:
            sys.stderr.write(out.stderr[-4000:])
    if args.mode in ("all", "live"):
        report["live"] = _live(args)
    print(json.dumps(report, indent=2))
    live = report.get("live", {})
    failed = report.get("atheris", {}).get("exit", 0) != 0 or bool(
        live and (live["failures"] or not live["server_alive"] or live["server_tracebacks"]))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_atheris":  # the libFuzzer child process
        rest = sys.argv[2:]
        run_atheris([Path(a) for a in rest if not a.startswith("-")], [a for a in rest if a.startswith("-")])
    sys.exit(main())
