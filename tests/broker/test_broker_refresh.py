"""Refreshing the queued request (broker/refresh.py) on an injected clock: once a period, while
the server is saturated, from an observation two periods old, once the request has been out a
median round trip; ``superseded`` and ``replace_missed`` settle it without an error; the chunk's
age and round trip follow the chain."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.broker import ActionChunk, Broker, BrokerConfig
from chunkline.broker.messages import BrokerStats
from chunkline.broker.refresh import Refresher
from chunkline.broker.sim import ReferencePolicy, ScriptedServer, simulate

P = 0.05


def _broker(**kw: object) -> Broker:
    # initial_latency_s: the median round trip before any is measured (a refresh waits that long)
    cfg = BrokerConfig(**{"control_period_s": P, "refresh_queued": True, "initial_latency_s": 2 * P, **kw})  # type: ignore[arg-type]
    return Broker(cfg, initial_position=np.zeros(2), limits=None, verify_fallback=False)


def _tick(b: Broker, k: int) -> object:
    return b.tick(k * P, {"state": np.full(2, float(k), np.float32)}, obs_time=k * P)


def test_a_waiting_request_is_refreshed_once_a_period_until_a_refresh_misses() -> None:
    b = _broker()
    first = _tick(b, 0).request  # saturated until a reply says otherwise: one request in flight
    assert first is not None and first.replaces is None
    b.on_sent(first.request_id, 0.0)
    assert _tick(b, 1).request is None  # a period old, out less than a round trip: it may run already
    second = _tick(b, 2).request
    assert second is not None and second.replaces == first.request_id and second.obs_time == pytest.approx(2 * P)
    b.on_sent(second.request_id, 2 * P)
    assert _tick(b, 3).request is None  # the first one's answer (superseded) has not come: both count
    b.on_error(3.1 * P, request_id=first.request_id, code="superseded")
    assert b.in_flight_ids == (second.request_id,) and b.stats.errors == 0
    # A refresh, too, is refreshed once out a median round trip with an observation two periods old.
    third = _tick(b, 4).request
    assert third is not None and third.replaces == second.request_id
    b.on_sent(third.request_id, 4 * P)
    b.on_error(4.1 * P, request_id=third.request_id, code="replace_missed")  # the second one runs
    assert b.in_flight_ids == (second.request_id,) and b.stats.errors == 0 and b.stats.refreshes_missed == 1
    assert all(_tick(b, k).request is None for k in range(5, 9))  # that chain is not refreshed again
    # Its chunk answers the second observation: ages from it, the round trip from the chain's first send.
    chunk = ActionChunk(np.zeros((10, 2), np.float32), 2 * P, P, 12 * P, request_id=second.request_id, received_at=9 * P)
    b.on_chunk(chunk, 9 * P)
    assert b.latency.last == pytest.approx(9 * P)
    cmd = _tick(b, 10)
    assert cmd.chunk_id == second.request_id
    assert b.stats.requests_refreshed == 2




@pytest.mark.parametrize(("queued_s", "refreshed"), [(0.004, False), (0.06, False), (0.099, False), (0.1, True), (0.2, True)])
def test_a_robot_the_server_serves_within_two_periods_does_not_refresh(queued_s: float, refreshed: bool) -> None:
    # Its observations do not age in the queue: a replacement would only move its cycle off the one
    # the server plans its batches around. One whose replies queue two periods or more refreshes.
    r = Refresher(P, True, BrokerStats())
    flights = {7: (0.0, 0.0)}  # sent at 0 from an observation at 0
    assert r.due(3 * P, flights, saturated=True, usual_wait=0.1) == 7  # no reply yet: as before
    for _ in range(5):
        r.on_reply({"queue_ms": 500 * queued_s, "batch_wait_ms": 500 * queued_s, "infer_ms": 73.0})
    r.on_reply({"queue_ms": 1000.0})  # one slow reply does not move the usual queueing
    assert (r.due(3 * P, flights, saturated=True, usual_wait=0.1) == 7) is refreshed

def test_no_refresh_with_room_on_the_server_or_when_turned_off() -> None:
    for b in (_broker(pace_under_load=False), _broker(refresh_queued=False)):
        first = _tick(b, 0).request
        assert first is not None
        b.on_sent(first.request_id, 0.0)
        for k in range(1, 8):
            r = _tick(b, k).request
            assert r is None or r.replaces is None
        assert b.stats.requests_refreshed == 0


def test_a_server_that_queues_nothing_misses_every_refresh_and_the_robot_runs_on() -> None:
    # The broker's own simulated server runs each request at once: a refresh always misses, and
    # the chain's answer is taken as without refreshing.
    server = ScriptedServer(policy=ReferencePolicy(lambda t: np.array([t, -t]), P, 10, step=0.01), dt=P,
                            latency=lambda i, t: 0.3)
    on, off = (simulate(b, server, duration_s=3.0) for b in (_broker(), _broker(refresh_queued=False)))
    assert on.broker.stats.refreshes_missed == on.broker.stats.requests_refreshed > 0
    assert on.policy_fraction == pytest.approx(off.policy_fraction, abs=0.05)


def _run_against_a_queueing_server(service: float, net: float, others: list[float], duration: float = 3.0) -> Broker:
    """One broker against a one-lane FIFO server that honours ``replaces``, sharing the lane with
    other work (``others``: when blocks of one ``service`` each arrive). Checks every invariant
    of refreshing on the way; returns the broker."""
    import heapq

    b = _broker(initial_latency_s=0.1)
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    for t in others:
        push(t, "other", None)
    queue: list[list[object]] = []  # [request id or None (other work), obs_time, arrived]
    free_at = 0.0
    chunks: dict[int, float] = {}  # request id answered with a chunk -> its observation's time
    answered: set[int] = set()
    obs_of: dict[int, float] = {}
    last_refresh = -1.0
    chain_start: dict[int, float] = {}  # request id -> its chain's first send
    k = 0
    while k * P <= duration:
        now = k * P
        while events and events[0][0] <= now:
            t, _, kind, payload = heapq.heappop(events)
            if kind == "other":
                queue.append([None, 0.0, t])
            elif kind == "arrive":
                rid, replaces = payload  # type: ignore[misc]
                place = next((q for q in queue if q[0] == replaces), None) if replaces is not None else None
                if replaces is None:
                    queue.append([rid, obs_of[rid], t])
                elif place is None:
                    push(t + net, "error", (rid, "replace_missed"))
                else:
                    place[0], place[1] = rid, obs_of[rid]  # in its place, the newer observation
                    push(t + net, "error", (replaces, "superseded"))
            elif kind == "error":
                rid, code = payload  # type: ignore[misc]
                assert rid not in answered
                answered.add(rid)
                b.on_error(t, request_id=rid, code=code)
            elif kind == "chunk":
                rid, obs_time, wait = payload  # type: ignore[misc]
                assert rid not in answered
                answered.add(rid)
                chunks[rid] = obs_time
                timing = {"queue_ms": 1000 * wait, "infer_ms": 1000 * service, "batch_size": 1.0, "backlog": float(len(queue))}
                b.on_chunk(ActionChunk(np.zeros((10, 2), np.float32), obs_time, P, obs_time + 10 * P, request_id=rid,
                                       received_at=t, timing=timing), t)
                if t - chain_start[rid] < b.config.request_timeout_s - 0.1:  # (a timed-out one is no round trip)
                    assert b.latency.last == pytest.approx(t - chain_start[rid])  # from the chain's first send
            if queue and free_at <= t:  # the lane takes the head as soon as it is free, as it is then
                rid, obs_time, arrived = queue.pop(0)
                free_at = t + service
                push(free_at, "free", None)
                if rid is not None:
                    push(free_at + net, "chunk", (rid, obs_time, t - arrived))
        cmd = _tick(b, k)
        r = cmd.request
        if r is not None:
            if r.replaces is not None:
                assert b.in_flight_ids == (r.replaces,)  # only the one in flight, never another
                assert now - last_refresh >= P - 1e-9  # once a period at most
                last_refresh = now
            obs_of[r.request_id] = r.obs_time
            chain_start[r.request_id] = chain_start[r.replaces] if r.replaces is not None else now
            b.on_sent(r.request_id, now)
            push(now + net, "arrive", (r.request_id, r.replaces))
        k += 1
    # Every request the server took answered once: one chunk per chain, from its newest observation.
    assert b.stats.errors == 0
    assert set(chunks) <= set(obs_of)
    return b


@settings(max_examples=60, deadline=None)
@given(service=st.floats(0.02, 0.3), net=st.floats(0.0005, 0.03),
       others=st.lists(st.floats(0.0, 3.0), max_size=25))
def test_property_refreshing_against_a_queueing_server(service: float, net: float, others: list[float]) -> None:
    b = _run_against_a_queueing_server(service, net, sorted(others))
    assert b.stats.refreshes_missed <= b.stats.requests_refreshed


def test_a_request_queued_behind_others_is_answered_from_a_fresher_observation() -> None:
    # Fifteen blocks of others' work ahead of the first request: it waits ~1.5 s, refreshed meanwhile.
    b = _run_against_a_queueing_server(0.1, 0.005, [0.0] * 15, duration=2.5)
    assert b.stats.requests_refreshed > 3 and b.stats.chunks_received >= 1
    assert b.stats.refreshes_missed < b.stats.requests_refreshed // 2


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_async_shell_sends_a_refresh_by_the_brokers_ids() -> None:
    import asyncio

    from chunkline.broker import AsyncBrokerLoop

    calls: list[dict[str, object]] = []

    class Waiting:  # a server whose queue never moves: every request waits
        async def infer(self, obs: object, **kw: object) -> object:
            calls.append(kw)
            await asyncio.Event().wait()

    async def main() -> None:
        clock = _Clock()
        loop = AsyncBrokerLoop(_broker(), Waiting(), read_observation=lambda: {"state": np.zeros(2, np.float32)},
                               send_command=lambda c: None, clock=clock)
        for _ in range(4):
            await loop.step()
            await asyncio.sleep(0)
            clock.t += P
        await loop.close()

    asyncio.run(main())
    assert [(c.get("request_id"), c.get("replaces")) for c in calls] == [(1, None), (2, 1)]


def test_the_threaded_shell_one_request_at_a_time_never_sends_a_refresh() -> None:
    import threading

    from chunkline.broker import SyncBrokerLoop

    release, took = threading.Event(), threading.Event()
    taken: list[int] = []

    def request(intent: object) -> ActionChunk:
        taken.append(intent.request_id)  # type: ignore[attr-defined]
        took.set()
        release.wait(5.0)
        raise TimeoutError("not answered")

    clock = _Clock()
    b = _broker()
    with SyncBrokerLoop(b, request=request, read_observation=lambda: {"state": np.zeros(2, np.float32)},
                        send_command=lambda c: None, clock=clock) as loop:
        for k in range(6):
            loop.step()
            if k == 0:
                assert took.wait(5.0)  # the worker has it (its "sent" reaches the broker at the next step)
            clock.t += P
        release.set()
    assert taken == [1] and b.stats.requests_refreshed >= 1 and b.stats.refreshes_missed == b.stats.requests_refreshed
