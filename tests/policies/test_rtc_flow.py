"""reach-flow: the flow-matching policy, its chunk basis and weights file, real-time-chunking
guidance, and equal answers on torch and JAX."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from chunkline.policies.base import example_observation, stack_observations
from chunkline.policies.embedded.flow import (
    FLOW_HEADER_KEY,
    FlowPolicy,
    FlowSettings,
    chunk_basis,
    continue_prefix,
    flow_features,
    load_flow,
    save_flow,
    soft_mask,
)
from chunkline.policies.exceptions import PolicyLoadError, WeightsFormatError
from chunkline.policies.prefix import ActionPrefix, stack_prefixes
from chunkline.policies.registry import load_policy
from chunkline.server.robot.lanes import run_batch

#: torch against JAX, same weights and noise: float32 round-off over ten steps of a 4-layer network.
BACKEND_TOLERANCE = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # The sampler's matrices are small: on a shared machine more threads only contend.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def policy() -> FlowPolicy:
    return FlowPolicy(load_flow())


@pytest.fixture(scope="module")
def jax_policy():
    pytest.importorskip("jax")
    from chunkline.policies.embedded.flow_jax import FlowJaxPolicy

    return FlowJaxPolicy(load_flow(), batch_sizes=(4,))  # one compile; a row alone runs padded


def _obs(policy, seed: int) -> dict:
    obs = example_observation(policy.spec, np.random.default_rng(seed))
    rng = np.random.default_rng(seed)
    q = rng.uniform(-2, 2, 2)
    target = np.array([np.cos(q[0]), np.sin(q[0])]) * 0.12
    obs["state"] = np.concatenate([q, [0, 0], target, [0.03, -0.02]]).astype(np.float32)
    obs.pop("target_accel", None)  # example_observation's draw is no target's motion: none reported
    return obs


def _mixed_prefixes(plain: np.ndarray) -> list[ActionPrefix | None]:
    """No prefix; a long one off the policy's plan with 8 frozen rows; a short all-frozen one."""
    return [None, ActionPrefix.from_wire(plain[:20] + 0.1, t0=0.0, dt=0.02, action_dim=2, horizon=50, delay_steps=8),
            ActionPrefix.from_wire(plain[:5] - 0.05, t0=0.0, dt=0.02, action_dim=2, horizon=50, delay_steps=5)]


def test_the_weights_file_round_trips_and_foreign_or_old_files_are_refused(tmp_path, policy) -> None:
    path = tmp_path / "w.npz"
    save_flow(policy.weights, path)
    again = load_flow(path)
    assert (again.horizon, again.action_dim, again.basis) == (50, 2, 16)
    assert again.steps == policy.weights.steps and again.knot_power == policy.weights.knot_power
    for k, v in policy.weights.arrays.items():
        np.testing.assert_array_equal(again.arrays[k], v)
    np.savez(tmp_path / "bad.npz", **{FLOW_HEADER_KEY: np.frombuffer(b'{"format": "other"}', np.uint8)})
    with pytest.raises(WeightsFormatError):
        load_flow(tmp_path / "bad.npz")
    old = json.dumps({"format": "chunkline.flow", "version": 2, "horizon": 50, "action_dim": 2, "basis": 16, "scale": 1.0,
                      "steps": 10, "knot_power": 1.5})
    np.savez(tmp_path / "v2.npz", **policy.weights.arrays, **{FLOW_HEADER_KEY: np.frombuffer(old.encode(), np.uint8)})
    with pytest.raises(WeightsFormatError, match="v3"):
        load_flow(tmp_path / "v2.npz")
    with pytest.raises(PolicyLoadError):
        load_flow(tmp_path / "absent.npz")


