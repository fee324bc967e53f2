"""Policy references with arguments and names: module:factory from the current directory, factory
arguments, openpi objects with a spec from the configuration or one example, the serve flags."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import repo_paths

from chunkline.policies import OpenPIPolicy, PolicyLoadError, load_policy
from chunkline.server.config import ServerConfig
from chunkline.server.entrypoints.cli_errors import UsageError
from chunkline.server.entrypoints.server_flags import add_server_flags, server_config_from_args
from chunkline.server.robot.config import PolicyConfig, parse_policy_arg, policies_from_flags

POLICY_FILE = textwrap.dedent('''
    import numpy as np
    from chunkline.policies import ArraySpec, NumpyPolicy, PolicySpec

    SEEN = []  # the observations Nested objects were given, in order

    def make(scale=1.0, device="cpu"):
        spec = PolicySpec(observation={"state": ArraySpec((3,), "float32")}, action_dim=3, horizon=4, dt=0.05)
        return NumpyPolicy("scaled", lambda obs: np.repeat(obs["state"][:, None, :] * scale, 4, axis=1), spec, settings={"scale": scale})

    class Nested:
        """openpi-style: nested observation, metadata, no spec of its own."""
        example = {"images": {"cam": np.zeros((8, 8, 3), np.uint8)}, "state": np.zeros(2, np.float32), "prompt": "go"}
        metadata = {"robot": "test"}
        def __init__(self, horizon=5):
            self.horizon = horizon
        def infer(self, obs):
            SEEN.append(obs)
            return {"actions": np.full((self.horizon, 2), float(obs["state"][0]), np.float32)}

    def nested(horizon=5):
        return Nested(horizon)

    def needs_missing():
        import chunkline_no_such_dependency  # noqa: F401
''')


@pytest.fixture
def policy_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding mypol.py, the current directory, not on the import path (as the console script runs)."""
    (tmp_path / "mypol_chunkline_test.py").write_text(POLICY_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mypol_chunkline_test", raising=False)
    return tmp_path


def test_factory_from_the_current_directory_with_arguments(policy_dir: Path) -> None:
    policy = load_policy("mypol_chunkline_test:make", args={"scale": 2.0})
    out = policy.infer_batch({"state": np.ones((1, 3), np.float32)})
    assert out.shape == (1, 4, 3) and np.all(out == 2.0)


def test_unknown_factory_argument_names_what_it_takes(policy_dir: Path) -> None:
    with pytest.raises(PolicyLoadError, match="takes no argument 'fps'; it takes: scale, device"):
        load_policy("mypol_chunkline_test:make", args={"fps": 30})


def test_missing_module_says_what_to_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PolicyLoadError, match="current directory .* PYTHONPATH"):
        load_policy("chunkline_absent_module:make")


def test_missing_dependency_is_named_not_the_module(policy_dir: Path) -> None:
    with pytest.raises(PolicyLoadError, match="chunkline_no_such_dependency"):
        load_policy("mypol_chunkline_test:needs_missing")


def test_arguments_refused_by_embedded_names() -> None:
    with pytest.raises(PolicyLoadError, match="takes no arguments"):
        load_policy("noop", args={"fps": 30})


def test_openpi_object_spec_inferred_from_its_example(policy_dir: Path) -> None:
    policy = load_policy("mypol_chunkline_test:nested", args={"horizon": 7}, spec={"dt": 0.1})
    assert isinstance(policy, OpenPIPolicy)
    assert policy.spec.horizon == 7 and policy.spec.action_dim == 2 and policy.spec.dt == 0.1
    assert set(policy.spec.observation) == {"images/cam", "state", "prompt"}
    obs = {"images/cam": np.zeros((1, 8, 8, 3), np.uint8), "state": np.full((1, 2), 3.0, np.float32), "prompt": ["up"]}
    out = policy.infer_batch(obs)
    assert np.all(out == 3.0)
    seen = sys.modules["mypol_chunkline_test"].SEEN[-1]
    assert set(seen) == {"images", "state", "prompt"} and seen["images"]["cam"].shape == (8, 8, 3)  # nested, as openpi expects
    assert policy.metadata()["robot"] == "test"


