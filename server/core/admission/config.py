"""How one model admits and schedules: its settings."""

from __future__ import annotations

import dataclasses

__all__ = ["AdmissionConfig"]


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
        deadlines: refuse at the door what cannot finish in time and drop queued work whose budget
            ran out (the default); ``False`` refuses and drops nothing for its deadline (a
            benchmark baseline's: see ``chunkline.bench.fifo``; late replies are still flagged late).
    """

    max_queue: int = 256
    max_batch_size: int = 1
    workers: int = 1
    max_concurrency: int | None = None
    drop_late: bool = True
    deadlines: bool = True

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.max_batch_size < 1 or self.workers < 1:
            raise ValueError("max_queue, max_batch_size and workers must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")

    @property
    def concurrency(self) -> int:
        """The effective max concurrency."""
        return self.max_concurrency if self.max_concurrency is not None else self.max_batch_size * self.workers
