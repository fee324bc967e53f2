"""The native session's handlers without a server: one in-flight map across classes, cancel
dispatched to the owning handler, close withdrawing what is in flight, unserved classes."""

from __future__ import annotations

import asyncio
from typing import Any

from chunkline.server.core.tenants import TenantInfo
from chunkline.server.entrypoints.handler import InFlight, RequestId, Send, TaskHandler, Unserved


class FakeSession:
    def __init__(self) -> None:
        self.id = "s1"
        self.tenant = TenantInfo("acme")
        self.in_flight: dict[RequestId, InFlight] = {}
        self.sent: list[dict[str, Any]] = []

    async def send_message(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


class Msg:
    def __init__(self, request_id: RequestId) -> None:
        self.id = request_id


def test_task_requests_share_the_sessions_one_map_and_cancel_through_their_handler() -> None:
    async def main() -> None:
        session = FakeSession()
        release = asyncio.Event()
        cancelled: list[RequestId] = []

        async def serve(msg: Any, tenant: TenantInfo, session_id: str, send: Send) -> None:
            try:
                await release.wait()
                await send({"type": "done", "id": msg.id})
            except asyncio.CancelledError:
                cancelled.append(msg.id)
                raise

        text, plans = TaskHandler(session, serve), TaskHandler(session, serve)
        text.handle(Msg(1), 0.0, 0.0)
        plans.handle(Msg("p"), 0.0, 0.0)
        await asyncio.sleep(0)  # both are waiting in their class
        assert set(session.in_flight) == {1, "p"} and text.in_flight == 1 and plans.in_flight == 1
        text.cancel("p")  # not its request: nothing happens
        session.in_flight["p"].handler.cancel("p")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert cancelled == ["p"] and set(session.in_flight) == {1}
        release.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert session.sent == [{"type": "done", "id": 1}] and not session.in_flight

    asyncio.run(main())


def test_close_withdraws_every_task_and_waits_for_it() -> None:
    async def main() -> None:
        session = FakeSession()
        ended: list[RequestId] = []

        async def serve(msg: Any, tenant: TenantInfo, session_id: str, send: Send) -> None:
            try:
                await asyncio.Event().wait()
            finally:
                ended.append(msg.id)

        handler = TaskHandler(session, serve)
        for i in range(3):
            handler.handle(Msg(i), 0.0, 0.0)
        await asyncio.sleep(0)
        waiting = handler.close()
        assert waiting is not None
        await waiting
        assert sorted(ended) == [0, 1, 2] and not session.in_flight and handler.in_flight == 0

    asyncio.run(main())


def test_an_unserved_class_answers_unknown_model_with_the_id() -> None:
    async def main() -> None:
        session = FakeSession()
        waiting = Unserved(session, "this server serves no planners").handle(Msg("p9"), 0.0, 0.0)
        await waiting
        (error,) = session.sent
        assert error["type"] == "error" and error["code"] == "unknown_model" and error["id"] == "p9"
        assert not session.in_flight

    asyncio.run(main())
