"""The ledger's error."""

from __future__ import annotations

__all__ = ["LedgerError"]


class LedgerError(Exception):
    """The ledger file cannot be opened, written or read."""
