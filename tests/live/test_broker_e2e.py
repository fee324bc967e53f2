"""End to end: broker shells and the openpi drop-in against a real server on loopback.

Timing here is real (a real server, real sockets), so the assertions are about behaviour,
never about how fast: generous limits only guard against hangs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import aloha_obs

from chunkline.bench.serverproc import ServerProcess
from chunkline.broker import AsyncBrokerLoop, Broker, BrokerConfig, SyncBrokerLoop, TickRecorder
from chunkline.broker.openpi_compat import ActionChunkBroker
from chunkline.client import AsyncClient, Client
from chunkline.client.openpi import WebsocketClientPolicy
from chunkline.safety import Limits, Mode, MotionState

DT = 0.02
A = 14
GIVE_UP_S = 30.0  # a hang guard, not a performance threshold


@pytest.fixture(scope="module")
def slow_server() -> Iterator[ServerProcess]:
    """A server whose policy takes 1.3 s: longer than its chunks stay valid (50 x 20 ms)."""
    with ServerProcess(["--policy", "sleep:1.3", "--shutdown-grace", "5"]) as server:
        yield server


def make_broker() -> Broker:
    lim = Limits(lower=[-1.0] * A, upper=[1.0] * A, max_velocity=2.0, max_acceleration=40.0, dt=DT)
    return Broker(BrokerConfig(control_period_s=DT), initial_position=np.full(A, 0.05), limits=lim)


def check_commands(broker: Broker, rec: TickRecorder) -> None:
    lim = broker.watchdog.limits
    state = MotionState.at_rest(np.full(A, 0.05))
    cols = rec.arrays()
    for action in cols["action"]:
        assert lim.step_violations(state, action) == []
        state = state.advanced(action, DT)
    ages = cols["action_age_s"][~np.isnan(cols["action_age_s"])]
    assert ages.size and ages.max() <= DT + 1e-9


def test_sync_loop_against_a_real_server(noop_server) -> None:
    obs = aloha_obs()
    rec = TickRecorder()
    broker = make_broker()
    with Client.connect(noop_server.uri) as client, SyncBrokerLoop(
        broker, client, read_observation=lambda: obs, send_command=lambda c: None, recorder=rec
    ) as loop:
        give_up = time.monotonic() + GIVE_UP_S
        policy_run = 0
        while policy_run < 60 and time.monotonic() < give_up:
            stats = loop.run(max_ticks=10)
            modes = rec.arrays()["mode"][-10:]
            policy_run = policy_run + 10 if (modes == "policy").all() else 0
        assert stats.count == 10
    assert policy_run >= 60, rec.arrays()["reason"][-20:]
    assert broker.stats.chunks_merged >= 1 and broker.latency.last is not None
    # The noop policy answers zeros: the robot moved from 0.05 to 0 within the limits.
    np.testing.assert_allclose(rec.arrays()["action"][-1], np.zeros(A), atol=1e-9)
    check_commands(broker, rec)


def test_async_loop_against_a_real_server(noop_server) -> None:
    obs = aloha_obs(1)

    async def main() -> tuple[Broker, TickRecorder]:
        broker = make_broker()
        rec = TickRecorder()
        client = await AsyncClient.connect(noop_server.uri)
        loop = AsyncBrokerLoop(broker, client, read_observation=lambda: obs, send_command=lambda c: None, recorder=rec)
        give_up = time.monotonic() + GIVE_UP_S
        while broker.watchdog.counts.policy_ticks < 60 and time.monotonic() < give_up:
            await loop.run(max_ticks=10)
        await loop.close()
        await client.close()
        return broker, rec

    broker, rec = asyncio.run(main())
    assert broker.watchdog.counts.policy_ticks >= 60
    check_commands(broker, rec)


def test_openpi_drop_in_over_chunkline_websocket_policy(noop_server) -> None:
    policy = WebsocketClientPolicy(noop_server.uri)
    broker = ActionChunkBroker(policy, action_horizon=25)
    try:
        obs = aloha_obs(2)
        modes = []
        give_up = time.monotonic() + GIVE_UP_S
        next_t = time.monotonic()
        while len(modes) < 100 and time.monotonic() < give_up:
            out = broker.infer(obs)
            assert out["actions"].shape == (A,)
            modes.append(out["chunkline"]["mode"])
            next_t += DT
            time.sleep(max(0.0, next_t - time.monotonic()))
        assert modes.count("policy") >= 50
        assert broker.broker is not None and broker.broker.timeline.dt == pytest.approx(DT)
    finally:
        broker.close()
        policy.close()


def test_a_server_that_cannot_meet_the_deadline_never_drives_the_robot(slow_server) -> None:
    rec = TickRecorder()
    broker = make_broker()
    with Client.connect(slow_server.uri) as client, SyncBrokerLoop(
        broker, client, read_observation=lambda: aloha_obs(3), send_command=lambda c: None, recorder=rec
    ) as loop:
        give_up = time.monotonic() + GIVE_UP_S
        while broker.stats.errors + broker.stats.chunks_expired + broker.stats.chunks_late < 1 and time.monotonic() < give_up:
            loop.run(max_ticks=25)
    assert broker.stats.errors + broker.stats.chunks_expired + broker.stats.chunks_late >= 1
    assert broker.watchdog.counts.policy_ticks == 0
    assert set(rec.arrays()["mode"]) == {Mode.FALLBACK.value}
    assert set(rec.arrays()["reason"]) <= {"no_chunk", "server_error"}
