"""Fingerprints: equal across loads of the same thing, different when anything that changes
behaviour changes (weights, backend, device, precision, settings, batch sizes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from chunkline.policies import NumpyPolicy, OpenPIPolicy, PolicySpec, load_policy
from chunkline.policies.base import ArraySpec
from chunkline.policies.embedded import ComputeConfig, LoadtestConfig, build_embedded, generate_weights

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

CFG = LoadtestConfig(width=32, blocks=1, expansion=2)


def _fp(backend: str, seed: int = 0, config: Any = CFG, **kw: Any) -> str:
    return build_embedded(generate_weights(config, seed), backend=backend, **kw).fingerprint


@pytest.mark.parametrize("backend", ["torch", "jax", "numpy"])
def test_equal_across_two_loads(backend: str) -> None:
    assert _fp(backend) == _fp(backend)
    assert _fp(backend).startswith("sha256:")


@pytest.mark.parametrize("backend", ["torch", "jax", "numpy"])
def test_weights_change_fingerprint(backend: str) -> None:
    assert _fp(backend, seed=0) != _fp(backend, seed=1)
    w = generate_weights(CFG, 0)
    tweaked = dict(w.arrays)
    tweaked["head.b"] = tweaked["head.b"].copy()
    tweaked["head.b"][0] += 1e-3  # one value in 26k
    from chunkline.policies.embedded import EmbeddedWeights

    assert build_embedded(EmbeddedWeights(CFG, tweaked), backend=backend).fingerprint != _fp(backend)


@pytest.mark.parametrize("backend", ["torch", "jax", "numpy"])
def test_architecture_changes_fingerprint(backend: str) -> None:
    assert _fp(backend, config=CFG) != _fp(backend, config=LoadtestConfig(width=32, blocks=1, expansion=2, tokens=2))


def test_backends_differ() -> None:
    fps = {_fp(b) for b in ("torch", "jax", "numpy")}
    assert len(fps) == 3


def test_jax_batch_sizes_enter_fingerprint() -> None:
    assert _fp("jax", batch_sizes=(1, 2)) != _fp("jax", batch_sizes=(1, 2, 4))
    assert _fp("jax", batch_sizes=(2, 1)) == _fp("jax", batch_sizes=(1, 2))  # order does not matter


def test_torch_precision_enters_fingerprint() -> None:
    assert _fp("torch", precision="float32") != _fp("torch", precision="float16")


def test_settings_enter_fingerprint() -> None:
    from chunkline.policies import JaxPolicy, TorchPolicy

    spec = PolicySpec(observation={"x": ArraySpec((2,), "float32")}, action_dim=1, horizon=1, dt=0.1)
    w = {"w": np.ones(2, np.float32)}
    fn = lambda obs: obs["x"][:, None, :1]  # noqa: E731
    assert NumpyPolicy("a", fn, spec, weights=w).fingerprint == NumpyPolicy("b", fn, spec, weights=w).fingerprint
    assert NumpyPolicy("a", fn, spec, weights=w).fingerprint != \
        NumpyPolicy("a", fn, spec, weights=w, settings={"temperature": 0.5}).fingerprint

    lin = torch.nn.Linear(2, 1)
    assert TorchPolicy("t", lin, spec).fingerprint != TorchPolicy("t", lin, spec, settings={"k": 1}).fingerprint
    apply = lambda p, o: o["x"][:, None, :1] * p["w"][0]  # noqa: E731
    assert JaxPolicy("j", apply, w, spec).fingerprint != JaxPolicy("j", apply, w, spec, settings={"k": 1}).fingerprint


def test_torch_fingerprint_tracks_buffers_and_dtype() -> None:
    from chunkline.policies import TorchPolicy

    spec = PolicySpec(observation={"x": ArraySpec((2,), "float32")}, action_dim=1, horizon=1, dt=0.1)
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    b = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    b.load_state_dict(a.state_dict())
    assert TorchPolicy("a", a, spec).fingerprint == TorchPolicy("b", b, spec).fingerprint
    with torch.no_grad():
        b[1].running_mean.add_(1.0)  # a buffer, not a parameter
    assert TorchPolicy("a", a, spec).fingerprint != TorchPolicy("b", b, spec).fingerprint


def test_numpy_without_weights_named_by_code() -> None:
    spec = PolicySpec(observation={"x": ArraySpec((2,), "float32")}, action_dim=1, horizon=1, dt=0.1)

    def f(obs: Mapping[str, Any]) -> np.ndarray:
        return obs["x"][:, None, :1]

    def g(obs: Mapping[str, Any]) -> np.ndarray:
        return obs["x"][:, None, 1:]

    assert NumpyPolicy("f", f, spec).fingerprint == NumpyPolicy("f", f, spec).fingerprint
    assert NumpyPolicy("f", f, spec).fingerprint != NumpyPolicy("g", g, spec).fingerprint


def test_spec_enters_fingerprint() -> None:
    a = build_embedded(generate_weights(ComputeConfig(width=16, layers=1, heads=2), 0), backend="numpy")
    b = build_embedded(generate_weights(ComputeConfig(width=16, layers=1, heads=2, dt=0.05), 0), backend="numpy")
    assert a.fingerprint != b.fingerprint


def test_openpi_fingerprint_from_digest_or_metadata() -> None:
    spec = PolicySpec(observation={"x": ArraySpec((2,), "float32")}, action_dim=1, horizon=1, dt=0.1)

    class P:
        def __init__(self, meta: dict[str, Any]) -> None:
            self.metadata = meta

        def infer(self, obs: Mapping[str, Any]) -> dict[str, Any]:
            return {"actions": np.zeros((1, 1), np.float32)}

    assert OpenPIPolicy(P({"v": 1}), spec).fingerprint == OpenPIPolicy(P({"v": 1}), spec).fingerprint
    assert OpenPIPolicy(P({"v": 1}), spec).fingerprint != OpenPIPolicy(P({"v": 2}), spec).fingerprint
    assert OpenPIPolicy(P({}), spec, digest="ckpt-a").fingerprint != OpenPIPolicy(P({}), spec, digest="ckpt-b").fingerprint


def test_registry_loads_agree() -> None:
    assert load_policy("noop").fingerprint == load_policy("noop").fingerprint
    assert load_policy("loadtest-compute-numpy").fingerprint == load_policy("loadtest-compute", backend="numpy").fingerprint
    assert load_policy("sleep:1").fingerprint != load_policy("sleep:2").fingerprint
    assert load_policy("noop").fingerprint != load_policy("sleep:0").fingerprint
