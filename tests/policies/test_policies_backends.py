"""torch, JAX and numpy run the embedded policies alike; batching never changes an item's answer."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.policies import PolicyOutputError, example_observation, stack_observations
from chunkline.policies.embedded import (
    ComputeConfig,
    LoadtestConfig,
    build_embedded,
    default_weights,
    generate_weights,
)
from chunkline.policies.embedded.config import LOADTEST_MAX_STEP
from chunkline.policies.embedded.models import prompt_features

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

KINDS = ["loadtest", "loadtest-compute"]
BACKENDS = ["torch", "jax", "numpy"]
ATOL = 2e-5  # float32, outputs tanh-bounded in [-1, 1]: observed differences are ~2e-6


@pytest.fixture(scope="module")
def policies() -> dict[tuple[str, str], Any]:
    """Every embedded model on every backend, default (full-size) weights, built once."""
    out = {}
    for kind in KINDS:
        w = default_weights(kind)
        for backend in BACKENDS:
            out[kind, backend] = build_embedded(w, backend=backend, batch_sizes=(1, 2, 4, 8))
    return out


def _items(spec: Any, n: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    items = [example_observation(spec, rng) for _ in range(n)]
    prompts = ["pick up the cube", "", "fold the towel", "PICK up the  cube", "transfer the peg"]
    for i, item in enumerate(items):
        if prompts[i % len(prompts)]:
            item["prompt"] = prompts[i % len(prompts)]
        else:
            del item["prompt"]  # absent: stacked as ""
    return items


def test_default_sizes_match_the_design() -> None:
    lt = default_weights("loadtest")
    assert 24e6 <= lt.num_params <= 28e6  # ~25M-parameter action head
    assert lt.config.tokens == 1
    ct = default_weights("loadtest-compute").config
    assert isinstance(ct, ComputeConfig) and ct.seq_len == 64 and ct.layers == 4 and ct.width == 256
    spec = lt.config.spec()
    assert (spec.horizon, spec.action_dim, spec.dt) == (50, 14, 0.02)
    assert set(spec.observation) == {"images/cam_high", "images/cam_left_wrist", "images/cam_right_wrist",
                                     "state", "prompt"}


@pytest.mark.parametrize("kind", KINDS)
def test_backends_agree(policies: Mapping[tuple[str, str], Any], kind: str) -> None:
    spec = policies[kind, "numpy"].spec
    obs = stack_observations(spec, _items(spec, 5, seed=1))
    outs = {b: policies[kind, b].infer_batch(obs) for b in BACKENDS}
    for b, out in outs.items():
        assert out.shape == (5, 50, 14) and out.dtype == np.float32, b
        if kind == "loadtest":  # a smooth path from the observed state, LOADTEST_MAX_STEP per action at most
            path = np.diff(np.concatenate([obs["state"][:, None, :], out], axis=1), axis=1)
            assert np.all(np.abs(path) <= LOADTEST_MAX_STEP * (1 + 1e-5)), b
        else:
            assert np.all(np.abs(out) <= 1.0), b  # tanh-bounded
    np.testing.assert_allclose(outs["torch"], outs["numpy"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(outs["jax"], outs["numpy"], atol=ATOL, rtol=0)
    # the outputs carry signal: items differ from each other, and are far from zero
    assert outs["numpy"].std() > 0.1
    assert np.abs(outs["numpy"][0] - outs["numpy"][2]).max() > 1e-2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_equals_items_alone(policies: Mapping[tuple[str, str], Any], kind: str, backend: str) -> None:
    policy = policies[kind, backend]
    items = _items(policy.spec, 6, seed=2)  # 6: padded to 8 on JAX
    batched = policy.infer_batch(stack_observations(policy.spec, items))
    for i, item in enumerate(items):
        alone = policy.infer_batch(stack_observations(policy.spec, [item]))
        np.testing.assert_allclose(batched[i], alone[0], atol=ATOL, rtol=0, err_msg=f"item {i}")


@pytest.mark.parametrize("kind", KINDS)
def test_every_input_matters(policies: Mapping[tuple[str, str], Any], kind: str) -> None:
    policy = policies[kind, "numpy"]
    base = _items(policy.spec, 1, seed=3)[0]
    ref = policy.infer_batch(stack_observations(policy.spec, [base]))
    for field in policy.spec.observation:
        changed = dict(base)
        if field == "prompt":
            changed[field] = "something else entirely"
        else:
            changed[field] = np.zeros_like(base[field])
        out = policy.infer_batch(stack_observations(policy.spec, [changed]))
        assert np.abs(out - ref).max() > 1e-4, f"output ignores {field}"


def test_torch_wraps_writable_inputs_and_copies_read_only_ones() -> None:
    from chunkline.policies import PolicySpec, TorchPolicy
    from chunkline.policies.base import ArraySpec

    seen: dict[str, int] = {}

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, obs: Mapping[str, Any]) -> torch.Tensor:
            seen["ptr"] = obs["x"].data_ptr()
            return (obs["x"].sum(dim=1) * self.w).reshape(-1, 1, 1).expand(-1, 2, 3).contiguous()

    spec = PolicySpec(observation={"x": ArraySpec((4,), "float32")}, action_dim=3, horizon=2, dt=0.1)
    policy = TorchPolicy("probe", Probe(), spec)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = policy.infer_batch({"x": x})
    assert seen["ptr"] == x.ctypes.data  # zero copy
    np.testing.assert_array_equal(out[:, 0, 0], [6.0, 22.0])
    ro = np.frombuffer(x.tobytes(), dtype=np.float32).reshape(2, 4)  # read-only, like a wire buffer
    assert not ro.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = policy.infer_batch({"x": ro})
    assert seen["ptr"] != ro.ctypes.data
    np.testing.assert_array_equal(out[:, 0, 0], [6.0, 22.0])
    flipped = x[::-1]  # negative strides cannot be wrapped
    np.testing.assert_array_equal(policy.infer_batch({"x": flipped})[:, 0, 0], [22.0, 6.0])


def test_torch_bfloat16_close_to_float32_with_its_own_fingerprint() -> None:
    w = generate_weights(LoadtestConfig(width=128, blocks=2), seed=5)
    f32 = build_embedded(w, backend="torch")
    bf16 = build_embedded(w, backend="torch", precision="bfloat16")
    spec = f32.spec
    obs = stack_observations(spec, _items(spec, 3, seed=4))
    a, b = f32.infer_batch(obs), bf16.infer_batch(obs)
    assert b.dtype == np.float32
    assert 0 < np.abs(a - b).max() < 0.1
    assert f32.fingerprint != bf16.fingerprint


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_on_cuda_matches_cpu() -> None:  # pragma: no cover - GPU machines only
    w = default_weights("loadtest")
    cpu = build_embedded(w, backend="torch")
    gpu = build_embedded(w, backend="torch", device="cuda:0")
    obs = stack_observations(cpu.spec, _items(cpu.spec, 4, seed=6))
    np.testing.assert_allclose(gpu.infer_batch(obs), cpu.infer_batch(obs), atol=5e-3)  # TF32 may apply
    assert gpu.fingerprint != cpu.fingerprint


# ---------------------------------------------------------------------------- output checks


def _small_spec() -> Any:
    from chunkline.policies import ArraySpec, PolicySpec

    return PolicySpec(observation={"x": ArraySpec((2,), "float32")}, action_dim=3, horizon=4, dt=0.1)


def _bad_outputs(batch: int) -> list[tuple[str, Any]]:
    return [
        ("missing batch dim", np.zeros((4, 3), np.float32)),
        ("wrong horizon", np.zeros((batch, 5, 3), np.float32)),
        ("wrong action dim", np.zeros((batch, 4, 2), np.float32)),
        ("wrong batch", np.zeros((batch + 1, 4, 3), np.float32)),
        ("integer", np.zeros((batch, 4, 3), np.int32)),
        ("bool", np.zeros((batch, 4, 3), bool)),
    ]


@pytest.mark.parametrize("case", range(6))
def test_numpy_backend_refuses_bad_outputs(case: int) -> None:
    from chunkline.policies import NumpyPolicy

    label, bad = _bad_outputs(2)[case]
    policy = NumpyPolicy("bad", lambda obs: bad, _small_spec())
    with pytest.raises(PolicyOutputError):
        policy.infer_batch({"x": np.zeros((2, 2), np.float32)})


@pytest.mark.parametrize("case", range(6))
def test_torch_backend_refuses_bad_outputs(case: int) -> None:
    from chunkline.policies import TorchPolicy

    label, bad = _bad_outputs(2)[case]

    class Bad(torch.nn.Module):
        def forward(self, obs: Mapping[str, Any]) -> torch.Tensor:
            return torch.from_numpy(bad.copy())

    policy = TorchPolicy("bad", Bad(), _small_spec())
    with pytest.raises(PolicyOutputError):
        policy.infer_batch({"x": np.zeros((2, 2), np.float32)})


@pytest.mark.parametrize("case", range(6))
def test_jax_backend_refuses_bad_outputs(case: int) -> None:
    import jax.numpy as jnp

    from chunkline.policies import JaxPolicy

    label, bad = _bad_outputs(2)[case]
    policy = JaxPolicy("bad", lambda p, obs: jnp.asarray(bad), {}, _small_spec(), batch_sizes=(2,))
    with pytest.raises(PolicyOutputError):
        policy.infer_batch({"x": np.zeros((2, 2), np.float32)})


def test_backends_refuse_non_arrays_and_pass_nan() -> None:
    from chunkline.policies import JaxPolicy, NumpyPolicy, TorchPolicy

    spec = _small_spec()
    obs = {"x": np.zeros((2, 2), np.float32)}
    with pytest.raises(PolicyOutputError):
        NumpyPolicy("list", lambda o: [[[0.0] * 3] * 4] * 2, spec).infer_batch(obs)

    class Tuple(torch.nn.Module):
        def forward(self, o: Mapping[str, Any]) -> Any:
            return (torch.zeros(2, 4, 3),)

    with pytest.raises(PolicyOutputError):
        TorchPolicy("tuple", Tuple(), spec).infer_batch(obs)
    with pytest.raises(PolicyOutputError):
        JaxPolicy("dict", lambda p, o: {"a": o["x"]}, {}, spec, batch_sizes=(2,)).infer_batch(obs)
    # NaN is the safety filter's business, and float64 is converted, not refused
    nan = np.full((2, 4, 3), np.nan)
    out = NumpyPolicy("nan", lambda o: nan, spec).infer_batch(obs)
    assert out.dtype == np.float32 and np.isnan(out).all()


# ---------------------------------------------------------------------------- properties

@pytest.fixture(scope="module")
def small_numpy() -> dict[str, Any]:
    """Small embedded models on numpy (fast enough for property tests)."""
    return {
        "loadtest": build_embedded(
            generate_weights(LoadtestConfig(width=64, blocks=1, expansion=2, tokens=3), seed=11), backend="numpy"),
        "loadtest-compute": build_embedded(
            generate_weights(ComputeConfig(width=32, layers=1, heads=2, expansion=2), seed=12), backend="numpy"),
    }


@settings(max_examples=15, deadline=None)
@given(kind=st.sampled_from(KINDS), n=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_numpy_rows_are_independent(small_numpy: dict[str, Any], kind: str, n: int, seed: int) -> None:
    policy = small_numpy[kind]
    items = _items(policy.spec, n, seed)
    batched = policy.infer_batch(stack_observations(policy.spec, items))
    last = policy.infer_batch(stack_observations(policy.spec, items[-1:]))
    np.testing.assert_allclose(batched[-1], last[0], atol=1e-5, rtol=0)


@settings(max_examples=40, deadline=None)
@given(prompts=st.lists(st.text(max_size=60), min_size=1, max_size=5))
def test_prompt_features_deterministic_and_normalised(prompts: list[str]) -> None:
    feats = prompt_features(prompts, len(prompts), 32)
    assert feats.shape == (len(prompts), 32) and feats.dtype == np.float32
    for text, row in zip(prompts, feats, strict=False):
        norm = float(np.linalg.norm(row))
        assert norm == pytest.approx(1.0, abs=1e-5) if text.split() else norm == 0.0
        np.testing.assert_array_equal(prompt_features([text], 1, 32)[0], row)  # batch-independent
    assert prompt_features(None, 2, 8).tolist() == [[0.0] * 8] * 2
