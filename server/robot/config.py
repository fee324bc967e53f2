"""Settings of one served policy (the robot request class's part of the server configuration)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from chunkline.server.core.admission import AdmissionConfig, AdmissionPolicy
from chunkline.server.robot.batching import BatchPolicy

__all__ = ["PolicyConfig"]

#: The FIFO baseline's queue bound: in effect none (it is what benchmarks compare against).
_FIFO_MAX_QUEUE = 1_000_000


class PolicyConfig(BaseModel):
    """One served policy.

    Args:
        ref: what to load: an embedded name, an ``.npz`` path or ``module:factory``.
        name: the model name clients ask for (defaults to ``ref``).
        device: ``cpu``, ``cuda``, ``cuda:1``, ...
        backend: ``torch``, ``jax`` or ``numpy`` for embedded policies; ``None`` picks one.
        default_deadline_ms: deadline for requests that carry none; ``None`` uses the policy's own.
        max_queue: most requests waiting for this policy; more are refused with ``overloaded``.
        max_batch_size: most robots' observations in one forward pass (1: one at a time).
        max_batch_wait_ms: longest a request waits on an idle lane for others to join its batch
            (never past what its deadline allows, and not at all when arrivals are too rare).
        lanes: execution threads for this policy (batches that run at the same time).
        admission: ``edf`` (deadline-aware admission and scheduling) or ``fifo`` (a plain bounded
            first-come queue with no refusal at the door: the baseline benchmarks compare against).
        hang_timeout_s: a batch running this long (and 10x its predicted time) is declared hung:
            its requests fail, its lane thread is replaced, ``/readyz`` reports not ready until
            the stuck call returns.
    """

    ref: str
    name: str | None = None
    device: str = "cpu"
    backend: str | None = None
    default_deadline_ms: Annotated[float, Field(gt=0)] | None = None
    max_queue: Annotated[int, Field(ge=1)] = 256
    max_batch_size: Annotated[int, Field(ge=1, le=1024)] = 16
    max_batch_wait_ms: Annotated[float, Field(ge=0, le=1000)] = 2.0
    lanes: Annotated[int, Field(ge=1, le=64)] = 1
    admission: Literal["edf", "fifo"] = "edf"
    hang_timeout_s: Annotated[float, Field(gt=0)] = 30.0

    model_config = ConfigDict(extra="forbid", frozen=True)

    @property
    def model_name(self) -> str:
        return self.name or self.ref

    def admission_config(self) -> AdmissionConfig:
        """Admission's settings for this policy (the FIFO baseline is a plain unbounded queue)."""
        fifo = self.admission == "fifo"
        return AdmissionConfig(
            max_queue=_FIFO_MAX_QUEUE if fifo else self.max_queue,
            max_batch_size=self.max_batch_size,
            workers=self.lanes,
            drop_late=not fifo,
            policy=AdmissionPolicy.FIFO if fifo else AdmissionPolicy.DEADLINE,
        )

    def batch_policy(self) -> BatchPolicy:
        return BatchPolicy(max_batch_size=self.max_batch_size, max_batch_wait=self.max_batch_wait_ms / 1000.0)
