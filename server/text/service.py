"""The text request class: one service that admits, queues, meters and bills text requests with
the same core as the robot path, and answers them on the OpenAI-compatible HTTP API and in the
native WebSocket protocol (``generate`` -> ``token``... ``done``).

Per text model: one :class:`~chunkline.server.core.admission.AdmissionController` (the same class the
policies use) with :class:`~chunkline.server.core.quotas.TextCost` (prompt + max_tokens, reserved from
the tenant's text budget in the shared :class:`~chunkline.server.core.quotas.QuotaManager` and
reconciled with the tokens actually used), and one backend (embedded or upstream). The deadline
a text request carries into admission is its **time-to-first-token** deadline. Every step here
is I/O glue on the event loop; inference runs on the backend's own thread (embedded) or
elsewhere (upstream).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from chunkline.client.exceptions import ErrorCode
from chunkline.client.protocol import Generate, error_message
from chunkline.server.core.accounting import Accounting
from chunkline.server.core.admission import (
    AdmissionConfig,
    AdmissionController,
    CancelOutcome,
    Request,
    ServiceTimeModel,
    resolve_deadline,
)
from chunkline.server.core.auth import Authenticator, NoAuth
from chunkline.server.core.ledger import Ledger, LedgerRow
from chunkline.server.core.metrics import Metrics
from chunkline.server.core.quotas import QuotaManager, TextCost
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.core.timers import EarliestTimer
from chunkline.server.errors import Refusal
from chunkline.server.text.backend import (
    Delta,
    EmbeddedBackend,
    Finished,
    GenerationRequest,
    LossItem,
    PreparedRequest,
    TextBackend,
)
from chunkline.server.text.config import TextModelConfig
from chunkline.server.text.errors import TextError, TextRefused, UnknownTextModel
from chunkline.server.text.http import HttpServer
from chunkline.server.text.openai_api import parse_chat_request, parse_completion_request
from chunkline.server.text.upstream import UpstreamBackend

__all__ = ["TextService", "TextJob", "generate_to_request"]

log = logging.getLogger("chunkline.server.text")

# Outcomes of admitted requests that ended without running.


@dataclasses.dataclass(eq=False)
class TextJob:
    """One text request from admission to its last event.

    Args:
        id: server-unique id.
        model: the model's name.
        tenant: who sent it.
        session: the session (native) or ``http:<peer>``.
        prepared: the validated request.
        received: receipt time (service clock).
        received_wall: receipt time (Unix, for the ledger).
        deadline: first-token deadline (service clock).
        priority: its tenant's text priority.
    """

    id: int
    model: str
    tenant: TenantInfo
    session: str
    prepared: PreparedRequest
    received: float
    received_wall: float
    deadline: float
    priority: int
    events: asyncio.Queue[Delta | Finished | TextError] = dataclasses.field(default_factory=asyncio.Queue, repr=False)
    admission: Request | None = dataclasses.field(default=None, repr=False)
    started: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    finished: Finished | None = None
    done: bool = False
    loss: list[LossItem] = dataclasses.field(default_factory=list)
    listener: Callable[[Delta | Finished | TextError], None] | None = dataclasses.field(default=None, repr=False)

    def deliver(self, ev: Delta | Finished | TextError) -> None:
        """Hand one event to the listener if one is set, else to the queue :meth:`stream` reads."""
        if self.listener is not None:
            self.listener(ev)
        else:
            self.events.put_nowait(ev)

    def listen(self, listener: Callable[[Delta | Finished | TextError], None]) -> None:
        """From now on, call ``listener`` on the loop with each event as it comes (events already
        queued first), instead of queueing them: a streaming front-end then writes each token
        straight from the engine's callback, without a task switch per token."""
        while not self.events.empty():
            listener(self.events.get_nowait())
        self.listener = listener

    async def stream(self) -> AsyncIterator[Delta | Finished]:
        """The job's events: :class:`Delta`... then :class:`Finished` (a failure raises its :class:`TextError`).

        Consecutive deltas already waiting are merged into one, so a slow reader catches up in
        one write instead of one per token.
        """
        while True:
            ev = await self.events.get()
            if isinstance(ev, Delta):
                text, tokens, t = [ev.text], ev.tokens, ev.time
                while not self.events.empty():
                    nxt = self.events.get_nowait()
                    if not isinstance(nxt, Delta):
                        yield Delta("".join(text), tokens, t)
                        ev = nxt
                        break
                    text.append(nxt.text)
                    tokens += nxt.tokens
                    t = nxt.time
                else:
                    yield Delta("".join(text), tokens, t)
                    continue
            if isinstance(ev, TextError):
                raise ev
            if isinstance(ev, Finished):
                if ev.error is not None:
                    raise ev.error
                yield ev
                return


