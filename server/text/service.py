"""The text request class: text-LLM requests on the serving core's :class:`~chunkline.server.core.pool.ModelPool`.

Per model: a pool whose admission costs :class:`~chunkline.server.core.quotas.TextCost` (prompt +
max_tokens, reserved from the tenant's text budget and reconciled with the tokens used) and one
backend (embedded or upstream). Admission's deadline is the **time-to-first-token** deadline, and
each running sequence is one slot whose service time is its time to first token. Everything here
runs on the event loop; inference runs on the backend's thread (embedded) or elsewhere (upstream).
Front-ends (HTTP, native ``generate``) call :meth:`TextService.submit` and read the job's stream.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.admission import AdmissionConfig, AdmissionController, Request, ServiceTimeModel, resolve_deadline
from chunkline.server.core.pool import ModelPool, PooledClass, count_refusal
from chunkline.server.core.quotas import TextCost
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.errors import Refusal
from chunkline.server.text.backend import (
    Delta,
    EmbeddedBackend,
    Finished,
    GenerationRequest,
    PreparedRequest,
    TextBackend,
)
from chunkline.server.text.config import TextModelConfig
from chunkline.server.text.errors import UnknownTextModel
from chunkline.server.text.job import TextJob
from chunkline.server.text.upstream import UpstreamBackend

__all__ = ["TextService", "TextJob", "Delta", "Finished", "GenerationRequest"]

log = logging.getLogger("chunkline.server.text")


class _Model:
    """A served text model: its backend and its pool, and how the pool launches, aborts and ends
    its jobs (a :class:`~chunkline.server.core.pool.JobHandlers`)."""

    def __init__(self, cfg: TextModelConfig, backend: TextBackend, service: TextService) -> None:
        self.cfg = cfg
        self.backend = backend
        self.service = service
        # One "batch" per sequence: each running sequence is a lane of its own, whose service
        # time (what the core plans and drops with) is the time to its first token.
        admission = AdmissionController(
            cfg.name,
            service.core.quotas,
            AdmissionConfig(max_queue=cfg.max_queue, max_batch_size=1, workers=cfg.max_batch, drop_late=True),
            ServiceTimeModel(initial={1: backend.load.prefill_s(64)}),
        )
        self.pool: ModelPool[TextJob] = ModelPool(admission, service.clock, self)

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def core(self) -> AdmissionController:
        return self.pool.admission

    compatible = None  # any two requests may share the engine

    def batch_size(self, now: float) -> int:
        return 1 if self.pool.admission.running < self.backend.capacity else 0

    def launch(self, batch: list[Request], now: float) -> None:
        job: TextJob = batch[0].payload
        self.backend.launch(job.id, job.prepared, priority=job.priority, deadline=job.deadline,
                            emit=functools.partial(self.service._on_event, job))

    def abort(self, job: TextJob, refusal: Refusal) -> None:
        self.backend.cancel(job.id)

    def end_unstarted(self, job: TextJob, refusal: Refusal) -> None:
        self.service._record(self, job, refusal.code_str, None)
        job.deliver(refusal)

    def changed(self) -> None:
        self.service.core.metrics.set_queue(self.name, self.pool.queued, self.pool.running)


class TextService(PooledClass[TextModelConfig, _Model]):
    """The text request class (see the module docstring); a
    :class:`~chunkline.server.core.serving.RequestClass`.

    Args:
        core: the server's serving core: authentication, quotas, metrics, accounting, the
            ledger, the door's rules (:meth:`ServingCore.gate`) and ledger request ids.
        models: the text models to serve (the first is the default of ``generate``).
        clock: monotonic seconds.
        yield_to: ``yield_to(priority)`` tells embedded engines to pause while robot-policy work
            of a higher priority is active (a :class:`~chunkline.server.text.priority.PolicyPriorityGate`).
    """

    name = "text"

    def __init__(
        self,
        core: ServingCore,
        *,
        models: list[TextModelConfig],
        clock: Callable[[], float] = time.perf_counter,
        yield_to: Callable[[int], bool] | None = None,
    ) -> None:
        super().__init__(core, models, clock)
        self.yield_to = yield_to
        self.created = int(time.time())

    # ------------------------------------------------------------------ life cycle

    async def _serve(self, cfg: TextModelConfig) -> _Model:
        backend: TextBackend = EmbeddedBackend(cfg, self.clock, self.yield_to) if cfg.backend == "embedded" \
            else UpstreamBackend(cfg, self.clock)
        await backend.start()
        return _Model(cfg, backend, self)

    async def _release(self, model: _Model) -> None:
        await model.backend.stop()

    # ------------------------------------------------------------------ queries

    @property
    def default_model(self) -> str | None:
        """The model ``generate`` uses when it names none."""
        return self.configs[0].name if self.configs else None

    def models_for(self, tenant: TenantInfo) -> list[str]:
        """The text models ``tenant`` may use (what ``/v1/models`` lists).

        Args:
            tenant: the authenticated tenant.
        """
        return [c.name for c in self.configs if tenant.may_use(c.name, self.name)]

    def fingerprint(self, model: str) -> str:
        """The model's fingerprint (embedded: weights and settings; upstream: its URL and name)."""
        m = self.models.get(model)
        return m.backend.fingerprint if m is not None else ""

    def max_model_len(self, model: str) -> int | None:
        """The model's context length in tokens (prompt + output), where this server knows it."""
        m = self.models.get(model)
        return m.backend.max_model_len if m is not None else None

    def stats(self) -> dict[str, Any]:
        """Per-model load: queued, running, capacity, fingerprint and the first-token service curve."""
        return {
            name: {"queued": m.pool.queued, "running": m.pool.running, "capacity": m.backend.capacity,
                   "fingerprint": m.backend.fingerprint, "service_s": m.core.service.snapshot()}
            for name, m in self.models.items()
        }

    # ------------------------------------------------------------------ admission

    def submit(self, request: GenerationRequest, tenant: TenantInfo, session: str, received: float | None = None) -> TextJob:
        """Validate and admit one request; its events then arrive on :meth:`TextJob.stream`.

        Args:
            request: the parsed request.
            tenant: who sent it.
            session: where from (for :meth:`release_session` and the ledger).
            received: receipt time (service clock); now by default.

        Raises:
            Refusal: refused (unknown model 404, forbidden 403, invalid 400, quota 429,
                overloaded 503, deadline unmeetable 503, not ready or shutting down 503); the
                text-specific refusals are :class:`~chunkline.server.text.errors.TextError`\\ s.
        """
        now = self.clock()
        received = now if received is None else received
        model = self.models.get(request.model)
        try:
            self._door("text models")
            if model is None or (tenant.models is not None and model.name not in tenant.models):
                raise UnknownTextModel(request.model)  # tenants do not learn each other's models
            self.core.gate(tenant, self.name, model.name)  # draining, class permission, ledger
            prepared = model.backend.prepare(request)
            # A text request's budget is its own or the model's: a tenant's default deadline is a
            # robot control-loop budget and says nothing about text.
            deadline = resolve_deadline(received, request.deadline_ms, policy_default_ms=model.cfg.default_ttft_ms)
            priority = tenant.priority_for(self.name)
            ttft = self._predict_ttft(model, prepared, priority)
            if now + ttft > deadline:
                raise Refusal(
                    ErrorCode.DEADLINE_UNMEETABLE,
                    f"first token predicted in {ttft * 1000:.0f} ms, the budget is {(deadline - received) * 1000:.0f} ms",
                    retry_after_ms=max(1000.0, (now + ttft - deadline) * 1000.0),
                )
            job = TextJob(next(self._ids), self.core.request_id(session), model.name, tenant, session, prepared, received,
                          time.time() - (now - received), deadline, priority)
            job.loss.extend(prepared.loss)
            job.admission = admitted = Request(
                id=job.id, session=session, tenant=tenant.name, cls=self.name,
                cost=TextCost(prepared.prompt_tokens, prepared.params.max_tokens), deadline=deadline, priority=priority, payload=job)
            model.pool.admit(admitted, now)
        except Refusal as exc:
            # A model name that is not served is the client's text: never a metrics label.
            count_refusal(self.core, self.name, model.name if model is not None else "(unknown)", tenant, exc)
            raise
        return job

    def _predict_ttft(self, model: _Model, prepared: PreparedRequest, priority: int) -> float:
        jobs = model.pool.jobs.values()
        running = [(j.tokens, j.prepared.params.max_tokens) for j in jobs if j.started is not None]
        ahead = [(j.prepared.prompt_tokens, j.prepared.params.max_tokens) for j in jobs if j.started is None and j.priority >= priority]
        return model.backend.load.predict_ttft(running, ahead, prepared.prompt_tokens)

    def cancel(self, job: TextJob) -> None:
        """Withdraw a request (client cancel, disconnect, stream closed): a queued one never runs;
        a running one frees its slot at the backend's next step."""
        if not job.done:
            self.models[job.model].pool.cancel(job)

    # ------------------------------------------------------------------ events

    def _on_event(self, job: TextJob, ev: Delta | Finished) -> None:
        if isinstance(ev, Delta):
            if ev.tokens > 0:
                if job.first_token is None:
                    job.first_token = ev.time
                job.last_token = ev.time
                job.tokens += ev.tokens
            job.deliver(ev)
            return
        model = self.models[job.model]
        job.finished = ev
        job.loss.extend(ev.loss)
        now = self.clock()
        ttft_service = None if job.first_token is None or job.started is None else job.first_token - job.started
        used = ev.prompt_tokens + ev.completion_tokens if ev.consumed else 0
        assert job.admission is not None  # (admitted: it ran)
        model.pool.finish(job.admission, now, service_time=ttft_service, used_tokens=used if ev.usage_reported else None)
        load = model.backend.load
        if ttft_service is not None:
            load.observe_first_token(ev.prompt_tokens, ttft_service)
        if job.first_token is not None and job.last_token is not None and ev.completion_tokens > 1:
            load.observe_tokens(ev.completion_tokens - 1, job.last_token - job.first_token)
        if ev.reason in ("stop", "length"):
            load.observe_length(ev.completion_tokens, job.prepared.params.max_tokens)
        if ev.error is not None:
            outcome = ev.error.code_str
        elif ev.reason == "cancelled":
            outcome = ErrorCode.CANCELLED.value
        elif job.first_token is not None and job.first_token > job.deadline:
            outcome = "late"
        else:
            outcome = "ok"
        self._record(model, job, outcome, ev)
        job.deliver(ev)
        model.pool.kick()

    # ------------------------------------------------------------------ accounting

    def _record(self, model: _Model, job: TextJob, outcome: str, ev: Finished | None) -> None:
        """Metrics and the ledger row of an admitted request (exactly once)."""
        if job.done:
            return
        job.done = True
        end = ev.time if ev is not None else self.clock()
        timing: dict[str, float] = {"server_ms": (end - job.received) * 1000.0}
        if job.started is not None:
            timing["queue_ms"] = (job.started - job.received) * 1000.0
            timing["infer_ms"] = (end - job.started) * 1000.0
        tokens_in = ev.prompt_tokens if ev is not None and ev.consumed else 0
        tokens_out = ev.completion_tokens if ev is not None else 0
        ttft = None if job.first_token is None else job.first_token - job.received
        decode = None if job.first_token is None or job.last_token is None else job.last_token - job.first_token
        self.core.metrics.observe_text(model.name, job.tenant.name, ttft, tokens_in, tokens_out, decode)
        self.core.accounting.finished(self.name, model.name, job.tenant.name, outcome, timing, session=job.session,
                                      request_id=job.request_id, fingerprint=model.backend.fingerprint, ts=job.received_wall,
                                      tokens_in=tokens_in, tokens_out=tokens_out)
