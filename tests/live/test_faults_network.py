"""Network faults between a running robot and the server: delay, loss, partition, reset.

The faults come from the closed-loop benchmark's fault layer
(:class:`chunkline.bench.faultproxy.FaultProxy`, a TCP proxy process: loopback has no netem):
delay and jitter, stalls as lost segments cause them, blackhole outages (a partition: bytes
arrive at TCP's first retransmission after it) and resets. Timing is real: assertions are about
behaviour; time limits only guard against hangs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import aloha_obs

from chunkline.bench.faultproxy import FaultProxy
from chunkline.bench.serverproc import ServerProcess
from chunkline.broker import AsyncBrokerLoop, Broker, BrokerConfig, TickRecorder
from chunkline.client import AsyncClient, Backoff, ConnectionLost
from chunkline.safety import Limits, MotionState

DT = 0.02
A = 14
GIVE_UP_S = 30.0  # hang guard
FALLBACK_REASONS = {"disconnected", "no_chunk", "stale", "expired", "server_error"}


@pytest.fixture()
def proxy(noop_server: ServerProcess) -> Iterator[FaultProxy]:
    with FaultProxy(noop_server.port, max_seconds=300) as p:
        yield p


def make_broker() -> Broker:
    lim = Limits(lower=[-1.0] * A, upper=[1.0] * A, max_velocity=2.0, max_acceleration=40.0, dt=DT)
    return Broker(BrokerConfig(control_period_s=DT), initial_position=np.full(A, 0.05), limits=lim)


def test_requests_survive_delay_and_partition_and_reconnect_after_a_reset(proxy: FaultProxy) -> None:
    async def main() -> tuple[float, float, bool, int]:
        async with AsyncClient(proxy.uri) as plain:
            fast = (await plain.infer(aloha_obs(), deadline_ms=5000)).client_timing["round_trip_ms"]
        # The proxy's faults apply to connections opened after they are set.
        await asyncio.to_thread(proxy.set, {"delay_ms": 50}, {"delay_ms": 50})
        async with AsyncClient(proxy.uri) as delayed:
            slow = (await delayed.infer(aloha_obs(), deadline_ms=5000)).client_timing["round_trip_ms"]
        await asyncio.to_thread(proxy.set, {}, {})
        client = await AsyncClient.connect(proxy.uri, backoff=Backoff(initial=0.05, maximum=0.2))
        try:
            await asyncio.to_thread(proxy.outage, 0.4, "blackhole")
            held = asyncio.create_task(client.infer(aloha_obs(), deadline_ms=5000))
            await asyncio.sleep(0.3)
            was_held = not held.done()
            await held  # nothing was lost: the held bytes flow once the partition heals
            await asyncio.to_thread(proxy.outage, 0.3, "reset")
            await asyncio.sleep(0.05)
            lost = 0
            give_up = time.monotonic() + GIVE_UP_S
            while True:  # a call that meets the dead connection fails; a later one reconnects
                try:
                    await client.infer(aloha_obs(), deadline_ms=5000)
                    break
                except ConnectionLost:
                    lost += 1
                    assert time.monotonic() < give_up
            return fast, slow, was_held, lost
        finally:
            await client.close()

    fast, slow, was_held, lost = asyncio.run(main())
    assert slow >= 100.0 and slow > fast  # 50 ms each way
    assert was_held
    assert lost <= 1  # at most the one call that met the reset; the client then reconnected
    stats = proxy.stats()
    assert stats["resets"] >= 1 and stats["connections"] >= 2


@pytest.mark.slow
def test_a_robot_rides_out_loss_partition_and_reset(proxy: FaultProxy) -> None:
    obs = aloha_obs()

    async def main() -> tuple[Broker, TickRecorder, dict[str, tuple[int, int]]]:
        broker = make_broker()
        rec = TickRecorder()
        # A slow, lossy link from the start (the proxy's faults apply to new connections).
        lossy = {"delay_ms": 20, "jitter_ms": 10, "stall_rate_hz": 2.0, "stall_ms": 200}
        await asyncio.to_thread(proxy.set, lossy, lossy)
        client = await AsyncClient.connect(proxy.uri, backoff=Backoff(initial=0.05, maximum=0.2))
        await asyncio.to_thread(proxy.set, {}, {})  # the connection after the reset will be clean
        control = AsyncBrokerLoop(broker, client, read_observation=lambda: obs, send_command=lambda c: None, recorder=rec)
        phases: dict[str, tuple[int, int]] = {}
        give_up = time.monotonic() + GIVE_UP_S

        async def until_policy(n: int) -> None:
            start = broker.watchdog.counts.policy_ticks
            while broker.watchdog.counts.policy_ticks - start < n:
                assert time.monotonic() < give_up, f"the policy never resumed ({broker.stats.as_dict()})"
                await control.run(max_ticks=5)

        def ticks() -> int:
            return len(rec.arrays()["t"])

        try:
            begin = ticks()
            await until_policy(30)
            await control.run(duration_s=1.0)
            phases["lossy"] = (begin, ticks())
            begin = ticks()
            await asyncio.to_thread(proxy.outage, 2.0, "blackhole")
            await control.run(duration_s=2.0)
            phases["partition"] = (begin, ticks())
            begin = ticks()
            await until_policy(30)
            phases["healed"] = (begin, ticks())
            connections = (await asyncio.to_thread(proxy.stats))["connections"]
            begin = ticks()
            await asyncio.to_thread(proxy.outage, 0.5, "reset")
            while (await asyncio.to_thread(proxy.stats))["connections"] == connections:  # the robot reconnects
                assert time.monotonic() < give_up, broker.stats.as_dict()
                await control.run(max_ticks=5)
            await until_policy(30)
            phases["reset"] = (begin, ticks())
        finally:
            await control.close()
            await client.close()
        return broker, rec, phases

    broker, rec, phases = asyncio.run(main())
    cols = rec.arrays()
    modes, reasons = cols["mode"], cols["reason"]
    lim = broker.watchdog.limits
    assert lim is not None
    state = MotionState.at_rest(np.full(A, 0.05))
    for action in cols["action"]:  # every command, through every fault, within the limits
        assert lim.step_violations(state, action) == []
        state = state.advanced(action, DT)
    ages = cols["action_age_s"][~np.isnan(cols["action_age_s"])]
    assert ages.max() <= DT + 1e-9  # no stale action ever ran
    a, b = phases["lossy"]
    assert (modes[a:b] == "policy").sum() > 0  # a lossy link still drives the robot part of the time
    a, b = phases["partition"]
    assert (modes[a:b] == "fallback").sum() > 0  # the timeline ran dry while the link was held
    assert set(reasons[a:b][modes[a:b] == "fallback"]) <= FALLBACK_REASONS
    assert broker.stats.errors + broker.stats.requests_timed_out + broker.stats.disconnects >= 1
    a, b = phases["reset"]
    assert (modes[a:b] == "policy").sum() >= 30