def test_openpi_object_spec_from_the_toml_table(policy_dir: Path) -> None:
    spec = {"dt": 0.02, "horizon": 5, "action_dim": 2, "nest": True,
            "observation": {"state": {"shape": [2], "dtype": "float32"}, "images/cam": {"shape": [8, 8, 3], "dtype": "uint8"}}}
    policy = load_policy("mypol_chunkline_test:nested", spec=spec)
    assert policy.spec.observation["state"].shape == (2,) and policy.spec.horizon == 5


def test_openpi_spec_needs_dt(policy_dir: Path) -> None:
    with pytest.raises(PolicyLoadError, match="needs dt"):
        load_policy("mypol_chunkline_test:nested", spec={"horizon": 5})


def test_policy_arg_values_are_toml_values() -> None:
    assert parse_policy_arg("fps=30") == ("fps", 30)
    assert parse_policy_arg("scale=0.5") == ("scale", 0.5)
    assert parse_policy_arg("sim=true") == ("sim", True)
    assert parse_policy_arg("path=/ckpt/act") == ("path", "/ckpt/act")
    assert parse_policy_arg("dims=[1, 2]") == ("dims", [1, 2])
    with pytest.raises(ValueError):
        parse_policy_arg("no-equals")


def test_arguments_and_names_belong_to_the_policy_before_them() -> None:
    policies = policies_from_flags([("policy", "a:make"), ("policy_arg", "fps=30"), ("name", "alpha"),
                                    ("policy", "lerobot:/ckpt"), ("policy_arg", "fps=10")])
    assert [(p.ref, p.model_name, p.args) for p in policies] == [("a:make", "alpha", {"fps": 30}), ("lerobot:/ckpt", "lerobot:/ckpt", {"fps": 10})]
    with pytest.raises(ValueError, match="before any --policy"):
        policies_from_flags([("policy_arg", "fps=30"), ("policy", "a:make")])


def test_serve_flags_make_the_config() -> None:
    p = argparse.ArgumentParser()
    add_server_flags(p)
    args = p.parse_args(["--no-auth", "--policy", "a:make", "--policy-arg", "fps=30", "--name", "act", "--policy", "noop"])
    config = server_config_from_args(args)
    assert isinstance(config, ServerConfig)
    assert [(pc.model_name, pc.args) for pc in config.policies] == [("act", {"fps": 30}), ("noop", {})]
    with pytest.raises(UsageError, match="comes before any --policy"):
        server_config_from_args(p.parse_args(["--no-auth", "--name", "x", "--policy", "noop"]))


def test_toml_table_per_policy(tmp_path: Path) -> None:
    from chunkline.server.config import load_config

    path = tmp_path / "serve.toml"
    path.write_text(textwrap.dedent('''
        no_auth = true
        [[policies]]
        ref = "lerobot:/ckpt/act"
        name = "act"
        warm_batch_sizes = [1, 8]
        [policies.args]
        fps = 30
        [[policies]]
        ref = "mypol:make"
        [policies.spec]
        dt = 0.02
        example = "example.npz"
    '''))
    config = load_config(path)
    assert config.policies[0].args == {"fps": 30} and config.policies[0].warm_batch_sizes == (1, 8)
    assert config.policies[1].spec == {"dt": 0.02, "example": "example.npz"}
    with pytest.raises(ValueError):
        PolicyConfig(ref="noop", warm_batch_sizes=(8,))


def test_torch_is_a_range_in_the_extras() -> None:
    import tomllib

    project = tomllib.loads((repo_paths.ROOT / "pyproject.toml").read_text())["project"]
    torch_reqs = [r for reqs in project["optional-dependencies"].values() for r in reqs if r.replace(" ", "").startswith("torch")]
    assert torch_reqs and all("==" not in r for r in torch_reqs), torch_reqs


def test_example_frames_of_free_size_are_camera_sized() -> None:
    from chunkline.policies import ArraySpec, PolicySpec, example_observation

    spec = PolicySpec(observation={"cam": ArraySpec((None, None, 3), "uint8"), "seq": ArraySpec((None, 4), "float32")},
                      action_dim=1, horizon=1, dt=0.1)
    obs = example_observation(spec)
    assert obs["cam"].shape == (224, 224, 3) and obs["seq"].shape == (1, 4)
