"""load_policy: names, backend suffixes, .npz paths, module:factory; lazy heavy imports."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from policies_for_tests import CountingPolicy

import chunkline.policies as policies
from chunkline.policies import (
    NumpyPolicy,
    OpenPIPolicy,
    Policy,
    PolicyLoadError,
    PolicyNotFound,
    WeightsFormatError,
    example_observation,
    list_policies,
    load_policy,
    stack_observations,
)
from chunkline.policies.embedded import (
    FailingPolicy,
    LoadtestConfig,
    NoopPolicy,
    SleepPolicy,
    generate_weights,
    save_weights,
)


def _one(policy: Policy) -> dict[str, Any]:
    return stack_observations(policy.spec, [example_observation(policy.spec, np.random.default_rng(0))])


def test_list_policies() -> None:
    names = list_policies()
    assert {"noop", "loadtest", "loadtest-compute", "fail"} <= set(names)
    assert any(n.startswith("sleep:") for n in names)


def test_unknown_names_list_the_known_ones() -> None:
    for ref in ("nope", "loadtest-tpu", "sleep:abc", "loadtest_jax", ""):
        with pytest.raises(PolicyNotFound) as info:
            load_policy(ref)
        assert "loadtest" in str(info.value) and info.value.available == list_policies()
        assert isinstance(info.value, LookupError)


def test_simple_names() -> None:
    assert isinstance(load_policy("noop"), NoopPolicy)
    assert isinstance(load_policy("fail"), FailingPolicy)
    sleep = load_policy("sleep:0.25")
    assert isinstance(sleep, SleepPolicy) and sleep.seconds == 0.25
    for bad in ("sleep:-1", "sleep:nan", "sleep:inf"):
        with pytest.raises(PolicyLoadError):
            load_policy(bad)


@pytest.mark.parametrize(
    ("ref", "backend", "cls"),
    [("loadtest-numpy", None, "NumpyPolicy"), ("loadtest-compute", "numpy", "NumpyPolicy"),
     ("loadtest-compute-jax", None, "JaxPolicy"), ("loadtest-torch", None, "TorchPolicy"),
     ("loadtest", None, "TorchPolicy")],
)
def test_embedded_names_and_backends(ref: str, backend: str | None, cls: str) -> None:
    if cls != "NumpyPolicy":
        pytest.importorskip("torch" if cls == "TorchPolicy" else "jax")
    policy = load_policy(ref, backend=backend)
    assert type(policy).__name__ == cls
    assert policy.name == ref
    out = policy.infer_batch(_one(policy))
    assert out.shape == (1, 50, 14)


def test_backend_conflicts_and_unknown_backends() -> None:
    with pytest.raises(PolicyLoadError):
        load_policy("loadtest-jax", backend="numpy")
    with pytest.raises(PolicyLoadError):
        load_policy("loadtest", backend="tensorflow")
    with pytest.raises(PolicyLoadError):
        load_policy("loadtest", backend="numpy", device="cuda:0")


def test_default_backend_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from chunkline.policies import registry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    assert registry.default_backend() == "numpy"
    assert isinstance(load_policy("loadtest-compute"), NumpyPolicy)


def test_npz_path(tmp_path: Path) -> None:
    w = generate_weights(LoadtestConfig(width=32, blocks=1), seed=3)
    path = tmp_path / "mine.npz"
    save_weights(path, w)
    policy = load_policy(str(path), backend="numpy")
    assert isinstance(policy, NumpyPolicy) and policy.name == "mine"
    assert policy.infer_batch(_one(policy)).shape == (1, 50, 14)
    with pytest.raises(PolicyLoadError):
        load_policy(str(tmp_path / "absent.npz"))
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"nope")
    with pytest.raises(WeightsFormatError):
        load_policy(str(junk))


_counter = itertools.count()


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> str:
    name = f"chunkline_test_factory_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_module_factory_returning_a_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _module(tmp_path, monkeypatch, """
        from chunkline.policies.embedded import NoopPolicy
        from policies_for_tests import CountingPolicy
        calls = []
        def make():
            calls.append(None)
            return NoopPolicy(name="mine")
        class Factories:
            @staticmethod
            def counting(device):
                calls.append(device)
                return CountingPolicy()
    """)
    policy = load_policy(f"{mod}:make", device="cuda:3")
    assert isinstance(policy, NoopPolicy) and policy.name == "mine"
    counting = load_policy(f"{mod}:Factories.counting", device="cuda:3")  # dotted attribute, takes device
    assert isinstance(counting, CountingPolicy)
    assert sys.modules[mod].calls == [None, "cuda:3"]


def test_module_factory_with_kwargs_gets_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _module(tmp_path, monkeypatch, """
        from chunkline.policies.embedded import NoopPolicy
        def make(**kw):
            return NoopPolicy(name=kw["device"])
    """)
    assert load_policy(f"{mod}:make", device="cpu").name == "cpu"


def test_module_factory_returning_an_openpi_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _module(tmp_path, monkeypatch, """
        import numpy as np
        from chunkline.policies.embedded import aloha_spec
        class Pi:
            chunkline_spec = aloha_spec(horizon=10)
            metadata = {"model": "pi0-like"}
            def __init__(self):
                self.seen = []
            def infer(self, obs):
                self.seen.append(sorted(obs))
                return {"actions": np.full((10, 14), float(obs["state"][0]))}
        def make(device="cpu"):
            return Pi()
        def no_spec():
            p = Pi()
            p.chunkline_spec = None
            return p
        def nothing():
            return 42
        def broken():
            raise RuntimeError("checkpoint missing")
    """)
    policy = load_policy(f"{mod}:make")
    assert isinstance(policy, OpenPIPolicy) and policy.spec.horizon == 10
    assert policy.metadata()["model"] == "pi0-like"
    obs = stack_observations(policy.spec, [example_observation(policy.spec, np.random.default_rng(i)) for i in range(2)])
    out = policy.infer_batch(obs)
    assert out.shape == (2, 10, 14) and out.dtype == np.float32
    np.testing.assert_allclose(out[:, 0, 0], obs["state"][:, 0], rtol=1e-6)
    for bad in ("no_spec", "nothing", "broken", "absent"):
        with pytest.raises(PolicyLoadError):
            load_policy(f"{mod}:{bad}")
    with pytest.raises(PolicyLoadError):
        load_policy("chunkline_no_such_module_xyz:make")


def test_import_is_light() -> None:
    """Importing the package, listing, and serving numpy/noop policies never imports torch or jax."""
    code = textwrap.dedent(
        """
        import sys
        import chunkline.policies as P
        import chunkline.policies.embedded
        import chunkline.policies.registry, chunkline.policies.numpy_backend, chunkline.policies.openpi_adapter
        P.list_policies()
        for ref in ("noop", "fail", "sleep:0", "loadtest-compute-numpy"):
            P.load_policy(ref)
        heavy = sorted(m for m in ("torch", "jax", "jaxlib") if m in sys.modules)
        assert not heavy, heavy
        P.TorchPolicy  # the lazy attribute works, and only now imports torch
        assert "torch" in sys.modules and "jax" not in sys.modules
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok"


def test_lazy_attributes() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    from chunkline.policies.jax_backend import JaxPolicy
    from chunkline.policies.torch_backend import TorchPolicy

    assert policies.TorchPolicy is TorchPolicy and policies.JaxPolicy is JaxPolicy
    assert "TorchPolicy" in dir(policies)
    with pytest.raises(AttributeError):
        policies.NoSuchThing  # noqa: B018
