"""The `chunkline` command end to end: demo (short), infer, help."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chunkline.bench.serverproc import ServerProcess

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback


def _chunkline(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chunkline.server", *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command() -> None:
    out = _chunkline("--help")
    assert out.returncode == 0
    for cmd in ("serve", "infer", "demo", "bench"):
        assert cmd in out.stdout
    for cmd in ("serve", "infer", "demo", "bench"):
        assert _chunkline(cmd, "--help").returncode == 0


def test_infer_prints_a_chunk(noop_server: ServerProcess) -> None:
    out = _chunkline("infer", "--uri", noop_server.uri, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["actions_shape"] == [50, 14] and len(result["actions"]) == 50
    assert "infer_ms" in result["server_timing_ms"]


def test_infer_reports_a_dead_server_cleanly() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys; from chunkline.server.entrypoints.cli import main; "
                          "sys.exit(main(['infer', '--uri', 'ws://127.0.0.1:9', '--connect-timeout', '1']))"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "could not connect" in out.stderr


@pytest.mark.slow
def test_demo_runs_end_to_end_and_exits_zero() -> None:
    out = _chunkline("demo", "--robots", "2", "--seconds", "3", "--policy", "noop")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "summary" in out.stdout and "obs->chunk latency" in out.stdout


def test_infer_retries_a_refusal_as_the_server_says_and_within_its_bound(capsys: pytest.CaptureFixture[str]) -> None:
    from chunkline.client import ErrorCode, ServerError
    from chunkline.server.entrypoints.cli import retry_as_told

    now = [0.0]
    answers: list[object] = [ServerError(ErrorCode.DEADLINE_UNMEETABLE, "busy timing", retry_after_ms=400.0), "chunk"]

    def send() -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(s: float) -> None:
        now[0] += s

    assert retry_as_told(send, 10.0, clock=lambda: now[0], sleep=sleep) == "chunk" and now[0] == 0.4
    assert "refused deadline_unmeetable: busy timing; retrying in 400 ms" in capsys.readouterr().err
    # past the bound, or no retry time: the refusal is the answer
    for refusal, within in ((ServerError(ErrorCode.OVERLOADED, "full", retry_after_ms=2000.0), 1.0),
                            (ServerError(ErrorCode.DEADLINE_UNMEETABLE, "too slow alone"), 10.0)):
        answers[:] = [refusal, "chunk"]
        with pytest.raises(ServerError):
            retry_as_told(send, within, clock=lambda: now[0], sleep=sleep)
