"""Shaped links: two namespaces and a veth pair rate-limited by tbf, made and removed by the
bench (also on failure), and the ``chunkline bench link`` suite end to end in a short run."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from chunkline.bench.link.netns import NamespaceLink, ProxyLink, namespaces_unavailable, run_in_namespace

WHY = namespaces_unavailable()
pytestmark = pytest.mark.live  # makes namespaces and starts servers, robots and proxies
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"network namespaces unavailable: {WHY}")


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def uplink_mbit(link: NamespaceLink, nbytes: int = 1_000_000) -> float:
    """Send ``nbytes`` from the client namespace to the server namespace; the receiver's rate."""
    listener = run_in_namespace(link.server_ns, socket.create_server, (link.server_host, 0))
    port = listener.getsockname()[1]
    received: list[float] = []

    def receive() -> None:
        conn, _ = listener.accept()
        with conn:
            got, first = 0, None
            while got < nbytes:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                first = first or time.perf_counter()
                got += len(chunk)
            received.append(got * 8 / (time.perf_counter() - (first or 0)) / 1e6)

    thread = threading.Thread(target=receive)
    thread.start()
    sender = run_in_namespace(link.client_ns, socket.create_connection, (link.server_host, port), 10.0)
    with sender:
        sender.sendall(b"\0" * nbytes)
        thread.join(30)
    listener.close()
    return received[0]


@needs_netns
def test_a_namespace_link_shapes_the_uplink_and_is_removed() -> None:
    with NamespaceLink(tag="cltst1") as link:
        assert {link.server_ns, link.client_ns} <= namespaces()
        link.set_rate(20)
        assert "tbf" in link.qdisc() and "20Mbit" in link.qdisc()
        assert 14 < uplink_mbit(link) < 26
        link.set_rate(80)
        assert 56 < uplink_mbit(link, 3_000_000) < 104
    assert not {link.server_ns, link.client_ns} & namespaces()


@needs_netns
def test_namespaces_are_removed_on_failure_and_only_ours() -> None:
    with pytest.raises(RuntimeError), NamespaceLink(tag="cltst2") as link:
        raise RuntimeError("the benchmark failed")
    assert not {link.server_ns, link.client_ns} & namespaces()
    # A half-made link (its client namespace's name is taken) removes what it made, not the other one.
    subprocess.run(["ip", "netns", "add", "cltst3c"], check=True)
    try:
        with pytest.raises(subprocess.CalledProcessError):
            NamespaceLink(tag="cltst3")
        assert "cltst3s" not in namespaces() and "cltst3c" in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", "cltst3c"], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param("netns", marks=needs_netns), "proxy"])
def test_the_link_suite_runs_and_reports_targets(kind: str, tmp_path) -> None:
    before = namespaces() if WHY is None else set()
    out = subprocess.run([sys.executable, "-m", "chunkline.bench.link.suite", "--rates", "25,1000", "--requests", "4", "--warmup", "2",
                          "--reps", "1", "--frames", "2", "--link", kind, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: a target missed in so short a run; the report is still whole
    assert "target 25 Mbit/s: raw p50 / adaptive p50" in out.stdout and "target 1000 Mbit/s" in out.stdout
    assert "action deviation" in out.stdout and (tmp_path / "results.jsonl").exists()
    assert ("netns+tbf" if kind == "netns" else "fault proxy") in out.stdout
    if WHY is None:
        assert namespaces() == before


def test_the_proxy_link_needs_its_proxy_before_a_rate() -> None:
    with pytest.raises(RuntimeError):
        ProxyLink().set_rate(10)
