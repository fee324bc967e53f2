"""One model's jobs on the serving core: the skeleton every request class runs on.

A :class:`ModelPool` does what is the same in every class: per-model admission (the model's
:class:`~chunkline.server.core.admission.AdmissionController`), the queue's chores (draws, drop
answers, expiry), the jobs admitted and not yet ended (by id), cancel, stop and the kick that
starts queued jobs. The class supplies how many jobs may start together now, and how a batch is
launched, a job aborted and ended unstarted (:class:`JobHandlers`), and records a finished job
itself after :meth:`ModelPool.finish`. Text and planner start batches of one; the robot class
batches.

Invariants: a job is in :attr:`ModelPool.jobs` from admission until it finishes or ends
unstarted; ``job.started`` is ``None`` exactly while it is queued; queue and running counts are
the controller's own; the kick is never re-entered (a kick asked for while one runs, say by a
job that ends inside its launch, is folded into the running one).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.admission import AdmissionController, Admitted, CancelOutcome, Request
from chunkline.server.core.admission.selection import Compatible
from chunkline.server.core.queue_chores import QueueChores
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.errors import Refusal

__all__ = ["ModelPool", "PoolJob", "JobHandlers", "PooledClass", "refuse_unless_serving", "count_refusal", "SHUTTING_DOWN"]

log = logging.getLogger("chunkline.server")

#: The answer queued work gets when its class stops.
SHUTTING_DOWN = "the server is shutting down"


class PoolJob(Protocol):
    """What the pool reads and writes of a class's job (the ``payload`` of its admission request)."""

    @property
    def id(self) -> Any: ...

    @property
    def session(self) -> str: ...

    started: float | None


J = TypeVar("J", bound=PoolJob)
J_contra = TypeVar("J_contra", bound=PoolJob, contravariant=True)


class JobHandlers(Protocol[J_contra]):
    """What a request class supplies to its pools."""

    @property
    def compatible(self) -> Compatible | None:
        """Whether a queued request may join a batch that starts with another (``None``: any may)."""

    def batch_size(self, now: float) -> int:
        """How many queued jobs may start together now (``0``: none now; a class that waits for a
        fuller batch arms its own timer and kicks when it fires)."""

    def launch(self, batch: list[Request], now: float) -> None:
        """Start a batch the pool has just marked started (each ``request.payload`` is a job, and
        holds its slot until :meth:`ModelPool.finish`)."""

    def abort(self, job: J_contra, refusal: Refusal) -> None:
        """Stop a running job (cancel with ``refusal``, stop); its :meth:`ModelPool.finish` still follows."""

    def end_unstarted(self, job: J_contra, refusal: Refusal) -> None:
        """Record and answer a job that ends without running (dropped, cancelled queued, stopped)."""

    def changed(self) -> None:
        """The pool's queue or running set changed (gauges, priorities, batch timers)."""


def refuse_unless_serving(stopping: bool, ready: bool, what: str) -> None:
    """The door of a class's ``submit``: ``shutting_down`` once stopping, ``not_ready`` while ``what`` load."""
    if stopping:
        raise Refusal(ErrorCode.SHUTTING_DOWN, SHUTTING_DOWN, retry_after_ms=1000.0)
    if not ready:
        raise Refusal(ErrorCode.NOT_READY, f"{what} are loading", retry_after_ms=1000.0)


def count_refusal(core: ServingCore, cls: str, model: str, tenant: TenantInfo, exc: Refusal) -> None:
    """Count a request refused before admission (no ledger row: nothing was admitted)."""
    core.accounting.refused(cls, model, tenant.name, exc.code_str, limit=exc.limit.value if exc.limit is not None else None)


