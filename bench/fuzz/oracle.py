"""The oracle: what the server must answer to one frame, from ``docs/protocol.md`` and the codec.

Pure functions of the frame, the limits and the spec (no I/O but reading the protocol document).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from pydantic import TypeAdapter, ValidationError

from chunkline.client.wire.codec import CodecLimits, Encoder, decode
from chunkline.client.wire.errors import CloseCode, CodecError, ErrorCode, ProtocolError
from chunkline.client.wire.protocol import Cancel, Infer, RequestId, parse_client_message
from chunkline.policies.base import ObservationError, PolicySpec, flatten_observation, validate_observation
from chunkline.server.entrypoints.sessions import readable_id
from chunkline.server.errors import Refusal
from chunkline.server.robot.field_decode import check_fields, encoded_fields

__all__ = [
    "DocumentedCodes",
    "documented_codes",
    "Expect",
    "expect_native",
    "valid_request_id",
    "expect_compat",
    "embed_in_infer",
    "sentinel_frame",
    "request_key",
]


_DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


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
                  text_models: Iterable[str] = (), encodings: Iterable[str] = ("raw",)) -> Expect:
    """Predict the server's answer to one binary frame on a native session.

    Args:
        frame: the message bytes.
        limits: the server's codec limits.
        spec: the served policy's spec.
        models: the model names the session may use.
        text_models: the text models it may ``generate`` with (``hello.text_models``).
        encodings: the array encodings the session agreed (``hello.encodings``).
    """
    if len(frame) > limits.max_message_bytes:
        return Expect("close", closes=frozenset({int(CloseCode.MESSAGE_TOO_BIG)}))
    try:
        obj = decode(frame, limits)
    except CodecError:
        # Named by its id where the message's top-level map can still be read (docs/protocol.md).
        return Expect("error", frozenset({ErrorCode.INVALID_MESSAGE.value}), readable_id(frame, limits))
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
    obs = flatten_observation(msg.obs)
    compressed = encoded_fields(obs)
    if compressed:  # checked before anything else about the observation, as the server does
        try:
            if check_fields(spec, set(encodings), compressed):
                # Agreed, allowed and declared right: the payload decodes, or is refused (its
                # payload, its decoded size, or the tenant's decoded bytes or queued decodes).
                return Expect("reply", _DEADLINE_CODES | {ErrorCode.INVALID_MESSAGE.value, ErrorCode.INVALID_OBSERVATION.value,
                                                          ErrorCode.OVERLOADED.value}, msg.id)
        except Refusal as refusal:
            return Expect("error", frozenset({refusal.code.value}), msg.id)
    try:
        validate_observation(spec, obs)
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


def request_key(request_id: Any) -> tuple[str, Any]:
    """A dict key for a request id: 1 and "1" are different ids, and the type keeps them apart."""
    return (type(request_id).__name__, request_id)
