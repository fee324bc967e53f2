"""The upstream planner against a fake OpenAI-compatible upstream (httpx mock transports):
structured output requested, every answer validated, one repair, typed refusals for invalid
JSON, wrong types, extra fields, huge strings, refusals and transport failures."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import numpy as np
import pytest

from chunkline.server.core.background import FALLBACK_NICE
from chunkline.server.errors import Refusal
from chunkline.server.planner.config import PlannerConfig
from chunkline.server.planner.image_encoder import ImageEncoder
from chunkline.server.planner.planners import PlanInput, PlanResult
from chunkline.server.planner.request_body import DataUrl
from chunkline.server.planner.upstream import UpstreamPlanner

GOOD = {"steps": [{"skill": "goto", "target": "t3", "goal": [0.1, 0.05]}, {"skill": "hold", "target": None, "goal": None}],
        "note": "nearest first"}
OBS = {"position": np.array([0.0, 0.1], np.float32), "images/cam": np.full((8, 6, 3), 200, np.uint8)}


def completion(content: str | None, refusal: str | None = None) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": refusal},
                                                  "finish_reason": "stop"}]})


def run(answers: list[Callable[[httpx.Request], httpx.Response] | httpx.Response], *, deadline_s: float = 5.0,
        obs: dict[str, Any] | None = None, **cfg: Any) -> tuple[PlanResult | Refusal, list[dict[str, Any]]]:
    bodies: list[dict[str, Any]] = []

    async def handler(request: httpx.Request) -> httpx.Response:  # (on the planner's upstream loop)
        bodies.append(json.loads(request.content))
        answer = answers[len(bodies) - 1]
        if callable(answer):
            return answer(request)
        return answer

    async def main() -> PlanResult | Refusal:
        planner = UpstreamPlanner(PlannerConfig(name="vlm", backend="upstream", upstream_url="http://up.test/v1", **cfg),
                                  transport=httpx.MockTransport(handler))
        await planner.start()
        try:
            request = PlanInput(obs=OBS if obs is None else obs, obs_time=1.0, instruction="visit the targets", subtask="t1", progress=0.5)
            planner.check(request)
            return await planner.plan(request, time.perf_counter() + deadline_s)
        except Refusal as exc:
            return exc
        finally:
            await planner.stop()

    return asyncio.run(main()), bodies


def test_a_valid_answer_is_used_and_the_request_asks_for_structured_output() -> None:
    result, [body] = run([completion(json.dumps(GOOD))])
    assert isinstance(result, PlanResult) and result.attempts == 1 and result.document.steps[0].target == "t3"
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] and fmt["json_schema"]["schema"]["properties"]["steps"]["maxItems"] == 4
    parts = body["messages"][1]["content"]
    image = next(p for p in parts if p["type"] == "image_url")["image_url"]["url"]
    assert image.startswith("data:image/png;base64,") and base64.b64decode(image.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(parts[0]["text"])["context"] == {"plan_id": None, "subtask": "t1", "progress": 0.5}


@pytest.mark.parametrize("bad", [
    "not json at all {",
    json.dumps({**GOOD, "steps": [{"skill": "goto", "target": "t3", "goal": ["0.1", 0.05]}]}),  # a string for a number
    json.dumps({**GOOD, "steps": [{"skill": "goto", "target": 3, "goal": None}]}),  # a number for a string
    json.dumps({**GOOD, "extra": "field"}),
    json.dumps({**GOOD, "steps": [{"skill": "teleport", "target": None, "goal": None}]}),
    json.dumps({**GOOD, "note": "x" * 5000}),  # a long string
    json.dumps({**GOOD, "steps": GOOD["steps"] * 3}),  # more steps than the planner publishes
    json.dumps({**GOOD, "steps": [{"skill": "goto", "target": "t1", "goal": [float("nan"), 0.0]}]}),
])
def test_an_invalid_answer_is_repaired_once(bad: str) -> None:
    result, bodies = run([completion(bad), completion(json.dumps(GOOD))])
    assert isinstance(result, PlanResult) and result.attempts == 2
    repair = bodies[1]["messages"]
    assert repair[-2] == {"role": "assistant", "content": bad[:2000]} and "invalid" in repair[-1]["content"]


@pytest.mark.parametrize("bad", ["[]", json.dumps({**GOOD, "note": 7}), json.dumps({"steps": [], "note": ""})])
def test_invalid_twice_is_a_typed_refusal(bad: str) -> None:
    result, bodies = run([completion(bad), completion(bad)])
    assert isinstance(result, Refusal) and result.code_str == "plan_invalid" and "after one repair" in result.message
    assert len(bodies) == 2


def test_a_huge_answer_is_cut_off_not_buffered() -> None:
    huge = completion(json.dumps({**GOOD, "note": "x" * (2 << 20)}))
    result, bodies = run([huge, huge], max_response_bytes=64 * 1024)
    assert isinstance(result, Refusal) and result.code_str == "plan_invalid" and "exceeds" in result.message and len(bodies) == 1


def test_refusals_and_transport_failures_are_typed() -> None:
    result, _ = run([completion(None, refusal="I cannot help with that")])
    assert isinstance(result, Refusal) and result.code_str == "plan_invalid"
    result, _ = run([httpx.Response(429, headers={"retry-after": "3"})])
    assert isinstance(result, Refusal) and result.code_str == "overloaded" and result.retry_after_ms == 3000.0
    result, _ = run([httpx.Response(500, text="boom")])
    assert isinstance(result, Refusal) and result.code_str == "policy_failed"
    result, _ = run([httpx.Response(200, json={"object": "nothing like a completion"})])
    assert isinstance(result, Refusal) and result.code_str == "policy_failed"

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("too slow", request=request)

    result, _ = run([slow])
    assert isinstance(result, Refusal) and result.code_str == "deadline_exceeded"
    result, bodies = run([completion(json.dumps(GOOD))], deadline_s=-1.0)
    assert isinstance(result, Refusal) and result.code_str == "deadline_exceeded" and bodies == []


def test_observation_fields_are_checked_before_admission() -> None:
    planner = UpstreamPlanner(PlannerConfig(name="vlm", backend="upstream", upstream_url="http://up.test/v1"))
    for obs in ({"x": np.zeros(5000, np.float32)}, {"x": np.array([np.inf], np.float32)}, {"x": [1, 2]},
                {"img": np.zeros((4000, 10, 3), np.uint8)}):
        with pytest.raises(Refusal) as info:
            planner.check(PlanInput(obs=obs))
        assert info.value.code_str == "invalid_observation"


@pytest.mark.parametrize(("header", "expected_ms"), [
    ("3", 3000.0), ("0", 0.0), ("1e308", 60_000.0), ("31536000", 60_000.0), ("inf", 1000.0), ("nan", 1000.0),
    ("-5", 1000.0), ("soon", 1000.0), ("Wed, 21 Oct 2026 07:28:00 GMT", 1000.0), ("9" * 400, 1000.0), (None, 1000.0)])
def test_an_upstreams_retry_after_is_clamped_and_garbage_is_the_default(header: str | None, expected_ms: float) -> None:
    headers = {"retry-after": header} if header is not None else {}
    result, _ = run([httpx.Response(429, headers=headers)])
    assert isinstance(result, Refusal) and result.code_str == "overloaded" and result.retry_after_ms == expected_ms


def test_the_retry_after_bounds_are_settings() -> None:
    result, _ = run([httpx.Response(429, headers={"retry-after": "1e308"})], max_retry_after_s=5.0, default_retry_after_s=0.5)
    assert isinstance(result, Refusal) and result.retry_after_ms == 5000.0
    result, _ = run([httpx.Response(503, headers={"retry-after": "inf"})], max_retry_after_s=5.0, default_retry_after_s=0.5)
    assert isinstance(result, Refusal) and result.code_str == "policy_failed" and result.retry_after_ms == 500.0
    result, _ = run([httpx.Response(503)])
    assert isinstance(result, Refusal) and result.retry_after_ms is None


def test_images_are_encoded_in_a_worker_process_never_in_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    # The server's process may not encode (neither its loop nor a thread of it): the GIL and the
    # CPU scheduler would let the encoding delay the loop. A spawned worker has its own modules.
    from chunkline.server.planner import image_encoder, request_body

    def not_here(*args: object) -> None:
        raise AssertionError("encoded in the server's process")

    for module in (request_body, image_encoder):
        monkeypatch.setattr(module, "png_pieces", not_here)
        monkeypatch.setattr(module, "base64_pieces", not_here)
    obs = {**OBS, "images/wrist": np.arange(16 * 16 * 3, dtype=np.uint8).reshape(16, 16, 3)}

    async def main() -> tuple[list[dict[str, Any]], Refusal]:
        encoder = image_encoder.ImageEncoder(1, max_pending_per_tenant=2)
        tight = image_encoder.ImageEncoder(1, max_pending_per_tenant=1)
        planner = UpstreamPlanner(PlannerConfig(name="vlm", backend="upstream", upstream_url="http://up.test/v1"), encoder=encoder)
        try:
            messages = await planner.messages(PlanInput(obs=obs, instruction="go", tenant="acme"))
            with pytest.raises(Refusal) as refused:  # two images, one allowed at a time for this tenant
                await UpstreamPlanner(planner.cfg, encoder=tight).messages(PlanInput(obs=obs, instruction="go", tenant="acme"))
            return messages, refused.value
        finally:
            encoder.close()
            tight.close()

    messages, refused = asyncio.run(main())
    urls = [p["image_url"]["url"] for p in messages[1]["content"] if p["type"] == "image_url"]
    decoded = [np.frombuffer(zlib_rows(base64.b64decode(u.text().split(",", 1)[1])), np.uint8) for u in urls]
    assert [d.size for d in decoded] == [8 * (6 * 3 + 1), 16 * (16 * 3 + 1)]
    assert np.array_equal(decoded[1].reshape(16, 49)[:, 1:].reshape(16, 16, 3), obs["images/wrist"])
    assert refused.code_str == "overloaded" and refused.retry_after_ms is not None


def zlib_rows(png: bytes) -> bytes:
    """A PNG's filtered rows (its IDAT chunks inflated)."""
    import struct
    import zlib

    at, data = 8, b""
    while at < len(png):
        (length,), tag = struct.unpack(">I", png[at:at + 4]), png[at + 4:at + 8]
        if tag == b"IDAT":
            data += png[at + 8:at + 8 + length]
        at += 12 + length
    return zlib.decompress(data)


