"""Thin I/O shells around the broker core: a threaded one for synchronous robot code, an asyncio one.

Both keep the core single-threaded: only the control loop calls into the :class:`Broker`.
:class:`SyncBrokerLoop` runs the loop in the caller's thread with a :class:`RequestWorker` thread
for the blocking ``client.infer`` calls (a one-slot mailbox of intents; results drained at each
tick, applied at the time they happened); :class:`AsyncBrokerLoop` runs each request as a task.
The client's exceptions map to broker events: ``ServerError`` and ``RequestTimeout`` ->
``on_error``, ``ConnectionLost`` (any ``ConnectionError``/``OSError``) -> ``on_disconnect``."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..client.exceptions import RequestTimeout, ServerError
from .chunk import ActionChunk
from .core import Broker, Command, RequestIntent
from .exceptions import BrokerClosed, BrokerConfigError, ChunkError
from .fixed_rate import AsyncRunner, JitterStats, SyncRunner, TickInfo
from .record import TickRecorder
from .refresh import REPLACE_MISSED

__all__ = ["RequestFn", "RequestWorker", "SyncBrokerLoop", "AsyncBrokerLoop", "apply_event", "client_request"]

log = logging.getLogger("chunkline.broker")

#: ``request(intent) -> chunk``: performs one request, blocking; raises on failure.
RequestFn = Callable[[RequestIntent], ActionChunk]

# Events from the worker: (kind, time, payload...)
_Event = tuple[Any, ...]


def _timeout_for(intent: RequestIntent, slack_s: float) -> float:
    return intent.deadline_ms / 1000.0 + slack_s


def _prefix_delay(intent: RequestIntent) -> dict[str, Any]:
    # Passed only when set: a client written before the fields existed keeps working.
    extra: dict[str, Any] = {} if intent.prefix_delay is None else {"prefix_delay": intent.prefix_delay}
    if intent.urgency is not None:
        extra["urgency"] = intent.urgency
    return extra


def client_request(client: Any, clock: Callable[[], float] = time.monotonic, slack_s: float = 0.5) -> RequestFn:
    """A :data:`RequestFn` over a blocking chunkline ``Client``.

    Args:
        client: the client.
        clock: the robot clock (must be the one the observation times come from).
        slack_s: extra wait on top of the request's deadline before giving up.
    """

    def request(intent: RequestIntent) -> ActionChunk:
        reply = client.infer(
            dict(intent.observation),
            obs_time=intent.obs_time,
            deadline_ms=intent.deadline_ms,
            prefix=intent.prefix,
            timeout=_timeout_for(intent, slack_s),
            **_prefix_delay(intent),
        )
        return ActionChunk.from_reply(reply, received_at=clock(), request_id=intent.request_id)

    return request


def _classify(exc: BaseException, request_id: int, now: float) -> _Event:
    if isinstance(exc, ServerError):
        retry = None if exc.retry_after_ms is None else exc.retry_after_ms / 1000.0
        code = getattr(exc.code, "value", exc.code)
        return ("error", now, request_id, str(code), retry)
    if isinstance(exc, RequestTimeout):
        return ("error", now, request_id, "timeout", None)
    if isinstance(exc, (ConnectionError, OSError)):  # ConnectionLost is a ConnectionError
        return ("disconnect", now, request_id)
    if isinstance(exc, ChunkError):
        return ("error", now, request_id, "invalid_chunk", None)
    log.warning("request %s failed: %r", request_id, exc)
    return ("error", now, request_id, "internal", None)


def apply_event(broker: Broker, event: _Event) -> None:
    """Apply one worker event to the core, at the time it happened."""
    kind, t = event[0], event[1]
    if kind == "sent":
        broker.on_sent(event[2], t)
    elif kind == "chunk":
        try:
            broker.on_chunk(event[2], t)
        except ChunkError as exc:  # wrong width: the server answered for another robot/model
            log.warning("chunk refused: %s", exc)
            broker.on_error(t, request_id=event[2].request_id, code="invalid_chunk")
    elif kind == "error":
        broker.on_error(t, request_id=event[2], code=event[3], retry_after_s=event[4])
    elif kind == "disconnect":
        broker.on_disconnect(t)


class RequestWorker:
    """A thread that performs requests one at a time and reports what happened.

    Args:
        request: performs one request (blocking).
        clock: the robot clock used to time-stamp events.
        name: the thread's name.
    """

    def __init__(self, request: RequestFn, clock: Callable[[], float] = time.monotonic, name: str = "chunkline-requests") -> None:
        self._request = request
        self._clock = clock
        self._cond = threading.Condition()
        self._mailbox: RequestIntent | None = None
        self._busy = False
        self._closed = False
        self.events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, intent: RequestIntent) -> None:
        """Queue ``intent``, replacing an older one not yet taken (the newer observation wins).

        Raises:
            BrokerClosed: the worker was closed.
        """
        with self._cond:
            if self._closed:
                raise BrokerClosed("the request worker is closed")
            self._mailbox = intent
            self._cond.notify_all()

    def drain(self) -> list[_Event]:
        """Every event reported since the last call, in order."""
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running (for tests and shutdown); ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._mailbox is None and not self._busy, timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop taking requests and join the thread (a request in progress finishes first)."""
        with self._cond:
            self._closed = True
            self._mailbox = None
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._mailbox is not None or self._closed)
                if self._closed:
                    return
                intent = self._mailbox
                assert intent is not None
                self._mailbox = None
                self._busy = True
            try:
                self.events.put(("sent", self._clock(), intent.request_id))
                try:
                    chunk = self._request(intent)
                except Exception as exc:  # every failure becomes an event; the loop never dies
                    self.events.put(_classify(exc, intent.request_id, self._clock()))
                else:
                    self.events.put(("chunk", self._clock(), chunk))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class SyncBrokerLoop:
    """Drive a :class:`Broker` from synchronous robot code with a blocking client.

    Per tick (:meth:`step`): apply the worker's events, read the observation, tick the core,
    send the command to the actuators, hand any request to the worker, record the tick.

    Args:
        broker: the core.
        client: a blocking client (``chunkline.client.Client``), or ``None`` with ``request``.
        read_observation: returns the current observation (called once per tick).
        send_command: sends one command to the actuators.
        request: a custom :data:`RequestFn` instead of ``client``.
        clock: the robot's monotonic clock.
        recorder: records every tick, when given.
    """

    def __init__(
        self,
        broker: Broker,
        client: Any = None,
        *,
        read_observation: Callable[[], Mapping[str, Any]],
        send_command: Callable[[Command], None],
        request: RequestFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        recorder: TickRecorder | None = None,
    ) -> None:
        if request is None:
            if client is None:
                raise BrokerConfigError("give a client or a request function")
            request = client_request(client, clock)
        self.broker = broker
        self.read_observation = read_observation
        self.send_command = send_command
        self.clock = clock
        self.recorder = recorder
        self.worker = RequestWorker(request, clock)
        self._closed = False

    def step(self, tick: TickInfo | None = None, now: float | None = None) -> Command:
        """Run one control tick.

        Args:
            tick: the runner's timing of this tick (recorded), if any.
            now: the tick time; ``None`` reads the clock.

        Raises:
            BrokerClosed: the loop was closed.
        """
        if self._closed:
            raise BrokerClosed("the broker loop is closed")
        broker = self.broker
        for event in self.worker.drain():
            apply_event(broker, event)
        t = self.clock() if now is None else now
        obs = self.read_observation()
        cmd = broker.tick(t, obs)
        self.send_command(cmd)
        if cmd.request is not None and cmd.request.replaces is not None:
            # One request at a time: a refresh could only follow its request's answer (missed).
            broker.on_error(t, request_id=cmd.request.request_id, code=REPLACE_MISSED)
        elif cmd.request is not None:
            self.worker.submit(cmd.request)
        if self.recorder is not None:
            self.recorder.append(cmd, tick)
        return cmd

    def run(
        self,
        *,
        max_ticks: int | None = None,
        duration_s: float | None = None,
        stop: threading.Event | None = None,
        runner: SyncRunner | None = None,
    ) -> JitterStats:
        """Run the control loop at the broker's control period (in this thread).

        Args:
            max_ticks, duration_s, stop: when to stop (see :meth:`SyncRunner.run`).
            runner: a custom runner (e.g. with ``spin_s``); default: one at the control period.
        """
        runner = runner or SyncRunner(self.broker.config.control_period_s, clock=self.clock)
        return runner.run(lambda info: self.step(info, info.started), max_ticks=max_ticks, duration_s=duration_s, stop=stop)

    def close(self) -> None:
        """Stop the worker thread."""
        self._closed = True
        self.worker.close()

    def __enter__(self) -> SyncBrokerLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncBrokerLoop:
    """Drive a :class:`Broker` from asyncio code with an ``AsyncClient``.

    Args:
        broker: the core.
        client: an async client (``chunkline.client.AsyncClient``).
        read_observation: returns the current observation (plain function or coroutine function).
        send_command: sends one command (plain function or coroutine function).
        clock: the robot's monotonic clock.
        recorder: records every tick, when given.
        slack_s: extra wait on top of a request's deadline before giving up.
    """

    def __init__(
        self,
        broker: Broker,
        client: Any,
        *,
        read_observation: Callable[[], Any],
        send_command: Callable[[Command], Any],
        clock: Callable[[], float] = time.monotonic,
        recorder: TickRecorder | None = None,
        slack_s: float = 0.5,
    ) -> None:
        self.broker = broker
        self.client = client
        self.read_observation = read_observation
        self.send_command = send_command
        self.clock = clock
        self.recorder = recorder
        self.slack_s = slack_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def step(self, tick: TickInfo | None = None, now: float | None = None) -> Command:
        """Run one control tick (see :meth:`SyncBrokerLoop.step`).

        Raises:
            BrokerClosed: the loop was closed.
        """
        if self._closed:
            raise BrokerClosed("the broker loop is closed")
        t = self.clock() if now is None else now
        obs = self.read_observation()
        if asyncio.iscoroutine(obs):
            obs = await obs
        cmd = self.broker.tick(t, obs)
        sent = self.send_command(cmd)
        if asyncio.iscoroutine(sent):
            await sent
        if cmd.request is not None:
            self.broker.on_sent(cmd.request.request_id, self.clock())
            task = asyncio.get_running_loop().create_task(self._request(cmd.request), name="chunkline-request")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self.recorder is not None:
            self.recorder.append(cmd, tick)
        return cmd

    def _ids(self, intent: RequestIntent) -> dict[str, Any]:
        # Refreshing (``replaces``) names requests by the broker's ids: every request goes by its own.
        if not self.broker.config.refresh_queued:
            return {}
        return {"request_id": intent.request_id} if intent.replaces is None else {"request_id": intent.request_id,
                                                                                    "replaces": intent.replaces}

    async def _request(self, intent: RequestIntent) -> None:
        try:
            reply = await self.client.infer(
                dict(intent.observation),
                obs_time=intent.obs_time,
                deadline_ms=intent.deadline_ms,
                prefix=intent.prefix,
                timeout=_timeout_for(intent, self.slack_s),
                **_prefix_delay(intent),
                **self._ids(intent),
            )
            t = self.clock()
            event: _Event = ("chunk", t, ActionChunk.from_reply(reply, received_at=t, request_id=intent.request_id))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every failure becomes an event
            event = _classify(exc, intent.request_id, self.clock())
        if not self._closed:
            apply_event(self.broker, event)

    async def run(
        self,
        *,
        max_ticks: int | None = None,
        duration_s: float | None = None,
        stop: asyncio.Event | None = None,
        runner: AsyncRunner | None = None,
    ) -> JitterStats:
        """Run the control loop at the broker's control period."""
        runner = runner or AsyncRunner(self.broker.config.control_period_s, clock=self.clock)
        return await runner.run(lambda info: self.step(info, info.started), max_ticks=max_ticks, duration_s=duration_s, stop=stop)

    async def wait_idle(self) -> None:
        """Wait until no request is in progress (for tests and shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel the requests in progress."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
