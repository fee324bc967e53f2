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

The pieces live by responsibility: :mod:`~chunkline.client.wire_format` (layout, dtypes, caps),
:mod:`~chunkline.client.encoder` and :mod:`~chunkline.client.decoder`; this module is the one
place to import them from. (The server's header-only peek lives with the server, in
:mod:`chunkline.server.robot.peek`.)
"""

from __future__ import annotations

from .decoder import decode
from .encoder import Encoded, Encoder, encode
from .wire_format import DEFAULT_LIMITS, CodecLimits, check_dtype

__all__ = ["CodecLimits", "DEFAULT_LIMITS", "Encoded", "Encoder", "check_dtype", "decode", "encode"]
