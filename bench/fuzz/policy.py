"""The live fuzz server's policy, spec and limits (``--policy chunkline.bench.fuzz:fuzz_policy``)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.client.wire.codec import CodecLimits
from chunkline.policies.base import PolicySpec
from chunkline.policies.numpy_backend import NumpyPolicy

__all__ = [
    "make_fuzz_spec",
    "FUZZ_SPEC",
    "FUZZ_POLICY_REF",
    "FUZZ_MAX_MESSAGE_BYTES",
    "CANARY",
    "fuzz_policy",
    "fuzz_limits",
]


def make_fuzz_spec(base: Any = None) -> PolicySpec:
    """The live fuzz server's policy spec: small arrays, an optional camera and a prompt.

    Args:
        base: the ``chunkline.policies.base`` module to build it from (the coverage-guided run
            re-imports that module under instrumentation, and its classes must match).
    """
    b = base if base is not None else sys.modules[PolicySpec.__module__]
    return b.PolicySpec(
        observation={
            "state": b.ArraySpec((14,), "float32"),
            "image": b.ArraySpec((8, 8, 3), "uint8", required=False),
            "prompt": b.TextSpec(max_chars=64),
        },
        action_dim=14,
        horizon=10,
        dt=0.02,
    )


FUZZ_SPEC = make_fuzz_spec()
FUZZ_POLICY_REF = "chunkline.bench.fuzz:fuzz_policy"
#: Small, so that oversize frames are cheap to send; larger frames must close with 1009.
FUZZ_MAX_MESSAGE_BYTES = 256 * 1024
#: Put into observation strings; no reply, log line or metric may ever contain it.
CANARY = "CANARY-7f3a9c"


# ---------------------------------------------------------------------------------- the policy


def _zeros(obs: Mapping[str, Any]) -> np.ndarray:
    return np.zeros((len(obs["state"]), FUZZ_SPEC.horizon, FUZZ_SPEC.action_dim), np.float32)


def fuzz_policy() -> NumpyPolicy:
    """The live fuzz server's policy (``--policy chunkline.bench.fuzz:fuzz_policy``): zeros, fast."""
    return NumpyPolicy("fuzz", _zeros, FUZZ_SPEC)


def fuzz_limits(max_message_bytes: int = FUZZ_MAX_MESSAGE_BYTES) -> CodecLimits:
    """The codec limits a server started with ``--max-message-bytes`` applies (other caps default)."""
    return CodecLimits(max_message_bytes=max_message_bytes)
