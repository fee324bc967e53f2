"""A peek at a message's top-level scalar fields, read from the msgpack headers alone.

The server reads an ``infer``'s ``type``, ``id``, ``deadline_ms`` and ``model`` with
:func:`peek_map` before decoding the observation, stepping over array data by its length without
reading it, so that it can refuse a request it has no room for at a cost that does not grow with
the observation. A message it accepts is still decoded in full (and may still be refused) by
:func:`chunkline.client.wire.codec.decode` before anything uses it. The caps are the decoder's
(:class:`~chunkline.client.wire.codec.CodecLimits`).
"""

from __future__ import annotations

import enum
import struct
from typing import Any

from chunkline.client.wire.codec import DEFAULT_LIMITS, CodecLimits
from chunkline.client.wire.format import OOB_MAGIC, OOB_PREFIX, oob_data_start

__all__ = ["PEEK_MAX_ITEMS", "Skipped", "peek_map"]


class Skipped(enum.Enum):
    """What :func:`peek_map` reports for a top-level value it stepped over without building."""

    MAP = "map"
    ARRAY = "array"
    BINARY = "binary"


class _Unpeekable(Exception):
    """Internal: the message is not plain enough to peek at; it is left to the full decode."""


#: most msgpack items one peek steps over; a message with more is left to the full decode.
PEEK_MAX_ITEMS = 4096

