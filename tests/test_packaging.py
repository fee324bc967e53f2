"""The built wheel installs into a clean environment with only the base dependencies, and the
robot-side packages import from it (no torch, no jax, no server extras)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_installs_with_base_dependencies_only(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("chunkline-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "--quiet", str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    code = ("import importlib.util, chunkline.client, chunkline.broker, chunkline.safety\n"
            "from chunkline.client import Client\n"
            "from chunkline.broker import Broker, BrokerConfig\n"
            "from chunkline.safety import Limits\n"
            "extras = [m for m in ('torch', 'jax', 'ray', 'starlette', 'prometheus_client') if importlib.util.find_spec(m)]\n"
            "print('ok', extras)\n")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok []", out.stdout
