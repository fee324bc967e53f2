"""Start-up and shutdown are one life cycle: SIGTERM at any moment (during the imports, the
policy's load and warm-up, or under load) drains once and exits 0 within the drain timeout, and
``ready`` is never logged after ``draining``.

Each run is a real ``chunkline serve`` process on a policy whose load and warm-up take a known
time (``tests/slow_start_policy.py``); the moment of the signal is drawn from a seeded generator,
from the moment chunkline catches SIGTERM (the interpreter's own start, before chunkline's first
line, keeps the default action: the process ends by the signal, nothing started).
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import repo_paths

from chunkline.client import ChunklineError, Client

GRACE_S = 2.0
#: what a process may take after its drain to tear down (interpreter exit on a shared machine)
EXIT_MARGIN_S = 4.0
LOAD_S, WARM_S = 0.3, 0.3
RUNS = int(os.environ.get("CHUNKLINE_SIGTERM_RUNS", "50"))


@dataclass(slots=True)
class Run:
    index: int
    phase: str
    returncode: int
    exit_s: float
    log: str


def _server_command(port_file: Path) -> list[str]:
    return [sys.executable, "-c", "from chunkline.server.entrypoints.cli import main; raise SystemExit(main())",
            "serve", "--no-auth", "--no-ledger", "--port", "0", "--port-file", str(port_file),
            "--shutdown-grace", str(GRACE_S), "--policy", "slow_start_policy:make",
            "--policy-arg", f"load_s={LOAD_S}", "--policy-arg", f"warm_s={WARM_S}", "--log-level", "INFO"]


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.01)
    raise AssertionError(f"{path.name} never appeared")


def _wait_until_caught(proc: subprocess.Popen[bytes], sig: int, timeout: float = 60) -> None:
    """Until ``proc`` has a handler for ``sig`` (its ``SigCgt`` mask in ``/proc``): chunkline's
    first line has run; before it the interpreter starts and the default action applies."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            return
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught >> (sig - 1) & 1:
            return
        time.sleep(0.005)
    raise AssertionError(f"the server never caught signal {sig}")


def _drive(uri: str, stop: threading.Event) -> None:
    """Requests back to back until the server goes away (it closes the session on drain)."""
    obs = {"images/cam_high": np.zeros((224, 224, 3), np.uint8), "images/cam_left_wrist": np.zeros((224, 224, 3), np.uint8),
           "images/cam_right_wrist": np.zeros((224, 224, 3), np.uint8), "state": np.zeros(14, np.float32), "prompt": "x"}
    try:
        with Client.connect(uri, connect_timeout=10) as client:
            while not stop.is_set():
                client.infer(obs, obs_time=time.monotonic(), deadline_ms=2000)
    except (ChunklineError, OSError):
        pass


def _one(index: int, tmp: Path) -> Run:
    rng = random.Random(index)
    phase = ("imports", "load and warm-up", "under load")[index % 3]
    folder = tmp / f"run{index}"
    folder.mkdir()
    port_file = folder / "port"
    env = {**os.environ, **repo_paths.env_with_tests_on_path()}
    with open(folder / "log.txt", "wb") as log:
        proc = subprocess.Popen(_server_command(port_file), stdout=log, stderr=subprocess.STDOUT, cwd=folder, env=env)
        stop, driver = threading.Event(), None
        try:
            if phase == "imports":
                _wait_until_caught(proc, signal.SIGTERM)  # past the interpreter's own start (default SIGTERM there)
                time.sleep(rng.uniform(0.0, 1.0))
            elif phase == "load and warm-up":
                _wait_for(port_file, proc, 60)  # listening: the load starts now
                time.sleep(rng.uniform(0.0, LOAD_S + WARM_S + 0.3))
            else:
                port = _wait_for(port_file, proc, 60)
                driver = threading.Thread(target=_drive, args=(f"ws://127.0.0.1:{port}", stop))
                driver.start()
                time.sleep(LOAD_S + WARM_S + rng.uniform(0.5, 1.5))
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            returncode = proc.wait(timeout=60)
            exit_s = time.monotonic() - signalled
        finally:
            stop.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if driver is not None:
                driver.join(timeout=30)
    return Run(index, phase, returncode, exit_s, (folder / "log.txt").read_text(errors="replace"))


def _problems(run: Run) -> list[str]:
    out = []
    if run.returncode != 0:
        out.append(f"exit status {run.returncode}")
    if run.exit_s > GRACE_S + EXIT_MARGIN_S:
        out.append(f"exited {run.exit_s:.1f} s after SIGTERM")
    lines = run.log.splitlines()
    drained = [i for i, line in enumerate(lines) if "draining" in line]
    if len(drained) > 1:
        out.append("drained twice")
    if drained and any(line.endswith(" ready") or ": ready:" in line for line in lines[drained[0]:]):
        out.append("ready logged after draining")
    out += [line for line in lines if "Traceback" in line or "terminate called" in line or "ERROR" in line]
    return out


# A stress run, outside `make test` (`make test-stress`): about one run in ten still finds a start-up
# point where the signal is not drained cleanly (an open defect of the life cycle, not of the test).
@pytest.mark.slow
@pytest.mark.stress
def test_sigterm_at_random_points_exits_cleanly_every_time(tmp_path: Path) -> None:
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(lambda i: _one(i, tmp_path), range(RUNS)))
    failed = {f"run {r.index} ({r.phase})": _problems(r) for r in runs if _problems(r)}
    assert not failed, failed
    assert {r.phase for r in runs} == {"imports", "load and warm-up", "under load"}
    # the drain is what ended them: every run that logged anything drained once
    assert sum("draining" in r.log for r in runs) >= RUNS * 2 // 3