class _Model:
    """A served text model: its backend, admission controller and jobs."""

    def __init__(self, cfg: TextModelConfig, backend: TextBackend, core: AdmissionController) -> None:
        self.cfg = cfg
        self.backend = backend
        self.core = core
        self.queued: dict[int, TextJob] = {}
        self.running: dict[int, TextJob] = {}
        self.expiry: EarliestTimer | None = None  # set by the service, which owns the callback
        self.kicking = False
        self.rekick = False

    @property
    def name(self) -> str:
        return self.cfg.name


def generate_to_request(msg: Generate, default_model: str | None) -> GenerationRequest:
    """A native ``generate`` message as a :class:`GenerationRequest` (same rules as the HTTP API).

    Args:
        msg: the validated message.
        default_model: the model used when ``msg.model`` is ``None``.

    Raises:
        TextError: a field is invalid or unsupported.
    """
    body: dict[str, Any] = {
        "model": msg.model or default_model,
        "max_tokens": msg.max_tokens,
        "temperature": msg.temperature,
        "top_p": msg.top_p,
        "seed": msg.seed,
        "stop": list(msg.stop) if msg.stop is not None else None,
        "ignore_eos": msg.ignore_eos,
        "deadline_ms": msg.deadline_ms,
    }
    if msg.messages is not None:
        body["messages"] = [m.model_dump() for m in msg.messages]
        return parse_chat_request(body).request
    body["prompt"] = msg.prompt
    return parse_completion_request(body).request