class ModelPool(Generic[J]):
    """One model's admission, queue and jobs (see the module docstring).

    Args:
        admission: the model's admission controller (this pool is its only user).
        clock: the controller's time (monotonic seconds).
        handlers: what the class does with a job.
    """

    def __init__(self, admission: AdmissionController, clock: Callable[[], float], handlers: JobHandlers[J]) -> None:
        self.admission = admission
        self.clock = clock
        self.handlers = handlers
        #: admitted jobs not yet ended, queued or running, by id
        self.jobs: dict[Any, J] = {}
        self.stopping = False
        self._queue = QueueChores(admission, clock, self._dropped, handlers.changed)
        self._kicking = False
        self._rekick = False

    @property
    def queued(self) -> int:
        return self.admission.queued

    @property
    def running(self) -> int:
        return self.admission.running

    def expire(self, now: float) -> None:
        """Drop the queued jobs whose budget has run out by ``now``, and answer them."""
        admission = self.admission
        admission.expire(now)
        if admission.dropped:
            self._queue.answer_dropped()
            self.handlers.changed()

    def offer(self, request: Request, now: float) -> None:
        """Offer a request (its ``payload`` the job, its ``id`` the job's) to admission, without
        starting anything (:meth:`kick` does).

        Raises:
            Refusal: admission refused it (nothing of it is kept).
        """
        admission = self.admission
        decision = admission.offer(request, now)
        if admission.dropped:
            waiting = len(self.jobs)
            self._queue.answer_dropped()
            if not isinstance(decision, Admitted) and len(self.jobs) != waiting:
                self.handlers.changed()
        if not isinstance(decision, Admitted):
            raise decision
        self.jobs[request.id] = request.payload

    def admit(self, request: Request, now: float) -> None:
        """:meth:`offer`, then start what may start.

        Raises:
            Refusal: admission refused it (nothing of it is kept).
        """
        self.offer(request, now)
        self.kick()

    def cancel(self, job: J, refusal: Refusal | None = None) -> None:
        """Withdraw a job: a queued one ends unstarted with ``refusal`` (``cancelled`` by
        default); a running one is aborted (its finish follows)."""
        if job.id not in self.jobs:
            return
        outcome = self.admission.cancel(job.id, self.clock())
        refusal = refusal or Refusal(ErrorCode.CANCELLED, "cancelled by the client")
        if outcome is CancelOutcome.QUEUED:
            self.jobs.pop(job.id, None)
            self.handlers.end_unstarted(job, refusal)
            if not self.stopping:
                self.kick()
        elif outcome is CancelOutcome.RUNNING:
            self.handlers.abort(job, refusal)

    def release_session(self, session: str) -> None:
        """Withdraw every job of a session (it disconnected)."""
        for job in [j for j in self.jobs.values() if j.session == session]:
            self.cancel(job)

    def stop(self, refusal: Refusal | None = None) -> None:
        """Start nothing more: queued jobs end with ``refusal`` (``shutting_down``, retry in a
        second, by default), running ones are aborted with it."""
        self.stopping = True
        self._queue.close()
        stopped = refusal or Refusal(ErrorCode.SHUTTING_DOWN, SHUTTING_DOWN, retry_after_ms=1000.0)
        for job in list(self.jobs.values()):
            self.cancel(job, stopped)
        self._queue.answer_dropped()
        self.handlers.changed()

    def finish(self, request: Request, now: float, *, service_time: float | None = None, used_tokens: int | None = None) -> None:
        """A running job (``request.payload``) ended, any outcome: free its slot. The class then
        records it and calls :meth:`kick`."""
        self.jobs.pop(request.id, None)
        try:
            self.admission.complete(request, now, service_time=service_time, batch_size=1, used_tokens=used_tokens)
        except Exception:  # pragma: no cover - the controller's own invariant; never leave the job hanging
            log.exception("admission bookkeeping failed for %s request %s", self.admission.model, request.id)

    def finish_batch(self, batch: Sequence[Request], now: float, service_time: float | None = None) -> None:
        """A running batch ended, any outcome: free its slots; ``service_time`` (how long it ran)
        feeds the service-time model once. The class then records it and calls :meth:`kick`."""
        jobs = self.jobs
        for r in batch:
            jobs.pop(r.id, None)
        self.admission.complete_batch(batch, now, service_time)

    def kick(self) -> None:
        """Start queued jobs while the class says a batch may start (admission picks which:
        priority, fairness, deadline)."""
        if self._kicking:
            self._rekick = True
            return
        self._kicking = True
        admission, handlers, queue = self.admission, self.handlers, self._queue
        try:
            rekick = True
            while rekick:
                self._rekick = False
                while admission.queued and not self.stopping:
                    now = self.clock()
                    size = handlers.batch_size(now)
                    if size <= 0:
                        break
                    batch = queue.take(now, size, handlers.compatible)
                    if not batch:
                        break
                    for r in batch:
                        r.payload.started = now
                    handlers.launch(batch, now)
                rekick = self._rekick
        finally:
            self._kicking = False
        if admission.queued and not self.stopping:  # an empty queue expires nothing
            queue.arm_expiry()
        handlers.changed()

    def _dropped(self, job: J, refusal: Refusal) -> None:
        self.jobs.pop(job.id, None)
        self.handlers.end_unstarted(job, refusal)


class _Served(Protocol):
    @property
    def pool(self) -> ModelPool[Any]: ...


class _Named(Protocol):
    @property
    def name(self) -> str: ...


C = TypeVar("C", bound=_Named)
M = TypeVar("M", bound=_Served)


class PooledClass(Generic[C, M]):
    """What a request class of pooled models shares (a :class:`~chunkline.server.core.serving.RequestClass`
    but for ``name`` and ``stats``): the life cycle, the door's state, in-flight counts and the
    release of a session. A subclass serves each config (:meth:`_serve`) and releases each
    served model once its pool has stopped (:meth:`_release`).

    Args:
        core: the server's serving core.
        configs: the models to serve, each with a ``name``.
        clock: monotonic seconds.
    """

    name: str

    def __init__(self, core: ServingCore, configs: Sequence[C], clock: Callable[[], float]) -> None:
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"two {self.name} models share a name: {names}")
        self.core = core
        self.configs = list(configs)
        self.clock = clock
        self.models: dict[str, M] = {}
        self.ready = False
        self._stopping = False
        self._ids = itertools.count(1)

    async def _serve(self, cfg: C) -> M:
        """Load one model and build its pool."""
        raise NotImplementedError

    async def _release(self, model: M) -> None:
        """Release a model whose pool has stopped (its running jobs aborted)."""
        raise NotImplementedError

    async def start(self) -> None:
        """Load every model; then accept requests."""
        for cfg in self.configs:
            self.models[cfg.name] = await self._serve(cfg)
        self.ready = True

    async def stop(self) -> None:
        """Refuse new work, fail queued work ``shutting_down``, abort running work, release the models."""
        self._stopping = True
        for model in self.models.values():
            model.pool.stop()
        for model in self.models.values():
            await self._release(model)
        self.ready = False

    def _door(self, what: str) -> None:
        refuse_unless_serving(self._stopping, self.ready, what)

    @property
    def in_flight(self) -> int:
        """Requests queued or running."""
        return sum(len(m.pool.jobs) for m in self.models.values())

    @property
    def healthy(self) -> bool:
        """Whether requests can be served (models loaded, not stopped)."""
        return self.ready and not self._stopping

    def release_session(self, session: str) -> None:
        """Withdraw every request of a session (it disconnected)."""
        for model in self.models.values():
            model.pool.release_session(session)