# Fixed-size scalars: type byte to the struct format of their payload ("" for nil and bools).
_SCALAR_FORMAT = {0xC0: "", 0xC2: "", 0xC3: "", 0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I",
                  0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_SCALAR_SIZE = {b: struct.calcsize(f) if f else 0 for b, f in _SCALAR_FORMAT.items()}
# Items with a length field: type byte to (kind, width of the length field); kinds as _header's.
_SIZED = {0xD9: (1, 1), 0xDA: (1, 2), 0xDB: (1, 4), 0xC4: (2, 1), 0xC5: (2, 2), 0xC6: (2, 4),
          0xDC: (3, 2), 0xDD: (3, 4), 0xDE: (4, 2), 0xDF: (4, 4)}
_LENGTH_FORMAT = {1: ">B", 2: ">H", 4: ">I"}
_SKIPPED_KIND = {2: Skipped.BINARY, 3: Skipped.ARRAY, 4: Skipped.MAP}


def _header(buf: Any, pos: int, end: int) -> tuple[int, int, int]:
    """The msgpack item at ``pos`` as ``(kind, n, payload start)``: kind 0 a scalar with ``n``
    payload bytes, 1 a string and 2 a binary of ``n`` bytes, 3 an array of ``n`` items, 4 a
    map of ``n`` entries."""
    if pos >= end:
        raise _Unpeekable
    b = buf[pos]
    if b <= 0x7F or b >= 0xE0:
        return 0, 0, pos + 1
    if b <= 0x8F:
        return 4, b & 0x0F, pos + 1
    if b <= 0x9F:
        return 3, b & 0x0F, pos + 1
    if b <= 0xBF:
        return 1, b & 0x1F, pos + 1
    size = _SCALAR_SIZE.get(b)
    if size is not None:
        return 0, size, pos + 1
    sized = _SIZED.get(b)
    if sized is None:
        raise _Unpeekable  # extension types (which decode refuses) and the never-used 0xC1
    kind, width = sized
    if pos + 1 + width > end:
        raise _Unpeekable
    return kind, struct.unpack_from(_LENGTH_FORMAT[width], buf, pos + 1)[0], pos + 1 + width


def _skip(buf: Any, pos: int, end: int, limits: CodecLimits, budget: list[int]) -> tuple[int, Skipped]:
    """Step over the container or binary at ``pos`` and everything inside it (headers only:
    strings and binaries are jumped over by their length), applying the caps; return where the
    next item starts and what was stepped over."""
    kind, n, pos = _header(buf, pos, end)
    what = _SKIPPED_KIND[kind]
    if kind == 2:
        if pos + n > end:
            raise _Unpeekable
        return pos + n, what
    max_len, max_str, max_depth = limits.max_container_len, limits.max_str_bytes, limits.max_depth
    if n > max_len or max_depth <= 1:  # a top-level value is at depth 1, as in decode's walk
        raise _Unpeekable
    left = [n if kind == 3 else 2 * n]  # items still to step over at each open level
    items = budget[0]
    while left:
        if not left[-1]:
            left.pop()
            continue
        left[-1] -= 1
        items -= 1
        if items < 0 or pos >= end:
            raise _Unpeekable
        b = buf[pos]
        # An observation's usual items first, inline: small ints, short strings, bools and nil,
        # fixed-size numbers, the short binary keys of array maps.
        if b <= 0x7F or b >= 0xE0 or b == 0xC3 or b == 0xC2 or b == 0xC0:
            pos += 1
        elif 0xA0 <= b <= 0xBF:
            if b & 0x1F > max_str:
                raise _Unpeekable
            pos += 1 + (b & 0x1F)
        elif b == 0xC4 and pos + 1 < end:
            pos += 2 + buf[pos + 1]
        elif b in _SCALAR_SIZE:
            pos += 1 + _SCALAR_SIZE[b]
        else:
            kind, n, pos = _header(buf, pos, end)
            if kind < 3:
                if kind == 1 and n > max_str:
                    raise _Unpeekable
                pos += n
            else:
                if n > max_len or len(left) + 1 >= max_depth:
                    raise _Unpeekable
                left.append(n if kind == 3 else 2 * n)
    budget[0] = items
    if pos > end:
        raise _Unpeekable
    return pos, what


def _scalar(buf: Any, pos: int, end: int, limits: CodecLimits) -> tuple[int, Any]:
    """The nil, bool, int, float or string at ``pos``, and where the next item starts."""
    kind, n, start = _header(buf, pos, end)
    if start + n > end or kind > 1:
        raise _Unpeekable
    b = buf[pos]
    if kind == 1:
        if n > limits.max_str_bytes:
            raise _Unpeekable
        try:
            return start + n, bytes(buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise _Unpeekable from None
    if b <= 0x7F:
        return start, b
    if b >= 0xE0:
        return start, b - 0x100
    fmt = _SCALAR_FORMAT[b]
    if not fmt:
        return start, None if b == 0xC0 else b == 0xC3
    return start + n, struct.unpack_from(fmt, buf, start)[0]


def peek_map(data: bytes | bytearray | memoryview, limits: CodecLimits = DEFAULT_LIMITS) -> dict[str, Any] | None:
    """Read the scalar entries of a message's top-level map without decoding the rest.

    Only msgpack headers are read: maps, arrays and binaries are stepped over (strings and
    binaries by their length), never built, so the cost does not grow with the size of the
    observation's arrays and their bytes are not even read. The caps of ``limits`` on sizes,
    lengths and depth apply as in :func:`decode`. This is for deciding *early* (a server
    refusing a request it has no room for); it is not validation: a message ``peek_map``
    accepts must still go through :func:`decode`, which may refuse it.

    Args:
        data: one encoded message.
        limits: the caps to apply.

    Returns:
        Key to value for every top-level entry: nil, bool, int, float and string values as
        Python values; maps, arrays and binaries as a :class:`Skipped` marker. ``None`` when the
        message is not a map with string keys, is malformed or truncated, has trailing bytes,
        uses an extension type, breaks a cap, or holds more than :data:`PEEK_MAX_ITEMS` items
        (such a message is left to :func:`decode`).
    """
    if not isinstance(data, (bytes, bytearray)):
        if not isinstance(data, memoryview):
            return None
        try:
            data = data.cast("B")  # indexing then gives bytes, as for bytes
        except TypeError:  # not contiguous
            return None
    end = len(data)
    if end > limits.max_message_bytes:
        return None
    start = 0
    if data[:4] == OOB_MAGIC:  # an out-of-band frame: the message is its header
        if end < OOB_PREFIX:
            return None
        header_end = OOB_PREFIX + int.from_bytes(data[4:OOB_PREFIX], "little")
        if oob_data_start(header_end - OOB_PREFIX) > end:
            return None
        start, end = OOB_PREFIX, header_end
    budget = [PEEK_MAX_ITEMS]
    try:
        kind, n, pos = _header(data, start, end)
        if kind != 4 or n > limits.max_container_len:
            return None
        out: dict[str, Any] = {}
        for _ in range(n):
            pos, key = _scalar(data, pos, end, limits)
            if type(key) is not str:
                return None
            if pos < end and data[pos] in _STEPPED_OVER:
                pos, out[key] = _skip(data, pos, end, limits, budget)
            else:
                pos, out[key] = _scalar(data, pos, end, limits)
    except _Unpeekable:
        return None
    return out if pos == end else None


# Type bytes of maps, arrays and binaries: what peek_map steps over.
_STEPPED_OVER = frozenset([*range(0x80, 0xA0), 0xC4, 0xC5, 0xC6, 0xDC, 0xDD, 0xDE, 0xDF])
