"""The openpi-compatible session's replies without a server: an answer is written by its listener
(which the runner calls as it resolves the request) in that same loop turn; a reply that finds no
room in the transport is sent by the session's coroutine; each is recorded once, and each reply
carries the previous one's ``server_ms``."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from chunkline.client.wire.codec import CodecLimits, Encoder, decode
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.entrypoints.openpi_session import CompatSession
from chunkline.server.robot.runner import InferenceResult, WorkItem
from chunkline.server.robot.service import ChunkFields


class FakeConnection:
    """The connection as a compat session uses it: messages in, frames out (``send_now`` while
    there is ``room``, else ``send``)."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.room = True
        self.written: list[tuple[str, Any]] = []
        self.transport = types.SimpleNamespace(get_write_buffer_size=lambda: 0)

    async def messages(self) -> AsyncIterator[bytes]:
        while (message := await self.inbox.get()) is not None:
            yield message

    def send_now(self, data: bytes) -> bool:
        if self.room:
            self.written.append(("now", decode(data)))
        return self.room

    async def send(self, data: bytes | str) -> None:
        self.written.append(("send", data if isinstance(data, str) else decode(data)))

    async def wait_closed(self) -> None:
        await asyncio.Event().wait()


class FakeRobot:
    def __init__(self) -> None:
        self.runner = object()
        self.chunk_fields = {self.runner: ChunkFields("m", 0.02, 0.0, 1.0, "fp")}
        self.admitted: asyncio.Queue[WorkItem] = asyncio.Queue()
        self.recorded: list[tuple[str, dict[str, float]]] = []

    def session_weight(self, tenant: TenantInfo, key_id: str | None, requested: str | None) -> float:
        return 1.0

    def runner_for(self, tenant: TenantInfo, model: str | None) -> object:
        return self.runner

    def metadata(self, runner: object) -> dict[str, Any]:
        return {"model": "m"}

    def admit(self, runner: object, obs: dict[str, Any], tenant: TenantInfo, session: str, received: float,
              robot_weight: float = 1.0) -> WorkItem:
        item = WorkItem(obs=obs, tenant=tenant.name, session=session, deadline=1e9, enqueued_at=received,
                        future=asyncio.get_running_loop().create_future(), id=self.admitted.qsize() + 1)
        self.admitted.put_nowait(item)
        return item

    def cancel(self, runner: object, item: WorkItem) -> None:
        pass

    def record(self, runner: object, tenant: TenantInfo, session: str, outcome: str, timing: dict[str, float],
               item: WorkItem | None) -> None:
        self.recorded.append((outcome, dict(timing)))


def _answer(item: WorkItem, value: float) -> None:
    """What the runner does: resolve the future, then tell its listener in the same loop turn."""
    item.future.set_result(InferenceResult(actions=np.full((50, 14), value, np.float32), queue_s=0.0, batch_wait_s=0.0,
                                           infer_s=0.001, batch_size=1, late=False))
    assert item.on_answered is not None
    item.on_answered()


def test_a_reply_is_written_in_the_answers_turn_or_else_by_the_coroutine() -> None:
    async def main() -> None:
        ws, robot = FakeConnection(), FakeRobot()
        ctx = types.SimpleNamespace(robot=robot, codec_limits=CodecLimits(), config=types.SimpleNamespace(write_limit_bytes=1 << 20))
        session = CompatSession(ctx, ws, TenantInfo("acme"))
        task = asyncio.get_running_loop().create_task(session.run())
        observation = Encoder().encode({"state": np.zeros(14, np.float32)})

        ws.inbox.put_nowait(observation)
        first = await robot.admitted.get()
        assert session.replies_pending
        _answer(first, 1.0)
        # Written by the listener, before the session's coroutine has run again (after the metadata).
        assert [how for how, _ in ws.written] == ["now", "now"] and not session.replies_pending
        assert float(ws.written[-1][1]["actions"][0, 0]) == 1.0
        assert [outcome for outcome, _ in robot.recorded] == ["ok"]

        ws.room = False  # no room: the coroutine sends the reply it encoded, and records it once
        ws.inbox.put_nowait(observation)
        second = await robot.admitted.get()
        _answer(second, 2.0)
        assert len(ws.written) == 2 and session.replies_pending
        for _ in range(5):
            await asyncio.sleep(0)
        how, reply = ws.written[-1]
        assert how == "send" and float(reply["actions"][0, 0]) == 2.0 and not session.replies_pending
        assert [outcome for outcome, _ in robot.recorded] == ["ok", "ok"]
        # Each reply carries the previous one's server time, as recorded.
        assert reply["server_timing"]["prev_total_ms"] == robot.recorded[0][1]["server_ms"]

        ws.inbox.put_nowait(None)
        await task

    asyncio.run(main())
