"""A model runner that serves one request per batch, and a policy whose batches wait for the test:
the set-up of the tests of refusals at the door (early refusal, retry economics)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from chunkline.bench.fifo import FifoSelector, fifo_config
from chunkline.policies.base import Policy
from chunkline.policies.registry import load_policy
from chunkline.server.core.admission import AdmissionConfig, ServiceTimeModel
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantRegistry
from chunkline.server.robot.batching import BatchPolicy
from chunkline.server.robot.runner import ModelRunner

ANON = TenantRegistry.anonymous()
TENANT = next(iter(ANON.tenants.values()))
#: the clock the tests' runners run on: a request's deadline is absolute on it
CLOCK: Callable[[], float] = time.perf_counter


class Gate(Policy):
    """Wraps a policy (the noop one by default); its batches wait until the test opens the gate,
    so the lane stays busy while the test offers more."""

    def __init__(self, inner: Policy | None = None) -> None:
        inner = inner if inner is not None else load_policy("noop")
        self.inner, self.name, self.spec, self.stateful = inner, inner.name, inner.spec, inner.stateful
        self.gate = threading.Event()

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    def infer_batch(self, obs: Any) -> np.ndarray:
        self.gate.wait(10)
        return self.inner.infer_batch(obs)


def one_at_a_time(policy: Policy, *, service: ServiceTimeModel | None = None, max_queue: int = 256, fifo: bool = False,
                  clock: Callable[[], float] = CLOCK) -> ModelRunner:
    """A runner for ``policy`` serving one request per batch, planned at ``service`` (default: 50 ms
    a batch); ``fifo``: the first-come-first-served baseline, which refuses and drops nothing for
    its deadline."""
    return ModelRunner("m", policy, quotas=QuotaManager(ANON),
                       admission=fifo_config(max_queue=max_queue) if fifo else AdmissionConfig(max_batch_size=1, max_queue=max_queue),
                       selector=FifoSelector() if fifo else None,
                       # a batch of one is full at once: nothing to wait for
                       batching=BatchPolicy(max_batch_size=1, max_batch_wait=0.0),
                       service=service if service is not None else ServiceTimeModel(initial={1: 0.05}), clock=clock)
