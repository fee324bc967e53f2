"""The native protocol's planner exchange on the robot port: ``plan`` -> one ``plan_reply`` (or one
``error``). A session runs :func:`handle_plan` as a task per ``plan`` message: the message becomes
a request for the planner class, its result the wire reply (:func:`plan_reply`): the plan, its
``plan_id``, what it supersedes, its validity on the robot clock (``expires = obs_time + valid_for``).

A session's :class:`PlanDoor` keeps the retry windows its plans were given, per planner: a large
plan sent inside one (or being read as it opens) is held unread after its first bytes until the
window ends (the door is the connection's body gate, :mod:`.peek`; TCP flow control holds the
sender back), and a plan read whole inside one is answered with the time still to wait and the
connection held the same way; a session that keeps sending such plans is closed.
The observation a plan holds counts in the receive budget until its answer is sent, within
:data:`PLANS_SHARE` of its tenant's share. Once a session's plan was refused for that, until one
fits again, a large plan that would not fit is refused from its first bytes (its id read there)
and the rest of it dropped unbuffered as it arrives.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from websockets.exceptions import ConnectionClosed

from chunkline.client.wire.codec import DEFAULT_LIMITS
from chunkline.client.wire.errors import CloseCode, ErrorCode
from chunkline.client.wire.protocol import Plan, error_message, valid_request_id
from chunkline.server.core.admission.retry_holds import HOLD_CODES, RetryHolds
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.entrypoints.cancellation import answer_cancelled
from chunkline.server.entrypoints.connection import BudgetedConnection
from chunkline.server.entrypoints.handler import Send
from chunkline.server.entrypoints.peek import peek_header
from chunkline.server.entrypoints.robot_native import IGNORED_RETRY_HINTS_BEFORE_CLOSE, SENT_EARLY
from chunkline.server.errors import Refusal
from chunkline.server.planner.service import PlanInput, PlanJob, PlannerService, PlanResult

__all__ = ["PlanDoor", "handle_plan", "observation_bytes", "plan_input", "plan_reply", "PLANS_SHARE", "RECEIVE_BUDGET_RETRY_MS"]

#: The retry time of a plan refused because its tenant's receive budget is full.
RECEIVE_BUDGET_RETRY_MS = 1000.0
#: The part of a tenant's receive-budget share its running plans may hold: the rest stays for the
#: frames its connections are receiving, which would otherwise push it over and close one (1013).
PLANS_SHARE = 0.5
#: Added to a body gate's hold: the loop's timers may fire a little before the window's end on
#: the service's clock, and a plan read just before it would be refused after all.
HOLD_MARGIN_S = 0.002


class PlanDoor:
    """One session's door for plans (see the module's docstring).

    Args:
        connection: the session's connection (held back, closed, and its budget).
        close_after: plans sent inside their windows in a row that are answered; the next closes
            the session (1013).
    """

    def __init__(self, connection: BudgetedConnection, close_after: int = IGNORED_RETRY_HINTS_BEFORE_CLOSE) -> None:
        self.connection = connection
        self.holds = RetryHolds(close_after)
        #: the service whose plans pass this door (set by :func:`handle_plan`)
        self.service: PlannerService | None = None
        self._ends: dict[str, float] = {}  # window -> when it ends, on the service's clock
        # A plan was refused for the receive budget and none has fitted since: large plans are
        # asked about the budget from their first bytes.
        self.tight = False
        #: how the session sends a message (set by :func:`handle_plan`): refusals from a plan's first bytes
        self.send: Send | None = None
        self._answers: set[asyncio.Task[None]] = set()  # refusals from a plan's first bytes being sent

    def hold(self, window: str, code: ErrorCode, retry_after_ms: float | None, now: float) -> None:
        """A plan for ``window`` was refused at ``now``: open a window if the code asks it."""
        self.holds.hold(window, code, retry_after_ms, now)
        if retry_after_ms is not None and code in HOLD_CODES:
            self._ends[window] = now + retry_after_ms / 1000.0
            self.connection.set_body_gate(self.gate)  # peeked at while a window is open or the door is tight
            self.connection.ask_gate_again()  # a plan being read now was sent inside the window

    def refused_for_budget(self, window: str, now: float) -> None:
        """A plan for ``window`` was refused at ``now`` because its observation does not fit."""
        self.tight = True
        self.hold(window, ErrorCode.OVERLOADED, RECEIVE_BUDGET_RETRY_MS, now)

    def gate(self, head: memoryview, length: int) -> float:
        """The connection's body gate: the seconds still to wait when ``head`` starts a plan for
        a planner whose window is open (its body is then left unread until the window ends),
        else 0. While :attr:`tight`, a plan of ``length`` bytes that would not fit the budget is
        refused here and its body dropped. A header that cannot be read whole leaves the plan to
        the door."""
        ends, service = self._ends, self.service
        if service is None:
            return 0.0
        now = service.clock()
        for ended in [window for window, end in ends.items() if end <= now]:
            del ends[ended]
        if not ends and not self.tight:
            self.connection.set_body_gate(None)  # nothing to ask: large frames are read on unpeeked
            return 0.0
        fields = peek_header(head, DEFAULT_LIMITS)
        if fields is None or fields.get("type") != "plan":
            return 0.0
        planner = fields.get("planner")
        if planner is None:
            planner = service.default_planner or ""
        if type(planner) is not str:
            return 0.0
        end = ends.get(planner)
        if end is not None:
            return end - now + HOLD_MARGIN_S
        request_id = fields.get("id")
        connection, send = self.connection, self.send
        if (self.tight and send is not None and valid_request_id(request_id) and connection.budget is not None
                and not connection.budget.fits(connection.tenant, length, PLANS_SHARE)):
            if connection.queued_messages:
                # The messages read before it first: the window this refusal opens is not theirs.
                return HOLD_MARGIN_S  # asked again when the hold ends
            connection.drop_body()
            self.refused_for_budget(planner, now)
            answer = asyncio.ensure_future(_refuse_for_budget(send, request_id))
            self._answers.add(answer)
            answer.add_done_callback(self._answers.discard)
        return 0.0


def observation_bytes(obs: dict[str, Any]) -> int:
    """The bytes of a plan's observation: its arrays (views of the message's buffer) and strings."""
    return sum(value.nbytes if isinstance(value, np.ndarray) else len(value) if isinstance(value, (str, bytes)) else 0
               for value in obs.values())


def plan_input(msg: Plan) -> PlanInput:
    """A validated ``plan`` message as the planner class's :class:`PlanInput`."""
    return PlanInput(obs=msg.obs, obs_time=msg.obs_time, instruction=msg.instruction, subtask=msg.context.subtask,
                     progress=msg.context.progress, plan_id=msg.context.plan_id)


