"""The sans-I/O client core: ids, messages, reply matching, refusals and reconnect decisions, on a fake clock."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import websockets
from websockets.datastructures import Headers
from websockets.http11 import Response

from chunkline.client import Backoff, ClientCore, ConnectionLost, ErrorCode, ProtocolError, ServerError
from chunkline.client.wire.codec import decode, encode


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _core(clock: FakeClock, **kwargs: object) -> ClientCore:
    return ClientCore("ws://127.0.0.1:1", clock=clock, **kwargs)  # type: ignore[arg-type]


def _hello() -> bytes:
    return encode({"type": "hello", "server": "t", "session": "s", "default_model": "m", "models": {"m": {}}})


def _chunk(request_id: object, actions: np.ndarray | None = None) -> bytes:
    acts = np.zeros((4, 2), np.float32) if actions is None else actions
    return encode({"type": "chunk", "id": request_id, "actions": acts, "t0": 1.0, "dt": 0.02, "expires": 1.1,
                   "model": "m", "fingerprint": "f", "timing": {"server_ms": 2.0}})


def test_infer_messages_carry_fresh_ids_and_only_the_fields_set() -> None:
    core = _core(FakeClock())
    first = core.start_infer({"x": np.ones(2)}, 1.5, None, None, None)
    second = core.start_infer({}, None, 250, "m", np.zeros((1, 2), np.float32))
    assert (first.request_id, second.request_id) == (1, 2)
    msg = decode(first.data)
    assert msg["type"] == "infer" and msg["id"] == 1 and msg["obs_time"] == 1.5
    assert not {"deadline_ms", "model", "prefix"} & set(msg)
    msg = decode(second.data)
    assert msg["deadline_ms"] == 250.0 and msg["model"] == "m" and msg["prefix"].shape == (1, 2)
    assert sorted(core.pending_ids()) == [1, 2]
    assert decode(core.cancel_message(2)) == {"type": "cancel", "id": 2}


def test_a_chunk_answers_its_request_with_the_clients_timing() -> None:
    clock = FakeClock()
    core = _core(clock)
    out = core.start_infer({}, 0.0, 100, None, None)
    core.sending(out.request_id)
    clock.now += 0.001
    core.sent(out.request_id)
    clock.now += 0.050
    answer = core.receive(_chunk(out.request_id))
    assert answer is not None and answer.request_id == out.request_id
    chunk = answer.result()
    assert chunk.actions.shape == (4, 2) and chunk.received_at == clock.now
    assert chunk.client_timing["send_ms"] == 1.0 and chunk.client_timing["round_trip_ms"] == 51.0
    assert {"encode_ms", "decode_ms"} <= set(chunk.client_timing)
    assert chunk.as_openpi()["server_timing"] == {"server_ms": 2.0}
    assert "actions=float32[4x2]" in repr(chunk) and len(repr(chunk)) < 200


def test_refusals_become_server_errors_with_retry_after() -> None:
    core = _core(FakeClock())
    out = core.start_infer({}, None, None, None, None)
    answer = core.receive(encode({"type": "error", "id": out.request_id, "code": "overloaded", "message": "busy",
                                  "retry_after_ms": 40.0}))
    assert answer is not None
    with pytest.raises(ServerError) as info:
        answer.result()
    assert info.value.code is ErrorCode.OVERLOADED and info.value.retry_after_ms == 40.0
    assert info.value.request_id == out.request_id


def test_what_answers_no_pending_request_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    core = _core(FakeClock())
    out = core.start_infer({}, None, None, None, None)
    core.forget(out.request_id)
    assert core.receive(_chunk(out.request_id)) is None  # a late reply
    assert core.receive(_chunk(99)) is None  # never asked
    assert core.receive(_hello()) is None
    with caplog.at_level(logging.WARNING, logger="chunkline.client"):
        assert core.receive(encode({"type": "error", "id": None, "code": "internal", "message": "x"})) is None
        assert core.receive(b"\xc1") is None
        assert core.receive("text") is None
    assert len(caplog.records) == 3


def test_a_text_message_or_a_bad_shape_fails_the_request_instead_of_crashing() -> None:
    core = _core(FakeClock())
    a = core.start_infer({}, None, None, None, None)
    b = core.start_infer({}, None, None, None, None)
    answer = core.receive(encode({"type": "token", "id": a.request_id, "text": "hi", "index": 0, "tokens": 1}))
    assert answer is not None and isinstance(answer.error, ProtocolError)
    answer = core.receive(_chunk(b.request_id, np.zeros(3, np.float32)))
    assert answer is not None and isinstance(answer.error, ProtocolError)


def test_hello_first_and_it_resets_the_backoff() -> None:
    backoff = Backoff(initial=0.1, maximum=1.0, jitter=0.0, rng=random.Random(0))
    core = _core(FakeClock(), backoff=backoff)
    backoff.next_delay()
    with pytest.raises(ProtocolError):
        core.on_connected(_chunk(1))
    assert backoff.attempts == 1
    hello = core.on_connected(_hello())
    assert core.hello is hello and hello.default_model == "m" and backoff.attempts == 0


def test_reconnect_delays_grow_until_the_deadline() -> None:
    clock = FakeClock()
    core = _core(clock, backoff=Backoff(initial=0.1, maximum=1.0, jitter=0.0), connect_timeout=1.0)
    give_up = core.connect_deadline()
    delays = []
    with pytest.raises(ConnectionLost, match="could not connect"):
        for _ in range(10):
            delays.append(core.retry_delay(give_up, OSError("refused")))
            clock.now += delays[-1]
    assert delays == [0.1, 0.2, 0.4] and clock.now <= give_up


def test_handshake_refusals_and_timeouts() -> None:
    core = _core(FakeClock(), request_timeout=None)
    refused = websockets.InvalidStatus(Response(429, "Too Many", Headers({"Retry-After": "3"}), b"slow down"))
    error = core.refusal(refused)
    assert error is not None and error.code is ErrorCode.QUOTA_EXCEEDED and error.retry_after_ms == 3000.0
    assert core.refusal(websockets.InvalidStatus(Response(503, "Unavailable", Headers(), b""))) is None
    assert core.reply_timeout(None, None) == 30.0 and core.reply_timeout(500, None) == 1.5
    assert core.reply_timeout(500, 2.0) == 2.0
    core.close()
    with pytest.raises(ConnectionLost):
        core.check_open()


# ----------------------------------------------------------------------------- retry_after_ms is honoured


def _refusal(request_id: int, code: str = "overloaded", retry_after_ms: float | None = 200.0) -> bytes:
    msg: dict[str, object] = {"type": "error", "id": request_id, "code": code, "message": "queue for 'm' is full"}
    if retry_after_ms is not None:
        msg["retry_after_ms"] = retry_after_ms
    return encode(msg)


def test_a_refusal_with_a_retry_time_holds_that_models_requests_back_locally() -> None:
    clock = FakeClock()
    core = _core(clock)
    first = core.start_infer({}, None, 100, "m", None)
    answer = core.receive(_refusal(first.request_id))
    assert answer is not None and isinstance(answer.error, ServerError)
    clock.now += 0.150
    with pytest.raises(ServerError) as held:  # nothing is encoded or sent inside the window
        core.start_infer({}, None, 100, "m", None)
    assert held.value.code == ErrorCode.OVERLOADED and held.value.retry_after_ms == pytest.approx(50.0)
    assert "queue for 'm' is full" in held.value.message and "not sent" in held.value.message
    assert core.pending_ids() == [first.request_id]  # the refused one until its shell forgets it; nothing new
    core.start_infer({}, None, 100, "other", None)  # another model is not held
    clock.now += 0.051
    assert decode(core.start_infer({}, None, 100, "m", None).data)["model"] == "m"


def test_refusals_without_a_retry_time_or_with_the_hold_turned_off_hold_nothing() -> None:
    clock = FakeClock()
    for core, retry in ((_core(clock), None), (_core(clock, honour_retry_after=False), 500.0)):
        out = core.start_infer({}, None, 100, None, None)
        core.receive(_refusal(out.request_id, "deadline_unmeetable", retry))
        core.start_infer({}, None, 100, None, None)  # sent at once


def _plan_reply(request_id: object) -> bytes:
    return encode({"type": "plan_reply", "id": request_id, "plan_id": "p9", "planner": "m", "fingerprint": "f",
                   "plan": {"steps": []}, "valid_for": 10.0, "timing": {"server_ms": 3.0}})


def test_a_plan_is_answered_by_a_plan_reply_only_and_its_hold_is_apart_from_the_models() -> None:
    clock = FakeClock()
    core = _core(clock)
    out = core.start_plan({"x": np.ones(2)}, 4.0, "tidy up", {"plan_id": "p1"}, 2000, "m")
    msg = decode(out.data)
    assert msg["type"] == "plan" and msg["instruction"] == "tidy up" and msg["context"] == {"plan_id": "p1"}
    assert msg["planner"] == "m" and msg["deadline_ms"] == 2000.0 and msg["obs_time"] == 4.0
    core.sending(out.request_id)
    clock.now += 0.25
    answer = core.receive(_plan_reply(out.request_id))
    assert answer is not None and answer.plan_result().plan_id == "p9" and answer.plan_result().timing["round_trip_ms"] == 250.0
    # A chunk cannot answer a plan, nor a plan_reply an infer.
    bad = core.start_plan({}, None, "", None, None, None)
    answer = core.receive(_chunk(bad.request_id))
    assert answer is not None and isinstance(answer.error, ProtocolError)
    infer = core.start_infer({}, None, None, "m", None)
    answer = core.receive(_plan_reply(infer.request_id))
    assert answer is not None and isinstance(answer.error, ProtocolError)
    # A refusal with retry_after holds that planner's plans, not the model of the same name.
    refused = core.start_plan({}, None, "", None, None, "m")
    core.receive(encode({"type": "error", "id": refused.request_id, "code": "overloaded", "message": "busy", "retry_after_ms": 500.0}))
    with pytest.raises(ServerError, match="not sent"):
        core.start_plan({}, None, "", None, None, "m")
    core.start_infer({}, None, None, "m", None)
    clock.now += 0.5
    core.start_plan({}, None, "", None, None, "m")  # the hold has passed