def test_a_worker_runs_at_background_cpu_priority() -> None:
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from chunkline.server.planner.image_encoder import worker_init

    with ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), initializer=worker_init) as workers:
        policy, nice = workers.submit(_priority).result()
    assert policy == os.SCHED_IDLE or nice >= FALLBACK_NICE


def _priority() -> tuple[int, int]:
    import os

    return os.sched_getscheduler(0), os.nice(0)


def test_a_worker_is_a_scheduling_group_of_its_own_at_the_lowest_weight() -> None:
    # SCHED_IDLE orders threads within one group only: the encoding must not be charged to the
    # server's group, or other groups' tasks run ahead of its event loop while it encodes.
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor
    from pathlib import Path

    from chunkline.server.planner.image_encoder import worker_init

    with ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), initializer=worker_init) as workers:
        pid, session, group = workers.submit(_session).result()
    assert session == pid != os.getsid(0)
    ours = Path("/proc/self/autogroup")
    # Where autogroup is off (CI's containers), the file exists but reads empty: only the
    # session is checked there.
    if ours.exists() and ours.read_text().split():
        assert group is not None and group.split()[0] != ours.read_text().split()[0]
        assert group.split()[-1] == "19"


def _session() -> tuple[int, int, str | None]:
    import os
    from pathlib import Path

    group = Path("/proc/self/autogroup")
    return os.getpid(), os.getsid(0), group.read_text() if group.exists() else None


