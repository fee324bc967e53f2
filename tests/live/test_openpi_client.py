"""The real openpi-client 0.1.2 from PyPI, unchanged, against `chunkline serve` (from its own
virtual environment, as it would run on a robot: ``openpi_helpers``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import openpi_helpers
import pytest
from tenants_files import POLICY_ONLY, TenantsFile

from chunkline.bench.serverproc import ServerProcess


@pytest.fixture(scope="module")
def openpi_python() -> Path:
    try:
        return openpi_helpers.openpi_python()
    except subprocess.CalledProcessError as exc:  # a machine without the package registry
        pytest.fail(f"could not install openpi-client==0.1.2 into {openpi_helpers.VENV}: {exc}")


def test_openpi_client_with_its_api_key(openpi_python: Path, tenants_file: TenantsFile) -> None:
    tenants, keys = tenants_file({"lab": POLICY_ONLY}, keys=("lab",))
    key = keys["lab"]
    with ServerProcess(["--tenants", str(tenants), "--policy", "noop"]) as server:
        refused = openpi_helpers.run_openpi(openpi_python, str(server.port), "ck_wrong")
        assert refused.returncode != 0 and "401" in refused.stderr
        accepted = openpi_helpers.run_openpi(openpi_python, str(server.port), key)
        assert accepted.returncode == 0, accepted.stderr
        assert json.loads(accepted.stdout.strip().splitlines()[-1])["actions_shape"] == [50, 14]


def test_openpi_client_unchanged_against_chunkline(openpi_python: Path, noop_server: ServerProcess) -> None:
    result = openpi_helpers.run_openpi(openpi_python, str(noop_server.port))
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
        result = openpi_helpers.run_openpi(openpi_python, str(server.port), "", "wss://127.0.0.1", env_extra={"SSL_CERT_FILE": str(cert)})
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1])["actions_shape"] == [50, 14]
