"""The content digest of a model's weights that served fingerprints are built from.

Policies and the server's own models (text, planner) digest their weights the same way, so
equal weights give equal fingerprints in ``hello`` whatever serves them. numpy only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

__all__ = ["weights_digest"]


def weights_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of the weights, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode())
        h.update(a.dtype.str.encode())
        h.update(repr(a.shape).encode())
        h.update(a.tobytes() if a.size else b"")
    return h.hexdigest()
