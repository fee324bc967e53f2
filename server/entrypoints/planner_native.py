"""The native protocol's planner exchange on the robot port: ``plan`` -> one ``plan_reply`` (or one
``error``).

A session (:mod:`chunkline.server.entrypoints.sessions`) runs :func:`handle_plan` as a task per
``plan`` message; this module turns the message into a request for the planner class and its
result into the wire reply (:func:`plan_reply`): the plan, its ``plan_id``, what it supersedes,
and its validity on the robot clock (``expires = obs_time + valid_for``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from chunkline.client.wire.protocol import Plan, error_message
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.entrypoints.cancellation import answer_cancelled
from chunkline.server.entrypoints.handler import Send
from chunkline.server.errors import Refusal
from chunkline.server.planner.service import PlanInput, PlanJob, PlannerService, PlanResult

__all__ = ["handle_plan", "plan_input", "plan_reply"]


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


async def handle_plan(service: PlannerService, msg: Plan, tenant: TenantInfo, session: str, send: Send) -> None:
    """Answer one ``plan``: a ``plan_reply``, or one ``error``.

    To cancel it (a ``cancel`` message or a disconnect), cancel the task running this coroutine:
    the request is withdrawn, an ``error`` ``cancelled`` is sent if the connection still stands,
    and ``CancelledError`` propagates.
    """
    received = service.clock()
    try:
        job = service.submit(plan_input(msg), msg.planner, tenant, session, msg.deadline_ms, received)
    except Refusal as exc:
        await send(error_message(exc.code, exc.message, msg.id, exc.retry_after_ms))
        return
    try:
        result = await asyncio.shield(job.result)
    except Refusal as exc:
        await send(error_message(exc.code, exc.message, msg.id, exc.retry_after_ms))
        return
    except asyncio.CancelledError:
        service.cancel(job)
        await answer_cancelled(send, msg.id)
        raise
    await send(plan_reply(msg, job, result, service))
