"""msgpack + numpy codec for observations and action chunks, hardened for wire data.

Arrays travel in the layout openpi uses::

    {b"__ndarray__": True, b"data": <bytes>, b"dtype": "<f4", b"shape": [50, 14]}
    {b"__npgeneric__": True, b"data": <python scalar>, b"dtype": "<f4"}

The decoder also reads the layout of the ``msgpack-numpy`` package
(``{b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [...], b"data": <bytes>}``
and ``{b"nd": False, b"type": ..., b"data": <bytes>}`` for scalars).

Safety rules, applied to every decoded payload:

* nothing is ever unpickled (``msgpack-numpy``'s own decoder unpickles object arrays:
  it is never called on wire data);
* only bool, signed/unsigned integer and float dtypes are accepted;
* ``len(data) == prod(shape) * itemsize`` is checked before an array is built;
* message size, nesting depth, array count, dimensions, elements per array,
  container lengths and string lengths are capped (:class:`CodecLimits`);
* msgpack extension types (timestamps included) are refused.

Every refusal raises :class:`~chunkline.client.exceptions.CodecError` with a reason.
Decoded arrays are read-only views of the received bytes (no extra copy).

Two helpers serve hot paths without weakening any of this. :func:`peek_map` reads a message's
top-level scalar fields (an ``infer``'s ``type``, ``id``, ``deadline_ms``, ``model``) from the
msgpack headers alone, stepping over array data by its length without reading it, so that a
server can refuse a request it has no room for without decoding the observation; a message it
accepts is still decoded in full (and may still be refused) by :func:`decode` before anything
uses it. :meth:`Encoder.preencode` packs a value once (an observation a load generator
re-sends) into an :class:`Encoded` that later messages embed as is.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import struct
from typing import Any

import msgpack
import numpy as np

from .exceptions import CodecError, CodecErrorReason

__all__ = ["CodecLimits", "DEFAULT_LIMITS", "Encoded", "Encoder", "PEEK_MAX_ITEMS", "Skipped", "decode", "encode", "check_dtype",
           "peek_map"]

# bool, int8..int64, uint8..uint64, float16..float64, with an optional byte-order mark.
_DTYPE_RE = re.compile(r"[<>|=]?(b1|[iu][1248]|f[248])")

_ND_KEY = b"__ndarray__"
_GENERIC_KEY = b"__npgeneric__"
_MN_KEY = b"nd"  # msgpack-numpy package layout


@dataclasses.dataclass(frozen=True)
class CodecLimits:
    """Caps applied when decoding untrusted bytes.

    Args:
        max_message_bytes: largest encoded message accepted.
        max_depth: deepest nesting of maps and lists.
        max_arrays: most arrays (and numpy scalars) in one message.
        max_dims: most dimensions of one array.
        max_elements: most elements in one array.
        max_container_len: most entries in one map or list.
        max_str_bytes: longest string (UTF-8 bytes) or plain binary value.
    """

    max_message_bytes: int = 64 * 1024 * 1024
    max_depth: int = 16
    max_arrays: int = 64
    max_dims: int = 8
    max_elements: int = 1 << 26
    max_container_len: int = 100_000
    max_str_bytes: int = 1 << 20


DEFAULT_LIMITS = CodecLimits()


_DTYPES: dict[object, np.dtype] = {}  # accepted wire dtype strings, filled on first use (bounded: ~100 valid strings)


def check_dtype(dtype_str: object) -> np.dtype:
    """Return the numpy dtype for a wire dtype string, refusing anything but bool/int/uint/float.

    Args:
        dtype_str: the dtype as it came off the wire (``str`` or ``bytes``).

    Raises:
        CodecError: ``unsupported_dtype`` for any other dtype or a malformed string.
    """
    if isinstance(dtype_str, bytes):
        try:
            dtype_str = dtype_str.decode("ascii")
        except UnicodeDecodeError:
            raise CodecError(CodecErrorReason.UNSUPPORTED_DTYPE, "dtype is not ASCII") from None
    cached = _DTYPES.get(dtype_str) if isinstance(dtype_str, str) else None
    if cached is not None:
        return cached
    if not isinstance(dtype_str, str) or not _DTYPE_RE.fullmatch(dtype_str):
        shown = dtype_str if isinstance(dtype_str, str) and len(dtype_str) < 40 else type(dtype_str).__name__
        raise CodecError(CodecErrorReason.UNSUPPORTED_DTYPE, f"dtype {shown!r} is not bool/int/uint/float")
    dtype = _DTYPES[dtype_str] = np.dtype(dtype_str)  # only strings matching the pattern are cached
    return dtype


# ----------------------------------------------------------------------------------------------
# encoding


def _encode_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise CodecError(CodecErrorReason.UNENCODABLE, f"cannot send arrays of dtype {obj.dtype}")
        if not obj.flags.c_contiguous:
            obj = np.ascontiguousarray(obj)
        # A flat byte view: msgpack copies it straight into its buffer, with no tobytes() copy first.
        data = memoryview(obj.reshape(-1)).cast("B") if obj.size else b""
        return {_ND_KEY: True, b"data": data, b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in "biuf":
            raise CodecError(CodecErrorReason.UNENCODABLE, f"cannot send scalars of dtype {obj.dtype}")
        return {_GENERIC_KEY: True, b"data": obj.item(), b"dtype": obj.dtype.str}
    if isinstance(obj, tuple):
        return list(obj)
    raise CodecError(CodecErrorReason.UNENCODABLE, f"cannot send values of type {type(obj).__name__}")


class Encoded:
    """One value already packed by :meth:`Encoder.preencode`; an :class:`Encoder` embeds its
    bytes as they are wherever the value appears in a message.

    Only an encoder makes these (the constructor is not for wire bytes): the bytes are always
    exactly one complete msgpack object, so a message that embeds them stays well-formed.

    Args:
        data: the packed bytes.
        _token: the encoder's private proof of origin.

    Raises:
        TypeError: made by anything but :meth:`Encoder.preencode`.
    """

    __slots__ = ("_data",)

    def __init__(self, data: bytes, _token: object = None) -> None:
        if _token is not _PREENCODED:
            raise TypeError("use Encoder.preencode() to make an Encoded value")
        self._data = data

    @property
    def data(self) -> bytes:
        """The packed bytes."""
        return self._data

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"Encoded({len(self._data)} bytes)"


_PREENCODED = object()


def _bin_header(n: int) -> bytes:
    if n < 0x100:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


class Encoder:
    """Encodes messages with one reused msgpack ``Packer`` (much faster than a packer per call).

    Array data is copied exactly once: maps, lists and array headers are packed piece by piece,
    the arrays' bytes are referenced in place, and one ``join`` builds the message.

    Not thread-safe: give each thread or connection its own encoder.
    """

    _CACHE_MAX = 256  # robots send the same keys and array shapes every time: cache their headers

    def __init__(self) -> None:
        self._packer = msgpack.Packer(default=_encode_hook, use_bin_type=True, autoreset=True)
        self._array_keys = [self._packer.pack(k) for k in (_ND_KEY, True, b"dtype", b"shape", b"data")]
        self._headers: dict[tuple[str, tuple[int, ...]], bytes] = {}
        self._keys: dict[str, bytes] = {}

    def _array(self, arr: np.ndarray, parts: list[Any]) -> None:
        if arr.dtype.kind not in "biuf":
            raise CodecError(CodecErrorReason.UNENCODABLE, f"cannot send arrays of dtype {arr.dtype}")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        cache_key = (arr.dtype.str, arr.shape)
        header = self._headers.get(cache_key)
        if header is None:
            nd, true, dtype, shape, data = self._array_keys
            pack = self._packer.pack
            header = b"".join((b"\x84", nd, true, dtype, pack(arr.dtype.str), shape, pack(list(arr.shape)),
                               data, _bin_header(arr.nbytes)))
            if len(self._headers) < self._CACHE_MAX:
                self._headers[cache_key] = header
        parts.append(header)
        if arr.nbytes:
            parts.append(memoryview(arr.reshape(-1)).cast("B"))

    def _key(self, key: Any) -> bytes:
        if type(key) is str:
            packed = self._keys.get(key)
            if packed is None:
                packed = self._packer.pack(key)
                if len(self._keys) < self._CACHE_MAX and len(key) <= 64:
                    self._keys[key] = packed
            return packed
        return self._packer.pack(key)

    def _emit(self, obj: Any, parts: list[Any]) -> None:
        kind = type(obj)
        if kind is dict:
            parts.append(self._packer.pack_map_header(len(obj)))
            for key, value in obj.items():
                parts.append(self._key(key))
                self._emit(value, parts)
        elif kind is np.ndarray:
            self._array(obj, parts)
        elif kind is list or kind is tuple:
            parts.append(self._packer.pack_array_header(len(obj)))
            for value in obj:
                self._emit(value, parts)
        elif kind is Encoded:
            parts.append(obj.data)
        else:  # scalars, strings, bytes, numpy scalars (through the hook)
            parts.append(self._packer.pack(obj))

    def _join(self, parts: list[Any]) -> bytes:
        return b"".join(parts)

    def encode(self, obj: Any) -> bytes:
        """Encode ``obj`` (maps, lists, str, bytes, numbers, bool, None, numpy arrays and scalars)."""
        parts: list[Any] = []
        try:
            self._emit(obj, parts)
        except CodecError:
            self._packer.reset()
            raise
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            self._packer.reset()
            raise CodecError(CodecErrorReason.UNENCODABLE, str(exc)) from None
        return self._join(parts)

    def preencode(self, obj: Any) -> Encoded:
        """Pack ``obj`` once, for messages that carry the same value again and again (a load
        generator re-sending one observation per robot): they embed the bytes as they are.

        Args:
            obj: anything :meth:`encode` takes.

        Raises:
            CodecError: ``unencodable``, as :meth:`encode`.
        """
        return Encoded(self.encode(obj), _PREENCODED)

    def encode_map_prefix(self, n_entries: int, entries: dict[str, Any]) -> bytes:
        """Encode the header of an ``n_entries`` map followed by ``entries``.

        The caller appends the remaining ``n_entries - len(entries)`` key/value pairs with
        :meth:`encode_map_entries`. This lets a server time the encoding of a reply and still
        put that time into the same reply.
        """
        return self._packer.pack_map_header(n_entries) + self.encode_map_entries(entries)

    def encode_map_entries(self, entries: dict[str, Any]) -> bytes:
        """Encode ``entries`` as bare key/value pairs (see :meth:`encode_map_prefix`)."""
        parts: list[Any] = []
        try:
            for key, value in entries.items():
                parts.append(self._key(key))
                self._emit(value, parts)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            self._packer.reset()
            raise CodecError(CodecErrorReason.UNENCODABLE, str(exc)) from None
        return b"".join(parts)


_default_encoder = Encoder()


def encode(obj: Any) -> bytes:
    """Encode with a module-level encoder. Prefer an :class:`Encoder` per thread in servers."""
    return _default_encoder.encode(obj)


# ----------------------------------------------------------------------------------------------
# decoding


_SCALARS = frozenset({str, bytes, int, float, bool})


class _Walk:
    """One decode's validation pass: turns array maps into arrays, counts and checks everything."""

    __slots__ = ("limits", "arrays")

    def __init__(self, limits: CodecLimits) -> None:
        self.limits = limits
        self.arrays = 0

    def value(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, dict):
            return self.mapping(obj, depth)
        if isinstance(obj, list):
            if depth >= self.limits.max_depth:
                raise CodecError(CodecErrorReason.TOO_DEEP, f"nesting deeper than {self.limits.max_depth}")
            for i, item in enumerate(obj):
                if isinstance(item, (dict, list)):
                    obj[i] = self.value(item, depth + 1)
                elif not isinstance(item, (str, bytes, int, float, bool)) and item is not None:
                    self.value(item, depth + 1)
            return obj
        if isinstance(obj, (str, int, float, bool, bytes)) or obj is None:
            return obj
        raise CodecError(CodecErrorReason.UNSUPPORTED_TYPE, f"values of type {type(obj).__name__} are not accepted")

    def mapping(self, obj: dict, depth: int) -> Any:
        if depth >= self.limits.max_depth:
            raise CodecError(CodecErrorReason.TOO_DEEP, f"nesting deeper than {self.limits.max_depth}")
        if _ND_KEY in obj:
            return self.ndarray(obj, obj.get(b"dtype"), obj.get(b"shape"))
        if _GENERIC_KEY in obj:
            return self.openpi_scalar(obj)
        if _MN_KEY in obj and b"type" in obj:
            if obj[_MN_KEY] is True:
                kind = obj.get(b"kind", b"")
                if kind not in (b"", ""):
                    raise CodecError(CodecErrorReason.UNSUPPORTED_DTYPE, "structured and object arrays are refused")
                return self.ndarray(obj, obj.get(b"type"), obj.get(b"shape"))
            return self.mn_scalar(obj)
        for key, item in obj.items():
            if type(key) is not str:
                raise CodecError(CodecErrorReason.UNSUPPORTED_TYPE, "map keys must be strings")
            kind = type(item)
            if kind is dict:
                obj[key] = self.mapping(item, depth + 1)
            elif kind is list:
                obj[key] = self.value(item, depth + 1)
            elif kind not in _SCALARS and item is not None:
                self.value(item, depth + 1)
        return obj

    def _count(self) -> None:
        self.arrays += 1
        if self.arrays > self.limits.max_arrays:
            raise CodecError(CodecErrorReason.TOO_MANY_ARRAYS, f"more than {self.limits.max_arrays} arrays")

    def ndarray(self, obj: dict, dtype_str: Any, shape: Any) -> np.ndarray:
        self._count()
        dtype = check_dtype(dtype_str)
        if type(shape) is not list:
            raise CodecError(CodecErrorReason.BAD_SHAPE, "shape must be a list of non-negative integers")
        for d in shape:
            if type(d) is not int or d < 0:
                raise CodecError(CodecErrorReason.BAD_SHAPE, "shape must be a list of non-negative integers")
        if len(shape) > self.limits.max_dims:
            raise CodecError(CodecErrorReason.TOO_MANY_DIMS, f"{len(shape)} dimensions, at most {self.limits.max_dims}")
        n = math.prod(shape)  # Python ints: a huge claimed shape cannot overflow
        if n > self.limits.max_elements:
            raise CodecError(CodecErrorReason.TOO_MANY_ELEMENTS, f"{n} elements, at most {self.limits.max_elements}")
        data = obj.get(b"data")
        if not isinstance(data, bytes):
            raise CodecError(CodecErrorReason.MALFORMED, "array data must be binary")
        if len(data) != n * dtype.itemsize:
            raise CodecError(
                CodecErrorReason.LENGTH_MISMATCH,
                f"shape {shape} of {dtype.str} needs {n * dtype.itemsize} bytes, got {len(data)}",
            )
        # A read-only view of the received bytes (one call: cheaper than frombuffer + reshape).
        return np.ndarray(shape, dtype, data)

    def openpi_scalar(self, obj: dict) -> np.generic:
        self._count()
        dtype = check_dtype(obj.get(b"dtype"))
        value = obj.get(b"data")
        if type(value) not in (int, float, bool):
            raise CodecError(CodecErrorReason.MALFORMED, "scalar data must be a number")
        try:
            with np.errstate(over="raise", invalid="raise"):
                return dtype.type(value)  # a float too large for its dtype is refused, not made inf
        except (OverflowError, ValueError, TypeError, FloatingPointError):
            raise CodecError(CodecErrorReason.MALFORMED, f"scalar does not fit {dtype.str}") from None

    def mn_scalar(self, obj: dict) -> np.generic:
        self._count()
        dtype = check_dtype(obj.get(b"type"))
        data = obj.get(b"data")
        if not isinstance(data, bytes) or len(data) != dtype.itemsize:
            raise CodecError(CodecErrorReason.LENGTH_MISMATCH, f"scalar of {dtype.str} needs {dtype.itemsize} bytes")
        return np.frombuffer(data, dtype=dtype, count=1)[0]


