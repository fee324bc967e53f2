"""The README's robot example, run as written against the server the README starts: it hands over
to the policy."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from chunkline.bench.serverproc import ServerProcess

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_the_readme_serves_the_policy_the_robot_example_expects() -> None:
    serve = [line for block in _blocks(_section("Serve"), "bash") for line in block.splitlines() if "--no-auth" in line]
    assert serve and "--policy loadtest" in serve[0]


@pytest.mark.slow
def test_the_robot_example_runs_and_hands_over_to_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = _blocks(_section("On the robot"), "python")
    assert len(blocks) == 2
    # The README's one request has a 100 ms budget. Without background timing no pass of an
    # untimed batch size (planned at 16x batch 1 as timed at start-up) holds the lane when it
    # arrives: on a busy CPU that plan alone is past 100 ms, and the request is rightly refused.
    with ServerProcess(["--policy", "loadtest", "--no-background-timing"]) as server:
        monkeypatch.setenv("CHUNKLINE_URI", server.uri)  # the README dials $CHUNKLINE_URI (default port 8000)
        namespace: dict[str, object] = {"__name__": "readme"}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            for block in blocks:
                exec(compile(block, str(README), "exec"), namespace)  # the README's own code
        namespace["client"].close()  # type: ignore[attr-defined]
    broker = namespace["broker"]
    counts = broker.watchdog.counts  # type: ignore[attr-defined]
    assert broker.stats.chunks_merged > 0, printed.getvalue()  # type: ignore[attr-defined]
    assert counts.resumes >= 1 and counts.policy_ticks > 0, (counts, printed.getvalue())
    assert broker.mode.value == "policy", printed.getvalue()  # type: ignore[attr-defined]
    assert broker.stats.chunks_unreachable == 0  # type: ignore[attr-defined]
    assert "Chunk(" in printed.getvalue() or "ChunkReply(" in printed.getvalue()  # a short repr, not 700 numbers
    assert len(printed.getvalue().splitlines()[0]) < 400
