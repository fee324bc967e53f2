"""Property tests of the plan broker's core: whatever the planner does (late, failing, invalid,
expired, out-of-order replies) and whatever the robot reports, no step of an expired plan is ever
executed, the outage bound holds, one request is in flight at a time, and a planner that answers
keeps the robot on its plan."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.broker.plan_broker import PlanBrokerConfig, PlanBrokerCore, PlanRequest

CFG = PlanBrokerConfig(request_timeout_s=2.0, outage_bound_s=1.5, refresh_before_s=0.5, scene_threshold=0.05, retry_s=0.2)


def reply(req: PlanRequest, valid_for: float, steps: int = 2, skill: str = "goto") -> dict[str, Any]:
    return {"plan_id": f"p{req.request_id}", "expires": req.obs_time + valid_for,
            "plan": {"steps": [{"skill": skill, "target": f"t{i}", "goal": [0.1 * i, 0.0]} for i in range(steps)], "note": ""}}


events = st.lists(
    st.one_of(
        st.tuples(st.just("tick"), st.floats(0.0, 0.7), st.floats(-0.1, 0.1)),  # advance time, scene wobble
        st.tuples(st.just("reply"), st.floats(0.01, 6.0), st.integers(0, 3)),  # valid_for, which request (0: in flight)
        st.tuples(st.just("bad"), st.sampled_from(["skill", "expired", "noexpiry"]), st.just(0)),
        st.tuples(st.just("fail"), st.just(0.0), st.just(0)),
        st.tuples(st.just("done"), st.just(0.0), st.just(0)),
        st.tuples(st.just("reject"), st.just(0.0), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_never_an_expired_plan_and_the_outage_bound_holds(evs: list[tuple[str, Any, Any]]) -> None:
    core = PlanBrokerCore(CFG)
    now = 0.0
    expires: dict[str, float] = {}
    sent: dict[int, PlanRequest] = {}
    in_flight: PlanRequest | None = None
    first_failure_sent: float | None = None  # the model's own outage clock

    def failed(req: PlanRequest) -> None:
        nonlocal first_failure_sent, in_flight
        if first_failure_sent is None:
            first_failure_sent = req.obs_time
        in_flight = None

    for kind, a, b in evs:
        if kind == "tick":
            now += a
            if in_flight is not None and now >= in_flight.obs_time + CFG.request_timeout_s:
                failed(in_flight)  # the broker times it out in this tick
            decision = core.tick(now, {"t0": (0.1 + b, 0.0), "t1": (0.1, 0.0)})
            sub = decision.subtask
            if not sub.safe:
                assert sub.plan_id is not None and expires[sub.plan_id] > now, "a step of an expired plan was executed"
                assert first_failure_sent is None or now - first_failure_sent < CFG.outage_bound_s, "outage bound exceeded"
            if decision.request is not None:
                assert in_flight is None, "two requests in flight"
                in_flight = sent[decision.request.request_id] = decision.request
        elif kind == "reply" and sent:
            req = in_flight if b == 0 and in_flight is not None else sent[sorted(sent)[min(b, len(sent)) - 1]]
            r = reply(req, a)
            accepted = core.on_reply(req.request_id, r, now)
            if req is in_flight:
                if accepted:
                    expires[r["plan_id"]] = r["expires"]
                    first_failure_sent, in_flight = None, None
                else:
                    assert r["expires"] <= now  # only an expired answer is turned down
                    failed(req)
            else:
                assert not accepted, "a reply to a request no longer in flight was used"
        elif kind == "bad" and in_flight is not None:
            r = reply(in_flight, 5.0, skill="fly" if a == "skill" else "goto")
            if a == "expired":
                r["expires"] = now
            if a == "noexpiry":
                r["expires"] = None
            assert not core.on_reply(in_flight.request_id, r, now)
            failed(in_flight)
        elif kind == "fail" and in_flight is not None:
            core.on_failure(in_flight.request_id, now)
            failed(in_flight)
        elif kind == "done":
            core.subtask_done(now)
        elif kind == "reject":
            core.reject_subtask(now)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 0.4), st.booleans()), min_size=1, max_size=200), st.floats(1.0, 5.0))
def test_an_answering_planner_keeps_the_robot_on_its_plan(steps: list[tuple[float, bool]], valid_for: float) -> None:
    """Replies come right after each request: once the first plan is held, the robot only falls
    back to the safe subtask after finishing every step of a plan (never for staleness)."""
    core = PlanBrokerCore(CFG)
    now, started, safe_while_on_plan = 0.0, False, 0
    for dt, done in steps:
        now += dt
        decision = core.tick(now, {f"t{i}": (0.1, 0.0) for i in range(16)})
        if started and decision.subtask.safe and core._current() is not None:
            safe_while_on_plan += 1
        if decision.request is not None:
            assert core.on_reply(decision.request.request_id, reply(decision.request, valid_for, steps=16), now)
            started = True
        if done:
            core.subtask_done(now)
    assert safe_while_on_plan == 0
    assert core.stats["expired"] == 0 or valid_for - CFG.refresh_before_s < max(dt for dt, _ in steps)


def test_outage_then_safe_subtask_then_recovery() -> None:
    core = PlanBrokerCore(CFG)
    d = core.tick(0.0)
    assert d.subtask.safe and d.request is not None
    assert core.on_reply(d.request.request_id, reply(d.request, 30.0), 0.1)
    core.subtask_done(1.0)  # asks for the next plan, keeps going with step 1
    d = core.tick(1.0)
    assert d.subtask.target == "t1" and d.request is not None
    # the planner goes silent: a slow answer is waited for (the plan is valid) until the request
    # times out at 3.0; the outage then counts from its sending (1.0), past the 1.5 s bound
    assert core.tick(2.9).subtask.target == "t1" and core.outage_since is None
    assert core.tick(3.0).subtask.safe and core.outage_since == 1.0
    retry = core.tick(3.2).request
    assert retry is not None and retry.trigger.value == "retry"
    assert core.on_reply(retry.request_id, reply(retry, 30.0), 3.3)
    assert core.tick(3.3).subtask.target == "t0" and core.outage_since is None


def test_scene_change_triggers_a_replan() -> None:
    core = PlanBrokerCore(CFG)
    d = core.tick(0.0, {"t0": (0.1, 0.0)})
    assert d.request is not None and core.on_reply(d.request.request_id, reply(d.request, 30.0, steps=1), 0.0)
    assert core.tick(0.1, {"t0": (0.12, 0.0)}).request is None  # moved 2 cm: below the threshold
    assert core.tick(0.2, {"t0": (0.1, 0.0), "t5": (0.0, 0.1)}).request is not None  # a target appeared
    assert math.isfinite(core.expires or math.nan)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["t1", "t2", "t3", "t999", "base_station"]), min_size=1, max_size=4),
       st.lists(st.floats(-2000.0, 2000.0), min_size=2, max_size=2))
def test_a_plan_that_does_not_fit_its_scene_is_refused_and_the_held_plan_kept(targets: list[str], goal: list[float]) -> None:
    """Observed targets t1-t3 in a 2 x 2 workspace: a plan naming anything else, or with a goal
    outside, is never held; the plan held before keeps being executed."""
    core = PlanBrokerCore(PlanBrokerConfig(workspace=(-1.0, -1.0, 1.0, 1.0)))
    scene = {"t1": (0.1, 0.0), "t2": (0.2, 0.0), "t3": (0.3, 0.0)}
    first = core.tick(0.0, scene).request
    assert first is not None
    good = {"plan_id": "good", "expires": 10.0, "plan": {"steps": [{"skill": "goto", "target": t, "goal": [0.1, 0.0]}
                                                                     for t in ("t1", "t2", "t3")], "note": ""}}
    assert core.on_reply(first.request_id, good, 0.1)
    core.reject_subtask(0.2)  # the robot asks for a new plan while it goes on with t2
    asked = core.tick(0.3, scene).request
    assert asked is not None
    steps = [{"skill": "goto", "target": t, "goal": goal} for t in targets]
    fits = all(t in scene for t in targets) and all(-1.0 <= g <= 1.0 for g in goal)
    accepted = core.on_reply(asked.request_id, {"plan_id": "new", "expires": 10.0, "plan": {"steps": steps, "note": ""}}, 0.6)
    assert accepted == fits
    assert core.plan_id == ("new" if fits else "good")
    assert core.stats["refused"] == (0 if fits else 1)
    if not fits:
        assert core.tick(0.7, scene).subtask.target == "t2"
