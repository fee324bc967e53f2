"""Refreshing the queued request (broker/refresh.py) on an injected clock: once a period, while
the server is saturated, from an observation two periods old, once the request has been out a
median round trip; ``superseded`` and ``replace_missed`` settle it without an error; the chunk's
age and round trip follow the chain."""

from __future__ import annotations

import numpy as np
import pytest

from chunkline.broker import ActionChunk, Broker, BrokerConfig
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
