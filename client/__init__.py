"""chunkline's robot-side package: wire protocol, codec and clients (numpy, msgpack, websockets, pydantic only)."""

from .asyncio_client import AsyncClient
from .backoff import Backoff
from .compression import Compression
from .core import ClientCore
from .exceptions import ConnectionLost, MappingError, MappingErrorReason, ReplaceMissed, RequestTimeout, ServerError, Superseded
from .sync_client import Client
from .wire.codec import CodecLimits, Encoder, decode, encode
from .wire.errors import ChunklineError, CloseCode, CodecError, CodecErrorReason, ErrorCode, ProtocolError
from .wire.protocol import SUBPROTOCOL, Chunk, ChunkReply

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
    "Superseded",
    "ReplaceMissed",
    "decode",
    "encode",
]
