"""The native session's replies without a server: an answer is written by its listener (which
the runner calls as it resolves the request) while the writer waits with nothing queued, in answer order; an error, or a chunk that finds no
room in the transport, goes through the writer; each is recorded once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from chunkline.client.wire.codec import CodecLimits, Encoder, decode
from chunkline.client.wire.errors import ErrorCode
from chunkline.client.wire.protocol import Infer
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.entrypoints.handler import InFlight, RequestId
from chunkline.server.entrypoints.robot_native import PendingInfer, RobotHandler
from chunkline.server.errors import Refusal
from chunkline.server.robot.runner import InferenceResult, WorkItem
from chunkline.server.robot.service import ChunkFields


class FakeSession:
    def __init__(self) -> None:
        self.id = "s1"
        self.tenant = TenantInfo("acme")
        self.in_flight: dict[RequestId, InFlight] = {}
        self.encoder = Encoder()
        self.clock = time.perf_counter
        self.robot_weight = 1.0
        self.room = True
        self.written: list[Any] = []  # (how, message) in the order written

    def send_now(self, data: bytes) -> bool:
        if self.room:
            self.written.append(("now", decode(data)))
        return self.room

    async def send(self, data: bytes | str) -> None:
        assert isinstance(data, bytes)
        self.written.append(("send", decode(data)))

    async def send_message(self, message: dict[str, Any]) -> None:
        self.written.append(("message", message))

    def full(self) -> bool:
        return False

    async def close(self, code: Any, reason: str) -> None:
        pass


class FakeRobot:
    def __init__(self, runner: object) -> None:
        self.chunk_fields = {runner: ChunkFields("m", 0.02, 0.0, 1.0, "fp")}
        self.recorded: list[tuple[str, Any]] = []

    def agree_encodings(self, offered: str | None) -> list[str]:
        return []

    def record(self, runner: object, tenant: TenantInfo, session: str, outcome: str, timing: dict[str, float],
               item: WorkItem | None) -> None:
        self.recorded.append((outcome, None if item is None else item.id))


def _result() -> InferenceResult:
    return InferenceResult(actions=np.zeros((50, 14), np.float32), queue_s=0.0, batch_wait_s=0.0, infer_s=0.001,
                           batch_size=1, late=False)


def _resolve(item: WorkItem, outcome: InferenceResult | BaseException) -> None:
    """What the runner does: resolve the future, then tell its listener in the same loop turn."""
    if isinstance(outcome, BaseException):
        item.future.set_exception(outcome)
    else:
        item.future.set_result(outcome)
    assert item.on_answered is not None
    item.on_answered()


def test_answers_are_written_at_once_in_answer_order_and_the_rest_by_the_writer() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        runner = object()
        session, robot = FakeSession(), FakeRobot(runner)
        handler = RobotHandler(session, robot, CodecLimits(), lambda: True, None)  # type: ignore[arg-type]

        def admit(request_id: int) -> WorkItem:
            item = WorkItem(obs={}, tenant="acme", session="s1", deadline=1e9, enqueued_at=0.0, future=loop.create_future(),
                            id=request_id)
            handler._admitted(PendingInfer(handler, Infer(id=request_id, obs={}), runner, item, 0.0, 0.0, None))  # type: ignore[arg-type]
            return item

        first, second, third = admit(1), admit(2), admit(3)
        await asyncio.sleep(0)  # the writer starts and waits: nothing is answered yet
        assert handler.writer_waiting and session.written == []
        _resolve(second, _result())
        _resolve(first, _result())
        # Both written at once, in answer order, with no loop turn between; the writer still waits.
        assert [(how, m["id"]) for how, m in session.written] == [("now", 2), ("now", 1)]
        assert handler.writer_waiting and set(session.in_flight) == {3}
        assert robot.recorded == [("ok", 2), ("ok", 1)]
        session.room = False  # the chunk finds no room: the writer sends it, encoded once
        _resolve(third, _result())
        for _ in range(5):
            await asyncio.sleep(0)
        assert [(how, m["id"]) for how, m in session.written][2:] == [("send", 3)]
        assert robot.recorded[2:] == [("ok", 3)] and not session.in_flight
        session.room = True
        failed = admit(4)
        _resolve(failed, Refusal(ErrorCode.POLICY_FAILED, "policy raised ValueError"))
        for _ in range(5):
            await asyncio.sleep(0)
        how, message = session.written[-1]
        assert how == "message" and message["type"] == "error" and message["id"] == 4
        assert robot.recorded[-1] == (ErrorCode.POLICY_FAILED.value, 4) and not session.in_flight
        handler.close()

    asyncio.run(main())
