"""A policy whose start-up takes a known time, for the SIGTERM-during-start-up tests: served by a
real ``chunkline serve`` process as ``slow_start_policy:make`` (this folder on ``PYTHONPATH``)."""

from __future__ import annotations

import time

import numpy as np

from chunkline.policies.embedded import SleepPolicy


class SlowStartPolicy(SleepPolicy):
    """:class:`SleepPolicy` whose warm-up blocks for ``warm_s`` and whose forward pass does real
    BLAS work (a matrix product) before its sleep, so a lane is inside native code at times."""

    def __init__(self, infer_s: float, warm_s: float) -> None:
        super().__init__(infer_s, name="slow-start")
        self.warm_s = warm_s
        self._w = np.random.default_rng(0).standard_normal((256, 256))

    def warmup(self) -> None:
        time.sleep(self.warm_s)

    def infer_batch(self, obs):  # type: ignore[no-untyped-def]
        float((self._w @ self._w).sum())
        return super().infer_batch(obs)


def make(load_s: float = 0.3, warm_s: float = 0.3, infer_s: float = 0.02) -> SlowStartPolicy:
    time.sleep(float(load_s))
    return SlowStartPolicy(float(infer_s), float(warm_s))
