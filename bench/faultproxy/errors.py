"""The fault proxy's one error."""

from __future__ import annotations

__all__ = ["FaultProxyError"]


class FaultProxyError(RuntimeError):
    """The proxy cannot do what was asked (a non-loopback address, a bad setting, a dead child)."""
