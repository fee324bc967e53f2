"""What the two clients' shells hold alike: the sans-I/O core, the URI and the compression workers.

:class:`~chunkline.client.sync_client.Client` and :class:`~chunkline.client.asyncio_client.AsyncClient`
differ only in how they wait (a thread blocking on a lock and a socket, or a coroutine awaiting);
what they decide, :class:`~chunkline.client.core.ClientCore` decides for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+; the annotations are never evaluated at run time
    from typing_extensions import Unpack

from .compression import FieldCompressor
from .core import ClientCore, ClientOptions
from .wire.protocol import Hello

__all__ = ["ClientShell"]


class ClientShell:
    """The state both clients start with (their arguments: see :class:`AsyncClient`)."""

    def __init__(self, uri: str | None = None, **options: Unpack[ClientOptions]) -> None:
        self._core = ClientCore(uri, **options)
        self.uri = self._core.uri
        compression = self._core.compression
        # Image fields compress on worker threads, in parallel; none when they travel raw.
        self._compressor = FieldCompressor(compression.workers) if compression.mode != "raw" else None

    @property
    def hello(self) -> Hello | None:
        """The server's ``hello`` on the current (or last) connection."""
        return self._core.hello