def _refuse_ext(code: int, data: bytes) -> Any:
    raise CodecError(CodecErrorReason.UNSUPPORTED_TYPE, f"msgpack extension type {code} is not accepted")


def decode(data: bytes | bytearray | memoryview, limits: CodecLimits = DEFAULT_LIMITS) -> Any:
    """Decode one message from untrusted bytes.

    Args:
        data: exactly one msgpack object (trailing bytes are refused).
        limits: the caps to apply.

    Returns:
        The decoded tree, with numpy arrays (read-only views of ``data``'s copy) in place of
        array maps.

    Raises:
        CodecError: with a reason, for anything refused.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(CodecErrorReason.MALFORMED, f"expected binary data, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise CodecError(
            CodecErrorReason.MESSAGE_TOO_LARGE, f"{len(data)} bytes, at most {limits.max_message_bytes}"
        )
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=False,  # keys are checked by the walk, which reports a typed error
            ext_hook=_refuse_ext,
            timestamp=0,
            max_str_len=limits.max_str_bytes,
            max_bin_len=limits.max_message_bytes,
            max_array_len=limits.max_container_len,
            max_map_len=limits.max_container_len,
            max_ext_len=0,
        )
    except CodecError:
        raise
    except msgpack.ExtraData:
        raise CodecError(CodecErrorReason.MALFORMED, "trailing bytes after the message") from None
    except (ValueError, msgpack.UnpackException, TypeError, RecursionError, UnicodeDecodeError) as exc:
        # StackError, FormatError, "incomplete input", too-long containers, bad UTF-8, ...
        raise CodecError(CodecErrorReason.MALFORMED, f"not a valid msgpack message ({type(exc).__name__})") from None
    return _Walk(limits).value(obj, 0)


# ----------------------------------------------------------------------------------------------
# peeking at a message's top-level fields


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
    budget = [PEEK_MAX_ITEMS]
    try:
        kind, n, pos = _header(data, 0, end)
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
