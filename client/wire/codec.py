"""msgpack + numpy codec for observations and action chunks, hardened for wire data.

Arrays travel in openpi's layout (``{b"__ndarray__": True, b"data", b"dtype", b"shape"}``); the
decoder also reads the ``msgpack-numpy`` package's layout. On every payload: nothing is ever
unpickled; only bool, integer and float dtypes; ``len(data) == prod(shape) * itemsize`` before an
array is built; sizes, depth, counts and lengths capped (:class:`CodecLimits`); extension types
refused. Every refusal is a :class:`~chunkline.client.wire.errors.CodecError` with a reason; decoded
arrays are read-only views of the received bytes. This module is the one place to import the
pieces from (:mod:`.format`, :mod:`.encoder`, :mod:`.decoder`)."""

from __future__ import annotations

from .decoder import decode
from .encoder import Encoded, Encoder, encode
from .format import DEFAULT_LIMITS, CodecLimits, check_dtype

__all__ = ["CodecLimits", "DEFAULT_LIMITS", "Encoded", "Encoder", "check_dtype", "decode", "encode"]
