"""The sync (thread) and asyncio shells with fake clients, on a fake clock."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from chunkline.broker import AsyncBrokerLoop, Broker, BrokerClosed, BrokerConfig, BrokerConfigError, SyncBrokerLoop, TickRecorder
from chunkline.client.exceptions import ConnectionLost, RequestTimeout, ServerError
from chunkline.client.wire.errors import ErrorCode
from chunkline.safety import FallbackReason, Limits, Mode

DT = 0.02
A = 2


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def reply(obs_time: float, h: int = 50, value: float = 0.0) -> SimpleNamespace:
    acts = np.full((h, A), value, np.float32)
    return SimpleNamespace(id=1, actions=acts, t0=obs_time, dt=DT, expires=obs_time + h * DT, model="m", fingerprint="f", timing={})


class FakeClient:
    """Blocking fake: answers from a script of results (a reply builder or an exception)."""

    def __init__(self, script) -> None:
        self.script = list(script)
        self.calls = []

    def infer(self, obs, *, obs_time, deadline_ms, prefix, timeout, **ids):
        self.calls.append(dict(obs=obs, obs_time=obs_time, deadline_ms=deadline_ms, prefix=prefix, timeout=timeout))
        item = self.script.pop(0) if self.script else (lambda t: reply(t))
        if isinstance(item, BaseException):
            raise item
        return item(obs_time)


def broker() -> Broker:
    lim = Limits(lower=[-1.0] * A, upper=[1.0] * A, max_velocity=2.0, max_acceleration=40.0, dt=DT)
    return Broker(BrokerConfig(control_period_s=DT, error_backoff_s=0.05, reconnect_interval_s=0.1), initial_position=np.zeros(A), limits=lim)


def run_sync(loop: SyncBrokerLoop, clock: Clock, ticks: int) -> list:
    out = []
    for _ in range(ticks):
        out.append(loop.step())
        assert loop.worker.wait_idle(10)  # deterministic: the worker finishes before time moves
        clock.t += DT
    return out


def test_sync_loop_requests_in_a_thread_and_runs_the_policy() -> None:
    clock = Clock()
    client = FakeClient([])
    sent = []
    rec = TickRecorder()
    with SyncBrokerLoop(broker(), client, read_observation=lambda: {"state": np.zeros(A)}, send_command=sent.append, clock=clock, recorder=rec) as loop:
        cmds = run_sync(loop, clock, 30)
        assert loop.worker._thread.name == "chunkline-requests"
    assert len(sent) == 30 == len(rec)
    assert cmds[0].mode is Mode.FALLBACK and cmds[0].request is not None
    assert cmds[-1].mode is Mode.POLICY
    call = client.calls[0]
    assert call["obs_time"] == 0.0 and call["deadline_ms"] == pytest.approx(1000.0)
    assert call["timeout"] == pytest.approx(1.5)
    with pytest.raises(BrokerClosed):
        loop.step()


@pytest.mark.parametrize(
    "exc, reason, code",
    [
        (ServerError(ErrorCode.OVERLOADED, "busy", retry_after_ms=100.0), FallbackReason.SERVER_ERROR, "overloaded"),
        (RequestTimeout("slow"), FallbackReason.SERVER_ERROR, "timeout"),
        (ConnectionLost("gone"), FallbackReason.DISCONNECTED, None),
        (RuntimeError("bug in a custom client"), FallbackReason.SERVER_ERROR, "internal"),
    ],
)
def test_sync_loop_maps_client_failures_to_broker_events(exc, reason, code) -> None:
    clock = Clock()
    client = FakeClient([exc])
    b = broker()
    loop = SyncBrokerLoop(b, client, read_observation=lambda: {"s": 0}, send_command=lambda c: None, clock=clock)
    try:
        cmds = run_sync(loop, clock, 3)
        assert cmds[1].reason is reason
        if code is not None:
            assert b.stats.last_error_code == code
        else:
            assert b.stats.disconnects == 1
        cmds = run_sync(loop, clock, 20)
        assert cmds[-1].mode is Mode.POLICY  # the retry succeeded
    finally:
        loop.close()


def test_sync_loop_with_a_custom_request_function() -> None:
    clock = Clock()
    seen = threading.Event()

    def request(intent):
        seen.set()
        from chunkline.broker import ActionChunk

        return ActionChunk(np.zeros((10, A), np.float32), intent.obs_time, DT, None, intent.request_id, clock())

    with SyncBrokerLoop(broker(), request=request, read_observation=lambda: {}, send_command=lambda c: None, clock=clock) as loop:
        run_sync(loop, clock, 5)
    assert seen.is_set()
    with pytest.raises(BrokerConfigError):
        SyncBrokerLoop(broker(), read_observation=lambda: {}, send_command=lambda c: None)


class FakeAsyncClient:
    def __init__(self, script) -> None:
        self.script = list(script)
        self.calls = 0

    async def infer(self, obs, *, obs_time, deadline_ms, prefix, timeout, **ids):
        self.calls += 1
        await asyncio.sleep(0)
        item = self.script.pop(0) if self.script else (lambda t: reply(t))
        if isinstance(item, BaseException):
            raise item
        return item(obs_time)


def test_async_loop() -> None:
    async def main():
        clock = Clock()
        client = FakeAsyncClient([ServerError("policy_failed", "boom")])
        sent = []

        async def read():
            return {"state": np.zeros(A)}

        loop = AsyncBrokerLoop(broker(), client, read_observation=read, send_command=sent.append, clock=clock, recorder=TickRecorder())
        cmds = []
        for _ in range(25):
            cmds.append(await loop.step())
            await loop.wait_idle()
            clock.t += DT
        await loop.close()
        with pytest.raises(BrokerClosed):
            await loop.step()
        return cmds, client, sent

    cmds, client, sent = asyncio.run(main())
    assert client.calls >= 2 and len(sent) == 25
    assert cmds[1].reason is FallbackReason.SERVER_ERROR
    assert cmds[-1].mode is Mode.POLICY


class SleepClock(Clock):
    def sleep(self, s: float) -> None:
        self.t += s

    async def asleep(self, s: float) -> None:
        self.t += s


def test_sync_loop_run_drives_ticks_at_the_control_period() -> None:
    from chunkline.broker import SyncRunner

    clock = SleepClock()
    rec = TickRecorder()
    with SyncBrokerLoop(broker(), FakeClient([]), read_observation=lambda: {}, send_command=lambda c: None, clock=clock, recorder=rec) as loop:
        stats = loop.run(max_ticks=20, runner=SyncRunner(DT, clock=clock, sleep=clock.sleep))
    assert stats.count == 20 == len(rec)
    cols = rec.arrays()
    np.testing.assert_allclose(np.diff(cols["scheduled"]), DT)
    assert (cols["jitter_s"] == 0).all()


def test_async_loop_run() -> None:
    from chunkline.broker import AsyncRunner

    async def main():
        clock = SleepClock()
        loop = AsyncBrokerLoop(broker(), FakeAsyncClient([]), read_observation=lambda: {}, send_command=lambda c: None, clock=clock)
        stats = await loop.run(max_ticks=15, runner=AsyncRunner(DT, clock=clock, sleep=clock.asleep))
        await loop.close()
        return stats

    assert asyncio.run(main()).count == 15
