"""The array layout on the wire, the dtypes it may carry, and the caps on decoded messages.

Shared by the encoder (:mod:`chunkline.client.wire.encoder`) and the hardened decoder
(:mod:`chunkline.client.wire.decoder`), and by the server's peek at a message's top-level fields.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from .errors import CodecError, CodecErrorReason

__all__ = [
    "CodecLimits",
    "DEFAULT_LIMITS",
    "GENERIC_KEY",
    "MN_KEY",
    "ND_KEY",
    "OOB_KEY",
    "ENC_KEY",
    "OOB_MAGIC",
    "OOB_PREFIX",
    "OOB_ALIGN",
    "LAYOUT_MSGPACK",
    "LAYOUT_OOB",
    "oob_data_start",
    "check_dtype",
]

# bool, int8..int64, uint8..uint64, float16..float64, with an optional byte-order mark.
_DTYPE_RE = re.compile(r"[<>|=]?(b1|[iu][1248]|f[248])")

ND_KEY = b"__ndarray__"
GENERIC_KEY = b"__npgeneric__"
MN_KEY = b"nd"  # msgpack-numpy package layout

# The out-of-band layout (native mode, when the server's hello lists it): array bytes follow a
# small msgpack header instead of sitting inside it, each 64-byte aligned, so the receiver makes
# read-only views of the received frame without copying them or walking them.
#
#   frame  := OOB_MAGIC (4 bytes) | header length (uint32, little-endian) | header | padding | data
#   header := the message as msgpack, each array a map {ND_KEY: true, dtype, shape, OOB_KEY: [offset, nbytes]}
#   data   := starts at oob_data_start(header length); offsets count from there, each a multiple of
#             OOB_ALIGN, in increasing order, never overlapping.
#
# 0xC1 is the one byte msgpack never uses, so a frame in either layout says which it is.
OOB_MAGIC = b"\xc1CL\x01"
OOB_PREFIX = len(OOB_MAGIC) + 4
OOB_ALIGN = 64
OOB_KEY = b"oob"
# A compressed field (:mod:`chunkline.client.wire.encodings`): the array map names its encoding, its
# dtype and shape are those of the decoded array, and its bytes (inline ``data`` or out of band)
# are the compressed payload: {ND_KEY: true, dtype, shape, ENC_KEY: "jpeg", data | OOB_KEY}.
ENC_KEY = b"enc"
LAYOUT_MSGPACK = "msgpack"
LAYOUT_OOB = "oob"


def oob_data_start(header_len: int) -> int:
    """Where an out-of-band frame's data section starts, for a header of ``header_len`` bytes."""
    end = OOB_PREFIX + header_len
    return -(-end // OOB_ALIGN) * OOB_ALIGN


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
    if type(dtype_str) is str:  # the usual case, told without isinstance calls: a known string is cached
        cached = _DTYPES.get(dtype_str)
        if cached is not None:
            return cached
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

