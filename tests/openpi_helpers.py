"""The real openpi-client 0.1.2 from PyPI, unchanged, in a virtual environment of its own (it pins
numpy<2 and forgets to declare typing_extensions, as it would run on a robot), and a script that
serves as its robot: one ``infer`` and 25 steps of its own action-chunk broker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import repo_paths

VENV = repo_paths.ROOT / ".venv-openpi"


def openpi_python() -> Path:
    """The openpi-client virtual environment's python (made on first use)."""
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


def run_openpi(python: Path, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the robot script on ``python`` with ``args`` (port, key, host), outside our environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(env_extra or {})
    return subprocess.run([str(python), "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)
