"""The hardened decoder: untrusted msgpack bytes to a tree of plain values and read-only arrays.

Every rule of :mod:`chunkline.client.wire.codec` (no unpickling, numeric dtypes only, lengths
checked before an array is built, every size capped, no extension types) is enforced here.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from .encodings import COMPRESSED, EncodedArray, payload_limit
from .errors import CodecError, CodecErrorReason
from .format import (
    DEFAULT_LIMITS,
    ENC_KEY,
    GENERIC_KEY,
    MN_KEY,
    ND_KEY,
    OOB_ALIGN,
    OOB_KEY,
    OOB_MAGIC,
    OOB_PREFIX,
    CodecLimits,
    check_dtype,
    oob_data_start,
)

__all__ = ["decode"]


_SCALARS = frozenset({str, bytes, int, float, bool})


class _Walk:
    """One decode's validation pass: turns array maps into arrays, counts and checks everything."""

    __slots__ = ("limits", "arrays", "frame", "frame_len", "data_start", "oob_end")

    def __init__(self, limits: CodecLimits, frame: Any = None, data_start: int = 0) -> None:
        self.limits = limits
        self.arrays = 0
        self.frame = frame  # an out-of-band frame (read-only bytes) whose data section arrays view
        self.frame_len = 0 if frame is None else len(frame)  # read once, not once per array
        self.data_start = data_start
        self.oob_end = 0  # where the last out-of-band array ended: the next one starts at or after it

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

    def mapping(self, obj: dict[Any, Any], depth: int) -> Any:
        if depth >= self.limits.max_depth:
            raise CodecError(CodecErrorReason.TOO_DEEP, f"nesting deeper than {self.limits.max_depth}")
        if ND_KEY in obj:
            return self.ndarray(obj, obj.get(b"dtype"), obj.get(b"shape"))
        if GENERIC_KEY in obj:
            return self.openpi_scalar(obj)
        if MN_KEY in obj and b"type" in obj:
            if obj[MN_KEY] is True:
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

    def ndarray(self, obj: dict[Any, Any], dtype_str: Any, shape: Any) -> np.ndarray | EncodedArray:
        # The hot path of every observation: checks inlined, limits read once.
        limits = self.limits
        self.arrays += 1
        if self.arrays > limits.max_arrays:
            raise CodecError(CodecErrorReason.TOO_MANY_ARRAYS, f"more than {limits.max_arrays} arrays")
        dtype = check_dtype(dtype_str)  # cached per string: one dict lookup for a known dtype
        if type(shape) is not list:
            raise CodecError(CodecErrorReason.BAD_SHAPE, "shape must be a list of non-negative integers")
        n = 1  # Python ints: a huge claimed shape cannot overflow
        for d in shape:
            if type(d) is not int or d < 0:
                raise CodecError(CodecErrorReason.BAD_SHAPE, "shape must be a list of non-negative integers")
            n *= d
        if len(shape) > limits.max_dims:
            raise CodecError(CodecErrorReason.TOO_MANY_DIMS, f"{len(shape)} dimensions, at most {limits.max_dims}")
        if n > limits.max_elements:
            raise CodecError(CodecErrorReason.TOO_MANY_ELEMENTS, f"{n} elements, at most {limits.max_elements}")
        if ENC_KEY in obj:
            return self.encoded(obj, obj[ENC_KEY], dtype, shape, n * dtype.itemsize)
        if OOB_KEY in obj:
            start, nbytes = self.oob_span(obj[OOB_KEY], b"data" in obj)
            if nbytes != n * dtype.itemsize:
                raise CodecError(CodecErrorReason.LENGTH_MISMATCH, f"shape {shape} of {dtype.str} needs {n * dtype.itemsize} bytes, "
                                 f"the frame says {nbytes}")
            oob_view: np.ndarray = np.ndarray(shape, dtype, self.frame, start)
            return oob_view
        data = obj.get(b"data")
        if not isinstance(data, bytes):
            raise CodecError(CodecErrorReason.MALFORMED, "array data must be binary")
        if len(data) != n * dtype.itemsize:
            raise CodecError(
                CodecErrorReason.LENGTH_MISMATCH,
                f"shape {shape} of {dtype.str} needs {n * dtype.itemsize} bytes, got {len(data)}",
            )
        # A read-only view of the received bytes (one call: cheaper than frombuffer + reshape).
        view: np.ndarray = np.ndarray(shape, dtype, data)
        return view

    def encoded(self, obj: dict[Any, Any], encoding: Any, dtype: np.dtype, shape: list[int], raw_nbytes: int) -> EncodedArray:
        """A compressed field, kept compressed: its payload is checked for size here and decoded
        later, off the event loop, once its declared dtype and shape match the policy's spec."""
        if type(encoding) is not str or encoding not in COMPRESSED:
            shown = encoding if type(encoding) is str and len(encoding) <= 16 else type(encoding).__name__
            raise CodecError(CodecErrorReason.BAD_ENCODING, f"unknown encoding {shown!r} (known: {', '.join(COMPRESSED)})")
        limit = payload_limit(raw_nbytes)
        payload: bytes | memoryview
        if OOB_KEY in obj:
            start, nbytes = self.oob_span(obj[OOB_KEY], b"data" in obj, limit)
            payload = memoryview(self.frame)[start:start + nbytes]
        else:
            data = obj.get(b"data")
            if not isinstance(data, bytes):
                raise CodecError(CodecErrorReason.MALFORMED, "array data must be binary")
            payload = data
        if not 0 < len(payload) <= limit:
            raise CodecError(CodecErrorReason.BAD_ENCODING, f"a {encoding} payload of {len(payload)} bytes for {raw_nbytes} raw bytes "
                             f"(at most {limit})")
        return EncodedArray(encoding, dtype, tuple(shape), payload)

    def oob_span(self, where: Any, also_inline: bool, max_nbytes: int | None = None) -> tuple[int, int]:
        """Where an out-of-band array's bytes lie in the frame, ``(start, nbytes)``, after every
        check of the placement (``max_nbytes`` bounds a compressed payload before the frame is)."""
        if self.frame is None or also_inline:
            raise CodecError(CodecErrorReason.MALFORMED, "an out-of-band array outside an out-of-band frame, or with inline data")
        if type(where) is not list or len(where) != 2:
            raise CodecError(CodecErrorReason.MALFORMED, "an out-of-band array needs [offset, nbytes]")
        offset, nbytes = where
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
            raise CodecError(CodecErrorReason.MALFORMED, "an out-of-band array needs [offset, nbytes]")
        if max_nbytes is not None and nbytes > max_nbytes:
            raise CodecError(CodecErrorReason.BAD_ENCODING, f"a compressed payload of {nbytes} bytes, at most {max_nbytes}")
        if offset % OOB_ALIGN or offset < self.oob_end:
            raise CodecError(CodecErrorReason.MALFORMED, f"out-of-band offsets must be multiples of {OOB_ALIGN}, "
                             "increasing and not overlapping")
        start = self.data_start + offset
        if start + nbytes > self.frame_len:
            raise CodecError(CodecErrorReason.LENGTH_MISMATCH, "an out-of-band array runs past the end of the frame")
        self.oob_end = offset + nbytes
        return start, nbytes

    def openpi_scalar(self, obj: dict[Any, Any]) -> np.generic:
        self._count()
        dtype = check_dtype(obj.get(b"dtype"))
        value = obj.get(b"data")
        if type(value) not in (int, float, bool):
            raise CodecError(CodecErrorReason.MALFORMED, "scalar data must be a number")
        try:
            with np.errstate(over="raise", invalid="raise"):
                scalar: np.generic = dtype.type(value)  # a float too large for its dtype is refused, not made inf
        except (OverflowError, ValueError, TypeError, FloatingPointError):
            raise CodecError(CodecErrorReason.MALFORMED, f"scalar does not fit {dtype.str}") from None
        return scalar

    def mn_scalar(self, obj: dict[Any, Any]) -> np.generic:
        self._count()
        dtype = check_dtype(obj.get(b"type"))
        data = obj.get(b"data")
        if not isinstance(data, bytes) or len(data) != dtype.itemsize:
            raise CodecError(CodecErrorReason.LENGTH_MISMATCH, f"scalar of {dtype.str} needs {dtype.itemsize} bytes")
        scalar: np.generic = np.frombuffer(data, dtype=dtype, count=1)[0]
        return scalar


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
    size = len(data)
    if size > limits.max_message_bytes:
        raise CodecError(
            CodecErrorReason.MESSAGE_TOO_LARGE, f"{size} bytes, at most {limits.max_message_bytes}"
        )
    body: Any = data
    if data[:4] == OOB_MAGIC:
        if size < OOB_PREFIX:
            raise CodecError(CodecErrorReason.MALFORMED, "a truncated out-of-band frame")
        header_len = int.from_bytes(data[4:OOB_PREFIX], "little")
        start = oob_data_start(header_len)
        if start > size:
            raise CodecError(CodecErrorReason.MALFORMED, "the out-of-band header runs past the end of the frame")
        frame = data if isinstance(data, bytes) else memoryview(data).toreadonly()  # views never write through
        walk = _Walk(limits, frame, start)
        body = memoryview(data)[OOB_PREFIX:OOB_PREFIX + header_len]
    else:
        walk = _Walk(limits)
    try:
        obj = msgpack.unpackb(
            body,
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
    return walk.value(obj, 0)

