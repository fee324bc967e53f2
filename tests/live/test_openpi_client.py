"""The real openpi-client 0.1.2 from PyPI, unchanged, against `chunkline serve`.

openpi-client pins numpy<2 and forgets to declare typing_extensions, so it runs from its own
virtual environment made here (as it would on a robot), not by pinning our numpy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import repo_paths
from tenants_files import POLICY_ONLY, TenantsFile

from chunkline.bench.serverproc import ServerProcess

REPO = repo_paths.ROOT
VENV = REPO / ".venv-openpi"


def _openpi_python() -> Path:
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "openpi-client==0.1.2", "typing_extensions"],
                       check=True)
        stamp.write_text("openpi-client==0.1.2\n")
    return python


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from openpi_client import websocket_client_policy, action_chunk_broker

    port = int(sys.argv[1])
    key = (sys.argv[2] or None) if len(sys.argv) > 2 else None
    host = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
    policy = websocket_client_policy.WebsocketClientPolicy(host=host, port=port, api_key=key)
    meta = policy.get_server_metadata()
    rng = np.random.default_rng(0)
    def obs():
        o = {f"images/{c}": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
             for c in ("cam_high", "cam_left_wrist", "cam_right_wrist")}
        o["state"] = rng.standard_normal(14)  # float64, as openpi examples send
        o["prompt"] = "fold the towel"
        return o
    out = policy.infer(obs())
    broker = action_chunk_broker.ActionChunkBroker(policy, action_horizon=10)
    steps = [broker.infer(obs())["actions"].shape for _ in range(25)]
    print(json.dumps({
        "meta_horizon": meta["action_horizon"],
        "actions_shape": list(out["actions"].shape),
        "actions_dtype": str(out["actions"].dtype),
        "timing_keys": sorted(out["server_timing"]),
        "step_shapes": sorted(set(map(tuple, steps))),
        "numpy": np.__version__,
    }))
    """
)


@pytest.fixture(scope="module")
def openpi_python() -> Path:
    try:
        return _openpi_python()
    except subprocess.CalledProcessError as exc:  # a machine without the package registry
        pytest.fail(f"could not install openpi-client==0.1.2 into {VENV}: {exc}")


def _run_openpi(python: Path, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(env_extra or {})
    return subprocess.run([str(python), "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)


def test_openpi_client_with_its_api_key(openpi_python: Path, tenants_file: TenantsFile) -> None:
    tenants, keys = tenants_file({"lab": POLICY_ONLY}, keys=("lab",))
    key = keys["lab"]
    with ServerProcess(["--tenants", str(tenants), "--policy", "noop"]) as server:
        refused = _run_openpi(openpi_python, str(server.port), "ck_wrong")
        assert refused.returncode != 0 and "401" in refused.stderr
        accepted = _run_openpi(openpi_python, str(server.port), key)
        assert accepted.returncode == 0, accepted.stderr
        assert json.loads(accepted.stdout.strip().splitlines()[-1])["actions_shape"] == [50, 14]


def test_openpi_client_unchanged_against_chunkline(openpi_python: Path, noop_server: ServerProcess) -> None:
    result = _run_openpi(openpi_python, str(noop_server.port))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["numpy"].startswith("1."), "openpi-client must run on its own numpy<2"
    assert out["meta_horizon"] == 50
    assert out["actions_shape"] == [50, 14] and out["actions_dtype"] == "float32"
    assert "infer_ms" in out["timing_keys"]
    assert out["step_shapes"] == [[14]]


def test_openpi_client_through_wss(openpi_python: Path, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    with ServerProcess(["--policy", "noop", "--tls-cert", str(cert), "--tls-key", str(key)]) as server:
        # The robot trusts the server's certificate through the standard SSL_CERT_FILE variable.
        result = _run_openpi(openpi_python, str(server.port), "", "wss://127.0.0.1", env_extra={"SSL_CERT_FILE": str(cert)})
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1])["actions_shape"] == [50, 14]