def plan_reply(msg: Plan, job: PlanJob, result: PlanResult, service: PlannerService) -> dict[str, Any]:
    """The ``plan_reply`` of a planned job."""
    valid_for = service.valid_for(job.planner)
    timing = {k: round(v, 4) for k, v in job.timing_ms().items()}
    timing["attempts"] = float(result.attempts)
    return {
        "type": "plan_reply",
        "id": msg.id,
        "plan_id": job.request_id,
        "planner": job.planner,
        "fingerprint": service.fingerprint(job.planner),
        "plan": result.document.model_dump(),
        "supersedes": msg.context.plan_id,
        "valid_for": valid_for,
        "expires": None if msg.obs_time is None else msg.obs_time + valid_for,
        "late": job.late,
        "timing": timing,
    }


async def handle_plan(service: PlannerService, msg: Plan, tenant: TenantInfo, session: str, send: Send,
                      door: PlanDoor | None = None) -> None:
    """Answer one ``plan``: a ``plan_reply``, or one ``error``; ``door`` is the session's (none:
    no retry windows, nothing reserved).

    To cancel it (a ``cancel`` message or a disconnect), cancel the task running this coroutine:
    the request is withdrawn, an ``error`` ``cancelled`` is sent if the connection still stands,
    and ``CancelledError`` propagates.
    """
    received = service.clock()
    if door is None:
        await _plan(service, None, "", msg, tenant, session, send, received)
        return
    door.service, door.send = service, send
    window = msg.planner if msg.planner is not None else service.default_planner or ""
    held = door.holds.check(window, received)
    if held is not None:
        if held.close:
            await door.connection.close(CloseCode.TRY_AGAIN_LATER, "retry_after_ms ignored: reconnect later")
            return
        door.connection.hold_reading(held.wait_ms / 1000.0)
        await send(error_message(held.code, f"sent {held.wait_ms:.0f} ms {SENT_EARLY}; wait retry_after_ms", msg.id, held.wait_ms))
        return
    reservation = door.connection.reserve(observation_bytes(msg.obs), PLANS_SHARE)
    if reservation is None:
        door.refused_for_budget(window, received)
        await _refuse_for_budget(send, msg.id)
        return
    door.tight = False
    with reservation:
        await _plan(service, door, window, msg, tenant, session, send, received)


async def _refuse_for_budget(send: Send, request_id: Any) -> None:
    try:
        await send(error_message(ErrorCode.OVERLOADED, "this tenant's receive budget is full; retry later", request_id,
                                 RECEIVE_BUDGET_RETRY_MS))
    except ConnectionClosed:
        pass


async def _plan(service: PlannerService, door: PlanDoor | None, window: str, msg: Plan, tenant: TenantInfo, session: str,
                send: Send, received: float) -> None:
    try:
        job = service.submit(plan_input(msg), msg.planner, tenant, session, msg.deadline_ms, received)
    except Refusal as exc:
        if door is not None:
            door.hold(window, exc.code, exc.retry_after_ms, received)
        await send(error_message(exc.code, exc.message, msg.id, exc.retry_after_ms))
        return
    try:
        result = await asyncio.shield(job.result)
    except Refusal as exc:
        if door is not None:
            door.hold(window, exc.code, exc.retry_after_ms, received)
        await send(error_message(exc.code, exc.message, msg.id, exc.retry_after_ms))
        return
    except asyncio.CancelledError:
        service.cancel(job)
        await answer_cancelled(send, msg.id)
        raise
    await send(plan_reply(msg, job, result, service))
