"""Start a real ``chunkline serve`` process on loopback, for benchmarks, the demo and tests."""

from __future__ import annotations

import dataclasses
import http.client
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ServerProcess", "http_get", "CpuTimes", "cpu_times", "stop_child", "signal_for_file"]


def http_get(host: str, port: int, path: str, timeout: float = 2.0, headers: dict[str, str] | None = None,
             tls: bool = False) -> tuple[int, bytes]:
    """One HTTP GET (HTTPS without certificate checks when ``tls``: probes only); returns (status, body)."""
    if tls:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=ssl._create_unverified_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@dataclasses.dataclass(frozen=True)
class CpuTimes:
    """CPU seconds (user + system) a process has used so far.

    Args:
        total: all its threads, those that have exited included.
        main: its main thread alone (a server's event loop).
    """

    total: float
    main: float

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.total - other.total, self.main - other.main)


def _stat_seconds(path: str) -> float:
    with open(path) as f:
        # The command name may hold spaces and parentheses: fields count from the last ')'.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> CpuTimes | None:
    """The CPU a process has used, from ``/proc`` (Linux; ``None`` elsewhere or once it is gone).

    CPU seconds per request are what a benchmark on a shared machine can trust: other jobs
    stretch wall-clock figures, hardly the CPU a request costs.

    Args:
        pid: the process.
    """
    try:
        return CpuTimes(_stat_seconds(f"/proc/{pid}/stat"), _stat_seconds(f"/proc/{pid}/task/{pid}/stat"))
    except (OSError, ValueError, IndexError):
        return None


def stop_child(proc: subprocess.Popen[Any], timeout: float, escalate: Sequence[str]) -> int:
    """Wait for a child to exit, escalating while it does not; returns its exit code.

    Args:
        proc: the child (already asked to exit, or about to exit by itself).
        timeout: seconds to wait before each escalation.
        escalate: ``Popen`` methods to call in turn when a wait times out (``"terminate"``,
            ``"kill"``); after the last one the wait is unbounded (a killed child always ends).
    """
    for step in escalate:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            getattr(proc, step)()
    return proc.wait()


class ServerProcess:
    """``chunkline serve`` in a child process on a free loopback port.

    Args:
        args: extra ``serve`` arguments (e.g. ``["--policy", "noop"]``).
        ready_timeout: seconds to wait for ``/readyz``.
        env: extra environment variables.
        log_path: where the server's output goes (a temp file by default).
        host: the address it listens on.
        prefix: prepended to its command line (``ip netns exec NS`` runs it in a namespace).
        probe: ``probe(fn, *args)`` runs the readiness check where it reaches ``host`` (a thread
            inside the namespace); by default, here.
    """

    def __init__(self, args: list[str], *, ready_timeout: float = 120.0, env: dict[str, str] | None = None,
                 log_path: Path | None = None, host: str = "127.0.0.1", prefix: Sequence[str] = (),
                 probe: Callable[..., Any] | None = None) -> None:
        self.args = args
        self.prefix = list(prefix)
        self._probe = probe or (lambda fn, *a: fn(*a))
        self.ready_timeout = ready_timeout
        self.env = {**os.environ, **(env or {})}
        self.host = host
        self._tmp = tempfile.TemporaryDirectory(prefix="chunkline-")
        self.log_path = log_path or Path(self._tmp.name) / "server.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def ledger_path(self) -> Path:
        """The ledger this server writes (unless ``--ledger``/``--no-ledger`` was given)."""
        return Path(self._tmp.name) / "ledger.db"

    @property
    def metrics_port(self) -> int:
        """The ``--metrics-port`` listener's port (when one was asked for)."""
        return int(Path(f"{self.port_file}.metrics").read_text())

    @property
    def http_port(self) -> int:
        """The OpenAI-compatible API's port (with ``--http-port``)."""
        return int(Path(f"{self.port_file}.http").read_text())

    @property
    def uri(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'wss' if '--tls-cert' in self.args else 'ws'}://{host}:{self.port}"

    def start(self) -> ServerProcess:
        port_file = Path(self._tmp.name) / "port"
        extra = []
        if "--tenants" not in self.args and "--no-auth" not in self.args and "--config" not in self.args:
            extra.append("--no-auth")  # a throwaway server on loopback
        if "--ledger" not in self.args and "--no-ledger" not in self.args:
            extra += ["--ledger", str(Path(self._tmp.name) / "ledger.db")]
        cmd = [*self.prefix, sys.executable, "-m", "chunkline.server", "serve", "--host", self.host, "--port", "0",
               "--port-file", str(port_file), *extra, *self.args]
        self.port_file = port_file
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        give_up = time.monotonic() + self.ready_timeout
        while time.monotonic() < give_up:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if not self.port and port_file.exists() and port_file.read_text().strip():
                self.port = int(port_file.read_text())
            if self.port:
                try:
                    status, _ = self._probe(http_get, self.host, self.port, "/readyz", 2.0, None, "--tls-cert" in self.args)
                    if status == 200:
                        return self
                except OSError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server not ready within {self.ready_timeout} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def terminate(self) -> None:
        """Send SIGTERM (graceful drain)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait, then SIGKILL if needed; returns the exit code."""
        if self.proc is None:
            return None
        self.terminate()
        code = stop_child(self.proc, timeout, ("kill",))
        self._log.close()
        return code

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._tmp.cleanup()


def signal_for_file(server: ServerProcess, sig: int, path: Path, what: str, timeout: float = 30.0) -> Path:
    """Send ``sig`` to a server process that answers it by writing ``path`` (whole, by a rename),
    and wait for the file. Raises RuntimeError with the server's log if it does not come.

    Args:
        server: the running server.
        sig: the signal (``signal.SIGUSR1``, ...).
        path: the file it writes.
        what: what the file holds, for the error.
        timeout: seconds to wait.
    """
    assert server.proc is not None
    server.proc.send_signal(sig)
    give_up = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > give_up:
            raise RuntimeError(f"no {what} from the server:\n{server.log()}")
        time.sleep(0.01)
    return path
