"""Property tests of the admission core (hypothesis, injected clock).

Random interleavings of offers, clock ticks, batch dispatches, completions and cancellations,
checked after every step: no admitted request starts after its deadline; the queue never
exceeds its bound; EDF holds within a priority (per tenant always; across tenants when fair
sharing is off); priorities are strict; every refusal and drop carries a code and a reason; the
quota counters match what is queued and running; an admission never breaks an earlier promise
(an oracle moves each admitted request's promised completion a slot at a time and predicts which
offers must be refused for it). A two-tenant contention run checks that each tenant gets at least
its weighted fair share. Everything is checked through the controller's public answers.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.admission import (
    REFUSAL_CODES,
    AdmissionConfig,
    AdmissionController,
    Admitted,
    CancelOutcome,
    EdfSelector,
    Request,
    ServiceTimeModel,
)
from chunkline.server.core.quotas import PolicyCost, QuotaManager, TextCost
from chunkline.server.core.tenants import TenantInfo, TenantLimits, TenantRegistry
from chunkline.server.errors import Refusal

TENANTS = ("t0", "t1", "t2")

_budget = st.sampled_from([0.003, 0.02, 0.1, 0.5, 2.0]) | st.floats(0.001, 1.0)
_offer = st.tuples(st.just("offer"), st.integers(0, 2), st.integers(0, 2), _budget, st.booleans(), st.integers(0, 3))
_op = st.one_of(
    _offer,  # offers weigh three times as much, so that queues build up
    _offer,
    _offer,
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.001, 0.01]) | st.floats(0.0, 0.05)),
    st.tuples(st.just("batch"), st.integers(1, 6)),
    st.tuples(st.just("done"), st.floats(0.0005, 0.05)),
    st.tuples(st.just("cancel"), st.integers(0, 60)),
    st.tuples(st.just("session"), st.integers(0, 3)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("replace"), st.integers(0, 60), st.integers(0, 3), _budget),
)

_config = st.fixed_dictionaries(
    {
        "max_queue": st.integers(1, 12),
        "max_batch_size": st.integers(1, 4),
        "workers": st.integers(1, 2),
        "fairness_slack": st.sampled_from([0.0, 1.0, 4.0, math.inf]),
        "drop_late": st.booleans(),
    }
)

_tenants = st.tuples(
    *[
        st.builds(
            TenantInfo,
            name=st.just(name),
            weight=st.sampled_from([0.5, 1.0, 3.0]),
            limits=st.builds(TenantLimits, max_in_flight=st.none() | st.integers(1, 6), rate_per_s=st.none() | st.sampled_from([50.0, 500.0])),
        )
        for name in TENANTS
    ]
)


class Model:
    """What the test believes is queued and running, to check the controller against."""

    def __init__(self, c: AdmissionController) -> None:
        self.c = c
        self.queued: dict[int, Request] = {}
        self.running: dict[int, Request] = {}
        self.batches: list[list[Request]] = []
        self.ids: list[int] = []
        self.next_id = 0
        self.now = 0.0
        self.dispatched = 0
        #: each queued request's promised completion, moved a slot at a time (the check's oracle)
        self.promised: dict[int, float] = {}

    def drain_events(self) -> None:
        thr = self.c.service.mean(1) if self.c.config.drop_late else 0.0
        for d in self.c.take_dropped():
            assert d.code in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.OVERLOADED)
            assert d.reason
            assert d.request.id in self.queued, "dropped something that was not queued"
            if d.code is ErrorCode.DEADLINE_EXCEEDED:
                assert d.request.deadline <= self.now + thr + 1e-9
            else:
                assert d.retry_after_ms is not None and d.retry_after_ms > 0
            del self.queued[d.request.id]

    def check(self) -> None:
        c = self.c
        assert c.queued <= c.config.max_queue
        assert c.queued == len(self.queued)
        assert c.running == len(self.running) <= c.config.concurrency
        for t in TENANTS:
            mine = sum(r.tenant == t for r in self.queued.values()) + sum(r.tenant == t for r in self.running.values())
            assert c.quotas.usage(t, self.now).in_flight == mine
            assert c.queued_for(t) == sum(r.tenant == t for r in self.queued.values())


def _slot_and_batch(c: AdmissionController) -> tuple[float, int]:
    """How much later a queued request finishes when one more goes ahead of it, and the planned
    batch size: a batch's occupancy shared by the requests the workers run at once."""
    cfg = c.config
    b = max(1, min(cfg.max_batch_size, cfg.concurrency))
    workers = max(1, min(cfg.workers, cfg.concurrency // b))
    return c.service.occupancy(b) / (b * workers), b


def _replace(m: Model, rid: int, session: str, deadline: float) -> None:
    """A replacement of ``rid`` from ``session``: in its place when it is queued there, with its
    promise and its quota, never ordered ahead of it; else ``replace_missed`` and it stands."""
    c = m.c
    c.expire(m.now)  # as replace does first
    m.drain_events()
    old = m.queued.get(rid)
    out = c.replace(rid, session, deadline, "fresh", m.now)
    if old is None or old.session != session:
        assert isinstance(out, Refusal) and out.code is ErrorCode.REPLACE_MISSED
        return
    if isinstance(out, Refusal):
        assert out.code is ErrorCode.QUOTA_EXCEEDED and out.limit is not None  # judged while the old one counts
        return
    event("replaced in place")
    new = out.request
    assert (new.id, new.session, new.tenant, new.priority, new.payload) == (rid, session, old.tenant, old.priority, "fresh")
    assert new.deadline == max(deadline, old.deadline)
    assert out.predicted_completion == m.promised[rid]
    m.queued[rid] = new


def _run(config: dict[str, Any], tenants: tuple[TenantInfo, ...], ops: list[tuple[Any, ...]]) -> None:
    reg = TenantRegistry({t.name: t for t in tenants})
    svc = ServiceTimeModel(initial={1: 0.004, 4: 0.01})
    config = dict(config)
    slack = config.pop("fairness_slack")
    c = AdmissionController("m", QuotaManager(reg), AdmissionConfig(**config), svc, EdfSelector(slack))
    m = Model(c)
    for op in ops:
        kind = op[0]
        if kind == "batch" and len({(r.priority, r.tenant) for r in m.queued.values()}) > 1 and len(m.queued) > op[1]:
            event("batch chooses among queues")
        if kind == "offer":
            _, ti, prio, budget, text, session = op
            cost = TextCost(5, 20) if text else PolicyCost()
            r = Request(m.next_id, f"s{session}", TENANTS[ti], "text" if text else "policy", cost, m.now + budget, prio)
            m.next_id += 1
            m.ids.append(r.id)
            c.expire(m.now)  # as offer does first: the oracle below sees the queue offer judges
            m.drain_events()
            slot, planned = _slot_and_batch(c)
            overtaken = [y.id for y in m.queued.values() if y.priority == r.priority and y.deadline > r.deadline]
            broken = [m.promised[i] for i in overtaken if m.promised[i] + slot > m.queued[i].deadline + 1e-9]
            result = c.offer(r, m.now)
            if isinstance(result, Admitted):
                assert result.predicted_completion <= r.deadline + 1e-9
                assert result.predicted_start >= m.now - 1e-9
                assert not broken, "admitted a request that breaks an earlier promise"
                for i in overtaken:
                    m.promised[i] += slot
                m.promised[r.id] = result.predicted_completion
                m.queued[r.id] = r
            else:
                assert isinstance(result, Refusal)
                assert result.code in REFUSAL_CODES and result.reason
                if "with later deadlines miss theirs" in result.reason:
                    assert f"would make {len(broken)} admitted" in result.reason
                    last_start = max(broken) - c.service.occupancy(planned)
                    assert result.retry_after_ms is not None
                    assert math.isclose(result.retry_after_ms, max(1.0, (last_start - m.now) * 1000.0), rel_tol=1e-9)
                if result.code is ErrorCode.OVERLOADED:
                    assert result.retry_after_ms is not None and result.retry_after_ms > 0
                if result.code is ErrorCode.QUOTA_EXCEEDED:
                    assert result.limit is not None
        elif kind == "tick":
            m.now += op[1]
        elif kind == "batch":
            c.expire(m.now)  # as next_batch does first
            m.drain_events()
            batch = c.next_batch(m.now, op[1])
            m.drain_events()
            assert len(batch) <= op[1]
            for x in batch:
                # never starts after its deadline
                assert x.deadline > m.now
                assert x.id in m.queued
                del m.queued[x.id]
                m.running[x.id] = x
            for x in batch:
                for y in m.queued.values():
                    # strict priority, and EDF within a priority and tenant
                    assert y.priority <= x.priority
                    if y.priority == x.priority and y.tenant == x.tenant:
                        assert y.deadline >= x.deadline
                    if math.isinf(slack) and y.priority == x.priority:
                        assert y.deadline >= x.deadline  # fair sharing off: plain EDF
            for a, b in zip(batch, batch[1:], strict=False):
                if (a.priority, a.tenant) == (b.priority, b.tenant):
                    assert a.deadline <= b.deadline
            if batch:
                m.batches.append(batch)
                m.dispatched += len(batch)
        elif kind == "done":
            if m.batches:
                batch = m.batches.pop(0)
                m.now += op[1]
                c.complete_batch(batch, m.now, service_time=op[1])
                for x in batch:
                    del m.running[x.id]
        elif kind == "cancel":
            if m.ids:
                rid = m.ids[op[1] % len(m.ids)]
                out = c.cancel(rid, m.now)
                if rid in m.queued:
                    assert out is CancelOutcome.QUEUED
                    del m.queued[rid]
                elif rid in m.running:
                    assert out is CancelOutcome.RUNNING
                else:
                    assert out is CancelOutcome.UNKNOWN
        elif kind == "replace":
            if m.ids:
                _replace(m, m.ids[op[1] % len(m.ids)], f"s{op[2]}", m.now + op[3])
        elif kind == "session":
            removed, running = c.cancel_session(f"s{op[1]}", m.now)
            assert {r.id for r in removed} == {r.id for r in m.queued.values() if r.session == f"s{op[1]}"}
            assert {r.id for r in running} == {r.id for r in m.running.values() if r.session == f"s{op[1]}"}
            for r in removed:
                del m.queued[r.id]
        elif kind == "expire":
            c.expire(m.now)
            nxt = c.next_expiry()
            m.drain_events()
            if nxt is not None:
                assert m.queued
        m.drain_events()
        m.check()
    # in the end every admitted request is accounted for: far in the future, all queued work expires
    for batch in m.batches:
        c.complete_batch(batch, m.now + 1.0)
    m.now += 10.0
    assert c.next_batch(m.now) == []
    m.running.clear()
    m.drain_events()
    assert not m.queued and c.queued == 0 and c.running == 0
    for t in TENANTS:
        assert c.quotas.usage(t, m.now).in_flight == 0


@settings(max_examples=150, deadline=None)
@given(_config, _tenants, st.lists(_offer, min_size=4, max_size=20), st.lists(_op, min_size=30, max_size=120))
def test_admission_invariants(
    config: dict[str, Any], tenants: tuple[TenantInfo, ...], burst: list[tuple[Any, ...]], ops: list[tuple[Any, ...]]
) -> None:
    # a burst of offers first, so that batches usually choose among several queues
    _run(config, tenants, burst + ops)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([0.5, 1.0, 2.0, 3.0]),
    st.sampled_from([0.5, 1.0, 2.0, 3.0]),
    st.integers(1, 8),
    st.sampled_from([0.0, 1.0, 4.0]),
    st.booleans(),
    st.integers(20, 120),
)
def test_two_tenants_under_contention_get_their_weighted_share(
    w0: float, w1: float, batch_size: int, slack: float, text: bool, rounds: int
) -> None:
    """Both tenants keep their queues full; each gets at least its weight's share of the work,
    within the scheduler's bound (slack + one request's work at the smaller weight)."""
    reg = TenantRegistry({"a": TenantInfo("a", weight=w0), "b": TenantInfo("b", weight=w1)})
    c = AdmissionController(
        "m",
        QuotaManager(reg),
        AdmissionConfig(max_queue=64, max_batch_size=batch_size),
        ServiceTimeModel(initial={1: 1e-4}),
        EdfSelector(slack),
    )
    work = {"a": 0.0, "b": 0.0}
    now = 0.0
    n = 0
    # a's requests are more urgent than b's: deadlines must not buy more than the fair share
    budget = {"a": 50.0, "b": 100.0}
    max_work = 0.0
    for _ in range(rounds):
        for t in ("a", "b"):
            while c.queued_for(t) < 16:
                cost = TextCost(prompt_tokens=1 + (n * 7) % 5, max_tokens=(n * 3) % 4) if text else PolicyCost()
                max_work = max(max_work, cost.work)
                r = Request(n, "s", t, "text" if text else "policy", cost, now + budget[t] + n * 1e-6)
                n += 1
                assert isinstance(c.offer(r, now), Admitted)
        batch = c.next_batch(now)
        assert batch
        for x in batch:
            work[x.tenant] += x.cost.work
        now += 0.001
        c.complete_batch(batch, now, service_time=1e-4)
    total = work["a"] + work["b"]
    bound = slack + max_work / min(w0, w1)
    # normalised service differs by at most the bound...
    assert abs(work["a"] / w0 - work["b"] / w1) <= bound + 1e-9
    # ...so each gets its weighted share of the total, minus at most its weight times the bound
    for t, w in (("a", w0), ("b", w1)):
        share = w / (w0 + w1)
        assert work[t] >= share * total - w * bound - 1e-9


def test_an_empty_queue_still_counts_other_tenants_arrivals_that_would_go_first() -> None:
    """Queue empty but the only worker busy: another tenant's recent arrivals may still run
    before a newcomer (fair sharing), so it is predicted to start after them, not at once."""
    reg = TenantRegistry({n: TenantInfo(name=n) for n in ("a", "b")})
    c = AdmissionController("m", QuotaManager(reg), AdmissionConfig(max_batch_size=1, workers=1),
                            ServiceTimeModel(initial={1: 0.01}), EdfSelector(1.0))
    now = 0.0
    for i in range(20):  # tenant b arrives at 1 kHz and is served as it comes
        assert isinstance(c.offer(Request(i, "sb", "b", "policy", PolicyCost(), now + 5.0, 0), now), Admitted)
        (running,) = c.next_batch(now)
        if i < 19:
            c.complete_batch([running], now + 0.0005, service_time=0.01)
        now += 0.001
    assert c.queued == 0 and c.running == 1
    alone = c.offer(Request(98, "sb", "b", "policy", PolicyCost(), now + 5.0, 0), now)
    assert isinstance(alone, Admitted)  # b's own: only the running batch goes first
    assert c.cancel(98, now) is CancelOutcome.QUEUED
    newcomer = c.offer(Request(99, "sa", "a", "policy", PolicyCost(), now + 5.0, 0), now)
    assert isinstance(newcomer, Admitted)
    assert newcomer.predicted_start > alone.predicted_start + 0.01  # b's expected arrivals go first


_SERVICE_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), st.integers(1, 40), st.floats(0.0, 0.2)),
        st.tuples(st.just("handoff"), st.floats(0.0, 0.01)),
        st.tuples(st.just("prime"), st.dictionaries(st.integers(1, 40), st.floats(0.0, 0.2), max_size=3)),
        st.tuples(st.just("factor"), st.sampled_from([0.0, 1.0, 2.0, 3.0])),
        st.tuples(st.just("ask"), st.integers(1, 64)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_SERVICE_OPS)
def test_the_service_models_kept_answers_are_what_it_would_work_out_afresh(ops: list[tuple[Any, ...]]) -> None:
    # The model keeps mean() and predict() answers across samples, dropping only those a sample can
    # change: every answer must equal the one worked out with nothing kept.
    model = ServiceTimeModel(initial={1: 0.001, 4: 0.003})
    for op in ops:
        if op[0] == "observe":
            model.observe(op[1], op[2])
        elif op[0] == "handoff":
            model.observe_handoff(op[1])
        elif op[0] == "prime":
            model.prime(op[1])
        elif op[0] == "factor":
            model.deviation_factor = op[1]
        fresh = copy.deepcopy(model)
        fresh._means.clear()
        fresh._predictions.clear()
        for b in (1, 2, 3, 4, 7, 16, 33, 64) if op[0] != "ask" else (op[1],):
            assert model.mean(b) == fresh.mean(b)
            assert model.predict(b) == fresh.predict(b)
            assert model.occupancy(b) == fresh.occupancy(b)
