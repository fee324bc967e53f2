"""The robot's prefix reaches the policy: wire, session, batching (mixed lengths), policies that ignore it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import repo_paths
from policies_for_tests import PrefixEchoPolicy

from chunkline.bench.serverproc import ServerProcess
from chunkline.client import Client, ErrorCode, ServerError
from chunkline.policies.embedded.noop import NoopPolicy
from chunkline.policies.prefix import ActionPrefix, PrefixError, stack_prefixes
from chunkline.server.robot.lanes import run_batch

H, A, DT = 8, 3, 0.02


def _prefix(rows: int, delay: int | None, seed: int = 0, t0: float | None = 1.0) -> ActionPrefix:
    acts = np.random.default_rng(seed).standard_normal((rows, A)).astype(np.float32)
    return ActionPrefix.from_wire(acts, t0=t0, dt=DT, action_dim=A, horizon=H, delay_steps=delay)


def _obs(i: int) -> dict[str, np.ndarray]:
    return {"state": np.array([i, -i], np.float32)}


def test_prefix_lands_on_the_chunk_grid_with_its_mask_and_delay() -> None:
    p = _prefix(5, 2)
    batch = stack_prefixes([p, None], horizon=H, action_dim=A)
    np.testing.assert_array_equal(batch.actions[0, :5], p.actions)
    assert batch.mask[0].tolist() == [True] * 5 + [False] * 3 and not batch.mask[1].any()
    assert batch.delay.tolist() == [2, 0]
    # A chunk that starts two periods after obs_time: the first two prefix rows have no slot.
    shifted = stack_prefixes([p], horizon=H, action_dim=A, action_offset=2 * DT)
    np.testing.assert_array_equal(shifted.actions[0, :3], p.actions[2:])
    assert shifted.mask[0].tolist() == [True] * 3 + [False] * 5 and shifted.delay.tolist() == [0]
    # A prefix longer than the chunk is cut at its end; the delay never covers rows not given.
    long = stack_prefixes([_prefix(12, 12)], horizon=H, action_dim=A)
    assert long.mask.all() and long.delay.tolist() == [H]


def test_mixed_prefix_lengths_batched_equal_alone() -> None:
    policy = PrefixEchoPolicy(A, H, DT)
    prefixes = [_prefix(3, 1, 1), None, _prefix(8, 5, 2), _prefix(1, 0, 3)]
    items = [_obs(i) for i in range(len(prefixes))]
    together = run_batch(policy, items, None, prefixes).actions
    for i, prefix in enumerate(prefixes):
        alone = run_batch(policy, [items[i]], None, [prefix]).actions
        np.testing.assert_array_equal(together[i], alone[0])
    first = together[0]
    assert isinstance(first, np.ndarray)
    np.testing.assert_array_equal(first[:3, :], np.c_[prefixes[0].actions[:, :-1], [1, 0, 0]])  # type: ignore[union-attr]
    assert (first[3:] == -1).all()


def test_policies_that_ignore_the_prefix_run_unchanged() -> None:
    policy = NoopPolicy()
    from helpers import aloha_obs

    obs = [aloha_obs(0), aloha_obs(1)]
    plain = run_batch(policy, obs, None).actions
    with_prefix = run_batch(policy, obs, None, [None, None]).actions
    for a, b in zip(plain, with_prefix, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not policy.accepts_prefix


@pytest.mark.parametrize(("acts", "delay", "message"), [
    (np.zeros((3, A + 1), np.float32), None, "shape"),
    (np.zeros((3,), np.float32), None, "shape"),
    (np.full((3, A), np.nan, np.float32), None, "NaN"),
    (np.zeros((3, A), np.float32), 4, "prefix_delay"),
    (np.zeros((5 * H, A), np.float32), None, "rows"),
    (np.zeros((3, A), bool), None, "dtype"),
])
def test_bad_prefixes_are_refused_by_name(acts: np.ndarray, delay: int | None, message: str) -> None:
    with pytest.raises(PrefixError, match=message):
        ActionPrefix.from_wire(acts, t0=0.0, dt=DT, action_dim=A, horizon=H, delay_steps=delay)


def test_the_prefix_a_client_sends_reaches_the_policy(server_process: Callable[..., ServerProcess]) -> None:
    ref = "policies_for_tests:PrefixEchoPolicy"
    server = server_process(["--policy", ref], env=repo_paths.env_with_tests_on_path())
    with Client.connect(server.uri) as client:
        prefix = np.arange(5 * A, dtype=np.float32).reshape(5, A)
        reply = client.infer(_obs(1), obs_time=10.0, prefix=prefix, prefix_delay=2)
        np.testing.assert_array_equal(reply.actions[:5, :-1], prefix[:, :-1])
        assert reply.actions[:, -1].tolist() == [1, 1, 0, 0, 0, -1, -1, -1]
        assert (reply.actions[5:, :-1] == -1).all()
        # Without a prefix the policy sees an empty mask; a prefix that does not fit is refused.
        assert (client.infer(_obs(2), obs_time=11.0).actions[:, :-1] == -1).all()
        with pytest.raises(ServerError) as err:
            client.infer(_obs(3), obs_time=12.0, prefix=np.zeros((2, A + 2), np.float32))
        assert err.value.code is ErrorCode.INVALID_MESSAGE and "shape" in str(err.value)
        with pytest.raises(ServerError) as err:
            client.infer(_obs(3), obs_time=12.0, prefix=prefix, prefix_delay=9)
        assert err.value.code is ErrorCode.INVALID_MESSAGE
