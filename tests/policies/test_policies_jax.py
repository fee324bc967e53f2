"""JAX backend: bucketed batch sizes, every size compiled at warmup, big batches split."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.policies import PolicyLoadError, example_observation, stack_observations
from chunkline.policies.embedded import LoadtestConfig, build_embedded, default_weights, generate_weights

jax = pytest.importorskip("jax")


def _batch(spec: Any, n: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return stack_observations(spec, [example_observation(spec, rng) for _ in range(n)])


def _rows(obs: dict[str, Any], sl: slice) -> dict[str, Any]:
    return {k: v[sl] for k, v in obs.items()}


@pytest.fixture(scope="module")
def full() -> Any:
    """The full-size loadtest on JAX with three buckets, warmed up."""
    policy = build_embedded(default_weights("loadtest"), backend="jax", batch_sizes=(4, 1, 2))
    assert policy.compile_count == 0  # nothing compiled at construction
    policy.warmup()
    return policy


def test_warmup_compiles_every_size_once(full: Any) -> None:
    assert full.batch_sizes == (1, 2, 4)
    assert full.compile_count == 3
    assert full._jitted._cache_size() == 3  # jax's own cache agrees with our trace counter
    full.warmup()
    assert full.compile_count == 3  # a second warmup compiles nothing


def test_no_request_compiles_after_warmup(full: Any) -> None:
    obs = _batch(full.spec, 11, seed=1)
    for n in range(1, 12):  # 3 -> 4, 5..8 -> split, 9..11 -> 4+4+bucket
        out = full.infer_batch(_rows(obs, slice(0, n)))
        assert out.shape == (n, 50, 14)
    assert full.compile_count == 3
    assert full._jitted._cache_size() == 3


def test_padded_batch_equals_items_alone(full: Any) -> None:
    obs = _batch(full.spec, 3, seed=2)
    assert full.bucket(3) == 4
    batched = full.infer_batch(obs)
    for i in range(3):
        alone = full.infer_batch(_rows(obs, slice(i, i + 1)))
        np.testing.assert_allclose(batched[i], alone[0], atol=2e-5, rtol=0)


def test_split_batch_matches_numpy(full: Any) -> None:
    ref = build_embedded(default_weights("loadtest"), backend="numpy")
    obs = _batch(full.spec, 10, seed=3)  # 4 + 4 + 2
    np.testing.assert_allclose(full.infer_batch(obs), ref.infer_batch(obs), atol=2e-5, rtol=0)


def test_bucket_choice() -> None:
    policy = build_embedded(generate_weights(LoadtestConfig(width=32, blocks=0)), backend="jax",
                            batch_sizes=(1, 2, 4, 8, 16, 32))
    assert [policy.bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]


@pytest.mark.parametrize("sizes", [(), (0, 2), (-1,)])
def test_bad_batch_sizes_refused(sizes: tuple[int, ...]) -> None:
    with pytest.raises(PolicyLoadError):
        build_embedded(generate_weights(LoadtestConfig(width=32, blocks=0)), backend="jax", batch_sizes=sizes)


def test_unknown_device_refused() -> None:
    w = generate_weights(LoadtestConfig(width=32, blocks=0))
    for device in ("cpu:7", "nosuchplatform", "cpu:x"):
        with pytest.raises(PolicyLoadError):
            build_embedded(w, backend="jax", device=device)


@pytest.fixture(scope="module")
def small() -> tuple[Any, Any]:
    """A small loadtest on JAX (buckets 1, 2, 4, warmed up) and its numpy reference."""
    w = generate_weights(LoadtestConfig(width=48, blocks=1, expansion=2, tokens=2), seed=3)
    policy = build_embedded(w, backend="jax", batch_sizes=(1, 2, 4))
    policy.warmup()
    return policy, build_embedded(w, backend="numpy")


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 13), seed=st.integers(0, 2**31))
def test_any_batch_size_matches_reference_without_compiling(small: tuple[Any, Any], n: int, seed: int) -> None:
    policy, ref = small
    obs = _batch(policy.spec, n, seed)
    np.testing.assert_allclose(policy.infer_batch(obs), ref.infer_batch(obs), atol=2e-5, rtol=0)
    assert policy.compile_count == 3


def test_device_enters_fingerprint_not_results() -> None:
    """Two host devices (forced by XLA_FLAGS in a fresh process): same answers, different fingerprints."""
    code = textwrap.dedent(
        """
        import numpy as np
        from chunkline.policies import example_observation, stack_observations
        from chunkline.policies.embedded import LoadtestConfig, build_embedded, generate_weights
        w = generate_weights(LoadtestConfig(width=32, blocks=1), seed=1)
        a = build_embedded(w, backend="jax", device="cpu:0", batch_sizes=(2,))
        b = build_embedded(w, backend="jax", device="cpu:1", batch_sizes=(2,))
        assert str(b.device).endswith("1") or b.device.id == 1, b.device
        obs = stack_observations(a.spec, [example_observation(a.spec, np.random.default_rng(0))] * 2)
        np.testing.assert_allclose(a.infer_batch(obs), b.infer_batch(obs), atol=1e-6)
        assert a.fingerprint != b.fingerprint
        print("ok")
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("ok")
