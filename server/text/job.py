"""One admitted text request, from admission to its last event, and the one place its token
deltas are merged.

The backend hands each step's output to :meth:`TextJob.deliver` on the event loop; a front-end
reads :meth:`TextJob.stream`. Whatever the reader has not taken yet is merged into one
:class:`~chunkline.server.text.backend.Delta`, so a reader that fell behind (a slow client, a
loop busy with other requests) catches up in one write instead of one per token, and a reader
that keeps up gets each step's delta as it comes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from chunkline.server.core.admission import Request
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.errors import Refusal
from chunkline.server.text.backend import Delta, Finished, LossItem, PreparedRequest

__all__ = ["TextJob"]


@dataclasses.dataclass(eq=False)
class TextJob:
    """One text request from admission to its last event.

    Its fields are the request's identity, times and streaming state, each read by another stage
    (admission, the backend, the stream, the ledger), so they stay on the one object those stages
    share.

    Args:
        id: the service's key for it (admission and the backend).
        request_id: its ledger request id (unique across models and request classes).
        model: the model's name.
        tenant: who sent it.
        session: the session (native) or ``http:<peer>``.
        prepared: the validated request.
        received: receipt time (service clock).
        received_wall: receipt time (Unix, for the ledger).
        deadline: first-token deadline (service clock).
        priority: its tenant's text priority.
    """

    id: int
    request_id: str
    model: str
    tenant: TenantInfo
    session: str
    prepared: PreparedRequest
    received: float
    received_wall: float
    deadline: float
    priority: int
    admission: Request | None = dataclasses.field(default=None, repr=False)
    started: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    finished: Finished | None = None
    done: bool = False
    loss: list[LossItem] = dataclasses.field(default_factory=list)
    # Output not yet taken by the reader: text pieces, their tokens, the latest piece's time.
    _text: list[str] = dataclasses.field(default_factory=list, repr=False)
    _tokens: int = 0
    _time: float | None = None
    _end: Finished | Refusal | None = dataclasses.field(default=None, repr=False)
    _waiter: asyncio.Future[None] | None = dataclasses.field(default=None, repr=False)

    def deliver(self, ev: Delta | Finished | Refusal) -> None:
        """Take one event (on the loop): a delta is added to what the reader has not taken yet;
        a :class:`Finished` or a :class:`Refusal` (dropped, cancelled, shut down) ends the job."""
        if isinstance(ev, Delta):
            self._text.append(ev.text)
            self._tokens += ev.tokens
            self._time = ev.time
        else:
            self._end = ev
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def stream(self) -> AsyncIterator[Delta | Finished]:
        """The job's events: :class:`Delta`... then one :class:`Finished`.

        Raises:
            Refusal: the job was dropped, cancelled or refused after admission, or failed
                (its :attr:`Finished.error`).
        """
        while True:
            if self._time is not None:
                delta = Delta("".join(self._text), self._tokens, self._time)
                self._text, self._tokens, self._time = [], 0, None
                yield delta
                continue
            end = self._end
            if isinstance(end, Refusal):
                raise end
            if end is not None:
                if end.error is not None:
                    raise end.error
                yield end
                return
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
