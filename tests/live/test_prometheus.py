"""The shipped Prometheus rules: promtool checks them and runs their unit tests, and a real
Prometheus scraping a real server computes a recording rule equal to the server's own counts."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import repo_paths
from helpers import aloha_obs
from prometheus_client.parser import text_string_to_metric_families

from chunkline.bench.serverproc import ServerProcess, http_get, stop_child
from chunkline.client import AsyncClient, ErrorCode, ServerError

RULES_DIR = repo_paths.ROOT / "docs" / "prometheus"
RULES, RULES_TEST = RULES_DIR / "rules.yml", RULES_DIR / "rules_test.yml"
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
#: CI installs Debian's prometheus package and sets this (.ci/run): there a missing binary fails
#: the tests; on a developer's machine without it they are skipped.
REQUIRED = os.environ.get("CHUNKLINE_REQUIRE_PROMETHEUS") == "1"
needs_promtool = pytest.mark.skipif(PROMTOOL is None and not REQUIRED,
                                    reason="promtool not installed (apt-get install prometheus; CI installs it)")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None and not REQUIRED,
                                      reason="prometheus not installed (apt-get install prometheus; CI installs it)")


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    assert PROMTOOL is not None, "promtool is required here (CHUNKLINE_REQUIRE_PROMETHEUS=1)"
    done = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@needs_promtool
def test_promtool_unit_tests_of_every_alert_pass() -> None:
    assert PROMTOOL is not None, "promtool is required here (CHUNKLINE_REQUIRE_PROMETHEUS=1)"
    done = subprocess.run([PROMTOOL, "test", "rules", RULES_TEST.name], capture_output=True, text=True, timeout=60, cwd=RULES_DIR)
    assert done.returncode == 0, done.stdout + done.stderr
    # every alert of the rules file has a unit test
    alerts = {line.split(":", 1)[1].strip() for line in RULES.read_text().splitlines() if line.strip().startswith("- alert:")}
    tested = {line.split(":", 1)[1].strip() for line in RULES_TEST.read_text().splitlines() if line.strip().startswith("alertname:")}
    assert alerts and alerts == tested, alerts ^ tested


# ----------------------------------------------------------------------------- a real Prometheus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(what: str, get: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll until ``get()`` is truthy (bounded: Prometheus scrapes and evaluates on its own clock)."""
    give_up = time.monotonic() + timeout
    while True:
        value = get()
        if value:
            return value
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class _Prometheus:
    """``prometheus`` on loopback, in a temp dir, scraping one target every 0.5 s with the shipped rules."""

    def __init__(self, target_port: int, workdir: Path) -> None:
        self.port = _free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n"
            f"rule_files:\n  - {RULES}\n"
            "scrape_configs:\n  - job_name: chunkline\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{target_port}']\n"
        )
        assert PROMETHEUS is not None, "prometheus is required here (CHUNKLINE_REQUIRE_PROMETHEUS=1)"
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir,
        )
        _until("prometheus to be ready", self._ready)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "prometheus exited"
        try:
            return http_get("127.0.0.1", self.port, "/-/ready")[0] == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        status, body = http_get("127.0.0.1", self.port, "/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=5.0)
        assert status == 200, body
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if len(result) == 1 else None

    def close(self) -> None:
        self.proc.terminate()
        stop_child(self.proc, 10.0, ("kill",))
        self.log.close()


def _server_counts(server: ServerProcess, model: str) -> tuple[float, float]:
    """(requests answered, refusals) of ``model`` from the server's own ``/metrics``."""
    _, body = http_get("127.0.0.1", server.metrics_port, "/metrics")
    requests = refusals = 0.0
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.labels.get("model") == model and s.name == "chunkline_requests_total":
                requests += s.value
            elif s.labels.get("model") == model and s.name == "chunkline_refusals_total":
                refusals += s.value
    return requests, refusals


async def _drive(uri: str, ok: int, refused: int) -> None:
    bad = aloha_obs()
    del bad["images/cam_high"]  # refused with invalid_observation, before admission
    async with AsyncClient(uri) as client:
        for _ in range(ok):
            await client.infer(aloha_obs(), deadline_ms=5000)
        for _ in range(refused):
            with pytest.raises(ServerError) as err:
                await client.infer(bad, deadline_ms=5000)
            assert err.value.code is ErrorCode.INVALID_OBSERVATION


@pytest.fixture()
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="chunkline-prom-") as d:
        yield Path(d)


@needs_prometheus
@pytest.mark.slow
def test_a_real_prometheus_computes_the_refusal_ratio_the_server_counted(workdir: Path) -> None:
    with ServerProcess(["--policy", "noop", "--metrics-port", "0"]) as server:
        # Every series the ratio reads exists before Prometheus' first scrape, so all of them start
        # at the same scrape and rate() treats them alike.
        asyncio.run(_drive(server.uri, ok=10, refused=10))
        requests_1, refusals_1 = _server_counts(server, "noop")
        assert (requests_1, refusals_1) == (20, 10)
        prom = _Prometheus(server.metrics_port, workdir)
        try:
            selector = '{job="chunkline",model="noop"}'
            _until("the first scrapes", lambda: (prom.value(f"count_over_time(sum(chunkline_requests_total{selector})[1m:500ms])") or 0) >= 4)
            assert prom.value(f"sum(chunkline_requests_total{selector})") == requests_1
            asyncio.run(_drive(server.uri, ok=30, refused=10))
            requests_2, refusals_2 = _server_counts(server, "noop")
            assert (requests_2 - requests_1, refusals_2 - refusals_1) == (40, 10)
            # Prometheus has scraped the final counts ...
            scraped_at = _until("the final counts", lambda: prom.value(f"sum(chunkline_refusals_total{selector}) == {refusals_2}")
                                and prom.value(f"max(timestamp(chunkline_refusals_total{selector}))"))
            # ... and evaluated the rules since (one interval later: that scrape was surely stored).
            rule = 'chunkline:refusal_ratio:rate5m{job="chunkline",class="policy",model="noop"}'
            _until("a rule evaluation after the final scrape", lambda: (prom.value(f"timestamp({rule})") or 0) > scraped_at + 0.5)
            ratio = prom.value(rule)
            rate = prom.value('chunkline:requests:rate5m{job="chunkline",class="policy",model="noop"}')
        finally:
            prom.close()
    # Over the scrapes Prometheus saw: 10 of the 40 requests answered after the first one were refused.
    assert ratio == pytest.approx((refusals_2 - refusals_1) / (requests_2 - requests_1), rel=1e-9)
    assert rate is not None and rate > 0