def test_sent_images_are_unmapped_off_the_event_loop() -> None:
    # Unmapping a 2048x2048 image's text (16 MiB) takes a millisecond or more: not the loop's.
    import threading

    from chunkline.server.planner.image_encoder import ImageEncoder
    from chunkline.server.planner.request_body import DataUrl

    closed: list[str] = []
    done = threading.Event()

    class Text:
        def __len__(self) -> int:
            return 4

        def read(self, start: int, end: int) -> bytes:
            return b"AAAA"[start:end]

        def close(self) -> None:
            closed.append(threading.current_thread().name)
            done.set()

    encoder = ImageEncoder(1)
    try:
        encoder.discard([DataUrl(Text())])
        assert done.wait(10.0)
    finally:
        encoder.close()
    assert closed and closed[0] != threading.current_thread().name


def test_a_dead_worker_fails_its_image_and_the_next_image_starts_a_new_one() -> None:
    import multiprocessing
    import os
    import signal

    from chunkline.server.planner.errors import PlannerFailed
    from chunkline.server.planner.image_encoder import ImageEncoder

    image = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)

    async def main() -> str:
        encoder = ImageEncoder(1)
        try:
            await encoder.data_url("acme", image)  # its worker is started
            for child in multiprocessing.active_children():
                os.kill(child.pid or 0, signal.SIGKILL)
                child.join(10.0)
            with pytest.raises(PlannerFailed):
                await encoder.data_url("acme", image)
            return (await encoder.data_url("acme", image)).text()
        finally:
            encoder.close()

    text = asyncio.run(main())
    assert text.startswith("data:image/png;base64,")


