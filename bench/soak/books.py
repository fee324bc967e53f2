"""The client's books: every request of a session as the client saw it, and their reconciliation
with the server's usage ledger (sans-I/O: the robots report events)."""

from __future__ import annotations

import collections
import dataclasses
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from chunkline.bench.fuzz.oracle import request_key
from chunkline.client.wire.errors import ErrorCode
from chunkline.client.wire.protocol import Chunk, Done, Error, Token

__all__ = [
    "ADMITTED_ERRORS",
    "LOAD",
    "NORMAL",
    "TEXT_NORMAL",
    "SessionBook",
    "Reconciliation",
    "reconcile",
    "read_ledger",
]


#: Errors that answer an *admitted* request: the ledger has a row for each (with that outcome).
ADMITTED_ERRORS = frozenset({ErrorCode.DEADLINE_EXCEEDED.value, ErrorCode.POLICY_FAILED.value,
                             ErrorCode.CANCELLED.value, ErrorCode.SHUTTING_DOWN.value, ErrorCode.INTERNAL.value})
#: What any admitted request may meet under load (refused at the door, or dropped from the queue).
#: With one tenant nothing is evicted from the queue, so ``overloaded`` is always a door refusal.
LOAD = frozenset({ErrorCode.DEADLINE_UNMEETABLE.value, ErrorCode.DEADLINE_EXCEEDED.value, ErrorCode.OVERLOADED.value})
#: A normal request: a chunk, a load refusal, or a batch-mate's failure (a poisoned or hung batch
#: fails every request in it; counted as ``collateral``).
NORMAL = frozenset({"chunk", ErrorCode.POLICY_FAILED.value}) | LOAD
#: A text request: its stream ends with ``done``, or with a load refusal.
TEXT_NORMAL = frozenset({"done"}) | LOAD


@dataclasses.dataclass
class _Due:
    kind: str
    answers: list[frozenset[str]]
    sent_at: float
    tokens: int = 0  # text: tokens streamed so far


class SessionBook:
    """One session's requests as the client saw them (sans-I/O: the shell reports events).

    Args:
        session: the session id from ``hello`` (the ledger's ``session`` column).
        documented: the documented error codes.
    """

    def __init__(self, session: str, documented: frozenset[str]) -> None:
        self.session = session
        self.documented = documented
        self.pending: dict[tuple[str, Any], _Due] = {}
        self.session_errors_due = 0
        self.answered: set[tuple[str, Any]] = set()
        self.sent = 0
        self.answers = 0
        self.tokens = 0
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.kinds: collections.Counter[str] = collections.Counter()
        #: ledger outcomes the client can vouch for: ok/late chunks and errors of admitted requests
        self.admitted: collections.Counter[str] = collections.Counter()
        self.duplicated = 0
        self.lost = 0
        self.abandoned = 0
        self.collateral = 0
        self.problems: list[str] = []
        self.clean: bool | None = None
        self.close_code: int | None = None
        self.expected_closes: set[int] = {1000}

    @property
    def idle(self) -> bool:
        """Nothing is due any more."""
        return not self.pending and self.session_errors_due == 0

    def on_sent(self, request_id: Any, kind: str, answers: list[frozenset[str]], now: float) -> None:
        """A request went out; ``answers`` lists, per answer due, the outcomes allowed
        (``"chunk"`` or error codes)."""
        key = request_key(request_id)
        due = self.pending.get(key)
        if due is not None:  # a deliberate duplicate: one more answer due for the same id
            due.answers.extend(answers)
        else:
            self.pending[key] = _Due(kind, list(answers), now)
        self.sent += 1
        self.kinds[kind] += 1

    def on_garbage_sent(self) -> None:
        """A frame that is not a message went out: one session error (id null) is due."""
        self.session_errors_due += 1
        self.sent += 1
        self.kinds["garbage"] += 1

    def on_token(self, msg: Token) -> None:
        """Streamed text arrived for a ``generate``: not an answer yet, its ``done`` is."""
        key = request_key(msg.id)
        due = self.pending.get(key)
        if due is None:
            if key in self.answered:
                self.duplicated += 1  # text after the stream's end
            else:
                self.problems.append(f"tokens for a request never sent: {msg.id!r}")
            return
        if msg.index != due.tokens:
            self.problems.append(f"{msg.id!r}: token index {msg.index} after {due.tokens} tokens")
        due.tokens += msg.tokens
        self.tokens += msg.tokens

    def on_answer(self, msg: Chunk | Done | Error) -> None:
        """An answer arrived (a chunk, the ``done`` ending a text stream, or an error)."""
        self.answers += 1
        outcome = "chunk" if isinstance(msg, Chunk) else "done" if isinstance(msg, Done) else msg.code
        self.outcomes[outcome] += 1
        if isinstance(msg, Error) and msg.code not in self.documented:
            self.problems.append(f"undocumented error code {msg.code!r}: {msg.message}")
        if isinstance(msg, Error) and msg.id is None:
            if self.session_errors_due > 0 and msg.code == ErrorCode.INVALID_MESSAGE.value:
                self.session_errors_due -= 1
            else:
                self.problems.append(f"unexpected session error {msg.code}: {msg.message}")
            return
        key = request_key(msg.id)
        due = self.pending.get(key)
        if due is None:
            if key in self.answered:
                self.duplicated += 1
            else:
                self.problems.append(f"an answer for a request never sent: {msg.id!r}")
            return
        slot = next((i for i, allowed in enumerate(due.answers) if outcome in allowed), None)
        if slot is None:
            self.problems.append(f"{due.kind} request answered {outcome!r}, allowed {sorted(due.answers[0])}")
            slot = 0
        due.answers.pop(slot)
        if outcome == ErrorCode.POLICY_FAILED.value and due.kind not in ("raise", "hang"):
            self.collateral += 1
        if isinstance(msg, Done) and msg.finish_reason != "cancelled" and msg.usage.get("completion_tokens") != due.tokens:
            self.problems.append(f"{msg.id!r}: done says {msg.usage.get('completion_tokens')} tokens, {due.tokens} came")
        if isinstance(msg, (Chunk, Done)):
            self.admitted["late" if msg.late else "ok"] += 1
        elif msg.code in ADMITTED_ERRORS:
            self.admitted[msg.code] += 1
        if not due.answers:
            del self.pending[key]
            self.answered.add(key)

    def on_end(self, clean: bool, close_code: int | None) -> None:
        """The session ended: ``clean`` when every answer was awaited on a live connection (what is
        still due is then lost), otherwise what is still due was abandoned (ambiguous: the
        server may or may not have admitted it)."""
        self.clean = clean
        self.close_code = close_code
        due = sum(len(d.answers) for d in self.pending.values()) + self.session_errors_due
        if clean:
            self.lost += due
        else:
            self.abandoned += sum(len(d.answers) for d in self.pending.values())
        if close_code is not None and close_code not in self.expected_closes:
            self.problems.append(f"session closed with {close_code}, expected {sorted(self.expected_closes)}")


