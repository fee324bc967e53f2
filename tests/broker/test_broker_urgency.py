"""The ``infer`` message's urgency: validated at the boundary, carried by the client, filled by
the broker, refused by a real server (typed, with the request id) when it lies."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from chunkline.bench.serverproc import ServerProcess
from chunkline.broker import ActionChunk, Broker, BrokerConfig, MergeMode, RequestIntent
from chunkline.client import ClientCore, ErrorCode, ProtocolError
from chunkline.client.wire.codec import decode
from chunkline.client.wire.protocol import Infer, Urgency, parse_client_message

GOOD = {"dry_in_ms": 120.0, "rows": 8, "period_ms": 50.0}


def _infer(urgency: object) -> dict[str, object]:
    return {"type": "infer", "id": 7, "obs": {}, "urgency": urgency}


def test_a_valid_urgency_parses_and_is_optional() -> None:
    msg = parse_client_message(_infer(GOOD))
    assert isinstance(msg, Infer) and msg.urgency == Urgency(**GOOD)
    assert parse_client_message({"type": "infer", "id": 1, "obs": {}}).urgency is None  # type: ignore[union-attr]
    assert Urgency(dry_in_ms=0, rows=1, period_ms=1).wire() == {"dry_in_ms": 0.0, "rows": 1, "period_ms": 1.0}


@pytest.mark.parametrize("field, value", [
    ("dry_in_ms", -1.0), ("dry_in_ms", math.nan), ("dry_in_ms", math.inf), ("dry_in_ms", 1e12), ("dry_in_ms", "5"),
    ("rows", 0), ("rows", 2.5), ("rows", True), ("rows", 10**9),
    ("period_ms", 0.0), ("period_ms", -5.0), ("period_ms", math.nan), ("period_ms", 1e9),
])
def test_urgency_that_lies_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ProtocolError, match=f"urgency.{field}"):
        parse_client_message(_infer({**GOOD, field: value}))


def test_urgency_needs_exactly_its_three_fields() -> None:
    for bad in ({"dry_in_ms": 1.0, "rows": 1}, {**GOOD, "deadline_ms": 5.0}, [1, 2, 3]):
        with pytest.raises(ProtocolError, match="urgency"):
            parse_client_message(_infer(bad))


def test_the_client_core_carries_it() -> None:
    core = ClientCore("ws://127.0.0.1:1", clock=lambda: 0.0)
    out = core.start_infer({}, 1.0, 500.0, None, None, urgency=Urgency(**GOOD))
    assert decode(out.data)["urgency"] == GOOD
    assert "urgency" not in decode(core.start_infer({}, 1.0, None, None, None).data)


def test_the_broker_fills_it_from_its_plan_once_it_knows_a_chunk() -> None:
    period = 0.05
    b = Broker(BrokerConfig(control_period_s=period, merge=MergeMode.REPLACE), initial_position=np.zeros(2), limits=None,
               verify_fallback=False)
    first = b.tick(0.0, {"s": 0}).request
    assert first is not None and first.urgency is None  # no chunk yet: the rows are unknown
    b.on_sent(first.request_id, 0.0)
    b.on_chunk(ActionChunk(np.zeros((10, 2)), 0.0, period, 0.5, request_id=first.request_id), 0.1)
    t, req = 0.1, None
    while req is None:
        t = round(t + period, 9)
        req = b.tick(t, {"s": 1}).request
    u = req.urgency
    assert u is not None and u.period_ms == pytest.approx(50.0) and u.rows >= 1
    # Time from the request until the plan runs dry, and its rows: what is left of a chunk's
    # coverage (0.5 s) once the expected round trip has passed.
    assert u.dry_in_ms == pytest.approx(1000.0 * (0.5 - t), abs=1e-6)
    assert u.rows == int((0.5 - b.latency.estimate) / period + 1e-9)
    Urgency.model_validate(u.wire())  # within the protocol's bounds


def test_a_real_server_refuses_a_lying_urgency_with_the_request_id(server_process: Callable[..., ServerProcess]) -> None:
    from chunkline.client import Client, ServerError

    server = server_process(["--policy", "chunkline.bench.fleet_contention.policy:latency_curve", "--policy-arg", "curve_ms=1"])
    with Client.connect(server.uri) as client:
        obs = {"state": np.zeros(2, np.float32)}
        ok = client.infer(obs, obs_time=1.0, urgency=Urgency(**GOOD))
        assert ok.actions.shape[0] > 0
        bad = Urgency.model_construct(dry_in_ms=-5.0, rows=3, period_ms=20.0)  # a client that skips validation
        with pytest.raises(ServerError) as err:
            client.infer(obs, obs_time=2.0, urgency=bad)
        assert err.value.code is ErrorCode.INVALID_MESSAGE and "urgency.dry_in_ms" in str(err.value)
        assert err.value.request_id is not None


def test_a_paced_request_asked_ahead_counts_the_rows_after_its_frozen_prefix() -> None:
    from chunkline.broker.pacing import urgency_for

    # Asked from a hold: every row a chunk covers; ahead of one: those after the frozen rows; else
    # those left after the expected round trip.
    assert urgency_for(0.5, 0.0, 0.2, 0.05, holding=True).rows == 10
    u = urgency_for(0.5, 0.1, 0.2, 0.05, holding=True, frozen=2)
    assert u is not None and u.rows == 8 and u.dry_in_ms == pytest.approx(100.0)
    assert urgency_for(0.5, 0.1, 0.2, 0.05, holding=False).rows == 6
    # A first reply that queued behind others: saturated, paced; the plan is asked for ahead of its end.
    req = _paced_request(BrokerConfig(control_period_s=0.05))
    assert req.prefix is not None
    lead = len(req.prefix)  # every row of the prefix runs before the answer: all frozen
    assert req.prefix_delay == lead and req.urgency is not None and req.urgency.rows == 10 - lead


@pytest.mark.parametrize("early", [0.0005, 0.002])
@pytest.mark.parametrize("lead_s", [None, 0.0])
def test_a_paced_request_asked_a_tick_ahead_of_the_plans_grid_still_counts_as_asked_ahead(early: float,
                                                                                          lead_s: float | None) -> None:
    # Ticks jitter: the plan sits on the grid of a later tick than the one that asks. The default
    # lead takes the row due a hair later; with none, the row running is due a period earlier and
    # the prefix holds one row more than the lead. Every prefix row runs before the answer either
    # way: the answer resumes after them.
    config = BrokerConfig(control_period_s=0.05, lead_s=lead_s)
    req = _paced_request(config, early)
    rows = config.paced_lead_rows + (lead_s == 0.0)
    assert req.prefix is not None and len(req.prefix) == rows == req.prefix_delay
    assert req.urgency is not None and req.urgency.rows == 10 - rows


def _paced_request(config: BrokerConfig, early: float = 0.0) -> RequestIntent:
    """The request a broker sends after a first reply that queued 300 ms behind others (saturated,
    so paced), its ticks ``early`` ahead of the plan's grid; the plan's 10 rows start at 0."""
    period = config.control_period_s
    b = Broker(config, initial_position=np.zeros(2), limits=None, verify_fallback=False)
    first = b.tick(0.0, {"s": 0}).request
    assert first is not None
    b.on_sent(first.request_id, 0.0)
    b.on_chunk(ActionChunk(np.zeros((10, 2)), 0.0, period, 0.5, request_id=first.request_id,
                           timing={"queue_ms": 300.0, "infer_ms": 140.0, "batch_size": 3.0}), 0.3)
    t, req = 0.3, None
    while req is None:
        t = round(t + period, 9)
        req = b.tick(t - early, {"s": 1}).request
    return req
