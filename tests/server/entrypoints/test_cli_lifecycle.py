"""Start-up and shutdown are one life cycle: SIGTERM at any moment (during the imports, the
policy's load and warm-up, or under load) drains once and exits 0 within the drain timeout, and
``ready`` is never logged after ``draining``.

Each run is a real ``chunkline serve`` process on a policy whose load and warm-up take a known
time (``tests/slow_start_policy.py``), started as the console script starts it (``launch.main``);
the moment of the signal is drawn from a seeded generator, from the moment chunkline catches
SIGTERM (the interpreter's own start, before the entry module's first line, keeps the default
action: the process ends by the signal, nothing started).
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
    return [sys.executable, "-c", "from chunkline.server.entrypoints.launch import main; raise SystemExit(main())",
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
    """Until ``proc`` has a handler for ``sig`` (its ``SigCgt`` mask in ``/proc``): the entry
    module's first line has run; before it the interpreter starts and the default action applies."""
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


def _message(line: str) -> str:
    return line.partition(" chunkline.server: ")[2]


def _is_ready_line(line: str) -> bool:
    """The server's ``ready`` and a policy's ``ready: NAME ...`` (not a later line that mentions it)."""
    return _message(line) == "ready" or _message(line).startswith("ready: ")


def _problems(run: Run) -> list[str]:
    out = []
    if run.returncode != 0:
        out.append(f"exit status {run.returncode}")
    if run.exit_s > GRACE_S + EXIT_MARGIN_S:
        out.append(f"exited {run.exit_s:.1f} s after SIGTERM")
    lines = run.log.splitlines()
    drained = [i for i, line in enumerate(lines) if _message(line).startswith("draining: ") and "requests in flight" in line]
    if len(drained) > 1:
        out.append("drained twice")
    if drained and any(_is_ready_line(line) for line in lines[drained[0]:]):
        out.append("ready logged after draining")
    out += [line for line in lines if "Traceback" in line or "terminate called" in line or "ERROR" in line]
    return out


# A stress run, outside `make test` (`make test-stress`): it takes minutes on 2 cores.
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


def test_the_log_checks_tell_ready_and_drain_lines_from_lines_that_mention_them() -> None:
    head = "2026-01-01 00:00:00,000 INFO chunkline.server: "
    drained = [head + "draining: 0 requests in flight"]
    late = [head + "policy p: every batch size up to 16 timed, 0.6 s after ready"]
    waiting = [head.replace("INFO", "WARNING") + "draining: waiting for the start-up step in progress (a policy load) to finish"]
    assert _problems(Run(0, "under load", 0, 1.0, "\n".join([head + "ready", *drained, *waiting, *late]))) == []
    assert _problems(Run(0, "under load", 0, 1.0, "\n".join(drained * 2))) == ["drained twice"]
    for ready in ("ready", "ready: p (p) in 1.00 s, fingerprint sha256:0"):
        assert _problems(Run(0, "under load", 0, 1.0, "\n".join([*drained, head + ready]))) == ["ready logged after draining"]


@pytest.mark.parametrize(("command", "expected"), [("serve", 0), ("infer", -signal.SIGTERM)])
def test_a_signal_during_the_imports_ends_serve_at_once_and_keeps_its_default_meaning_elsewhere(
        tmp_path: Path, command: str, expected: int) -> None:
    """The entry module catches SIGTERM before the imports: a ``serve`` that has started nothing
    exits 0 at once; any other command is ended by the signal, as without chunkline's handler."""
    cmd = _server_command(tmp_path / "port")
    if command != "serve":
        cmd = [*cmd[:3], command, "--uri", "ws://127.0.0.1:9"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        _wait_until_caught(proc, signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == expected, out.decode(errors="replace")
    assert b"Traceback" not in out