@dataclasses.dataclass
class Reconciliation:
    """The ledger against the client's books.

    Args:
        rows: ledger rows in all.
        exact_sessions: sessions whose ledger rows equal the client's admitted outcomes exactly.
        abandoned_sessions: sessions that ended with requests in flight (checked as bounds).
        abandoned_admitted: rows of requests in flight at an abrupt end that the server had admitted.
        mismatches: sessions whose rows disagree with the books.
        phantom_rows: rows of sessions the client never opened.
    """

    rows: int = 0
    exact_sessions: int = 0
    abandoned_sessions: int = 0
    abandoned_admitted: int = 0
    mismatches: list[str] = dataclasses.field(default_factory=list)
    phantom_rows: int = 0


def reconcile(rows: Iterable[tuple[str, str]], books: Iterable[SessionBook], ignore: Iterable[str] = ()) -> Reconciliation:
    """Match ledger ``(session, outcome)`` rows with the sessions' books.

    A session that ended with nothing in flight must have rows equal to its admitted outcomes,
    exactly. A session that ended with requests in flight must have a row for every answer it
    received, and at most one more row per request left in flight.

    Args:
        rows: ``(session, outcome)`` per ledger row.
        books: the client's sessions.
        ignore: sessions to leave out (a warm-up session).
    """
    per: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    result = Reconciliation()
    skip = set(ignore)
    for session, outcome in rows:
        if session in skip:
            continue
        per[session][outcome] += 1
        result.rows += 1
    books = list(books)
    known = {b.session for b in books}
    result.phantom_rows = sum(sum(c.values()) for s, c in per.items() if s not in known)
    for book in books:
        ledger = per.get(book.session, collections.Counter())
        if book.abandoned == 0:  # nothing was in flight when it ended: every row is accounted for
            if ledger == book.admitted:
                result.exact_sessions += 1
            else:
                result.mismatches.append(f"{book.session}: client {dict(book.admitted)} ledger {dict(ledger)}")
            continue
        result.abandoned_sessions += 1
        missing = book.admitted - ledger
        extra = ledger - book.admitted
        if missing or sum(extra.values()) > book.abandoned:
            result.mismatches.append(f"{book.session} (abandoned {book.abandoned}): client {dict(book.admitted)} ledger {dict(ledger)}")
        else:
            result.abandoned_admitted += sum(extra.values())
    return result


def read_ledger(path: Path) -> list[tuple[str, str]]:
    """``(session, outcome)`` of every row of a chunkline usage ledger."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return [(str(s), str(o)) for s, o in db.execute("SELECT session, outcome FROM requests")]
