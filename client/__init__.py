"""chunkline's robot-side package: wire protocol, codec and clients (numpy, msgpack, websockets, pydantic only)."""

from .asyncio_client import AsyncClient
from .backoff import Backoff
from .codec import CodecLimits, Encoder, decode, encode
from .compression import Compression
from .core import ClientCore
from .exceptions import (
    ChunklineError,
    CodecError,
    CodecErrorReason,
    ConnectionLost,
    ErrorCode,
    MappingError,
    MappingErrorReason,
    ProtocolError,
    RequestTimeout,
    ServerError,
)
from .protocol import SUBPROTOCOL, Chunk, ChunkReply, CloseCode
from .sync_client import Client

__all__ = [
    "AsyncClient",
    "Backoff",
    "Chunk",
    "ChunkReply",
    "ChunklineError",
    "Client",
    "ClientCore",
    "CloseCode",
    "CodecError",
    "CodecErrorReason",
    "CodecLimits",
    "Compression",
    "ConnectionLost",
    "Encoder",
    "ErrorCode",
    "MappingError",
    "MappingErrorReason",
    "ProtocolError",
    "RequestTimeout",
    "SUBPROTOCOL",
    "ServerError",
    "decode",
    "encode",
]
