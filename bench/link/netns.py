"""Shaped links for tests and benchmarks: two network namespaces joined by a veth pair, the robot's
side rate-limited with ``tbf``; the fault proxy's bandwidth cap where namespaces cannot be made.

:class:`NamespaceLink`: a server and a client namespace (nothing reaches or leaves the machine), a
veth pair on a private /30 and ``tbf`` on the client's end, so the uplink runs at the set rate and
the reply path is free; removed on :meth:`close`, on leaving the ``with`` block and at exit.
:class:`ProxyLink` (no root, no ``ip``): the fault proxy's user-space cap on 127.0.0.1. Both say
where the server listens, the URI the robot dials, how to start each side, and :meth:`set_rate`."""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["Link", "NamespaceLink", "ProxyLink", "namespaces_unavailable", "open_link", "run_in_namespace"]

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_SUBNET = ("10.213.0.1", "10.213.0.2")  # server, client: a /30 that exists only inside the two namespaces


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=10)


def namespaces_unavailable() -> str | None:
    """Why namespaces with a veth pair and ``tbf`` cannot be made here, or ``None`` when they can
    (tried for real: a probe namespace is made and removed)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"clprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns add failed: {getattr(exc, 'stderr', '') or exc}".strip()
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def run_in_namespace(namespace: str, fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)`` on a thread that has joined ``namespace``'s network (``setns`` changes
    only the calling thread, so this process's other threads stay where they are). Sockets the
    call makes belong to that namespace."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
            finally:
                os.close(fd)
            result.append(fn(*args))
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name=f"netns-{namespace}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


class Link:
    """A shaped path from a robot process to a server process (see the module docstring)."""

    kind = ""
    #: the host the server listens on
    server_host = "127.0.0.1"

    def server_prefix(self) -> list[str]:
        """Prepended to the server's command line."""
        return []

    def client_prefix(self) -> list[str]:
        """Prepended to the robot process's command line."""
        return []

    def probe(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` where it reaches the server (a readiness probe)."""
        return fn(*args)

    def client_uri(self, server_port: int) -> str:
        """What the robot connects to."""
        raise NotImplementedError

    def set_rate(self, mbit_per_s: float) -> None:
        """The uplink's rate from now on."""
        raise NotImplementedError

    def close(self) -> None:
        """Remove what the link made."""

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NamespaceLink(Link):
    """Two namespaces and a veth pair, ``tbf`` on the client's egress.

    Args:
        tag: a short name for this link's namespaces and interfaces (unique per process by default).
    """

    kind = "netns+tbf"

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or f"cl{os.getpid() % 100000}"
        self.server_ns, self.client_ns = f"{tag}s", f"{tag}c"
        self.server_if, self.client_if = f"{tag}vs", f"{tag}vc"  # interface names: at most 15 characters
        self.server_host, self.client_host = _SUBNET
        self.rate_mbit: float | None = None
        self._made: list[str] = []  # the namespaces this link made (and so removes)
        self._closed = False
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        for ns in (self.server_ns, self.client_ns):
            _ip("netns", "add", ns)
            self._made.append(ns)
        _ip("link", "add", self.client_if, "netns", self.client_ns, "type", "veth", "peer", "name", self.server_if,
            "netns", self.server_ns)
        for ns, dev, addr in ((self.server_ns, self.server_if, self.server_host), (self.client_ns, self.client_if, self.client_host)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def server_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.server_ns]

    def client_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.client_ns]

    def probe(self, fn: Callable[..., T], *args: Any) -> T:
        return run_in_namespace(self.server_ns, fn, *args)

    def client_uri(self, server_port: int) -> str:
        return f"ws://{self.server_host}:{server_port}"

    def set_rate(self, mbit_per_s: float) -> None:
        """``tbf`` at ``mbit_per_s`` on the client's end. The bucket holds 1 ms of the rate (at
        least 16 KiB, a few packets); the queue holds 4 MiB, several raw observations, so the
        shaper delays rather than drops."""
        rate_bytes = mbit_per_s * 1e6 / 8.0
        burst = max(16 * 1024, int(rate_bytes / 1000.0))
        subprocess.run(["tc", "-n", self.client_ns, "qdisc", "replace", "dev", self.client_if, "root", "tbf",
                        "rate", f"{mbit_per_s:g}mbit", "burst", str(burst), "limit", str(4 * 1024 * 1024)],
                       check=True, capture_output=True, text=True, timeout=10)
        self.rate_mbit = mbit_per_s

    def qdisc(self) -> str:
        """``tc qdisc show`` of the shaped interface."""
        return subprocess.run(["tc", "-n", self.client_ns, "qdisc", "show", "dev", self.client_if],
                              capture_output=True, text=True, timeout=10).stdout.strip()

    def close(self) -> None:
        """Remove both namespaces (the veth pair goes with them). Safe to call again."""
        if self._closed:
            return
        self._closed = True
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        atexit.unregister(self.close)


class ProxyLink(Link):
    """The fault proxy on 127.0.0.1 with an uplink bandwidth cap (no namespaces needed).

    Args:
        seed: the proxy's seed.
        max_seconds: the proxy exits after this long in any case.
    """

    kind = "fault proxy (user-space cap)"

    def __init__(self, seed: int = 0, max_seconds: float = 3600.0) -> None:
        self.seed = seed
        self.max_seconds = max_seconds
        self._proxy: Any = None

    def client_uri(self, server_port: int) -> str:
        from chunkline.bench.faultproxy import FaultProxy

        if self._proxy is None:
            self._proxy = FaultProxy(server_port, seed=self.seed, max_seconds=self.max_seconds).start()
        return str(self._proxy.uri)

    def set_rate(self, mbit_per_s: float) -> None:
        if self._proxy is None:
            raise RuntimeError("client_uri() starts the proxy: call it first")
        self._proxy.set(up={"bandwidth_mbps": mbit_per_s})

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.stop()
            self._proxy = None


def open_link(prefer: Sequence[str] = ("netns", "proxy")) -> tuple[Link, str | None]:
    """The first link kind that works here, and why the namespaces were passed over (if they were)."""
    why: str | None = None
    for kind in prefer:
        if kind == "netns":
            why = namespaces_unavailable()
            if why is None:
                try:
                    return NamespaceLink(), None
                except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
                    why = f"namespace setup failed: {getattr(exc, 'stderr', '') or exc}".strip()
        elif kind == "proxy":
            return ProxyLink(), why
    raise RuntimeError(f"no shaped link available ({why})")
