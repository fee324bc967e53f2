"""chunkline's robot-side package: wire protocol, codec and clients (numpy, msgpack, websockets, pydantic only)."""

from .asyncio_client import AsyncClient
from .backoff import Backoff
from .codec import CodecLimits, Encoder, decode, encode
from .exceptions import (
    ChunklineError,
    CodecError,
    CodecErrorReason,
    ConnectionLost,
    ErrorCode,
    ProtocolError,
    RequestTimeout,
    ServerError,
)
from .protocol import SUBPROTOCOL, CloseCode
from .replies import ChunkReply
from .sync_client import Client

__all__ = [
    "AsyncClient",
    "Backoff",
    "ChunkReply",
    "ChunklineError",
    "Client",
    "CloseCode",
    "CodecError",
    "CodecErrorReason",
    "CodecLimits",
    "ConnectionLost",
    "Encoder",
    "ErrorCode",
    "ProtocolError",
    "RequestTimeout",
    "SUBPROTOCOL",
    "ServerError",
    "decode",
    "encode",
]