_OWNER = """
import asyncio, multiprocessing, threading
import numpy as np
from chunkline.server.planner.image_encoder import ImageEncoder

async def main() -> None:
    encoder = ImageEncoder(2)
    await asyncio.gather(*(encoder.data_url("acme", np.zeros((4, 5, 3), np.uint8)) for _ in range(4)))
    print(" ".join(str(child.pid) for child in multiprocessing.active_children()), flush=True)
    threading.Event().wait()

asyncio.run(main())
"""


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie no one has reaped yet included)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    if state in ("Z", "X"):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_the_workers_die_with_a_server_killed_outright() -> None:
    import os
    import signal
    import subprocess

    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        workers = [int(pid) for pid in owner.stdout.readline().split()]
        assert workers and not any(_gone(pid) for pid in workers)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        end = time.monotonic() + 10.0
        while not all(_gone(pid) for pid in workers) and time.monotonic() < end:
            time.sleep(0.05)
        left = [pid for pid in workers if not _gone(pid)]
    finally:
        owner.kill()
        owner.wait()
    for pid in left:  # what the assertion below reports must not outlive the test either
        os.kill(pid, signal.SIGKILL)
    assert not left, "worker processes outlived the process that owned them"


def test_the_upload_runs_on_the_planners_own_thread_not_the_callers() -> None:
    threads: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        threads.append(threading.current_thread().name)
        return completion(json.dumps(GOOD))

    result, _ = run([answer])
    assert isinstance(result, PlanResult) and threads == ["chunkline-upstream"]


class RecordingEncoder(ImageEncoder):
    """An image encoder that notes when a plan's image texts are let go."""

    def __init__(self, events: list[str]) -> None:
        super().__init__(processes=1)
        self.events = events
        self.discarded = threading.Event()

    def discard(self, urls: Iterable[DataUrl]) -> None:
        self.events.append("discarded")
        self.discarded.set()
        super().discard(urls)


def test_a_cancelled_plan_lets_its_image_texts_go_only_after_the_upload_has_ended() -> None:
    events: list[str] = []
    reading = threading.Event()
    may_end = threading.Event()

    async def handler(request: httpx.Request) -> httpx.Response:  # (on the planner's upstream loop)
        reading.set()
        try:
            await asyncio.Event().wait()  # the upstream never answers
        except asyncio.CancelledError:
            await asyncio.to_thread(may_end.wait, 10.0)  # still holding the body's texts
            events.append("upload ended")
            raise
        raise AssertionError("unreachable")

    async def main() -> None:
        encoder = RecordingEncoder(events)
        planner = UpstreamPlanner(PlannerConfig(name="vlm", backend="upstream", upstream_url="http://up.test/v1"),
                                  transport=httpx.MockTransport(handler))
        await planner.start()
        try:
            request = PlanInput(obs=OBS, instruction="visit the targets", tenant="a", encoder=encoder)
            task = asyncio.ensure_future(planner.plan(request, time.perf_counter() + 30.0))
            assert await asyncio.to_thread(reading.wait, 10.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert events == []  # the upload still reads the texts
            may_end.set()
            assert await asyncio.to_thread(encoder.discarded.wait, 10.0)
            assert events == ["upload ended", "discarded"]
        finally:
            await planner.stop()
            encoder.close()

    asyncio.run(main())
