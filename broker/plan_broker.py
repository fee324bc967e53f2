"""The robot-side plan broker: the current plan, its validity on the robot clock, when to ask for
the next one, and what to do while the planner is late or unreachable (``docs/planner.md``).

- A plan is usable until ``expires`` (``obs_time + valid_for``); no step of an expired plan runs.
- It asks when it has no plan, when a subtask completes, before the plan expires, when the scene
  changed beyond ``scene_threshold``, and when the robot rejects a step; one request at a time,
  an older reply ignored.
- A plan off the scene it was asked about (an unreported target, a goal outside ``workspace``) is
  refused and the current plan kept.
- A failed request starts an outage: the current subtask continues for at most ``outage_bound_s``,
  then the safe subtask, retrying every ``retry_s``.
:class:`PlanBrokerCore` is sans-I/O (every call takes ``now``); :class:`SyncPlanBroker` and
:class:`AsyncPlanBroker` are its shells."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import itertools
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from chunkline.client.wire.protocol import PlanReply

__all__ = [
    "PlanBrokerConfig",
    "Subtask",
    "Trigger",
    "PlanRequest",
    "PlanDecision",
    "PlanBrokerCore",
    "SyncPlanBroker",
    "AsyncPlanBroker",
    "scene_change",
]

#: The skills a robot-side plan may name (the schema's vocabulary; anything else is refused).
SKILLS = frozenset({"goto", "hold", "return"})


@dataclasses.dataclass(frozen=True)
class PlanBrokerConfig:
    """The plan broker's settings (seconds of robot time).

    Args:
        request_timeout_s: the deadline of each plan request; no answer by then is a failure.
        outage_bound_s: how long the current subtask continues after the planner stopped answering.
        refresh_before_s: ask for the next plan this long before the current one expires.
        scene_threshold: a target that moved farther than this (scene units, metres) since the
            plan's observation triggers a re-plan; one that appeared or vanished always does.
        retry_s: wait after a failure before asking again.
        safe_skill: ``hold`` or ``return``: what the robot does without a usable plan.
        workspace: ``(xmin, ymin, xmax, ymax)``: where a plan's goals may be (scene units);
            ``None``: anywhere finite.
    """

    request_timeout_s: float = 5.0
    outage_bound_s: float = 2.0
    refresh_before_s: float = 1.0
    scene_threshold: float = 0.03
    retry_s: float = 0.25
    safe_skill: str = "hold"
    workspace: tuple[float, float, float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "outage_bound_s", "retry_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not (math.isfinite(self.refresh_before_s) and self.refresh_before_s >= 0):
            raise ValueError("refresh_before_s must be >= 0")
        if not (math.isfinite(self.scene_threshold) and self.scene_threshold > 0):
            raise ValueError("scene_threshold must be positive")
        if self.safe_skill not in ("hold", "return"):
            raise ValueError("safe_skill must be 'hold' or 'return'")
        if self.workspace is not None:
            xmin, ymin, xmax, ymax = self.workspace
            if not (all(math.isfinite(v) for v in self.workspace) and xmin < xmax and ymin < ymax):
                raise ValueError("workspace is (xmin, ymin, xmax, ymax), finite, with xmin < xmax and ymin < ymax")


@dataclasses.dataclass(frozen=True)
class Subtask:
    """What the local policy should do now.

    Args:
        skill: ``goto``, ``hold`` or ``return``.
        target: the target id of a ``goto``.
        goal: where the target was when planned (a hint), or ``None``.
        plan_id: the plan it comes from; ``None`` for the safe subtask.
        step: its index in that plan.
    """

    skill: str
    target: str | None = None
    goal: tuple[float, float] | None = None
    plan_id: str | None = None
    step: int = 0

    @property
    def safe(self) -> bool:
        """The broker's own fallback, not a planned step."""
        return self.plan_id is None


