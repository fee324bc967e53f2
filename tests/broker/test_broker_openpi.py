"""The openpi ``ActionChunkBroker`` drop-in: same interface, timeline and fallback underneath."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from chunkline.broker import BrokerConfigError, FirstChunkTimeout
from chunkline.broker.openpi_compat import ActionChunkBroker
from chunkline.safety import Limits

DT = 0.02
A = 2


class Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


def ref(t: float) -> np.ndarray:
    return np.array([0.1 * t, -0.1 * t])


class TimedPolicy:
    """An openpi-style policy whose k-th action is ref(obs time + k dt); can be paused."""

    def __init__(self, clock: Clock, horizon: int = 50, with_dt: bool = False) -> None:
        self.clock = clock
        self.horizon = horizon
        self.with_dt = with_dt
        self.calls = 0
        self.resets = 0
        self.gate = threading.Event()
        self.gate.set()
        self.fail: BaseException | None = None

    def infer(self, obs):
        self.calls += 1
        t = obs["t"]
        if self.fail is not None:
            raise self.fail
        assert self.gate.wait(30)
        acts = np.stack([ref(t + k * DT) for k in range(self.horizon)]).astype(np.float32)
        out = {"actions": acts, "server_timing": {"infer_ms": 1.0}, "per_step": np.zeros(self.horizon)}
        if self.with_dt:
            out.update(t0=t, dt=DT, expires=t + 0.5)
        return out

    def reset(self) -> None:
        self.resets += 1


def step(b: ActionChunkBroker, clock: Clock, settle: bool = True) -> dict:
    out = b.infer({"t": clock.t})
    if settle:
        assert b._worker.wait_idle(10)  # deterministic: requests finish before time moves
    clock.t += DT
    return out


def test_same_interface_and_actions_due_now() -> None:
    clock = Clock()
    policy = TimedPolicy(clock)
    b = ActionChunkBroker(policy, action_horizon=25, dt=DT, clock=clock)
    outs = [step(b, clock) for _ in range(100)]
    for i, out in enumerate(outs):
        assert set(out) == {"actions", "server_timing", "chunkline"}
        assert out["actions"].shape == (A,) and out["actions"].dtype == np.float32
        np.testing.assert_allclose(out["actions"], ref(10.0 + i * DT), atol=1e-5)
        assert out["chunkline"]["mode"] == "policy"
    # Prefetch: fewer requests than one per 25 steps would need, and never a stall.
    assert policy.calls <= 100 // 24 + 2
    b.close()


def test_dt_is_measured_from_the_first_two_calls() -> None:
    clock = Clock()
    b = ActionChunkBroker(TimedPolicy(clock), action_horizon=10, clock=clock)
    first = step(b, clock)
    np.testing.assert_allclose(first["actions"], ref(10.0), atol=1e-6)
    outs = [step(b, clock) for _ in range(30)]
    assert b.broker is not None and b.broker.config.control_period_s == pytest.approx(DT)
    for i, out in enumerate(outs, start=1):
        np.testing.assert_allclose(out["actions"], ref(10.0 + i * DT), atol=1e-5)
    b.close()


def test_dt_from_a_chunkline_reply() -> None:
    clock = Clock()
    b = ActionChunkBroker(TimedPolicy(clock, with_dt=True), action_horizon=50, clock=clock)
    step(b, clock)
    assert b.broker is not None and b.broker.timeline.dt == pytest.approx(DT)
    b.close()


def test_a_slow_server_gives_fallback_instead_of_blocking() -> None:
    clock = Clock()
    policy = TimedPolicy(clock, horizon=10)
    b = ActionChunkBroker(policy, action_horizon=10, dt=DT, clock=clock)
    for _ in range(3):
        step(b, clock)
    policy.gate.clear()  # the server stops answering
    outs = [step(b, clock, settle=False) for _ in range(20)]
    modes = [o["chunkline"]["mode"] for o in outs]
    assert modes[:5] == ["policy"] * 5 and modes[-1] == "fallback"
    assert outs[-1]["chunkline"]["reason"] == "expired"  # ran past the chunk
    held = [o["actions"] for o in outs if o["chunkline"]["mode"] == "fallback"]
    np.testing.assert_array_equal(held[0], held[-1])  # hold the last command
    policy.gate.set()
    assert b._worker.wait_idle(10)
    outs = [step(b, clock) for _ in range(5)]
    assert outs[-1]["chunkline"]["mode"] == "policy"
    b.close()


def test_first_call_errors_surface_and_timeouts_are_bounded() -> None:
    clock = Clock()
    policy = TimedPolicy(clock)
    policy.fail = RuntimeError("server down")
    b = ActionChunkBroker(policy, action_horizon=10, dt=DT, clock=clock)
    with pytest.raises(RuntimeError, match="server down"):
        b.infer({"t": clock.t})
    policy.fail = None
    policy.gate.clear()
    b2 = ActionChunkBroker(policy, action_horizon=10, dt=DT, clock=clock, first_chunk_timeout_s=0.05)
    with pytest.raises(FirstChunkTimeout):
        b2.infer({"t": clock.t})
    policy.gate.set()
    b.close()
    b2.close()


def test_reset_resets_the_policy_and_fetches_afresh() -> None:
    clock = Clock()
    policy = TimedPolicy(clock)
    b = ActionChunkBroker(policy, action_horizon=25, dt=DT, clock=clock)
    for _ in range(5):
        step(b, clock)
    calls = policy.calls
    b.reset()
    assert policy.resets == 1 and b.broker is None
    out = step(b, clock)
    assert policy.calls == calls + 1
    np.testing.assert_allclose(out["actions"], ref(clock.t - DT), atol=1e-5)
    b.close()


def test_with_limits_commands_are_filtered() -> None:
    clock = Clock()
    lim = Limits(lower=[-5.0, -5.0], upper=[5.0, 5.0], max_velocity=1.0, max_acceleration=10.0, dt=DT)
    with pytest.raises(BrokerConfigError):
        ActionChunkBroker(TimedPolicy(clock), 10, limits=lim)
    b = ActionChunkBroker(TimedPolicy(clock), 25, limits=lim, state_key="pos", clock=clock, info_key=None)
    pos = ref(clock.t)
    outs = []
    for _ in range(40):
        out = b.infer({"t": clock.t, "pos": pos})
        assert b._worker.wait_idle(10)
        clock.t += DT
        outs.append(out)
        pos = out["actions"]
    assert "chunkline" not in outs[0]
    assert b.broker is not None and b.broker.mode.value == "policy"
    np.testing.assert_allclose(outs[-1]["actions"], ref(clock.t - DT), atol=1e-5)
    b.close()
