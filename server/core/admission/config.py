"""How one model admits and schedules: the admission policy and its settings."""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["AdmissionPolicy", "AdmissionConfig"]


class AdmissionPolicy(str, enum.Enum):
    """How a model's queue treats deadlines."""

    #: deadline-aware: refuse at the door what cannot finish in time, drop queued work whose
    #: budget ran out, earliest deadline first
    DEADLINE = "edf"
    #: the benchmark baseline: first come, first served; nothing refused for its deadline or
    #: dropped (late replies are still flagged late by the request class)
    FIFO = "fifo"


@dataclasses.dataclass(frozen=True)
class AdmissionConfig:
    """How one model admits and schedules.

    Args:
        max_queue: most requests queued (not running); beyond it, ``overloaded``.
        max_batch_size: most requests per batch.
        workers: batches that can run at the same time.
        max_concurrency: most request slots running at once (default ``max_batch_size * workers``);
            tenants' ``reserved_share`` is a share of it.
        drop_late: also drop queued work that cannot finish in time even alone in a batch
            (``now + mean service time of one > deadline``), not only work already past its deadline.
        policy: deadline-aware (the default) or the FIFO baseline (see :class:`AdmissionPolicy`).
    """

    max_queue: int = 256
    max_batch_size: int = 1
    workers: int = 1
    max_concurrency: int | None = None
    drop_late: bool = True
    policy: AdmissionPolicy = AdmissionPolicy.DEADLINE

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.max_batch_size < 1 or self.workers < 1:
            raise ValueError("max_queue, max_batch_size and workers must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")

    @property
    def enforces_deadlines(self) -> bool:
        """Whether work is refused, dropped and cut off for its deadline (not in the FIFO baseline)."""
        return self.policy is AdmissionPolicy.DEADLINE

    @property
    def concurrency(self) -> int:
        """The effective max concurrency."""
        return self.max_concurrency if self.max_concurrency is not None else self.max_batch_size * self.workers