class Trigger(str, enum.Enum):
    """Why the broker asks for a plan."""

    NO_PLAN = "no_plan"
    SUBTASK_DONE = "subtask_done"
    EXPIRING = "expiring"
    SCENE_CHANGED = "scene_changed"
    REJECTED = "rejected"
    RETRY = "retry"


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """A plan request to send (the shell sends it and reports the reply or the failure).

    Args:
        request_id: the broker's id for it (use it as the message ``id``).
        trigger: why.
        obs_time: robot clock of the observation to send (now).
        deadline_ms: the request's budget (``request_timeout_s``).
        plan_id, subtask, progress: the ``context`` to send.
    """

    request_id: int
    trigger: Trigger
    obs_time: float
    deadline_ms: float
    plan_id: str | None
    subtask: str | None
    progress: float | None

    def context(self) -> dict[str, Any]:
        """The ``context`` of the ``plan`` message: the fields that are set."""
        fields = {"plan_id": self.plan_id, "subtask": self.subtask, "progress": self.progress}
        return {k: v for k, v in fields.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class PlanDecision:
    """The result of one :meth:`PlanBrokerCore.tick`: the subtask to execute and, if the broker
    wants a plan now, the request to send."""

    subtask: Subtask
    request: PlanRequest | None = None


@dataclasses.dataclass(frozen=True)
class _Plan:
    plan_id: str
    steps: tuple[Subtask, ...]
    expires: float
    scene: Mapping[str, tuple[float, float]] | None


@dataclasses.dataclass(frozen=True)
class _InFlight:
    request: PlanRequest
    sent_at: float
    scene: Mapping[str, tuple[float, float]] | None


def scene_change(before: Mapping[str, tuple[float, float]], after: Mapping[str, tuple[float, float]]) -> float:
    """How much the scene changed: ``inf`` when a target appeared or vanished, else the largest
    distance a target moved."""
    if before.keys() != after.keys():
        return math.inf
    return max((math.dist(before[k], after[k]) for k in before), default=0.0)


def _steps(plan_id: str, document: Mapping[str, Any]) -> tuple[Subtask, ...]:
    """The plan's steps as subtasks; raises ``ValueError`` on anything the robot cannot execute."""
    raw = document.get("steps")
    if not isinstance(raw, list) or not raw:
        raise ValueError("a plan needs at least one step")
    out = []
    for i, step in enumerate(raw):
        if not isinstance(step, dict) or step.get("skill") not in SKILLS:
            raise ValueError(f"step {i}: unknown skill")
        target, goal = step.get("target"), step.get("goal")
        if step["skill"] == "goto" and not (isinstance(target, str) and target):
            raise ValueError(f"step {i}: goto without a target")
        point: tuple[float, float] | None = None
        if goal is not None:
            if not (isinstance(goal, list) and len(goal) == 2 and all(type(v) in (int, float) and math.isfinite(v) for v in goal)):
                raise ValueError(f"step {i}: goal must be two finite numbers")
            point = (float(goal[0]), float(goal[1]))
        out.append(Subtask(step["skill"], target if isinstance(target, str) else None, point, plan_id, i))
    return tuple(out)


def _check_scene(steps: tuple[Subtask, ...], scene: Mapping[str, tuple[float, float]] | None,
                 workspace: tuple[float, float, float, float] | None) -> None:
    """Raises ``ValueError`` for a step the scene cannot hold: a ``goto`` to a target the scene
    (when known) did not report, or a goal outside the workspace."""
    for step in steps:
        if step.skill == "goto" and scene is not None and step.target not in scene:
            raise ValueError(f"step {step.step}: target {step.target!r} is not in the scene")
        if step.goal is not None and workspace is not None:
            x, y = step.goal
            if not (workspace[0] <= x <= workspace[2] and workspace[1] <= y <= workspace[3]):
                raise ValueError(f"step {step.step}: goal outside the workspace")


class PlanBrokerCore:
    """The plan broker's decisions (sans-I/O; see the module docstring).

    Args:
        config: its settings.

    Drive it with :meth:`tick` every control period (or every time the local policy asks what to
    do), report each request's end with :meth:`on_reply` or :meth:`on_failure`, and the local
    policy's progress with :meth:`subtask_done` and :meth:`reject_subtask`.
    """

    def __init__(self, config: PlanBrokerConfig | None = None) -> None:
        self.config = config or PlanBrokerConfig()
        self._ids = itertools.count(1)
        self._plan: _Plan | None = None
        self._step = 0
        self._in_flight: _InFlight | None = None
        self._want: Trigger | None = Trigger.NO_PLAN
        self._retry_at = -math.inf
        #: robot time the planner stopped answering (the send time of the first failed request
        #: since the last good plan), or ``None``
        self.outage_since: float | None = None
        #: counters: requests sent, plans accepted, failures, stale replies ignored, safe ticks
        self.stats: dict[str, int] = {"requests": 0, "plans": 0, "failures": 0, "ignored": 0, "safe_ticks": 0, "expired": 0,
                                      "refused": 0}

    # ------------------------------------------------------------------ queries

    @property
    def plan_id(self) -> str | None:
        return self._plan.plan_id if self._plan is not None else None

    @property
    def expires(self) -> float | None:
        """When the held plan expires (robot clock), if one is held."""
        return self._plan.expires if self._plan is not None else None

    @property
    def in_flight(self) -> PlanRequest | None:
        return self._in_flight.request if self._in_flight is not None else None

    def _current(self) -> Subtask | None:
        if self._plan is None or self._step >= len(self._plan.steps):
            return None
        return self._plan.steps[self._step]

    # ------------------------------------------------------------------ the control loop's call

    def tick(self, now: float, scene: Mapping[str, tuple[float, float]] | None = None, progress: float | None = None) -> PlanDecision:
        """The subtask to execute at ``now``, and a request to send if one is due.

        Args:
            now: robot clock.
            scene: what perception reports now (target id -> position), for the scene-change trigger.
            progress: the current subtask's progress (0-1), sent as context.
        """
        cfg = self.config
        if self._in_flight is not None and now >= self._in_flight.sent_at + cfg.request_timeout_s:
            self.on_failure(self._in_flight.request.request_id, now)
        if self._plan is not None and now >= self._plan.expires:
            self._plan = None  # never executed again
            self.stats["expired"] += 1
            self._want = self._want or Trigger.NO_PLAN
        if self._plan is not None:
            if self._current() is None:
                self._want = self._want or Trigger.SUBTASK_DONE
            elif now >= self._plan.expires - cfg.refresh_before_s:
                self._want = self._want or Trigger.EXPIRING
            if scene is not None and self._plan.scene is not None and scene_change(self._plan.scene, scene) > cfg.scene_threshold:
                self._want = self._want or Trigger.SCENE_CHANGED
        elif self._want is None:
            self._want = Trigger.NO_PLAN
        subtask = self._current()
        usable = (subtask is not None and self._plan is not None and now < self._plan.expires
                  and (self.outage_since is None or now - self.outage_since < cfg.outage_bound_s))
        if not usable or subtask is None:
            subtask = Subtask(cfg.safe_skill)
            self.stats["safe_ticks"] += 1
        request = None
        if self._want is not None and self._in_flight is None and now >= self._retry_at:
            current = self._current()
            request = PlanRequest(next(self._ids), self._want if self.outage_since is None else Trigger.RETRY, now,
                                  cfg.request_timeout_s * 1000.0, self.plan_id, current.target if current is not None else None,
                                  progress)
            self._in_flight = _InFlight(request, now, dict(scene) if scene is not None else None)
            self._want = None
            self.stats["requests"] += 1
        return PlanDecision(subtask, request)

    # ------------------------------------------------------------------ events

    def on_reply(self, request_id: int, reply: PlanReply | Mapping[str, Any], now: float) -> bool:
        """A reply arrived. Returns whether its plan is now the held plan.

        A reply to a request that is no longer in flight (timed out, superseded) is ignored; one
        that is already expired, has no ``expires``, names a step the robot cannot execute, or
        does not fit the scene it was asked for (see the module docstring) is a failure (the
        robot keeps what it has).
        """
        if self._in_flight is None or self._in_flight.request.request_id != request_id:
            self.stats["ignored"] += 1
            return False
        fields = reply.model_dump() if isinstance(reply, PlanReply) else dict(reply)
        raw_expires = fields.get("expires")
        try:
            if not isinstance(raw_expires, (int, float)) or isinstance(raw_expires, bool) or not math.isfinite(raw_expires):
                raise ValueError("the reply has no expiry on the robot clock")
            expires = float(raw_expires)
            steps = _steps(str(fields.get("plan_id")), fields.get("plan") or {})
        except ValueError:
            self.on_failure(request_id, now)
            return False
        try:
            _check_scene(steps, self._in_flight.scene, self.config.workspace)
        except ValueError:
            self.stats["refused"] += 1
            self.on_failure(request_id, now)
            return False
        if expires <= now:
            self.on_failure(request_id, now)  # arrived too late to be used
            return False
        scene = self._in_flight.scene
        self._in_flight = None
        self._plan = _Plan(str(fields["plan_id"]), steps, expires, scene)
        self._step = 0
        self.outage_since = None
        self._retry_at = -math.inf
        self.stats["plans"] += 1
        return True

    def on_failure(self, request_id: int, now: float) -> None:
        """The request failed (error reply, invalid plan, timeout, connection lost)."""
        if self._in_flight is None or self._in_flight.request.request_id != request_id:
            return
        if self.outage_since is None:
            self.outage_since = self._in_flight.sent_at
        self._in_flight = None
        self._want = self._want or Trigger.RETRY
        self._retry_at = now + self.config.retry_s
        self.stats["failures"] += 1

    def subtask_done(self, now: float) -> None:
        """The local policy finished the current subtask: go on with the plan's next step and ask
        for a fresh plan."""
        if self._current() is not None:
            self._step += 1
        self._want = self._want or Trigger.SUBTASK_DONE

    def reject_subtask(self, now: float) -> None:
        """The robot cannot carry out the current step (unknown target, already done): skip it
        and ask for a new plan."""
        self.subtask_done(now)
        self._want = Trigger.REJECTED


# ---------------------------------------------------------------------------- shells

#: Sends one plan request (blocking) and returns the reply; raises on any failure.
SyncPlanFn = Callable[[PlanRequest], PlanReply | Mapping[str, Any]]
#: The same, for asyncio.
AsyncPlanFn = Callable[[PlanRequest], Awaitable[PlanReply | Mapping[str, Any]]]


class SyncPlanBroker:
    """The plan broker for a threaded control loop: requests run on one worker thread, ``tick``
    never blocks.

    Args:
        request: performs one plan request (blocking), e.g. over the robot's connection.
        clock: the robot clock.
        config: the broker's settings.
    """

    def __init__(self, request: SyncPlanFn, clock: Callable[[], float], config: PlanBrokerConfig | None = None) -> None:
        self.core = PlanBrokerCore(config)
        self._request = request
        self._clock = clock
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkline-plans")
        self._pending: list[tuple[int, concurrent.futures.Future[Any]]] = []

    def tick(self, scene: Mapping[str, tuple[float, float]] | None = None, progress: float | None = None) -> Subtask:
        """Take finished requests into account, then decide (see :meth:`PlanBrokerCore.tick`)."""
        self._collect()
        decision = self.core.tick(self._clock(), scene, progress)
        if decision.request is not None:
            self._pending.append((decision.request.request_id, self._pool.submit(self._request, decision.request)))
        return decision.subtask

    def _collect(self) -> None:
        keep = []
        for request_id, future in self._pending:
            if not future.done():
                keep.append((request_id, future))
            elif future.exception() is not None:
                self.core.on_failure(request_id, self._clock())
            else:
                self.core.on_reply(request_id, future.result(), self._clock())
        self._pending = keep

    def subtask_done(self) -> None:
        self.core.subtask_done(self._clock())

    def reject_subtask(self) -> None:
        self.core.reject_subtask(self._clock())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class AsyncPlanBroker:
    """The plan broker for an asyncio control loop: each request is a task, ``tick`` never awaits.

    Args:
        request: performs one plan request, e.g. over an ``AsyncClient``'s connection.
        clock: the robot clock.
        config: the broker's settings.
    """

    def __init__(self, request: AsyncPlanFn, clock: Callable[[], float], config: PlanBrokerConfig | None = None) -> None:
        self.core = PlanBrokerCore(config)
        self._request = request
        self._clock = clock
        self._tasks: dict[int, asyncio.Task[Any]] = {}

    def tick(self, scene: Mapping[str, tuple[float, float]] | None = None, progress: float | None = None) -> Subtask:
        for request_id, task in list(self._tasks.items()):
            if task.done():
                del self._tasks[request_id]
                if task.cancelled() or task.exception() is not None:
                    self.core.on_failure(request_id, self._clock())
                else:
                    self.core.on_reply(request_id, task.result(), self._clock())
        decision = self.core.tick(self._clock(), scene, progress)
        if decision.request is not None:
            self._tasks[decision.request.request_id] = asyncio.get_running_loop().create_task(self._call(decision.request))
        return decision.subtask

    async def _call(self, request: PlanRequest) -> PlanReply | Mapping[str, Any]:
        return await self._request(request)

    def subtask_done(self) -> None:
        self.core.subtask_done(self._clock())

    def reject_subtask(self) -> None:
        self.core.reject_subtask(self._clock())

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
