"""`chunkline top` in a real terminal (tmux) against a live server: it shows what /metrics reports."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time

import pytest
from helpers import aloha_obs

from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.bench.top import histogram_quantile, parse_metrics
from chunkline.client import Client

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.001, 0.0), (0.002, 50.0), (0.004, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.002)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.003)
    assert histogram_quantile(0.5, []) != histogram_quantile(0.5, [])  # NaN when empty


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
def test_top_in_tmux_shows_the_metrics_figures() -> None:
    with ServerProcess(["--policy", "noop", "--metrics-port", "0"]) as server, Client.connect(server.uri) as client:
        for i in range(17):
            client.infer(aloha_obs(i))
        session = f"chunkline-top-{server.port}"
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "60",
                        f"{sys.executable} -m chunkline.server top --url {url} --interval 0.5"], check=True)
        try:
            give_up = time.monotonic() + 20
            screen = ""
            while time.monotonic() < give_up:
                time.sleep(0.5)
                screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
                if "anonymous" in screen and "server e2e" in screen:
                    break
            snap = parse_metrics(http_get("127.0.0.1", server.metrics_port, "/metrics")[1].decode(), 0.0)
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    ok = snap.requests[("anonymous", "noop", "ok")]
    assert ok == 17
    row = next(line for line in screen.splitlines() if "anonymous" in line and "│" in line)
    assert re.search(rf"│\s*1\s*│\s*{int(ok)}\s*│", row), row  # sessions 1, ok 17: the same figures as /metrics
    assert "server e2e" in screen and "noop" in screen