class TextService:
    """Text requests on the shared serving core (see the module docstring).

    Args:
        auth: the server's authenticator (``Authenticator`` or ``NoAuth``): the same keys and tenants.
        quotas: the server's quota manager (shared with the robot path).
        metrics: the server's metrics.
        ledger: the server's ledger, or ``None``.
        models: the text models to serve (the first is the default of ``generate``).
        clock: monotonic seconds.
        yield_to: ``yield_to(priority)`` tells embedded engines to pause while robot-policy work
            of a higher priority is active (a :class:`~chunkline.server.text.priority.PolicyPriorityGate`).
        ledger_fail_closed: refuse new work while the ledger cannot be written.
        max_body: largest HTTP request body.
        accounting: where outcomes are counted (the server's, shared with the robot path);
            by default one over ``metrics`` and ``ledger``.
    """

    def __init__(
        self,
        *,
        auth: Authenticator | NoAuth,
        quotas: QuotaManager,
        metrics: Metrics,
        ledger: Ledger | None,
        models: list[TextModelConfig],
        clock: Callable[[], float] = time.perf_counter,
        yield_to: Callable[[int], bool] | None = None,
        ledger_fail_closed: bool = True,
        max_body: int = 8 * 1024 * 1024,
        accounting: Accounting | None = None,
    ) -> None:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"two text models share a name: {names}")
        self.auth = auth
        self.quotas = quotas
        self.metrics = metrics
        self.ledger = ledger
        self.accounting = accounting if accounting is not None else Accounting(metrics, ledger)
        self.configs = list(models)
        self.clock = clock
        self.yield_to = yield_to
        self.ledger_fail_closed = ledger_fail_closed
        self.max_body = max_body
        self.models: dict[str, _Model] = {}
        self.ready = False
        self.stopping = False
        self.created = int(time.time())
        self._ids = itertools.count(1)
        self._http: list[HttpServer] = []
        self._live: dict[int, TextJob] = {}

    # ------------------------------------------------------------------ life cycle

    def _backend(self, cfg: TextModelConfig) -> TextBackend:
        if cfg.backend == "embedded":
            return EmbeddedBackend(cfg, self.clock, self.yield_to)
        return UpstreamBackend(cfg, self.clock)

    async def start(self) -> None:
        """Load and warm every model and start its engine; then accept requests."""
        for cfg in self.configs:
            backend = self._backend(cfg)
            await backend.start()
            # One "batch" per sequence: each running sequence is a lane of its own, whose service
            # time (what the core plans and drops with) is the time to its first token.
            core = AdmissionController(
                cfg.name,
                self.quotas,
                AdmissionConfig(max_queue=cfg.max_queue, max_batch_size=1, workers=cfg.max_batch, drop_late=True),
                ServiceTimeModel(initial={1: backend.load.prefill_s(64)}),
            )
            self.models[cfg.name] = _Model(cfg, backend, core)
        self.ready = True

    async def serve_http(self, host: str, port: int) -> int:
        """Serve the OpenAI-compatible API on its own listener; returns the bound port.

        Args:
            host: address to listen on.
            port: port (0 picks a free one).
        """
        from chunkline.server.text.api import OpenAIApp

        server = HttpServer(OpenAIApp(self), max_body=self.max_body)
        bound = await server.start(host, port)
        self._http.append(server)
        log.info("OpenAI-compatible API on http://%s:%d/v1", host, bound)
        return bound

    async def stop(self) -> None:
        """Refuse new work, fail queued work ``shutting_down``, cancel running work, stop engines."""
        self.stopping = True
        for server in self._http:
            await server.close()
        self._http.clear()
        for model in self.models.values():
            if model.expiry is not None:
                model.expiry.cancel()
            for job in list(model.queued.values()):
                if job.admission is not None and model.core.cancel(job.id, self.clock()) is CancelOutcome.QUEUED:
                    model.queued.pop(job.id, None)
                    self._end_unstarted(model, job, TextRefused(ErrorCode.SHUTTING_DOWN.value, "the server is shutting down", retry_after_ms=1000.0))
            for job in list(model.running.values()):
                model.backend.cancel(job.id)
        for model in self.models.values():
            await model.backend.stop()
        self.ready = False

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
        return [c.name for c in self.configs if tenant.may_use(c.name, "text")]

    def fingerprint(self, model: str) -> str:
        """The model's fingerprint (embedded: weights and settings; upstream: its URL and name)."""
        m = self.models.get(model)
        return m.backend.fingerprint if m is not None else ""

    @property
    def in_flight(self) -> int:
        """Text requests queued or running."""
        return sum(len(m.queued) + len(m.running) for m in self.models.values())

    # ------------------------------------------------------------------ admission

    def submit(self, request: GenerationRequest, tenant: TenantInfo, session: str, received: float | None = None) -> TextJob:
        """Validate and admit one request; its events then arrive on :meth:`TextJob.stream`.

        Args:
            request: the parsed request.
            tenant: who sent it.
            session: where from (for ``cancel_session`` and the ledger).
            received: receipt time (service clock); now by default.

        Raises:
            TextError: refused (unknown model 404, forbidden 403, invalid 400, quota 429,
                overloaded 503, deadline unmeetable 503, not ready 503).
        """
        now = self.clock()
        received = now if received is None else received
        model = self.models.get(request.model)
        try:
            if self.stopping:
                raise TextRefused(ErrorCode.SHUTTING_DOWN.value, "the server is shutting down", retry_after_ms=1000.0)
            if not self.ready:
                raise TextRefused(ErrorCode.NOT_READY.value, "text models are loading", retry_after_ms=1000.0)
            if model is None or (tenant.models is not None and model.name not in tenant.models):
                raise UnknownTextModel(request.model)  # tenants do not learn each other's models
            if "text" not in tenant.classes:
                raise TextRefused(ErrorCode.FORBIDDEN.value, f"tenant {tenant.name!r} may not send text requests")
            if self.ledger is not None and self.ledger_fail_closed and not self.ledger.healthy:
                raise TextRefused(ErrorCode.NOT_READY.value, "usage ledger unavailable: refusing unrecorded work", retry_after_ms=1000.0)
            prepared = model.backend.prepare(request)
            # A text request's budget is its own or the model's: a tenant's default deadline is a
            # robot control-loop budget and says nothing about text.
            deadline = resolve_deadline(received, request.deadline_ms, policy_default_ms=model.cfg.default_ttft_ms)
            priority = tenant.priority_for("text")
            ttft = self._predict_ttft(model, prepared, priority)
            if now + ttft > deadline:
                raise TextRefused(
                    ErrorCode.DEADLINE_UNMEETABLE.value,
                    f"first token predicted in {ttft * 1000:.0f} ms, the budget is {(deadline - received) * 1000:.0f} ms",
                    retry_after_ms=max(1000.0, (now + ttft - deadline) * 1000.0),
                )
        except TextError as exc:
            # A model name that is not served is the client's text: never a metrics label.
            self._count_refusal(model.name if model is not None else "(unknown)", tenant, exc)
            raise
        job = TextJob(next(self._ids), model.name, tenant, session, prepared, received, time.time() - (now - received), deadline, priority)
        job.loss.extend(prepared.loss)
        job.admission = Request(id=job.id, session=session, tenant=tenant.name, cls="text",
                                cost=TextCost(prepared.prompt_tokens, prepared.params.max_tokens), deadline=deadline,
                                priority=priority, payload=job)
        decision = model.core.offer(job.admission, now)
        self._answer_dropped(model)
        if isinstance(decision, Refusal):
            limit = getattr(decision, "limit", None)
            exc = TextRefused(decision.code.value, decision.reason, retry_after_ms=decision.retry_after_ms,
                              limit=limit.value if limit is not None else None)
            self._count_refusal(model.name, tenant, exc)
            raise exc
        model.queued[job.id] = job
        self._live[job.id] = job
        self._kick(model)
        self._arm_expiry(model)
        return job

    def _predict_ttft(self, model: _Model, prepared: PreparedRequest, priority: int) -> float:
        running = [(j.tokens, j.prepared.params.max_tokens) for j in model.running.values()]
        ahead = [(j.prepared.prompt_tokens, j.prepared.params.max_tokens) for j in model.queued.values() if j.priority >= priority]
        return model.backend.load.predict_ttft(running, ahead, prepared.prompt_tokens)

    def cancel(self, job: TextJob) -> None:
        """Withdraw a request (client cancel, disconnect, stream closed): a queued one never runs;
        a running one frees its slot at the backend's next step."""
        if job.done:
            return
        model = self.models[job.model]
        if job.id in model.queued:
            model.core.cancel(job.id, self.clock())
            model.queued.pop(job.id, None)
            self._end_unstarted(model, job, TextRefused(ErrorCode.CANCELLED.value, "cancelled by the client"))
            self._kick(model)
        elif job.id in model.running:
            model.core.cancel(job.id, self.clock())  # flags it; complete() still follows
            model.backend.cancel(job.id)

    def cancel_session(self, session: str) -> None:
        """Cancel every text request of a session (it disconnected)."""
        for job in [j for j in self._live.values() if j.session == session]:
            self.cancel(job)

    # ------------------------------------------------------------------ request class

    name = "text"

    @property
    def healthy(self) -> bool:
        """Text engines fail requests, not the server: the class is healthy once started."""
        return True

    def release_session(self, session: str) -> None:
        self.cancel_session(session)

    def stats(self) -> dict[str, Any]:
        return {name: {"queued": len(m.queued), "running": len(m.running)} for name, m in self.models.items()}

    # ------------------------------------------------------------------ dispatch

    def _kick(self, model: _Model) -> None:
        """Give free slots to queued requests (the core picks which: priority, fairness, deadline)."""
        if model.kicking:
            model.rekick = True
            return
        model.kicking = True
        try:
            while True:
                model.rekick = False
                while model.core.queued and len(model.running) < model.backend.capacity and not self.stopping:
                    now = self.clock()
                    batch = model.core.next_batch(now, 1)
                    self._answer_dropped(model)
                    if not batch:
                        break
                    job: TextJob = batch[0].payload
                    model.queued.pop(job.id, None)
                    model.running[job.id] = job
                    job.started = now
                    model.backend.launch(job.id, job.prepared, priority=job.priority, deadline=job.deadline,
                                         emit=lambda ev, job=job: self._on_event(job, ev))
                if not model.rekick:
                    break
        finally:
            model.kicking = False
        self.metrics.set_queue(model.name, len(model.queued), len(model.running))

    def _answer_dropped(self, model: _Model) -> None:
        for dropped in model.core.take_dropped():
            job: TextJob = dropped.request.payload
            model.queued.pop(job.id, None)
            self._end_unstarted(model, job, TextRefused(dropped.code.value, dropped.reason, retry_after_ms=dropped.retry_after_ms))

    def _arm_expiry(self, model: _Model) -> None:
        if model.expiry is None:
            model.expiry = EarliestTimer(self.clock, functools.partial(self._on_expiry, model))
        model.expiry.arm(model.core.next_expiry())

    def _on_expiry(self, model: _Model) -> None:
        model.core.expire(self.clock())
        self._answer_dropped(model)
        self._arm_expiry(model)

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
        model.running.pop(job.id, None)
        job.finished = ev
        job.loss.extend(ev.loss)
        now = self.clock()
        ttft_service = None if job.first_token is None or job.started is None else job.first_token - job.started
        used = ev.prompt_tokens + ev.completion_tokens if ev.consumed else 0
        assert job.admission is not None
        try:
            model.core.complete(job.admission, now, service_time=ttft_service, batch_size=1,
                                used_tokens=used if ev.usage_reported else None)
        except Exception:  # pragma: no cover - the core's own invariant; never leave the job hanging
            log.exception("admission bookkeeping failed for text request %s", job.id)
        load = model.backend.load
        if ttft_service is not None:
            load.observe_first_token(ev.prompt_tokens, ttft_service)
        if job.first_token is not None and job.last_token is not None and ev.completion_tokens > 1:
            load.observe_tokens(ev.completion_tokens - 1, job.last_token - job.first_token)
        if ev.reason in ("stop", "length"):
            load.observe_length(ev.completion_tokens, job.prepared.params.max_tokens)
        if ev.error is not None:
            outcome = ev.error.code
        elif ev.reason == "cancelled":
            outcome = ErrorCode.CANCELLED.value
        elif job.first_token is not None and job.first_token > job.deadline:
            outcome = "late"
        else:
            outcome = "ok"
        self._record(model, job, outcome, ev)
        job.deliver(ev)
        self._kick(model)
        self._arm_expiry(model)

    def _end_unstarted(self, model: _Model, job: TextJob, error: TextError) -> None:
        """A job admitted but never started (dropped, cancelled in the queue, shutdown)."""
        self._record(model, job, error.code, None)
        job.deliver(error)

    # ------------------------------------------------------------------ accounting

    def _count_refusal(self, model: str, tenant: TenantInfo, exc: TextError) -> None:
        self.accounting.refused("text", model, tenant.name, exc.code, limit=exc.limit)

    def _record(self, model: _Model, job: TextJob, outcome: str, ev: Finished | None) -> None:
        """Metrics and the ledger row of an admitted request (exactly once)."""
        if job.done:
            return
        job.done = True
        self._live.pop(job.id, None)
        end = ev.time if ev is not None else self.clock()
        timing: dict[str, float] = {"server_ms": (end - job.received) * 1000.0}
        if job.started is not None:
            timing["queue_ms"] = (job.started - job.received) * 1000.0
            timing["infer_ms"] = (end - job.started) * 1000.0
        tokens_in = ev.prompt_tokens if ev is not None and ev.consumed else 0
        tokens_out = ev.completion_tokens if ev is not None else 0
        ttft = None if job.first_token is None else job.first_token - job.received
        decode = None if job.first_token is None or job.last_token is None else job.last_token - job.first_token
        self.metrics.observe_text(model.name, job.tenant.name, ttft, tokens_in, tokens_out, decode)
        row = None
        if self.ledger is not None:
            row = LedgerRow(
                request_id=f"{job.session}:t{job.id}", tenant=job.tenant.name, cls="text", model=model.name, outcome=outcome,
                ts=job.received_wall, session=job.session, fingerprint=model.backend.fingerprint,
                queue_ms=timing.get("queue_ms"), infer_ms=timing.get("infer_ms"), server_ms=timing["server_ms"],
                tokens_in=tokens_in, tokens_out=tokens_out,
            )
        self.accounting.finished("text", model.name, job.tenant.name, outcome, timing, row)

    # ------------------------------------------------------------------ native protocol

    async def handle_generate(self, msg: Generate, tenant: TenantInfo, session: str,
                              send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Answer one native ``generate``: ``token`` messages, then ``done`` (or one ``error``).

        To cancel it (a ``cancel`` message or a disconnect), cancel the task running this
        coroutine: the request is withdrawn (its slot is freed at the engine's next step), an
        ``error`` ``cancelled`` is sent if the connection still stands, and ``CancelledError``
        propagates. A failing ``send`` (connection closed) cancels the request too.

        Args:
            msg: the validated message.
            tenant: the session's tenant.
            session: the session id.
            send: sends one message map (the session encodes it).
        """
        received = self.clock()
        try:
            job = self.submit(generate_to_request(msg, self.default_model), tenant, session, received)
        except TextError as exc:
            await send(error_message(exc.wire_code, exc.message, msg.id, exc.retry_after_ms))
            return
        index = 0
        try:
            async for ev in job.stream():
                if isinstance(ev, Delta):
                    if ev.text or ev.tokens:
                        await send({"type": "token", "id": msg.id, "text": ev.text, "index": index, "tokens": ev.tokens})
                        index += ev.tokens
                    continue
                await send(self._done_message(msg.id, job, ev))
        except TextError as exc:
            await send(error_message(exc.wire_code, exc.message, msg.id, exc.retry_after_ms))
        except asyncio.CancelledError:
            self.cancel(job)
            try:
                await send(error_message(ErrorCode.CANCELLED, "cancelled by the client", msg.id))
            except Exception as exc:
                log.debug("could not send the cancellation of %r: %s", msg.id, type(exc).__name__)
            raise
        except Exception:
            self.cancel(job)  # the connection went away mid-stream
            raise

    def _done_message(self, request_id: Any, job: TextJob, ev: Finished) -> dict[str, Any]:
        timing: dict[str, float] = {"server_ms": round((ev.time - job.received) * 1000.0, 4)}
        if job.started is not None:
            timing["queue_ms"] = round((job.started - job.received) * 1000.0, 4)
        if job.first_token is not None:
            timing["ttft_ms"] = round((job.first_token - job.received) * 1000.0, 4)
        if job.first_token is not None and job.last_token is not None and ev.completion_tokens > 1:
            timing["tpot_ms"] = round((job.last_token - job.first_token) / (ev.completion_tokens - 1) * 1000.0, 4)
        out: dict[str, Any] = {
            "type": "done",
            "id": request_id,
            "model": job.model,
            "finish_reason": ev.reason,
            "usage": {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                      "total_tokens": ev.prompt_tokens + ev.completion_tokens},
            "fingerprint": self.fingerprint(job.model),
            "late": job.first_token is not None and job.first_token > job.deadline,
            "timing": timing,
        }
        if job.loss:
            out["translation_loss"] = [x.to_json() for x in job.loss]
        return out