def test_the_chunk_basis_is_orthonormal_smooth_and_spans_straight_lines() -> None:
    b = chunk_basis(50, 16).astype(np.float64)
    np.testing.assert_allclose(b.T @ b, np.eye(16), atol=1e-5)
    # Cubic B-splines reproduce polynomials up to degree 3: a ramp is fitted exactly.
    ramp = np.linspace(-1.0, 2.0, 50)
    np.testing.assert_allclose(b @ (b.T @ ramp), ramp, atol=1e-5)
    # A step is not in the span: its fit is smoothed (the basis cannot jump between rows).
    step = (np.arange(50) >= 25).astype(np.float64)
    assert np.abs(b @ (b.T @ step) - step).max() > 0.05
    with pytest.raises(WeightsFormatError):
        chunk_basis(50, 3)
    with pytest.raises(WeightsFormatError, match="nearly dependent"):
        chunk_basis(50, 16, 2.0)  # knots closer than the rows near the start


def test_soft_mask_freezes_the_delay_and_decays_over_the_rest() -> None:
    mask = np.zeros((1, 8), bool)
    mask[0, :6] = True
    w = soft_mask(mask, np.array([2]), decay_steps=2.0)[0]
    assert w[:2].tolist() == [1.0, 1.0] and (np.diff(w[2:6]) < 0).all() and 0 < w[5] < w[2] < 1 and (w[6:] == 0).all()


def test_the_prefix_is_continued_at_its_last_velocity() -> None:
    rows = np.array([[0.0, 1.0], [0.1, 0.8], [0.3, 0.7]], np.float32)
    prefixes = [ActionPrefix.from_wire(rows, t0=0.0, dt=0.02, action_dim=2, horizon=6, delay_steps=2),
                ActionPrefix.from_wire(rows[:1], t0=0.0, dt=0.02, action_dim=2, horizon=6, delay_steps=1), None]
    actions, covered = continue_prefix(stack_prefixes(prefixes, horizon=6, action_dim=2))
    np.testing.assert_allclose(actions[0], [[0, 1], [0.1, 0.8], [0.3, 0.7], [0.5, 0.6], [0.7, 0.5], [0.9, 0.4]], atol=1e-6)
    np.testing.assert_allclose(actions[1], np.repeat(rows[:1], 6, axis=0))  # one row: standing still
    assert covered[:2].all() and not covered[2].any() and not actions[2].any()


def test_batched_equals_alone_with_and_without_prefixes(policy) -> None:
    obs = [_obs(policy, i) for i in range(3)]
    plain = policy.infer_batch(stack_observations(policy.spec, [obs[0]]))[0]
    prefixes = _mixed_prefixes(plain)
    together = run_batch(policy, obs, None, prefixes).actions
    for i in range(3):
        alone = run_batch(policy, [obs[i]], None, [prefixes[i]]).actions
        np.testing.assert_allclose(together[i], alone[0], atol=1e-5)
    # A row without a prefix gets the plain answer, whatever the others in its batch carry.
    np.testing.assert_allclose(together[0], plain, atol=1e-5)


def test_torch_and_jax_give_the_same_chunks_with_and_without_prefixes(policy, jax_policy) -> None:
    obs = [_obs(policy, i) for i in range(3)]
    batch = stack_observations(policy.spec, obs)
    plain_torch, plain_jax = policy.infer_batch(batch), jax_policy.infer_batch(batch)
    assert plain_jax.shape == (3, 50, 2) and plain_jax.dtype == np.float32
    np.testing.assert_allclose(plain_jax, plain_torch, atol=BACKEND_TOLERANCE)
    stacked = stack_prefixes(_mixed_prefixes(plain_torch[0]), horizon=50, action_dim=2)
    guided_torch, _ = policy.infer_batch_with_prefix(batch, stacked, None)
    guided_jax, _ = jax_policy.infer_batch_with_prefix(batch, stacked, None)
    np.testing.assert_allclose(guided_jax, guided_torch, atol=BACKEND_TOLERANCE)
    # The prefixes changed the rows that carry one, and only those.
    assert np.abs(guided_jax[1] - plain_jax[1]).max() > 0.01 and np.abs(guided_jax[2] - plain_jax[2]).max() > 0.01
    np.testing.assert_allclose(guided_jax[0], plain_jax[0], atol=1e-6)
    # Batched equals alone on JAX too (alone: one row and three zero rows of padding).
    for i in range(3):
        alone = run_batch(jax_policy, [obs[i]], None, [_mixed_prefixes(plain_torch[0])[i]]).actions
        np.testing.assert_allclose(guided_jax[i], alone[0], atol=1e-5)


