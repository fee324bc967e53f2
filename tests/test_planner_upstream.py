"""The upstream planner against a fake OpenAI-compatible upstream (httpx mock transports):
structured output requested, every answer validated, one repair, typed refusals for invalid
JSON, wrong types, extra fields, huge strings, refusals and transport failures."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from chunkline.server.errors import Refusal
from chunkline.server.planner.config import PlannerConfig
from chunkline.server.planner.planners import PlanInput, PlanResult
from chunkline.server.planner.upstream import UpstreamPlanner

GOOD = {"steps": [{"skill": "goto", "target": "t3", "goal": [0.1, 0.05]}, {"skill": "hold", "target": None, "goal": None}],
        "note": "nearest first"}
OBS = {"position": np.array([0.0, 0.1], np.float32), "images/cam": np.full((8, 6, 3), 200, np.uint8)}


def completion(content: str | None, refusal: str | None = None) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": refusal},
                                                  "finish_reason": "stop"}]})


def run(answers: list[Callable[[httpx.Request], httpx.Response] | httpx.Response], *, deadline_s: float = 5.0,
        **cfg: Any) -> tuple[PlanResult | Refusal, list[dict[str, Any]]]:
    bodies: list[dict[str, Any]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
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
            request = PlanInput(obs=OBS, obs_time=1.0, instruction="visit the targets", subtask="t1", progress=0.5)
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
