"""The parent's side: start the proxy as a child process and steer it over its control port."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chunkline.bench.serverproc import stop_child

from .errors import FaultProxyError
from .schedule import LinkFaults

__all__ = ["FaultProxy"]


class FaultProxy:
    """Start the proxy as a child process and steer it (context manager).

    Args:
        target_port: the server's port on 127.0.0.1.
        up, down: initial faults per direction.
        seed: seed of the proxy's random draws.
        max_seconds: the child exits after this long in any case.
        ready_timeout: seconds to wait for it to listen.
    """

    def __init__(self, target_port: int, *, up: LinkFaults | None = None, down: LinkFaults | None = None,
                 seed: int = 0, max_seconds: float = 3600.0, ready_timeout: float = 20.0) -> None:
        self.target_port = target_port
        self.up = up or LinkFaults()
        self.down = down or LinkFaults()
        self.seed = seed
        self.max_seconds = max_seconds
        self.ready_timeout = ready_timeout
        self.port = 0
        self.control_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="chunkline-proxy-")
        self._ctl: socket.socket | None = None
        self._buf = b""

    @staticmethod
    def _fault_args(prefix: str, f: LinkFaults) -> list[str]:
        out = [f"--{prefix}delay-ms", str(f.delay_s * 1000.0), f"--{prefix}jitter-ms", str(f.jitter_s * 1000.0),
               f"--{prefix}stall-rate-hz", str(f.stall_rate_hz), f"--{prefix}stall-ms", str(f.stall_s * 1000.0)]
        if f.bandwidth_bps is not None:
            out += [f"--{prefix}bandwidth-mbps", str(f.bandwidth_bps / 1e6)]
        return out

    @property
    def uri(self) -> str:
        """``ws://127.0.0.1:<relay port>``: what the robot connects to."""
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        """Start the child and wait until it listens.

        Raises:
            FaultProxyError: it exited or did not listen in time.
        """
        port_file = Path(self._tmp.name) / "ports"
        cmd = [sys.executable, "-m", "chunkline.bench.faultproxy", "--target-port", str(self.target_port),
               "--port-file", str(port_file), "--max-seconds", str(self.max_seconds), "--seed", str(self.seed),
               *self._fault_args("up-", self.up), *self._fault_args("down-", self.down)]
        self._log = open(Path(self._tmp.name) / "proxy.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        give_up = time.monotonic() + self.ready_timeout
        while time.monotonic() < give_up:  # bounded by ready_timeout
            if self.proc.poll() is not None:
                raise FaultProxyError(f"the proxy exited with {self.proc.returncode}: {self.log()}")
            if port_file.exists():
                relay, control = port_file.read_text().split()
                self.port, self.control_port = int(relay), int(control)
                self._ctl = socket.create_connection(("127.0.0.1", self.control_port), timeout=5.0)
                return self
            time.sleep(0.02)
        self.stop()
        raise FaultProxyError(f"the proxy did not start within {self.ready_timeout} s: {self.log()}")

    def log(self) -> str:
        """The child's output so far."""
        try:
            return (Path(self._tmp.name) / "proxy.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def command(self, doc: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        """Send one control command and return the answer.

        Raises:
            FaultProxyError: the proxy refused it or did not answer.
        """
        if self._ctl is None:
            raise FaultProxyError("the proxy is not running")
        self._ctl.settimeout(timeout)
        self._ctl.sendall((json.dumps(doc) + "\n").encode())
        give_up = time.monotonic() + timeout
        while b"\n" not in self._buf:  # bounded by the timeout
            if time.monotonic() > give_up:
                raise FaultProxyError("no answer from the proxy")
            chunk = self._ctl.recv(65536)
            if not chunk:
                raise FaultProxyError("the proxy closed its control port")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise FaultProxyError(str(answer.get("error")))
        return answer

    def set(self, up: dict[str, Any] | None = None, down: dict[str, Any] | None = None) -> None:
        """Change the faults (``{"delay_ms", "jitter_ms", "bandwidth_mbps", "stall_rate_hz", "stall_ms"}``)."""
        doc: dict[str, Any] = {"op": "set"}
        if up is not None:
            doc["up"] = up
        if down is not None:
            doc["down"] = down
        self.command(doc)

    def outage(self, seconds: float, mode: str = "blackhole", start_in: float = 0.0) -> dict[str, Any]:
        """Schedule an outage of both directions."""
        return self.command({"op": "outage", "seconds": seconds, "mode": mode, "start_in": start_in})

    def stats(self) -> dict[str, Any]:
        """Connections, refusals, resets and bytes relayed so far."""
        return self.command({"op": "stats"})

    def stop(self, timeout: float = 5.0) -> int | None:
        """Ask the child to quit; terminate it if it does not."""
        if self._ctl is not None:
            try:
                self.command({"op": "quit"}, timeout=2.0)
            except (FaultProxyError, OSError):
                pass
            self._ctl.close()
            self._ctl = None
        if self.proc is None:
            return None
        code = stop_child(self.proc, timeout, ("terminate", "kill"))
        self._log.close()
        return code

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._tmp.cleanup()