def test_guidance_makes_the_chunk_continue_the_frozen_prefix(policy) -> None:
    # The previous plan disagrees with what the policy would say now by 0.25 rad; the robot will
    # execute its first 10 rows whatever the answer: the guided chunk must start there.
    obs = _obs(policy, 5)
    batch = stack_observations(policy.spec, [obs])
    free = policy.infer_batch(batch)[0]
    previous = free + 0.25
    prefix = ActionPrefix.from_wire(previous[:30], t0=0.0, dt=0.02, action_dim=2, horizon=50, delay_steps=10)
    stacked = stack_prefixes([prefix], horizon=50, action_dim=2)
    guided, _ = policy.infer_batch_with_prefix(batch, stacked, None)
    assert np.abs(guided[0, :10] - previous[:10]).max() < 0.01, "the frozen rows are the prefix's"
    # Past the prefix the guided chunk returns to where the observation says.
    assert np.abs(guided[0, 40:] - free[40:]).mean() < 0.3 * np.abs(guided[0, :10] - free[:10]).mean()


def test_the_flow_policy_is_registered_on_both_backends(monkeypatch) -> None:
    assert isinstance(load_policy("reach-flow-torch"), FlowPolicy)
    assert load_policy("reach-flow").accepts_prefix
    with pytest.raises(PolicyLoadError, match="torch or jax"):
        load_policy("reach-flow-numpy")
    with pytest.raises(PolicyLoadError):
        FlowSettings(decay_steps=0.0)
    pytest.importorskip("jax")
    from chunkline.policies.embedded.flow_jax import FlowJaxPolicy

    jp = load_policy("reach-flow-jax")
    assert isinstance(jp, FlowJaxPolicy) and jp.name == "reach-flow-jax" and jp.fingerprint != load_policy("reach-flow").fingerprint
    # Where torch is absent, plain reach-flow runs on JAX (numpy cannot differentiate the network).
    from chunkline.policies import registry

    monkeypatch.setattr(registry, "default_backend", lambda: "numpy")
    assert isinstance(load_policy("reach-flow"), FlowJaxPolicy)


def test_training_fits_a_small_problem_and_writes_a_file_the_policy_reads(tmp_path) -> None:
    # Chunks that ramp towards the target's bearing (one of the features): the trained policy
    # must follow them far better than their spread, read back from its file.
    from chunkline.bench.closedloop.train_common import Demos
    from chunkline.bench.closedloop.train_flow import train

    rng = np.random.default_rng(0)
    n = 512
    q = rng.uniform(-2, 2, (n, 2))
    bearing = rng.uniform(-np.pi, np.pi, n)
    target = 0.12 * np.stack([np.cos(q[:, 0] + bearing), np.sin(q[:, 0] + bearing)], axis=1)
    states = np.concatenate([q, np.zeros((n, 2)), target, np.zeros((n, 2))], axis=1).astype(np.float32)
    ramp = np.linspace(0.0, 1.0, 50)[None, :, None]
    chunks = (q[:, None, :] + 0.5 * ramp * np.sin(bearing)[:, None, None] * np.array([1.0, -0.5])).astype(np.float32)
    none = np.zeros((n, 50, 2), np.float32)
    demos = Demos(states, np.zeros((n, 2), np.float32), chunks, none, np.zeros((n, 50), bool), np.zeros(n, np.int64), chunks)
    weights = train(demos, epochs=40, hidden=64, log=False)
    save_flow(weights, tmp_path / "small.npz")
    trained = FlowPolicy(load_flow(tmp_path / "small.npz"))
    out = trained.infer_batch({"state": states[:64]})
    error = np.abs(out - chunks[:64]).mean()
    spread = np.abs(chunks[:64] - chunks[:64].mean(axis=0)).mean()
    assert error < 0.2 * spread, (error, spread)


