"""The workload: robots and text users, each a thin asyncio shell that opens sessions one after
the other, acts (normal requests and injected faults) and books every event in a
:class:`SessionBook`."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import numpy as np

from chunkline.client.wire.codec import Encoder, decode
from chunkline.client.wire.errors import CodecError, ErrorCode, ProtocolError
from chunkline.client.wire.protocol import SUBPROTOCOL, Hello, PlanReply, Token, parse_server_message

from .books import LOAD, NORMAL, TEXT_NORMAL, SessionBook
from .config import SoakConfig
from .policy import MARK_HANG, MARK_RAISE

__all__ = ["SoakRobot"]


class SoakRobot:
    """One robot: sessions one after the other, each booked in a :class:`SessionBook`."""

    def __init__(self, index: int, uri: str, cfg: SoakConfig, documented: frozenset[str], stop: asyncio.Event,
                 books: list[SessionBook], via_proxy: bool, text: bool = False) -> None:
        self.index = index
        self.text = text
        self.uri = uri
        self.cfg = cfg
        self.documented = documented
        self.stop = stop
        self.books = books
        self.via_proxy = via_proxy
        self.rng = random.Random(cfg.seed * 1_000_003 + index)
        self.encoder = Encoder()
        self.ids = 0
        self.connect_failures = 0
        if text:
            kinds = dict(cfg.text_weights) if cfg.faults else {"generate": 1.0}
            self.script = list(cfg.text_first_actions[index % max(1, cfg.text_streams)::max(1, cfg.text_streams)]) if cfg.faults else []
            self.rate_hz = cfg.text_rate_hz
        else:
            kinds = dict(cfg.fault_weights) if cfg.faults else {"normal": 1.0}
            self.script = list(cfg.first_actions[index::cfg.robots]) if cfg.faults else []
            self.rate_hz = cfg.rate_hz
        self.kinds, self.weights = list(kinds), list(kinds.values())
        rng = np.random.default_rng(cfg.seed + index)
        self.image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        self.bad_image = self.image.astype(np.float32)

    def _state(self, first: float = 0.0, sleep_ms: float = 0.0) -> np.ndarray:
        state = np.zeros(14, np.float32)
        state[0], state[1], state[2] = first, float(self.index), sleep_ms
        return state

    def _obs(self, state: np.ndarray, image: np.ndarray | None = None) -> dict[str, Any]:
        obs: dict[str, Any] = {"state": state, "prompt": f"soak robot {self.index}"}
        if self.cfg.image:
            obs["image"] = self.image if image is None else image
        return obs

    def _next_id(self) -> str:
        self.ids += 1
        return f"r{self.index}-{self.ids}"

    async def run(self) -> None:
        while not self.stop.is_set():
            await self._session()

    async def _session(self) -> None:
        import websockets
        from websockets.asyncio.client import connect
        from websockets.typing import Subprotocol

        try:
            ws = await connect(self.uri, subprotocols=[Subprotocol(SUBPROTOCOL)], max_size=None, compression=None, open_timeout=10)
            first = await asyncio.wait_for(ws.recv(), 10)
            if not isinstance(first, bytes):
                raise ProtocolError("a text frame instead of hello")
            hello = parse_server_message(decode(first))
        except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake, websockets.ConnectionClosed,
                CodecError, ProtocolError):
            self.connect_failures += 1  # a proxy cut during the handshake, or the server draining
            await asyncio.sleep(0.2 + self.rng.random() * 0.3)
            return
        if not isinstance(hello, Hello):
            raise ProtocolError("no hello")
        book = SessionBook(hello.session, self.documented)
        if self.via_proxy:
            book.expected_closes.add(1006)  # the proxy may reset the connection
        idle = asyncio.Event()
        reader = asyncio.get_running_loop().create_task(self._read(ws, book, idle))
        loop = asyncio.get_running_loop()
        end_at = loop.time() + self.rng.uniform(*self.cfg.session_s)
        ended = "clean"
        try:
            while loop.time() < end_at and not self.stop.is_set():
                await asyncio.sleep(self.rng.uniform(0.5, 1.5) / self.rate_hz)
                if reader.done():
                    ended = "closed"
                    break
                kind = self.script.pop(0) if self.script else self.rng.choices(self.kinds, self.weights)[0]
                ended = await self._act(kind, ws, book)
                if ended != "clean":
                    break
            if ended == "clean":
                idle.clear()
                if not book.idle:
                    try:
                        await asyncio.wait_for(idle.wait(), self.cfg.drain_s)
                    except asyncio.TimeoutError:
                        pass
                if reader.done():
                    ended = "closed"
                else:
                    await ws.close()
        except websockets.ConnectionClosed:
            ended = "closed"
        finally:
            if ended == "abort":
                ws.transport.abort()
            try:  # after an oversize or text frame the server closes the session itself
                await asyncio.wait_for(asyncio.gather(reader, return_exceptions=True), 10.0)
            except asyncio.TimeoutError:
                book.problems.append("the server did not close the session after a protocol violation")
                ws.transport.abort()
                await asyncio.gather(reader, return_exceptions=True)
            book.on_end(ended == "clean", ws.close_code)
            self.books.append(book)

    async def _read(self, ws: Any, book: SessionBook, idle: asyncio.Event) -> None:
        import websockets

        try:
            async for data in ws:
                if isinstance(data, str):
                    book.problems.append(f"a text frame from the server: {data[:80]!r}")
                    continue
                try:
                    msg = parse_server_message(decode(data))
                except (CodecError, ProtocolError) as exc:
                    book.problems.append(f"an invalid message from the server: {exc}")
                    continue
                if isinstance(msg, Hello):
                    book.problems.append("a second hello")
                    continue
                if isinstance(msg, Token):
                    book.on_token(msg)
                    continue
                if isinstance(msg, PlanReply):  # the soak sends no plans
                    book.problems.append(f"an unexpected plan_reply {msg.id!r}")
                    continue
                book.on_answer(msg)
                if book.idle:
                    idle.set()
        except websockets.ConnectionClosed:
            pass

    async def _send(self, ws: Any, book: SessionBook, kind: str, msg: dict[str, Any], answers: list[frozenset[str]]) -> None:
        book.on_sent(msg["id"], kind, answers, time.monotonic())
        await ws.send(self.encoder.encode(msg))

    async def _act(self, kind: str, ws: Any, book: SessionBook) -> str:
        infer = lambda state, **kw: {"type": "infer", "id": self._next_id(), "obs": self._obs(state), **kw}  # noqa: E731
        if kind == "normal":
            await self._send(ws, book, kind, infer(self._state(), deadline_ms=1000.0, obs_time=time.monotonic()), [NORMAL])
        elif kind == "burst":
            for _ in range(4):
                await self._send(ws, book, kind, infer(self._state(), deadline_ms=1000.0), [NORMAL])
        elif kind == "bad_obs":
            msg: dict[str, Any] = {"type": "infer", "id": self._next_id(), "obs": self._obs(self._state(), self.bad_image)}
            if not self.cfg.image:
                msg["obs"]["state"] = np.zeros(13, np.float32)
            await self._send(ws, book, kind, msg, [frozenset({ErrorCode.INVALID_OBSERVATION.value})])
        elif kind == "bad_msg":
            await self._send(ws, book, kind, infer(self._state(), priority=9), [frozenset({ErrorCode.INVALID_MESSAGE.value})])
        elif kind == "garbage":
            book.on_garbage_sent()
            await ws.send(b"\xc1" + self.rng.randbytes(31))  # 0xc1 is never valid msgpack
        elif kind == "unknown_model":
            await self._send(ws, book, kind, infer(self._state(), model="no-such-model"),
                             [frozenset({ErrorCode.UNKNOWN_MODEL.value})])
        elif kind == "unmeetable":
            await self._send(ws, book, kind, infer(self._state(), deadline_ms=0.01), [LOAD | {"chunk"}])
        elif kind == "raise":
            await self._send(ws, book, kind, infer(self._state(MARK_RAISE), deadline_ms=2000.0),
                             [frozenset({ErrorCode.POLICY_FAILED.value}) | LOAD])
        elif kind == "hang":
            await self._send(ws, book, kind, infer(self._state(MARK_HANG), deadline_ms=300.0),
                             [frozenset({ErrorCode.POLICY_FAILED.value}) | LOAD])
        elif kind == "cancel":
            msg = infer(self._state(sleep_ms=300.0), deadline_ms=5000.0)
            await self._send(ws, book, kind, msg, [NORMAL | {ErrorCode.CANCELLED.value}])
            await asyncio.sleep(0.05)
            await ws.send(self.encoder.encode({"type": "cancel", "id": msg["id"]}))
        elif kind == "duplicate":
            msg = infer(self._state(sleep_ms=200.0), deadline_ms=5000.0)
            await self._send(ws, book, kind, msg, [NORMAL])
            await self._send(ws, book, kind, msg, [NORMAL | {ErrorCode.DUPLICATE_ID.value}])
        elif kind.startswith("text_") or kind == "generate":
            await self._text_act(kind, ws, book)
        elif kind == "disconnect":
            book.kinds[kind] += 1
            book.expected_closes.add(1006)
            return "abort"
        elif kind == "oversize":
            book.kinds[kind] += 1
            book.expected_closes.add(1009)
            await ws.send(bytes(self.cfg.max_message_bytes + 1))
            return "closed"
        elif kind == "text":
            book.kinds[kind] += 1
            book.expected_closes.add(1003)
            await ws.send("this is not msgpack")
            return "closed"
        else:
            raise ValueError(f"unknown action {kind!r}")
        return "clean"


    async def _text_act(self, kind: str, ws: Any, book: SessionBook) -> None:
        msg: dict[str, Any] = {"type": "generate", "id": self._next_id(), "prompt": f"soak stream {self.index}",
                               "max_tokens": self.rng.randint(4, 32), "ignore_eos": True, "deadline_ms": 5000.0}
        if kind == "generate":
            await self._send(ws, book, kind, msg, [TEXT_NORMAL])
        elif kind == "text_cancel":  # cancelled mid-stream (or, if it was quick, answered first)
            msg["max_tokens"] = 200  # the embedded text model allows 256
            await self._send(ws, book, kind, msg, [TEXT_NORMAL | {ErrorCode.CANCELLED.value}])
            await asyncio.sleep(0.03)
            await ws.send(self.encoder.encode({"type": "cancel", "id": msg["id"]}))
        elif kind == "text_dup":
            msg["max_tokens"] = 64
            await self._send(ws, book, kind, msg, [TEXT_NORMAL])
            await self._send(ws, book, kind, msg, [TEXT_NORMAL | {ErrorCode.DUPLICATE_ID.value}])
        elif kind == "text_unknown":
            await self._send(ws, book, kind, {**msg, "model": "no-such-text-model"}, [frozenset({ErrorCode.UNKNOWN_MODEL.value})])
        elif kind == "text_bad":  # prompt and messages both: not a valid generate
            await self._send(ws, book, kind, {**msg, "messages": [{"role": "user", "content": "hi"}]},
                             [frozenset({ErrorCode.INVALID_MESSAGE.value})])
        else:
            raise ValueError(f"unknown action {kind!r}")
