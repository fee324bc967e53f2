"""A reply written as one WebSocket frame straight to the transport, below websockets' protocol.

The send side's counterpart of :mod:`.frame_reader`. websockets' ``send`` of one binary message
runs about twenty Python calls per reply (an async context manager entered and left, the sans-I/O
protocol's ``send_binary``, a ``Frame`` built, checked and serialized through a ``BytesIO``, the
``writes`` list handed out, ``drain``) to put a 2-10 byte header in front of the payload and hand
both to ``transport.write``. :func:`write_binary` writes the very same bytes itself, *only when
that is exactly what websockets would write and do*, and otherwise says no, so the caller sends
through ``ws.send`` as before.

Why skipping each piece of websockets' state is safe (checked against websockets 17.4's
``asyncio/connection.py``, ``protocol.py`` and ``frames.py``; :data:`DIRECT_WRITES` limits the
direct path to the major version read, and a test fails when another one is installed):

- ``protocol.state is OPEN``: ``send_context`` would let the write through only then. Any close
  (a close frame sent or received, ``fail()``, end of stream) moves the state off ``OPEN``
  synchronously, before this check can run again, so a data frame never follows a close frame.
- ``protocol.extensions`` empty: no extension (permessage-deflate) would rewrite the frame; the
  server asks for none (``compression=None``), checked per connection all the same.
- ``protocol.expect_continuation_frame`` false and ``ws.send_in_progress`` is ``None``: no
  fragmented message is being sent; websockets' ``send`` would wait for one to end first.
- ``protocol.writes`` empty: websockets flushes it synchronously after every ``send_*`` and
  after every read (pongs, close replies), so it is empty between callbacks; were anything ever
  left there, the fallback sends it first, keeping the order on the wire.
- ``protocol.debug`` false: websockets logs every frame at DEBUG; with DEBUG on, it does.
- ``ws.paused`` false and the caller's own check that the reply fits below ``write_limit``:
  websockets' ``drain`` would not wait (it waits only while the transport has paused writing,
  which it does only above ``write_limit``), so its ``send`` completes without suspending, as
  this write does. Keepalive pings share the transport but are written whole, synchronously, in
  their own ``send_context``: frames from both never interleave within a frame.
- ``transport.is_closing()`` false: websockets' ``drain`` yields once to let ``connection_lost``
  run when it is; the fallback does the same.

Masking: a server never masks (RFC 6455 5.1), and websockets' ``Frame.check`` always passes for a
final binary frame with no reserved bits.
"""

from __future__ import annotations

import struct

import websockets
from websockets.asyncio.server import ServerConnection
from websockets.protocol import State

__all__ = ["DIRECT_WRITES", "frame_header", "write_binary", "verified_version"]

#: FIN set, no reserved bits, opcode 2 (binary): the first byte of every frame written here.
_FIN_BINARY = 0x82
_OPEN = State.OPEN
#: Headers of payloads under 126 bytes (length in the second byte), built once.
_SHORT = tuple(bytes((_FIN_BINARY, n)) for n in range(126))
_MEDIUM = struct.Struct("!BBH")  # 126, then a 16-bit length
_LONG = struct.Struct("!BBQ")  # 127, then a 64-bit length
#: Payloads below this are joined to their header (one small copy, one write); larger ones are
#: handed over as two buffers, not copied. At most 65536: below it a header is 2 or 4 bytes, which
#: :func:`write_binary` builds inline.
JOIN_MAX_BYTES = 64 * 1024


def verified_version(version: str) -> bool:
    """Whether websockets ``version`` is one whose send path :func:`write_binary` was checked
    against (the major version read: its state attributes and ``send`` logic)."""
    return version.split(".", 1)[0] == "17"


#: Whether :func:`write_binary` may write at all with the websockets installed.
DIRECT_WRITES = verified_version(websockets.__version__)


def frame_header(length: int) -> bytes:
    """The header of a final, unmasked binary frame with a payload of ``length`` bytes."""
    if length < 126:
        return _SHORT[length]
    if length < 65536:
        return _MEDIUM.pack(_FIN_BINARY, 126, length)
    return _LONG.pack(_FIN_BINARY, 127, length)


def write_binary(ws: ServerConnection, data: bytes) -> bool:
    """Write ``data`` to ``ws``'s transport as one complete binary frame when that is exactly
    what ``ws.send(data)`` would write, without suspending, now (see the module's docstring).

    The caller has checked that the transport's write buffer has room for ``data`` below the
    connection's ``write_limit``.

    Returns:
        whether it was written; if not, nothing was, and the caller sends through ``ws.send``.
    """
    protocol = ws.protocol
    if (protocol.state is not _OPEN or protocol.extensions or protocol.expect_continuation_frame or protocol.writes
            or protocol.debug or ws.send_in_progress is not None or ws.paused):
        return False
    transport = ws.transport
    if transport.is_closing():
        return False
    length = len(data)
    if length < JOIN_MAX_BYTES:
        # frame_header() inlined for the sizes replies have: one Python call fewer per reply.
        transport.write((_SHORT[length] if length < 126 else _MEDIUM.pack(_FIN_BINARY, 126, length)) + data)
    else:
        transport.writelines((frame_header(length), data))
    return True
