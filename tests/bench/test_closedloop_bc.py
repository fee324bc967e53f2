"""reach-bc: shipped weights, equal answers on torch, JAX and numpy, and it does the task."""

from __future__ import annotations

import os

import numpy as np
import pytest

from chunkline.policies.embedded.bc import BC_HEADER_KEY, load_bc, save_bc
from chunkline.policies.exceptions import WeightsFormatError
from chunkline.policies.registry import list_policies, load_policy


def _states(n: int = 6) -> np.ndarray:
    rng = np.random.default_rng(0)
    s = np.zeros((n, 8), np.float32)
    s[:, 0] = rng.uniform(-6, 6, n)  # the shoulder turns without end stops
    s[:, 1] = rng.uniform(-2.5, 2.5, n)
    s[:, 2:4] = rng.normal(0, 2, (n, 2))
    ang = rng.uniform(-np.pi, np.pi, n)
    r = rng.uniform(0.08, 0.17, n)
    s[:, 4], s[:, 5] = r * np.cos(ang), r * np.sin(ang)
    s[:, 6], s[:, 7] = -0.3 * np.sin(ang), 0.3 * np.cos(ang)
    return s


def test_weights_are_a_few_hundred_kb_of_float32() -> None:
    w = load_bc()
    assert 50_000 <= w.num_params <= 200_000
    assert 200_000 <= os.path.getsize(os.path.join(os.path.dirname(__import__("chunkline.policies.embedded.bc", fromlist=["x"]).__file__), "reach_bc.npz")) <= 800_000
    assert all(a.dtype == np.float32 for a in w.arrays.values())
    assert w.horizon == 50 and w.action_dim == 2


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_torch_and_jax_answer_like_numpy(backend: str) -> None:
    pytest.importorskip(backend)
    ref = load_policy("reach-bc", backend="numpy")
    other = load_policy(f"reach-bc-{backend}")
    obs = {"state": _states(), "images/cam_high": np.zeros((6, 224, 224, 3), np.uint8)}
    a, b = ref.infer_batch(obs), other.infer_batch(obs)
    assert a.shape == b.shape == (6, 50, 2)
    assert np.allclose(a, b, atol=2e-5, rtol=0)
    assert ref.fingerprint != other.fingerprint  # same weights, another backend: another deployment


def test_registry_knows_the_task_policies() -> None:
    names = list_policies()
    for name in ("reach-expert", "track7-expert", "reach-bc"):
        assert name in names
    assert load_policy("reach-expert").spec.action_dim == 2


def test_a_bad_weights_file_is_refused(tmp_path) -> None:
    w = load_bc()
    good = tmp_path / "good.npz"
    save_bc(w, good)
    assert np.array_equal(load_bc(good).arrays["w0"], w.arrays["w0"])
    arrays = {k: np.array(v) for k, v in w.arrays.items()}
    arrays.pop("b2")
    np.savez(tmp_path / "missing.npz", **arrays, **{BC_HEADER_KEY: np.frombuffer(b'{"format": "chunkline.bc", "version": 1, "horizon": 50, "action_dim": 2, "scale": 1.0}', np.uint8)})
    with pytest.raises(WeightsFormatError):
        load_bc(tmp_path / "missing.npz")
    np.savez(tmp_path / "noheader.npz", **{k: np.array(v) for k, v in w.arrays.items()})
    with pytest.raises(WeightsFormatError):
        load_bc(tmp_path / "noheader.npz")


def test_the_clone_does_the_task_at_zero_delay() -> None:
    pytest.importorskip("gymnasium")
    pytest.importorskip("mujoco")
    from chunkline.bench.closedloop.des import Conditions, LocalServer, run_des_episode
    from chunkline.bench.closedloop.tasks import make_task

    task = make_task("reach", episode_s=4.0)
    server = LocalServer(load_policy("reach-bc", backend="numpy"))
    results = [run_des_episode(task, "chunkline", server, Conditions(0.0), seed=s) for s in (0, 1, 2)]
    assert sum(r.success for r in results) >= 2, [r.score for r in results]
    assert all(r.score < 0.05 for r in results)
    task.close()
