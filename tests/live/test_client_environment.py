"""CHUNKLINE_URI and CHUNKLINE_API_KEY (argument > environment > default), and the openpi drop-in's
errors being the RuntimeError openpi code catches."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import repo_paths

from chunkline.bench.serverproc import ServerProcess
from chunkline.client import ServerError
from chunkline.client.core import ClientCore
from chunkline.client.environment import API_KEY_ENV, DEFAULT_URI, URI_ENV
from chunkline.client.openpi import WebsocketClientPolicy


def test_argument_beats_environment_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(URI_ENV, raising=False)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    core = ClientCore()
    assert core.uri == DEFAULT_URI and core.connect_options()["additional_headers"] is None
    monkeypatch.setenv(URI_ENV, "ws://10.0.0.7:9000")
    monkeypatch.setenv(API_KEY_ENV, "ck_from_env")
    core = ClientCore()
    assert core.uri == "ws://10.0.0.7:9000"
    assert core.connect_options()["additional_headers"] == {"Authorization": "Api-Key ck_from_env"}
    core = ClientCore("ws://127.0.0.1:1234", api_key="ck_given")
    assert core.uri == "ws://127.0.0.1:1234"
    assert core.connect_options()["additional_headers"] == {"Authorization": "Api-Key ck_given"}


def test_cli_infer_dials_chunkline_uri(noop_server: ServerProcess) -> None:
    env = {**os.environ, URI_ENV: noop_server.uri}
    out = subprocess.run([sys.executable, "-m", "chunkline.server", "infer", "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["actions_shape"] == [50, 14]


def test_openpi_drop_in_dials_chunkline_uri(noop_server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(URI_ENV, noop_server.uri)
    policy = WebsocketClientPolicy()
    try:
        assert "actions" in policy.infer(_noop_obs(policy.get_server_metadata()))
    finally:
        policy.close()


def _noop_obs(spec: dict[str, object]) -> dict[str, object]:
    from chunkline.server.entrypoints.cli import example_from_wire_spec

    return example_from_wire_spec(spec, np.random.default_rng(0))  # type: ignore[arg-type]


def test_openpi_drop_in_raises_runtime_error_on_a_server_error() -> None:
    """openpi-client raises RuntimeError when its server fails; code catching that keeps working."""
    with ServerProcess(["--policy", "policies_for_tests:flaky"], env=repo_paths.env_with_tests_on_path()) as server:
        policy = WebsocketClientPolicy(server.uri)
        try:
            obs = _noop_obs(policy.get_server_metadata())
            obs["state"] = np.full(14, 1000.0, np.float32)  # the flaky policy fails on it
            with pytest.raises(RuntimeError) as caught:
                policy.infer(obs)
            assert isinstance(caught.value, ServerError) and caught.value.code == "policy_failed"
        finally:
            policy.close()