def test_the_training_driver_evaluates_a_policy_in_closed_loop() -> None:
    # The expert through the broker at 0 ms: it succeeds, and its rtc chunks continue the frozen
    # rows (less acceleration at the switch than replace, whose switches the filter cuts).
    from chunkline.bench.closedloop.tasks import TaskUnavailable, make_task
    from chunkline.bench.closedloop.train_common import evaluate

    try:
        make_task("reach").close()
    except TaskUnavailable as exc:
        pytest.skip(str(exc))
    rows = evaluate(load_policy("reach-expert"), [0], delays_ms=(0.0,))
    by = {r["merge"]: r for r in rows}
    assert set(by) == {"replace", "rtc"} and all(r["episodes"] == 1 for r in rows)
    assert by["replace"]["success_rate"] == 1.0 and by["rtc"]["success_rate"] == 1.0
    assert by["rtc"]["switch_accel_jump"] < by["replace"]["switch_accel_jump"]


def test_flow_features_read_the_frozen_rows_end_and_the_targets_radial_acceleration() -> None:
    # Target at (0.1, 0) moving tangentially at 0.2 m/s (w = 2 rad/s): the centripetal
    # acceleration alone (-0.4 x) means a radius that holds; 0.1 m/s^2 more outwards reads 1.
    state = np.array([[0.3, -0.2, 0.0, 0.0, 0.1, 0.0, 0.0, 0.2]] * 3, np.float32)
    accel = np.array([[-0.4, 0.0], [-0.3, 0.0], [0.0, 0.0]], np.float32)
    h = 50
    rows = np.arange(h, dtype=np.float32)[:, None]
    actions = np.broadcast_to(np.array([0.3, -0.2]) + 0.01 * rows + 0.001 * rows**2, (3, h, 2)).astype(np.float32)
    mask = np.ones((3, h), bool)
    mask[2, 5:] = False  # a prefix shorter than its frozen count is no prefix
    delay = np.array([10, 1, 8])
    f = flow_features(state, accel, actions, delay, mask)
    extra = f[:, -11:]
    assert extra[0, 0] == pytest.approx(0.0, abs=1e-4) and extra[1, 0] == pytest.approx(1.0, abs=1e-3)
    assert extra[2, 0] == 0.0, "all-zero acceleration is a batch's filler: not reported"
    end = 0.01 * 9 + 0.001 * 81
    assert extra[0, 1:5] == pytest.approx([1.0, 10 / h, end, end], abs=1e-5)
    assert extra[0, 5:7] == pytest.approx([(0.01 + 0.001 * 17) / 0.1] * 2, abs=1e-4)  # rad per row, unit 0.1
    assert extra[0, 7:9] == pytest.approx([0.002 / 0.01] * 2, abs=1e-3)
    # The target (bearing 0) from the frozen end's shoulder angle.
    assert extra[0, 9:11] == pytest.approx([np.sin(-(0.3 + end)), np.cos(-(0.3 + end))], abs=1e-5)
    assert extra[1, 1:5] == pytest.approx([1.0, 1 / h, 0.0, 0.0]) and not extra[1, 5:9].any(), "one row: no velocity"
    assert not extra[2, 1:].any()
    assert np.array_equal(flow_features(state, None, None, None, None)[:, :-11], f[:, :-11])
    assert not flow_features(state, None, None, None, None)[:, -11:].any()
