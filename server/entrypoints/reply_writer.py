"""The header of a binary WebSocket frame as a server writes it (final, unmasked: RFC 6455 5.2),
for :meth:`~chunkline.server.entrypoints.connection.BudgetedConnection.send_now`, which writes a
reply's frame to the transport the connection owns, behind whatever websockets had to send."""

from __future__ import annotations

import struct

__all__ = ["frame_header"]

_FIN_BINARY = 0x82  # FIN, no reserved bits, opcode 2
_SHORT = tuple(bytes((_FIN_BINARY, n)) for n in range(126))  # lengths in the second byte
_MEDIUM = struct.Struct("!BBH")  # 126, then a 16-bit length
_LONG = struct.Struct("!BBQ")  # 127, then a 64-bit length


def frame_header(length: int) -> bytes:
    """The header of a final, unmasked binary frame with a payload of ``length`` bytes."""
    if length < 126:
        return _SHORT[length]
    if length < 65536:
        return _MEDIUM.pack(_FIN_BINARY, 126, length)
    return _LONG.pack(_FIN_BINARY, 127, length)

