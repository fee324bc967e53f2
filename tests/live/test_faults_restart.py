"""The server going away: a graceful drain (SIGTERM) and a crash (SIGKILL) with robots running.

Timing is real (processes, sockets): assertions are about behaviour; time limits only guard
against hangs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import aloha_obs
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.bench.soak import FAULT_POLICY_REF, read_ledger
from chunkline.broker import AsyncBrokerLoop, Broker, BrokerConfig, TickRecorder
from chunkline.client import AsyncClient, Backoff
from chunkline.client.wire.codec import decode, encode
from chunkline.client.wire.protocol import SUBPROTOCOL
from chunkline.safety import Limits, MotionState

DT = 0.02
A = 14
GIVE_UP_S = 30.0  # hang guard


def _obs(sleep_ms: float = 0.0) -> dict[str, object]:
    state = np.zeros(14, np.float32)
    state[2] = sleep_ms
    return {"state": state, "prompt": "drain"}


def test_sigterm_drains_then_tells_clients_to_reconnect(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.db"
    with ServerProcess(["--policy", FAULT_POLICY_REF, "--lanes", "1", "--max-batch-size", "1", "--shutdown-grace", "10",
                        "--ledger", str(ledger)]) as server:
        async def go() -> tuple[str, list[dict], int | None, tuple[int, str], tuple[int, str | None]]:
            ws = await connect(server.uri, subprotocols=[SUBPROTOCOL], compression=None)
            session = decode(await ws.recv())["session"]
            await ws.send(encode({"type": "infer", "id": 1, "obs": _obs(sleep_ms=1000), "deadline_ms": 10_000}))
            await asyncio.sleep(0.2)  # running
            server.terminate()
            give_up = time.monotonic() + GIVE_UP_S
            while (ready := await asyncio.to_thread(http_get, server.host, server.port, "/readyz"))[0] != 503:
                assert time.monotonic() < give_up
                await asyncio.sleep(0.02)
            # No new sessions while draining: 503 with Retry-After.
            with pytest.raises(InvalidStatus) as refused:
                await connect(server.uri, subprotocols=[SUBPROTOCOL])
            handshake = (refused.value.response.status_code, refused.value.response.headers.get("Retry-After"))
            # New work on an open session is refused, with a hint to come back.
            await ws.send(encode({"type": "infer", "id": 2, "obs": _obs(), "deadline_ms": 10_000}))
            replies = []
            try:
                while True:
                    replies.append(decode(await asyncio.wait_for(ws.recv(), GIVE_UP_S)))
            except ConnectionClosed:
                pass
            return session, replies, ws.close_code, (ready[0], ready[1].decode().strip()), handshake

        session, replies, close_code, ready, handshake = asyncio.run(go())
        assert server.proc is not None and server.proc.wait(GIVE_UP_S) == 0
    assert ready == (503, "draining")
    assert handshake == (503, "1")
    by_id = {r["id"]: r for r in replies}
    assert by_id[2]["type"] == "error" and by_id[2]["code"] == "shutting_down" and by_id[2]["retry_after_ms"] > 0
    assert by_id[1]["type"] == "chunk"  # the request in flight finished
    assert len(replies) == 2
    assert close_code == 1001  # going away: reconnect
    # The drain flushed the ledger: the finished request is recorded; the refused one never was.
    assert sorted(o for s, o in read_ledger(ledger) if s == session) == ["ok"]


@dataclasses.dataclass
class RecordingBackoff(Backoff):
    """A :class:`Backoff` that remembers each delay it gave (``None`` marks a reset)."""

    log: list[float | None] = dataclasses.field(default_factory=list)

    def next_delay(self) -> float:
        delay = super().next_delay()
        self.log.append(delay)
        return delay

    def reset(self) -> None:
        super().reset()
        self.log.append(None)


def make_broker() -> Broker:
    lim = Limits(lower=[-1.0] * A, upper=[1.0] * A, max_velocity=2.0, max_acceleration=40.0, dt=DT)
    return Broker(BrokerConfig(control_period_s=DT), initial_position=np.full(A, 0.05), limits=lim)


@pytest.mark.slow
def test_sigkill_robots_sit_in_fallback_and_reconnect_with_backoff() -> None:
    first = ServerProcess(["--policy", "noop"]).start()
    port = first.port
    second = ServerProcess(["--policy", "noop", "--port", str(port)])  # the same port, after the crash
    backoff = RecordingBackoff(initial=0.05, maximum=0.4, jitter=0.0)
    obs = aloha_obs()

    async def main() -> tuple[Broker, TickRecorder, int, int, int, int]:
        broker = make_broker()
        rec = TickRecorder()
        client = await AsyncClient.connect(first.uri, backoff=backoff)
        control = AsyncBrokerLoop(broker, client, read_observation=lambda: obs, send_command=lambda c: None, recorder=rec)
        give_up = time.monotonic() + GIVE_UP_S
        while broker.watchdog.counts.policy_ticks < 30:
            assert time.monotonic() < give_up
            await control.run(max_ticks=10)
        backoff_mark = len(backoff.log)
        kill_tick = len(rec.arrays()["t"])
        assert first.proc is not None
        first.proc.kill()  # no drain, no close frames: the connection just breaks
        await control.run(duration_s=1.5)  # the outage, with the robot running
        start_tick = len(rec.arrays()["t"])
        starting = asyncio.get_running_loop().run_in_executor(None, second.start)
        while not starting.done():
            await control.run(max_ticks=5)
        await starting
        resumed = broker.watchdog.counts.policy_ticks
        while broker.watchdog.counts.policy_ticks - resumed < 30:
            assert time.monotonic() < give_up + GIVE_UP_S
            await control.run(max_ticks=10)
        await control.close()
        await client.close()
        return broker, rec, kill_tick, start_tick, backoff_mark, broker.stats.disconnects

    try:
        broker, rec, kill_tick, start_tick, backoff_mark, disconnects = asyncio.run(main())
    finally:
        first.stop()
        second.stop()
    cols = rec.arrays()
    modes, reasons, chunk_ids, t = cols["mode"], cols["reason"], cols["chunk_id"], cols["t"]
    # Every command, before, during and after the outage, is within the limits.
    lim = broker.watchdog.limits
    assert lim is not None
    state = MotionState.at_rest(np.full(A, 0.05))
    for action in cols["action"]:
        assert lim.step_violations(state, action) == []
        state = state.advanced(action, DT)
    # The control loop never waited on the network: ticks kept coming through the outage.
    assert np.diff(t[kill_tick:start_tick]).max() < 0.5
    # After the kill: the chunk already received may finish (it is still valid), then the
    # fallback runs on every tick until a chunk from the restarted server arrives.
    before = {c for c in chunk_ids[:kill_tick] if c}
    after_kill = modes[kill_tick:]
    first_fallback = kill_tick + int(np.argmax(after_kill == "fallback"))
    assert modes[first_fallback] == "fallback"
    assert all(c in before for c in chunk_ids[kill_tick:first_fallback] if c)
    back = first_fallback + int(np.argmax(modes[first_fallback:] != "fallback"))
    assert back >= start_tick  # the policy drives again only once a server is back
    assert all(c not in before for c in chunk_ids[back:] if c)  # ... and from fresh chunks
    assert "disconnected" in set(reasons[first_fallback:back])
    assert set(reasons[first_fallback:back]) <= {"disconnected", "no_chunk", "stale", "expired", "server_error"}
    assert disconnects >= 1
    # Reconnection attempts backed off exponentially (no jitter here), up to the cap.
    outage = backoff.log[backoff_mark:]
    assert len([d for d in outage if d is not None]) >= 3
    run: list[float] = []
    for d in outage + [None]:
        if d is None:
            assert run == pytest.approx([min(0.4, 0.05 * 2**i) for i in range(len(run))])
            run = []
        else:
            run.append(d)
