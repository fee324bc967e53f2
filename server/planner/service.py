"""The planner request class: plan requests on the serving core's :class:`~chunkline.server.core.pool.ModelPool`.

Per planner: a pool whose admission costs a policy request (one slot, one unit of work, no
tokens) with ``concurrency`` workers, and one :class:`~chunkline.server.planner.planners.Planner`
whose plans run as tasks. A plan's deadline is the robot's wait budget (the planner's
``default_deadline_ms`` by default); its priority is the tenant's for ``plan``, and
:meth:`PlannerService.busy_above` lets another class's engine yield to plan work above its own.
Outcomes are counted under class ``plan``. The native ``plan`` exchange calls
:meth:`PlannerService.submit` and renders the job's result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.admission import AdmissionConfig, AdmissionController, PolicyCost, Request, ServiceTimeModel, resolve_deadline
from chunkline.server.core.pool import ModelPool, PooledClass, count_refusal
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.errors import Refusal
from chunkline.server.planner.config import PlannerConfig
from chunkline.server.planner.image_encoder import ImageEncoder
from chunkline.server.planner.planners import NearestTargetPlanner, PlanInput, Planner, PlanResult

__all__ = ["PlannerService", "PlanJob", "PlanInput", "PlanResult", "default_planner_factory"]

log = logging.getLogger("chunkline.server.planner")


@dataclasses.dataclass(eq=False)
class PlanJob:
    """One admitted plan request; :attr:`result` resolves to a :class:`PlanResult` or raises a
    :class:`~chunkline.server.errors.Refusal`.

    ``request_id`` (the ledger's id, unique across classes) is also the reply's ``plan_id``.
    """

    id: int
    request_id: str
    planner: str
    tenant: TenantInfo
    session: str
    input: PlanInput
    received: float
    received_wall: float
    deadline: float
    priority: int
    result: asyncio.Future[PlanResult]
    admission: Request | None = None
    started: float | None = None
    finished: float | None = None
    attempts: int = 0
    task: asyncio.Task[None] | None = None
    done: bool = False

    @property
    def late(self) -> bool:
        return self.finished is not None and self.finished > self.deadline

    def timing_ms(self) -> dict[str, float]:
        """``queue_ms``, ``plan_ms``, ``server_ms`` so far (milliseconds)."""
        end = self.finished if self.finished is not None else self.received
        out = {"server_ms": (end - self.received) * 1000.0}
        if self.started is not None:
            out["queue_ms"] = (self.started - self.received) * 1000.0
            out["plan_ms"] = (end - self.started) * 1000.0
        return out


class _Served:
    """A served planner: its settings, planner and pool, and how the pool launches, aborts and
    ends its jobs (a :class:`~chunkline.server.core.pool.JobHandlers`)."""

    def __init__(self, cfg: PlannerConfig, planner: Planner, service: PlannerService) -> None:
        self.cfg = cfg
        self.planner = planner
        self.service = service
        admission = AdmissionController(
            cfg.name, service.core.quotas,
            AdmissionConfig(max_queue=cfg.max_queue, max_batch_size=1, workers=cfg.concurrency, drop_late=True),
            ServiceTimeModel(initial={1: cfg.expected_plan_s}),
        )
        self.pool: ModelPool[PlanJob] = ModelPool(admission, service.clock, self)

    compatible = None  # plans run one per worker

    def batch_size(self, now: float) -> int:
        return 1 if self.pool.admission.running < self.cfg.concurrency else 0

    def launch(self, batch: list[Request], now: float) -> None:
        job: PlanJob = batch[0].payload
        job.task = asyncio.get_running_loop().create_task(self.service._run(self, job))

    def abort(self, job: PlanJob, refusal: Refusal) -> None:
        if job.task is not None:
            job.task.cancel()

    def end_unstarted(self, job: PlanJob, refusal: Refusal) -> None:
        self.service._end(self, job, refusal)

    def changed(self) -> None:
        self.service._refresh(self)


def default_planner_factory(cfg: PlannerConfig) -> Planner:
    """The planner a config names: the embedded nearest-target planner or the upstream adapter."""
    if cfg.backend == "embedded":
        return NearestTargetPlanner(cfg.name, cfg.max_steps, cfg.workspace_area())
    from chunkline.server.planner.upstream import UpstreamPlanner  # httpx only where an upstream is served

    return UpstreamPlanner(cfg)


class PlannerService(PooledClass[PlannerConfig, _Served]):
    """The planner request class (see the module docstring); a
    :class:`~chunkline.server.core.serving.RequestClass`.

    Args:
        core: the server's serving core.
        planners: the planners to serve (the first is the default of ``plan``).
        clock: monotonic seconds.
        factory: builds each planner from its config (the server passes its own to serve a
            planner backed by another class's model).
    """

    name = "plan"

    def __init__(self, core: ServingCore, *, planners: list[PlannerConfig], clock: Callable[[], float] = time.perf_counter,
                 factory: Callable[[PlannerConfig], Planner] = default_planner_factory) -> None:
        super().__init__(core, planners, clock)
        self.factory = factory
        #: where upstream planners encode camera images: bounded per tenant as the core's pool is
        self.encoder = ImageEncoder(core.cpu_pool.threads, core.cpu_pool.max_pending_per_tenant)
        #: priorities of the plan work queued or running, swapped whole so that another
        #: thread (the text engine's) reads a consistent tuple without a lock
        self._active_priorities: tuple[int, ...] = ()

    # ------------------------------------------------------------------ life cycle

    async def _serve(self, cfg: PlannerConfig) -> _Served:
        planner = self.factory(cfg)
        await planner.start()
        return _Served(cfg, planner, self)

    async def stop(self) -> None:
        await super().stop()
        self.encoder.close()

    async def _release(self, served: _Served) -> None:
        tasks = [job.task for job in served.pool.jobs.values() if job.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await served.planner.stop()

    # ------------------------------------------------------------------ queries

    @property
    def default_planner(self) -> str | None:
        return self.configs[0].name if self.configs else None

    def metadata_for(self, tenant: TenantInfo) -> dict[str, dict[str, Any]]:
        """The planners ``tenant`` may use and their metadata (schema, skills, timing), for the hello."""
        out: dict[str, dict[str, Any]] = {}
        for name, served in self.models.items():
            if tenant.may_use(name, self.name):
                cfg = served.cfg
                out[name] = {**served.planner.metadata(), "default_deadline_ms": cfg.default_deadline_ms,
                             "valid_for_s": cfg.valid_for_s, "max_steps": cfg.max_steps}
        return out

    def fingerprint(self, planner: str) -> str:
        served = self.models.get(planner)
        return served.planner.fingerprint if served is not None else ""

    def valid_for(self, planner: str) -> float:
        return self.models[planner].cfg.valid_for_s

    def stats(self) -> dict[str, Any]:
        return {name: {"queued": s.pool.queued, "running": s.pool.running, "capacity": s.cfg.concurrency,
                       "fingerprint": s.planner.fingerprint, "service_s": s.pool.admission.service.snapshot()}
                for name, s in self.models.items()}

    def busy_above(self, priority: int) -> bool:
        """Whether plan work of a priority above ``priority`` is queued or running (thread-safe read)."""
        return any(p > priority for p in self._active_priorities)

    # ------------------------------------------------------------------ admission

    def submit(self, request: PlanInput, planner: str | None, tenant: TenantInfo, session: str,
               deadline_ms: float | None = None, received: float | None = None) -> PlanJob:
        """Check and admit one plan request; await :attr:`PlanJob.result` for its plan.

        Args:
            request: the observation, instruction and context.
            planner: the planner asked for (``None``: the default).
            tenant: who sent it.
            session: where from (for :meth:`release_session` and the ledger).
            deadline_ms: the robot's wait budget; ``None`` for the planner's default.
            received: receipt time (service clock); now by default.

        Raises:
            Refusal: ``unknown_model`` (no such planner, or not this tenant's), ``forbidden``,
                ``invalid_observation``, ``quota_exceeded``, ``overloaded``,
                ``deadline_unmeetable``, ``not_ready``, ``shutting_down``.
        """
        now = self.clock()
        received = now if received is None else received
        name = planner if planner is not None else self.default_planner
        served = self.models.get(name) if name is not None else None
        try:
            self._door("planners")
            if served is None or (tenant.models is not None and served.cfg.name not in tenant.models):
                raise Refusal(ErrorCode.UNKNOWN_MODEL, f"no planner named {planner!r}")  # tenants do not learn others' planners
            self.core.gate(tenant, self.name, served.cfg.name)
            served.planner.check(request)
            deadline = resolve_deadline(received, deadline_ms, policy_default_ms=served.cfg.default_deadline_ms)
            priority = tenant.priority_for(self.name)
            # The job owns its own mapping of the observation, which _end empties: see there.
            request = dataclasses.replace(request, obs=dict(request.obs), tenant=tenant.name, encoder=self.encoder)
            job = PlanJob(next(self._ids), self.core.request_id(session), served.cfg.name, tenant, session, request, received,
                          time.time() - (now - received), deadline, priority, asyncio.get_running_loop().create_future())
            job.admission = admitted = Request(id=job.id, session=session, tenant=tenant.name, cls=self.name, cost=PolicyCost(),
                                               deadline=deadline, priority=priority, payload=job)
            served.pool.admit(admitted, now)
        except Refusal as exc:
            count_refusal(self.core, self.name, served.cfg.name if served is not None else "(unknown)", tenant, exc)
            raise
        return job

    def cancel(self, job: PlanJob) -> None:
        """Withdraw a plan request (client cancel, disconnect): a queued one never runs; a running
        one is cancelled (an upstream request is closed)."""
        if not job.done:
            self.models[job.planner].pool.cancel(job)

    # ------------------------------------------------------------------ dispatch

    async def _run(self, served: _Served, job: PlanJob) -> None:
        outcome: PlanResult | Refusal
        try:
            budget = max(0.0, job.deadline - self.clock())
            outcome = await asyncio.wait_for(served.planner.plan(job.input, job.deadline), budget)
        except asyncio.TimeoutError:
            outcome = Refusal(ErrorCode.DEADLINE_EXCEEDED, f"no plan within the {(job.deadline - job.received) * 1000:.0f} ms budget")
        except asyncio.CancelledError:
            outcome = Refusal(ErrorCode.CANCELLED, "cancelled")
        except Refusal as exc:
            outcome = exc
        except Exception as exc:  # a planner bug fails its request alone
            log.exception("planner %s failed", served.cfg.name)
            outcome = Refusal(ErrorCode.POLICY_FAILED, f"the planner failed: {type(exc).__name__}")
        now = self.clock()
        job.finished = now
        assert job.admission is not None  # (admitted: it ran)
        served.pool.finish(job.admission, now, service_time=now - (job.started or now) if isinstance(outcome, PlanResult) else None)
        if isinstance(outcome, PlanResult):
            job.attempts = outcome.attempts
            self._end(served, job, None, "late" if job.late else "ok")
            job.result.set_result(outcome)
        else:
            self._end(served, job, outcome)
        served.pool.kick()

    def _refresh(self, served: _Served) -> None:
        active = {j.priority for s in self.models.values() for j in s.pool.jobs.values()}
        self._active_priorities = tuple(sorted(active))
        self.core.metrics.set_queue(served.cfg.name, served.pool.queued, served.pool.running)

    # ------------------------------------------------------------------ accounting

    def _end(self, served: _Served, job: PlanJob, error: Refusal | None, outcome: str | None = None) -> None:
        """Count an admitted request's outcome once (metrics, one ledger row) and, for an error,
        resolve its result with it."""
        if job.done:
            return
        job.done = True
        # The images go now, not when the cycle collector next finds the job: a stored refusal's
        # traceback and the job's own links (its pool request, its task) keep it reachable only
        # from cycles, and the receive budget has already let those bytes go.
        job.input.obs.clear()
        if job.finished is None:
            job.finished = self.clock()
        timing = job.timing_ms()
        if "plan_ms" in timing:
            timing["infer_ms"] = timing["plan_ms"]  # the ledger's and the metrics' name for the work itself
        self.core.accounting.finished(self.name, served.cfg.name, job.tenant.name, outcome or (error.code_str if error else "ok"), timing,
                                      session=job.session, request_id=job.request_id, fingerprint=served.planner.fingerprint,
                                      ts=job.received_wall)
        if error is not None and not job.result.done():
            job.result.set_exception(error)
            job.result.exception()  # retrieved here: nobody may be awaiting a dropped job


