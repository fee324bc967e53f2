"""The errors of the tenants file and its key operations."""

from __future__ import annotations

import os

__all__ = ["TenantsFileError", "UnknownTenant", "UnknownKey"]


class TenantsFileError(Exception):
    """The tenants file cannot be read, parsed, validated or written.

    Args:
        path: the file.
        detail: what is wrong (never a key).
    """

    def __init__(self, path: str | os.PathLike[str], detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = str(path)
        self.detail = detail


class UnknownTenant(KeyError):
    """No tenant of that name in the tenants file."""


class UnknownKey(KeyError):
    """No key with that id in the tenants file."""
