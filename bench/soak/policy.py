"""The soak server's policy: fast, and it raises or hangs when an observation asks it to
(``--policy chunkline.bench.soak:fault_policy``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.policies.base import ArraySpec, Policy, PolicySpec, TextSpec, make_fingerprint
from chunkline.policies.exceptions import InjectedPolicyFailure

__all__ = ["SOAK_SPEC", "FAULT_POLICY_REF", "MARK_RAISE", "MARK_HANG", "FaultPolicy", "fault_policy"]


#: The fault policy's spec: a state, an optional camera, an optional variable-length token field
#: (a free dimension) and a prompt; 50 x 14 chunks at 50 Hz.
SOAK_SPEC = PolicySpec(
    observation={
        "state": ArraySpec((14,), "float32"),
        "image": ArraySpec((64, 64, 3), "uint8", required=False),
        "tokens": ArraySpec((None,), "int32", required=False),
        "prompt": TextSpec(max_chars=256),
    },
    action_dim=14,
    horizon=50,
    dt=0.02,
)
FAULT_POLICY_REF = "chunkline.bench.soak:fault_policy"
#: ``state[0]`` of an observation that makes the policy raise.
MARK_RAISE = 1000.0
#: ``state[0]`` of an observation that makes the policy hang (``hang_s``).
MARK_HANG = 555.0


class FaultPolicy(Policy):
    """A fast policy that misbehaves on request, driven by markers in the observation.

    * ``state[0] == MARK_RAISE``: the batch raises :class:`InjectedPolicyFailure`;
    * ``state[0] == MARK_HANG``: the batch blocks for ``hang_s`` (a wedged backend);
    * ``state[2]``: milliseconds the batch takes (0 to 5000; the largest in the batch);
    * ``state[1]``: a tag. Each reply's ``actions[:, 0]`` is the number of batches with this tag
      running when the batch started (this one included), ``actions[:, 1]`` the number of
      batches running in all, ``actions[:, 2]`` the batch size: a client can see concurrency.

    Args:
        hang_s: how long a hang lasts.
    """

    name = "faults"
    spec = SOAK_SPEC

    def __init__(self, hang_s: float = 1.5) -> None:
        self.hang_s = float(hang_s)
        self._lock = threading.Lock()
        self._running: dict[float, int] = {}
        self._total = 0
        self._fingerprint = make_fingerprint(weights="none", backend="faults", versions={}, precision="float32",
                                             device="cpu", spec=SOAK_SPEC, settings={"hang_s": self.hang_s})

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        state = np.asarray(obs["state"], dtype=np.float64)
        if (state[:, 0] == MARK_RAISE).any():
            raise InjectedPolicyFailure("a marked observation asked for a failure")
        tags = sorted(set(state[:, 1].tolist()))
        with self._lock:
            for tag in tags:
                self._running[tag] = self._running.get(tag, 0) + 1
            self._total += 1
            same = max(self._running[tag] for tag in tags)
            total = self._total
        try:
            seconds = float(np.clip(state[:, 2].max(), 0.0, 5000.0)) / 1000.0
            if (state[:, 0] == MARK_HANG).any():
                seconds = max(seconds, self.hang_s)
            if seconds > 0:
                time.sleep(seconds)
            out = np.zeros((len(state), SOAK_SPEC.horizon, SOAK_SPEC.action_dim), np.float32)
            out[:, :, 0], out[:, :, 1], out[:, :, 2] = same, total, len(state)
            return out
        finally:
            with self._lock:
                for tag in tags:
                    self._running[tag] -= 1
                self._total -= 1


def fault_policy() -> FaultPolicy:
    """``--policy chunkline.bench.soak:fault_policy`` (``CHUNKLINE_FAULT_HANG_S`` sets the hang)."""
    return FaultPolicy(float(os.environ.get("CHUNKLINE_FAULT_HANG_S", "1.5")))
