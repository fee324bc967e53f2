"""Content digests for things that are not weight arrays (callables, objects, metadata)."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from collections.abc import Iterable
from typing import Any

__all__ = ["callable_identity", "digest_of", "package_versions"]


def callable_identity(fn: Any) -> str:
    """``module.qualname`` of a function, class or callable object (``functools.partial``
    unwrapped), so that two loads of the same code name it the same way."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}.{getattr(target, '__qualname__', type(target).__name__)}"


def digest_of(doc: Any) -> str:
    """SHA-256 of a JSON rendering of ``doc`` (unknown types rendered with ``str``)."""
    text = json.dumps(doc, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def package_versions(names: Iterable[str]) -> dict[str, str]:
    """Installed versions of the named distributions (``"absent"`` when not installed)."""
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out
