"""Fixed-rate runners (on a fake clock) and the per-tick record files."""

from __future__ import annotations

import asyncio
import math
import threading

import numpy as np
import pytest

from chunkline.broker import (
    AsyncRunner,
    Broker,
    BrokerConfig,
    BrokerConfigError,
    RateScheduler,
    SyncRunner,
    TickRecorder,
    load_jsonl,
    load_npz,
)
from chunkline.broker.sim import ReferencePolicy, ScriptedServer, simulate
from chunkline.safety import Limits


class FakeClock:
    """A clock that only moves when slept on (plus a scripted extra delay per sleep)."""

    def __init__(self, delays=None) -> None:
        self.t = 100.0
        self.delays = list(delays or [])
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s + (self.delays.pop(0) if self.delays else 0.0)

    async def asleep(self, s: float) -> None:
        self.sleep(s)


def test_scheduler_is_drift_free_and_skips_overrun_slots() -> None:
    s = RateScheduler(0.01, start=0.0)
    a = s.wake(0.0002)
    assert (a.index, a.skipped) == (0, 0) and a.jitter == pytest.approx(0.0002)
    assert s.next_due == pytest.approx(0.01)  # not 0.0102: no drift
    b = s.wake(0.0101)
    assert b.index == 1 and b.jitter == pytest.approx(0.0001)
    # The next tick overran: woke at 0.0475, slots 2 and 3 passed.
    c = s.wake(0.0475)
    assert (c.index, c.skipped) == (4, 2) and c.scheduled == pytest.approx(0.04)
    assert s.next_due == pytest.approx(0.05)
    assert s.stats.count == 3 and s.stats.skipped == 2
    assert s.stats.max == pytest.approx(0.0075)
    with pytest.raises(BrokerConfigError):
        RateScheduler(0.0, 0.0)


def test_sync_runner_on_a_fake_clock_measures_jitter() -> None:
    clock = FakeClock(delays=[0.0, 0.001, 0.0, 0.0005] + [0.0] * 10)
    runner = SyncRunner(0.02, clock=clock, sleep=clock.sleep)
    seen = []
    stats = runner.run(lambda info: seen.append(info), max_ticks=6)
    assert [i.index for i in seen] == list(range(6))
    assert [round(i.scheduled - 100.0, 6) for i in seen] == [0.0, 0.02, 0.04, 0.06, 0.08, 0.1]
    assert stats.count == 6 and stats.max == pytest.approx(0.001)
    assert stats.summary()["ticks"] == 6


def test_sync_runner_stops_on_false_duration_and_event() -> None:
    clock = FakeClock()
    runner = SyncRunner(0.01, clock=clock, sleep=clock.sleep)
    assert runner.run(lambda info: info.index < 3).count == 4
    assert runner.run(lambda info: None, duration_s=0.1).count == 10
    stop = threading.Event()

    def step(info):
        if info.index == 2:
            stop.set()

    assert runner.run(step, stop=stop).count == 3


def test_sync_runner_thread_flavour() -> None:
    clock = FakeClock()
    runner = SyncRunner(0.01, clock=clock, sleep=clock.sleep)
    done = []
    thread = runner.start_thread(lambda info: done.append(info.index), max_ticks=5)
    thread.join(10)
    assert not thread.is_alive() and done == [0, 1, 2, 3, 4]


def test_async_runner_awaits_async_steps() -> None:
    clock = FakeClock(delays=[0.002])
    runner = AsyncRunner(0.05, clock=clock, sleep=clock.asleep)
    seen = []

    async def step(info):
        seen.append(info.index)
        return None if info.index < 4 else False

    stats = asyncio.run(runner.run(step))
    assert seen == [0, 1, 2, 3, 4] and stats.count == 5
    assert stats.max == pytest.approx(0.002)


def _broker() -> Broker:
    lim = Limits(lower=[-1.0, -1.0], upper=[1.0, 1.0], max_velocity=2.0, max_acceleration=40.0, dt=0.02)
    return Broker(BrokerConfig(control_period_s=0.02), initial_position=np.zeros(2), limits=lim)


def _record(keep_actions: bool = True, max_ticks=None) -> TickRecorder:
    rec = TickRecorder(keep_actions=keep_actions, max_ticks=max_ticks)
    ref = lambda t: 0.3 * np.array([math.sin(t), math.cos(t) - 1])  # noqa: E731
    server = ScriptedServer(policy=ReferencePolicy(ref, 0.02, 50, 0.02), dt=0.02, latency=lambda i, t: 0.05, outages=[(1.0, 2.2)])
    simulate(_broker(), server, duration_s=3.0, on_tick=rec.append)
    return rec


def test_recorder_saves_jsonl_and_npz(tmp_path) -> None:
    rec = _record()
    assert len(rec) == 150
    rec.save(tmp_path / "ticks.jsonl")
    rows = load_jsonl(tmp_path / "ticks.jsonl")
    assert len(rows) == 150 and set(rows[0]) >= {"t", "mode", "reason", "chunk_id", "action_age_s", "latency_s", "action"}
    assert rows[0]["mode"] == "fallback" and rows[0]["reason"] == "no_chunk" and rows[0]["request_id"] == 1
    modes = {r["mode"] for r in rows}
    assert modes == {"fallback", "resuming", "policy"}
    assert any(r["reason"] == "disconnected" for r in rows)
    policy_rows = [r for r in rows if r["mode"] == "policy"]
    assert policy_rows and all(r["latency_s"] == pytest.approx(0.05) for r in policy_rows)
    rec.save(tmp_path / "ticks.npz")
    cols = load_npz(tmp_path / "ticks.npz")
    assert cols["action"].shape == (150, 2) and cols["t"].shape == (150,)
    assert cols["mode"][0] == "fallback" and np.isnan(cols["action_age_s"][0])
    np.testing.assert_allclose(cols["action"][5], rows[5]["action"])


def test_recorder_can_cap_and_skip_actions() -> None:
    rec = _record(keep_actions=False, max_ticks=30)
    assert len(rec) == 30
    assert "action" not in rec.arrays()
    assert rec.arrays()["t"][0] == pytest.approx(2.4)
