"""Refusing before decoding: admission's side-effect-free verdict, the runner's precheck, the
native session's early answer (live), and the load benchmark's server-side refusal latency."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from helpers import aloha_obs
from hypothesis import given, settings
from hypothesis import strategies as st
from policies_for_tests import CountingPolicy
from runner_helpers import CLOCK, TENANT, Gate, one_at_a_time
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from chunkline.bench.load import bucket_quantile, refusal_buckets, scrape_latency_buckets
from chunkline.bench.loadgen import _Session
from chunkline.bench.records import RequestRecord
from chunkline.bench.serverproc import ServerProcess
from chunkline.client import AsyncClient, ErrorCode, ServerError
from chunkline.client.wire.codec import Encoded, decode, encode
from chunkline.client.wire.protocol import SUBPROTOCOL
from chunkline.policies.base import validate_observation
from chunkline.server.core.admission import AdmissionConfig, AdmissionController, EdfSelector, Request, ServiceTimeModel
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantLimits, TenantRegistry
from chunkline.server.errors import Refusal

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback

# ----------------------------------------------------------------------------- admission: check == offer

_op = st.one_of(
    st.tuples(st.just("offer"), st.integers(0, 1), st.sampled_from([0.002, 0.01, 0.03, 0.1, 1.0]), st.integers(0, 1)),
    st.tuples(st.just("offer"), st.integers(0, 1), st.floats(0.0005, 0.2), st.integers(0, 1)),
    st.tuples(st.just("tick"), st.floats(0.0, 0.03)),
    st.tuples(st.just("batch"), st.integers(1, 3)),
    st.tuples(st.just("done"), st.floats(0.001, 0.04)),
)


def _state(c: AdmissionController, now: float) -> tuple[Any, ...]:
    usage = tuple((t, c.quotas.usage(t, now).in_flight) for t in ("a", "b"))
    return c.queued, c.running, c.queued_for("a"), c.queued_for("b"), usage, c.next_expiry()


@settings(max_examples=120, deadline=None)
@given(
    ops=st.lists(_op, min_size=1, max_size=50),
    max_queue=st.integers(1, 6),
    batch=st.integers(1, 3),
    in_flight=st.none() | st.integers(1, 5),
    slack=st.sampled_from([0.0, 4.0, math.inf]),
)
def test_check_gives_offers_verdict_and_changes_nothing(ops: list[tuple[Any, ...]], max_queue: int, batch: int,
                                                        in_flight: int | None, slack: float) -> None:
    reg = TenantRegistry({"a": TenantInfo("a", limits=TenantLimits(max_in_flight=in_flight)), "b": TenantInfo("b", weight=2.0)})
    c = AdmissionController("m", QuotaManager(reg), AdmissionConfig(max_queue=max_queue, max_batch_size=batch),
                            ServiceTimeModel(initial={1: 0.004, 3: 0.008}), EdfSelector(slack))
    now, ids, running = 0.0, 0, []
    for op in ops:
        if op[0] == "offer":
            _, tenant, budget, prio = op
            ids += 1
            r = Request(ids, f"s{ids % 3}", "ab"[tenant], "policy", PolicyCost(), now + budget, prio)
            c.expire(now)  # what offer does first: check's answer is then offer's exactly
            c.take_dropped()
            before = _state(c, now)
            verdict = c.check(r, now)
            assert _state(c, now) == before and c.take_dropped() == []
            decision = c.offer(r, now)
            assert (verdict is None) == (not isinstance(decision, Refusal))
            if verdict is not None:
                assert isinstance(decision, Refusal)
                assert (verdict.code, verdict.reason, verdict.retry_after_ms, verdict.limit) == (
                    decision.code, decision.reason, decision.retry_after_ms, decision.limit)
        elif op[0] == "tick":
            now += op[1]
        elif op[0] == "batch":
            got = c.next_batch(now, op[1])
            if got:
                running.append(got)
        elif op[0] == "done" and running:
            now += op[1]
            c.complete_batch(running.pop(0), now, op[1])
        c.take_dropped()


def test_service_estimates_follow_new_samples_and_settings() -> None:
    m = ServiceTimeModel(alpha=0.5, beta=0.5, deviation_factor=2.0, initial={1: 0.01, 4: 0.05})
    assert m.predict(2) == pytest.approx(0.01 + (0.05 - 0.01) / 3)  # asked twice: answered alike
    assert m.predict(2) == pytest.approx(0.01 + (0.05 - 0.01) / 3)
    m.observe(1, 0.02)  # a new sample is seen at once, by every size
    assert m.mean(1) == pytest.approx(0.02) and m.predict(1) == pytest.approx(0.02 + 2 * 0.005)
    assert m.mean(2) == pytest.approx(0.02 + (0.05 - 0.02) / 3)
    m.deviation_factor = 0.0
    assert m.predict(1) == pytest.approx(0.02)


# ----------------------------------------------------------------------------- runner: precheck

def test_precheck_refuses_as_submit_would_and_admits_nothing() -> None:
    counting = CountingPolicy()
    gate = Gate(counting)
    obs = validate_observation(counting.spec, aloha_obs(0))

    async def go() -> None:
        runner = one_at_a_time(gate, max_queue=2)
        first = runner.submit(obs, tenant=TENANT, session="a", deadline=CLOCK() + 60)  # blocks the lane
        assert not runner.refusing
        # The lane is busy for about 50 ms more: a 10 ms budget cannot be met, whatever the observation.
        tight = CLOCK() + 0.01
        refusal = runner.precheck(tenant=TENANT, session="b", deadline=tight)
        assert refusal is not None and refusal.code is ErrorCode.DEADLINE_UNMEETABLE and runner.refusing
        assert runner.queued == 0
        with pytest.raises(Refusal) as info:
            runner.submit(obs, tenant=TENANT, session="b", deadline=tight)
        assert info.value.code is ErrorCode.DEADLINE_UNMEETABLE
        assert runner.precheck(tenant=TENANT, session="b", deadline=CLOCK() + 60) is None
        assert not runner.refusing and runner.queued == 0
        queued = [runner.submit(obs, tenant=TENANT, session=f"q{i}", deadline=CLOCK() + 60) for i in range(2)]
        full = runner.precheck(tenant=TENANT, session="c", deadline=CLOCK() + 60)
        assert full is not None and full.code is ErrorCode.OVERLOADED and full.retry_after_ms and runner.queued == 2
        gate.gate.set()
        await asyncio.gather(first.future, *(q.future for q in queued))
        assert runner.precheck(tenant=TENANT, session="c", deadline=CLOCK() + 60) is None
        await runner.stop()
        assert runner.precheck(tenant=TENANT, session="c", deadline=CLOCK() + 60).code is ErrorCode.SHUTTING_DOWN

    asyncio.run(go())


def test_fifo_baseline_precheck_never_refuses_for_deadlines() -> None:
    counting = CountingPolicy()
    gate = Gate(counting)
    obs = validate_observation(counting.spec, aloha_obs(0))

    async def go() -> None:
        runner = one_at_a_time(gate, max_queue=8, fifo=True)
        first = runner.submit(obs, tenant=TENANT, session="a", deadline=CLOCK() + 0.001)
        assert runner.precheck(tenant=TENANT, session="b", deadline=CLOCK() + 0.001) is None
        gate.gate.set()
        await first.future
        await runner.stop()

    asyncio.run(go())


# ----------------------------------------------------------------------------- live: refused before decoding


def _lying_infer(request_id: int, deadline_ms: float) -> bytes:
    """An ``infer`` whose image claims more bytes than it carries: decode would refuse it."""
    obs = {k: v for k, v in aloha_obs(1).items() if k != "images/cam_high"}
    body = encode({"type": "infer", "id": request_id, "obs": obs, "deadline_ms": deadline_ms})
    bad = {b"__ndarray__": True, b"data": b"\x00" * 10, b"dtype": "|u1", b"shape": [224, 224, 3]}
    # Re-pack the observation map with the lying array as one more entry.
    tree = msgpack.unpackb(body, raw=False, strict_map_key=False)
    tree["obs"]["images/cam_high"] = bad
    return msgpack.packb(tree, use_bin_type=True)


def test_a_request_refused_anyway_is_answered_without_decoding_it() -> None:
    with ServerProcess(["--policy", "sleep:0.3", "--max-batch-size", "1"]) as server:
        async def go() -> tuple[str, str, str]:
            before = scrape_latency_buckets(server.uri)
            async with AsyncClient(server.uri) as client:
                busy = asyncio.ensure_future(client.infer(aloha_obs(), deadline_ms=5000))
                await asyncio.sleep(0.1)  # the lane now runs for about 0.2 s more
                with pytest.raises(ServerError) as first:
                    await client.infer(aloha_obs(), deadline_ms=20)  # full path: decoded, then refused
                async with connect(server.uri, subprotocols=[SUBPROTOCOL]) as ws:  # type: ignore[list-item]
                    decode(await ws.recv())  # hello
                    # The model is refusing: this one is peeked at and refused before its (lying)
                    # observation is decoded, so the answer is the admission refusal.
                    await ws.send(_lying_infer(1, 20))
                    early = decode(await ws.recv())
                    await busy
                    # The lane is free now: the same lie takes the full path and is caught by the decoder.
                    await ws.send(_lying_infer(2, 5000))
                    full = decode(await ws.recv())
            after = scrape_latency_buckets(server.uri)
            assert before is not None and after is not None
            # Three refusals (the invalid message too) and one chunk recorded a server-side latency.
            assert after[math.inf] - before.get(math.inf, 0.0) == 4
            return first.value.code, early["code"], full["code"]

        first, early, full = asyncio.run(go())
    assert first == ErrorCode.DEADLINE_UNMEETABLE
    assert early == ErrorCode.DEADLINE_UNMEETABLE.value
    assert full == ErrorCode.INVALID_MESSAGE.value


# ----------------------------------------------------------------------------- load benchmark helpers


def _rec(outcome: str, server_ms: float | None = None) -> RequestRecord:
    return RequestRecord(scheduled=0.0, sent=0.0, robot=0, outcome=outcome, latency_s=0.01,
                         server={} if server_ms is None else {"server_ms": server_ms})


def test_refusal_latency_is_what_the_chunks_leave_of_the_histogram() -> None:
    before = {0.001: 10.0, 0.002: 12.0, 0.005: 20.0, math.inf: 20.0}
    # The step added: chunks at 1.5 ms and 4 ms, refusals at 0.4, 0.6 and 1.8 ms.
    after = {0.001: 12.0, 0.002: 16.0, 0.005: 25.0, math.inf: 25.0}
    records = [_rec("ok", 1.5), _rec("ok", 4.0), _rec("overloaded"), _rec("deadline_unmeetable"), _rec("deadline_unmeetable"),
               _rec("deadline_exceeded")]
    left = refusal_buckets(before, after, records)
    assert left == {0.001: 2.0, 0.002: 3.0, 0.005: 3.0, math.inf: 3.0}
    assert bucket_quantile(left, 0.5) == 0.001 and bucket_quantile(left, 0.99) == 0.002
    # What is left does not match the refusals the client saw: no figure rather than a wrong one.
    assert refusal_buckets(before, after, records[:2]) is None
    assert refusal_buckets(None, after, records) is None
    assert math.isnan(bucket_quantile(None, 0.99)) and math.isnan(bucket_quantile({math.inf: 0.0}, 0.5))


def test_the_generator_sends_each_robot_its_own_observation_packed_once() -> None:
    from chunkline.client.wire.codec import Encoder
    from chunkline.policies.registry import load_policy

    meta, spec = load_policy("noop").metadata(), load_policy("noop").spec
    robots = [_Session(None, meta, np.random.default_rng([0, robot]), Encoder()) for robot in range(2)]  # type: ignore[arg-type]
    packed = [r.observation(None) for r in robots]
    assert all(isinstance(p, Encoded) for p in packed)
    assert robots[0].observation(None) is packed[0]  # packed once, re-sent
    assert packed[0].data != packed[1].data  # robots differ
    assert set(validate_observation(spec, decode(packed[0].data))) == set(spec.observation)
    # Without an encoder (the breakdown suite measures the client's encoding) the arrays go as they are.
    plain = _Session(None, meta, np.random.default_rng([0, 0])).observation(None)  # type: ignore[arg-type]
    assert isinstance(plain, dict) and encode(plain) == packed[0].data


# ----------------------------------------------------------------------------- retry_after_ms at the door


def test_admission_gives_a_retry_time_only_when_waiting_can_help() -> None:
    c = AdmissionController("m", QuotaManager(TenantRegistry({"a": TenantInfo("a")})), AdmissionConfig(max_batch_size=1),
                            ServiceTimeModel(initial={1: 0.100}, deviation_factor=0.0))
    assert not isinstance(c.offer(Request(1, "s", "a", "policy", PolicyCost(), 10.0), 0.0), Refusal)
    assert len(c.next_batch(0.0)) == 1  # running: 100 ms of work ahead of anything new
    busy = c.offer(Request(2, "s", "a", "policy", PolicyCost(), 0.150), 0.0)  # 100 ms ahead + 100 ms of its own
    assert isinstance(busy, Refusal) and busy.code is ErrorCode.DEADLINE_UNMEETABLE
    assert busy.retry_after_ms == pytest.approx(50.0)
    hopeless = c.offer(Request(3, "s", "a", "policy", PolicyCost(), 0.050), 0.0)  # one batch alone takes 100 ms
    assert isinstance(hopeless, Refusal) and hopeless.retry_after_ms is None


def _tiny_lying_infer(request_id: int, deadline_ms: float) -> bytes:
    """A small ``infer`` whose one array claims 150 KiB and carries 10 bytes: decoding it would fail."""
    bad = {b"__ndarray__": True, b"data": b"\x00" * 10, b"dtype": "|u1", b"shape": [224, 224, 3]}
    return msgpack.packb({"type": "infer", "id": request_id, "obs": {"images/cam_high": bad}, "deadline_ms": deadline_ms},
                         use_bin_type=True)


def test_a_session_that_ignores_retry_after_is_refused_at_the_door_then_closed() -> None:
    from chunkline.server.entrypoints.sessions import IGNORED_RETRY_HINTS_BEFORE_CLOSE

    with ServerProcess(["--policy", "sleep:1.0", "--max-batch-size", "1"]) as server:
        async def go() -> tuple[dict[str, Any], list[dict[str, Any]], int | None]:
            async with connect(server.uri, subprotocols=[SUBPROTOCOL], max_size=None) as ws:  # type: ignore[list-item]
                decode(await ws.recv())  # hello
                await ws.send(encode({"type": "infer", "id": 1, "obs": aloha_obs(0), "deadline_ms": 5000.0}))
                # 1 s of work ahead and 1 s of its own: a 1.5 s budget is 0.5 s short -> retry in ~0.5 s.
                await ws.send(encode({"type": "infer", "id": 2, "obs": aloha_obs(1), "deadline_ms": 1500.0}))
                refused = decode(await ws.recv())
                answers = []
                try:
                    for i in range(IGNORED_RETRY_HINTS_BEFORE_CLOSE + 1):  # all inside the retry window
                        await ws.send(_tiny_lying_infer(100 + i, 1500.0))
                    async with asyncio.timeout(10):
                        while True:
                            msg = decode(await ws.recv())
                            if msg["type"] == "error":
                                answers.append(msg)
                except ConnectionClosed:
                    pass
                return refused, answers, ws.close_code

        refused, answers, close_code = asyncio.run(go())
    assert refused["code"] == ErrorCode.DEADLINE_UNMEETABLE.value and 300.0 < refused["retry_after_ms"] <= 700.0
    # Held back without being decoded: the lie is never seen, each answer repeats the wait.
    held = [a for a in answers if a.get("id", 0) >= 100]
    assert len(held) == IGNORED_RETRY_HINTS_BEFORE_CLOSE
    assert all(a["code"] == ErrorCode.DEADLINE_UNMEETABLE.value and 0 < a["retry_after_ms"] <= refused["retry_after_ms"] for a in held)
    assert close_code == 1013
