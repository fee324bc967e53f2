"""reach-flow: the flow-matching policy, its weights file, and real-time-chunking guidance."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from chunkline.policies.base import example_observation, stack_observations
from chunkline.policies.embedded.flow import FLOW_HEADER_KEY, FlowPolicy, load_flow, save_flow, soft_mask
from chunkline.policies.exceptions import WeightsFormatError
from chunkline.policies.prefix import ActionPrefix, stack_prefixes
from chunkline.server.robot.lanes import run_batch


@pytest.fixture(scope="module")
def policy() -> FlowPolicy:
    return FlowPolicy(load_flow())


def _obs(policy: FlowPolicy, seed: int) -> dict:
    obs = example_observation(policy.spec, np.random.default_rng(seed))
    rng = np.random.default_rng(seed)
    q = rng.uniform(-2, 2, 2)
    target = np.array([np.cos(q[0]), np.sin(q[0])]) * 0.12
    obs["state"] = np.concatenate([q, [0, 0], target, [0.03, -0.02]]).astype(np.float32)
    return obs


def test_the_weights_file_round_trips_and_a_foreign_file_is_refused(tmp_path, policy) -> None:
    path = tmp_path / "w.npz"
    save_flow(policy.weights, path)
    again = load_flow(path)
    assert again.horizon == 50 and again.action_dim == 2 and again.steps == policy.weights.steps
    for k, v in policy.weights.arrays.items():
        np.testing.assert_array_equal(again.arrays[k], v)
    np.savez(tmp_path / "bad.npz", **{FLOW_HEADER_KEY: np.frombuffer(b'{"format": "other"}', np.uint8)})
    with pytest.raises(WeightsFormatError):
        load_flow(tmp_path / "bad.npz")


def test_soft_mask_freezes_the_delay_and_decays_over_the_rest() -> None:
    mask = np.zeros((1, 8), bool)
    mask[0, :6] = True
    w = soft_mask(mask, np.array([2]), decay_steps=2.0)[0]
    assert w[:2].tolist() == [1.0, 1.0] and (np.diff(w[2:6]) < 0).all() and 0 < w[5] < w[2] < 1 and (w[6:] == 0).all()


def test_batched_equals_alone_with_and_without_prefixes(policy) -> None:
    obs = [_obs(policy, i) for i in range(3)]
    plain = policy.infer_batch(stack_observations(policy.spec, [obs[0]]))[0]
    prefixes = [None, ActionPrefix.from_wire(plain[:20] + 0.1, t0=0.0, dt=0.02, action_dim=2, horizon=50, delay_steps=8),
                ActionPrefix.from_wire(plain[:5], t0=0.0, dt=0.02, action_dim=2, horizon=50, delay_steps=5)]
    together, _, _, _ = run_batch(policy, obs, None, prefixes)
    for i in range(3):
        alone, _, _, _ = run_batch(policy, [obs[i]], None, [prefixes[i]])
        np.testing.assert_allclose(together[i], alone[0], atol=1e-5)


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
    frozen_free = np.abs(free[:10] - previous[:10]).max()
    frozen_guided = np.abs(guided[0, :10] - previous[:10]).max()
    assert frozen_guided < 0.3 * frozen_free, (frozen_guided, frozen_free)
    # Past the prefix the guided chunk is free to go where the observation says.
    assert np.abs(guided[0, 40:] - previous[40:]).mean() > np.abs(guided[0, :10] - previous[:10]).mean()
