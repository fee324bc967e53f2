"""Where a client connects and with which key when the caller does not say: ``CHUNKLINE_URI`` and
``CHUNKLINE_API_KEY``.

Precedence, for the clients and the ``chunkline`` command alike: an explicit argument (or flag),
then the environment variable, then the default (``ws://127.0.0.1:8000``; no key).
"""

from __future__ import annotations

import os

__all__ = ["URI_ENV", "API_KEY_ENV", "DEFAULT_URI", "resolve_uri", "resolve_api_key"]

URI_ENV = "CHUNKLINE_URI"
API_KEY_ENV = "CHUNKLINE_API_KEY"
DEFAULT_URI = "ws://127.0.0.1:8000"


def resolve_uri(uri: str | None) -> str:
    """``uri`` if given, else ``$CHUNKLINE_URI`` if set and not empty, else :data:`DEFAULT_URI`."""
    if uri is not None:
        return uri
    return os.environ.get(URI_ENV) or DEFAULT_URI


def resolve_api_key(api_key: str | None) -> str | None:
    """``api_key`` if given, else ``$CHUNKLINE_API_KEY`` if set and not empty, else ``None``."""
    if api_key is not None:
        return api_key
    return os.environ.get(API_KEY_ENV) or None
