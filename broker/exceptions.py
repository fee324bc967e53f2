"""Every error the broker raises, each a named class.

Like the safety layer, the broker raises at configuration time and on malformed input handed
to it (a chunk of the wrong width); the per-tick path never raises for timing problems: those
become a typed fallback reason on the command.
"""

from __future__ import annotations

__all__ = ["BrokerError", "BrokerConfigError", "ChunkError", "BrokerClosed", "FirstChunkTimeout"]


class BrokerError(Exception):
    """Base class of every broker error."""


class BrokerConfigError(BrokerError, ValueError):
    """A broker configuration value is invalid."""


class ChunkError(BrokerError, ValueError):
    """A chunk cannot be placed on the timeline (wrong width, no ``t0``, non-positive ``dt``, ...)."""


class BrokerClosed(BrokerError, RuntimeError):
    """The broker loop was closed and cannot be used any more."""


class FirstChunkTimeout(BrokerError, TimeoutError):
    """The openpi drop-in waited longer than its limit for the first chunk."""
