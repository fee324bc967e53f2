"""Soak: many robot sessions for a long time, with faults, against a real server.

``chunkline bench soak`` (default 10 minutes) starts ``chunkline serve`` on
:func:`fault_policy`, then drives robot sessions at their control rate. Each robot opens a
session, sends observations, injects faults now and then (invalid observations and messages,
garbage frames, unknown models, unmeetable deadlines, policy exceptions and hangs, cancels,
duplicate ids, bursts, abrupt disconnects, oversize and text frames) and rotates to a new session
after a while. Half of the robots reach the server through the closed-loop benchmark's fault
layer (:class:`chunkline.bench.faultproxy.FaultProxy`), which a :class:`FaultPlan` steers:
lossy periods (delay, jitter, stalls like lost segments), partitions (blackhole outages) and
resets of every connection.

Every request is booked on the client side (:class:`SessionBook`); at the end the server is
drained with SIGTERM and its usage ledger is reconciled with the books, session by session.
The report (:class:`SoakReport`) says: requests, refusals, lost (sent on a session that stayed
up and never answered) and duplicated answers (both must be 0), errors outside the documented
set, ledger mismatches, and the server's memory and file-descriptor slopes.

Beside the robots, text users (``text_streams``) stream ``generate`` completions from the
embedded text model (``chunkline serve --text-model``) on native sessions, cancel them
mid-stream, reuse ids, ask for unknown models, send invalid requests and disconnect; their
streams are booked the same way (every token in order, exactly one ``done`` or error). On a
server without text support the soak runs robots only and says so in ``notes``.

The pure parts (:class:`FaultPolicy`'s markers, :class:`FaultPlan`, :class:`SessionBook`,
:func:`reconcile`, :func:`slope`) take times as arguments; the robots are thin asyncio shells
around them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import os
import random
import sqlite3
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.client.codec import Encoder, decode
from chunkline.client.exceptions import CodecError, ErrorCode, ProtocolError
from chunkline.client.protocol import SUBPROTOCOL, Chunk, Done, Error, Hello, Token, parse_server_message
from chunkline.policies.base import ArraySpec, Policy, PolicySpec, TextSpec, make_fingerprint
from chunkline.policies.exceptions import InjectedPolicyFailure

__all__ = [
    "SOAK_SPEC",
    "FAULT_POLICY_REF",
    "MARK_RAISE",
    "MARK_HANG",
    "FaultPolicy",
    "fault_policy",
    "FaultEvent",
    "FaultPlan",
    "apply_fault",
    "ResourceSample",
    "read_process",
    "slope",
    "ADMITTED_ERRORS",
    "SessionBook",
    "Reconciliation",
    "reconcile",
    "read_ledger",
    "SoakConfig",
    "SoakReport",
    "run_soak",
    "main",
]

# ---------------------------------------------------------------------------------- the policy

#: The fault policy's spec: a state, an optional camera, an optional variable-length token field
#: (a free dimension) and a prompt; 50 x 14 chunks at 50 Hz.
SOAK_SPEC = PolicySpec(
    observation={
        "state": ArraySpec((14,), "float32"),
        "image": ArraySpec((64, 64, 3), "uint8", required=False),
        "tokens": ArraySpec((None,), "int32", required=False),
        "prompt": TextSpec(max_chars=256),
    },
    action_dim=14,
    horizon=50,
    dt=0.02,
)
FAULT_POLICY_REF = "chunkline.bench.soak:fault_policy"
#: ``state[0]`` of an observation that makes the policy raise.
MARK_RAISE = 1000.0
#: ``state[0]`` of an observation that makes the policy hang (``hang_s``).
MARK_HANG = 555.0


class FaultPolicy(Policy):
    """A fast policy that misbehaves on request, driven by markers in the observation.

    * ``state[0] == MARK_RAISE``: the batch raises :class:`InjectedPolicyFailure`;
    * ``state[0] == MARK_HANG``: the batch blocks for ``hang_s`` (a wedged backend);
    * ``state[2]``: milliseconds the batch takes (0 to 5000; the largest in the batch);
    * ``state[1]``: a tag. Each reply's ``actions[:, 0]`` is the number of batches with this tag
      running when the batch started (this one included), ``actions[:, 1]`` the number of
      batches running in all, ``actions[:, 2]`` the batch size: a client can see concurrency.

    Args:
        hang_s: how long a hang lasts.
    """

    name = "faults"
    spec = SOAK_SPEC

    def __init__(self, hang_s: float = 1.5) -> None:
        self.hang_s = float(hang_s)
        self._lock = threading.Lock()
        self._running: dict[float, int] = {}
        self._total = 0
        self._fingerprint = make_fingerprint(weights="none", backend="faults", versions={}, precision="float32",
                                             device="cpu", spec=SOAK_SPEC, settings={"hang_s": self.hang_s})

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        state = np.asarray(obs["state"], dtype=np.float64)
        if (state[:, 0] == MARK_RAISE).any():
            raise InjectedPolicyFailure("a marked observation asked for a failure")
        tags = sorted(set(state[:, 1].tolist()))
        with self._lock:
            for tag in tags:
                self._running[tag] = self._running.get(tag, 0) + 1
            self._total += 1
            same = max(self._running[tag] for tag in tags)
            total = self._total
        try:
            seconds = float(np.clip(state[:, 2].max(), 0.0, 5000.0)) / 1000.0
            if (state[:, 0] == MARK_HANG).any():
                seconds = max(seconds, self.hang_s)
            if seconds > 0:
                time.sleep(seconds)
            out = np.zeros((len(state), SOAK_SPEC.horizon, SOAK_SPEC.action_dim), np.float32)
            out[:, :, 0], out[:, :, 1], out[:, :, 2] = same, total, len(state)
            return out
        finally:
            with self._lock:
                for tag in tags:
                    self._running[tag] -= 1
                self._total -= 1


def fault_policy() -> FaultPolicy:
    """``--policy chunkline.bench.soak:fault_policy`` (``CHUNKLINE_FAULT_HANG_S`` sets the hang)."""
    return FaultPolicy(float(os.environ.get("CHUNKLINE_FAULT_HANG_S", "1.5")))


# ---------------------------------------------------------------------------------- network faults


@dataclasses.dataclass(frozen=True)
class FaultEvent:
    """One scheduled network fault, applied through :class:`chunkline.bench.faultproxy.FaultProxy`.

    Args:
        at: seconds from the start.
        kind: ``partition`` (a blackhole outage of both directions for ``duration``: bytes are
            held and arrive at TCP's first retransmission after it), ``lossy`` (``delay_s`` each
            way with jitter, and stalls as lost segments would cause, for ``duration``) or ``cut``
            (every connection reset; new ones refused for ``duration``).
        duration: how long it lasts.
        delay_s: the one-way delay of a ``lossy`` period.
    """

    at: float
    kind: str
    duration: float = 0.0
    delay_s: float = 0.0

    @property
    def end(self) -> float:
        return self.at + self.duration


class FaultPlan:
    """A seeded schedule of network faults, one kind after the other (pure: no clock, no I/O).

    Args:
        duration_s: the run's length.
        seed: the random seed.
        mean_gap_s: mean time between faults.
        max_partition_s: longest partition (with the retransmission after it, keep it well under
            the server's send timeout).
    """

    KINDS = ("partition", "lossy", "cut")

    def __init__(self, duration_s: float, seed: int = 0, mean_gap_s: float = 4.0, max_partition_s: float = 1.2) -> None:
        rng = random.Random(seed)
        kinds = list(self.KINDS)
        rng.shuffle(kinds)
        self.events: list[FaultEvent] = []
        t = rng.expovariate(1.0 / mean_gap_s)
        while t < duration_s - 1.0:
            kind = kinds[len(self.events) % len(kinds)]  # every kind, in turn: a short run still sees each
            if kind == "partition":
                event = FaultEvent(t, kind, duration=rng.uniform(0.2, max_partition_s))
            elif kind == "lossy":
                event = FaultEvent(t, kind, duration=rng.uniform(1.0, 4.0), delay_s=rng.uniform(0.005, 0.04))
            else:
                event = FaultEvent(t, kind, duration=rng.uniform(0.1, 0.5))
            self.events.append(event)
            t = event.end + 1.0 + rng.expovariate(1.0 / mean_gap_s)  # at least 1 s of quiet between faults

    def starting(self, t0: float, t1: float) -> list[FaultEvent]:
        """The faults that start in ``[t0, t1)``."""
        return [e for e in self.events if t0 <= e.at < t1]

    def ending(self, t0: float, t1: float) -> list[FaultEvent]:
        """The faults that end in ``[t0, t1)``."""
        return [e for e in self.events if t0 <= e.end < t1]

    def counts(self) -> dict[str, int]:
        """How many faults of each kind."""
        return dict(collections.Counter(e.kind for e in self.events))


def apply_fault(proxy: Any, event: FaultEvent, starting: bool) -> None:
    """Start or end ``event`` on a running :class:`chunkline.bench.faultproxy.FaultProxy`."""
    if event.kind == "lossy":
        ms = event.delay_s * 1000.0
        link = {"delay_ms": ms, "jitter_ms": ms / 2, "stall_rate_hz": 0.5, "stall_ms": 200.0} if starting else {}
        proxy.set(up=link, down=link)
    elif starting:
        proxy.outage(event.duration, "blackhole" if event.kind == "partition" else "reset")


# ---------------------------------------------------------------------------------- resources


@dataclasses.dataclass(frozen=True)
class ResourceSample:
    """The server process at one moment.

    Args:
        t: seconds from the start.
        rss_bytes: resident memory.
        fds: open file descriptors.
    """

    t: float
    rss_bytes: int
    fds: int


def read_process(pid: int, t: float) -> ResourceSample | None:
    """Resident memory and open descriptors of ``pid`` from ``/proc`` (``None`` if unavailable)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        return None
    return ResourceSample(t, pages * os.sysconf("SC_PAGE_SIZE"), fds)


def slope(points: Iterable[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, y)`` points (0 with fewer than two distinct times)."""
    pts = list(points)
    if len(pts) < 2:
        return 0.0
    ts = np.array([p[0] for p in pts], np.float64)
    ys = np.array([p[1] for p in pts], np.float64)
    var = float(((ts - ts.mean()) ** 2).sum())
    if var == 0.0:
        return 0.0
    return float(((ts - ts.mean()) * (ys - ys.mean())).sum() / var)


# ---------------------------------------------------------------------------------- client-side books

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


def _key(request_id: Any) -> tuple[str, Any]:
    return (type(request_id).__name__, request_id)


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
        key = _key(request_id)
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
        key = _key(msg.id)
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
        key = _key(msg.id)
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


# ---------------------------------------------------------------------------------- the robots


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """A soak run.

    Args:
        duration_s: how long the robots run.
        robots: robot sessions at once.
        rate_hz: requests per robot per second (jittered).
        seed: everything random derives from it.
        faults: inject faults (else only normal requests, for a baseline).
        proxy: route half of the robots through the fault proxy, steered by a :class:`FaultPlan`.
        session_s: each session lasts a random time in this range, then a new one opens.
        fault_weights: relative weight of each action per tick (``normal`` included).
        sample_period_s: how often the server's memory and descriptors are read.
        drain_s: longest wait for a session's answers before it closes.
        max_message_bytes: the server's message cap (oversize frames are just above it).
        server_args: extra ``chunkline serve`` arguments.
        image: send a 64x64x3 camera frame with every normal request (a leak of observations
            would then show in memory).
        fault_gap_s: mean time between network faults.
        first_actions: actions done first (robot ``i`` takes every ``robots``-th one, starting at
            ``i``), so that even a short run injects every fault; then the weights decide.
        max_rss_slope_kib_per_min: a memory slope over the second half of the run above this is
            a problem, in runs of at least ``min_duration_for_slopes_s`` (shorter runs are
            dominated by start-up allocation; their slope is reported, not judged). The
            allocator's arenas fill up over the first minutes (replaced lane threads get new
            ones): a leak keeps its slope, a filling allocator flattens.
        server_env: extra environment for the server process (e.g. ``MALLOC_ARENA_MAX``).
        text_streams: sessions of text users beside the robots (``generate`` streams with
            cancels mid-stream, duplicate ids, unknown models, invalid requests, disconnects),
            on the embedded text model served as ``text_model``; 0 for robots only.
        text_rate_hz: ``generate`` requests per text session per second.
        text_weights, text_first_actions: as ``fault_weights`` and ``first_actions``, for them.
    """

    duration_s: float = 600.0
    robots: int = 16
    rate_hz: float = 10.0
    seed: int = 0
    faults: bool = True
    proxy: bool = True
    session_s: tuple[float, float] = (3.0, 15.0)
    fault_weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: {
        "normal": 0.76, "burst": 0.03, "bad_obs": 0.02, "bad_msg": 0.02, "garbage": 0.015, "unknown_model": 0.01,
        "unmeetable": 0.02, "raise": 0.02, "hang": 0.002, "cancel": 0.03, "duplicate": 0.02, "disconnect": 0.01,
        "oversize": 0.003, "text": 0.003,
    })
    sample_period_s: float = 1.0
    drain_s: float = 15.0
    max_message_bytes: int = 1 << 20
    server_args: tuple[str, ...] = ()
    image: bool = True
    max_rss_slope_kib_per_min: float = 1024.0
    min_duration_for_slopes_s: float = 300.0
    fault_gap_s: float = 4.0
    server_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    text_streams: int = 4
    text_rate_hz: float = 3.0
    text_model: str = "chat"
    text_weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: {
        "generate": 0.75, "text_cancel": 0.08, "text_dup": 0.05, "text_unknown": 0.03, "text_bad": 0.03, "disconnect": 0.06,
    })
    text_first_actions: tuple[str, ...] = ("text_cancel", "text_dup", "text_unknown", "text_bad", "disconnect")
    first_actions: tuple[str, ...] = ("raise", "cancel", "duplicate", "bad_obs", "bad_msg", "garbage", "unknown_model",
                                      "unmeetable", "burst", "hang", "disconnect", "oversize", "text")


class _Robot:
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

        try:
            ws = await connect(self.uri, subprotocols=[SUBPROTOCOL], max_size=None, compression=None, open_timeout=10)
            hello = parse_server_message(decode(await asyncio.wait_for(ws.recv(), 10)))
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
            msg = {"type": "infer", "id": self._next_id(), "obs": self._obs(self._state(), self.bad_image)}
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


# ---------------------------------------------------------------------------------- the run


@dataclasses.dataclass
class SoakReport:
    """What a soak run found (see the module docstring). ``problems`` empty means it passed."""

    duration_s: float = 0.0
    robots: int = 0
    sessions: int = 0
    requests: int = 0
    answers: int = 0
    chunks: int = 0
    refusals: int = 0
    admitted: int = 0
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)
    injected: dict[str, int] = dataclasses.field(default_factory=dict)
    network_faults: dict[str, int] = dataclasses.field(default_factory=dict)
    proxy: dict[str, int] = dataclasses.field(default_factory=dict)
    close_codes: dict[str, int] = dataclasses.field(default_factory=dict)
    lost: int = 0
    duplicated: int = 0
    abandoned: int = 0
    collateral: int = 0
    connect_failures: int = 0
    ledger: dict[str, Any] = dataclasses.field(default_factory=dict)
    rss_mib_start: float = math.nan
    rss_mib_end: float = math.nan
    rss_slope_kib_per_min: float = math.nan
    rss_slope_late_kib_per_min: float = math.nan
    rss_mib_samples: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    fds_start: int = -1
    fds_end: int = -1
    fd_slope_per_min: float = math.nan
    server_exit: int | None = None
    warm_up_session: str = ""
    text_requests: int = 0
    tokens: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


async def _drive(cfg: SoakConfig, host: str, port: int, pid: int, documented: frozenset[str],
                 report: SoakReport) -> list[SessionBook]:
    from chunkline.bench.faultproxy import FaultProxy

    loop = asyncio.get_running_loop()
    proxy = await loop.run_in_executor(None, FaultProxy(port, seed=cfg.seed, max_seconds=cfg.duration_s + 600).start) \
        if cfg.proxy else None
    plan = FaultPlan(cfg.duration_s, cfg.seed, mean_gap_s=cfg.fault_gap_s) if proxy is not None and cfg.faults else None
    stop = asyncio.Event()
    books: list[SessionBook] = []
    try:
        report.warm_up_session = await _warm_up(f"ws://{host}:{port}")
        texts = cfg.text_streams if text_served(cfg) else 0
        robots = [_Robot(i, proxy.uri if proxy is not None and i % 2 else f"ws://{host}:{port}", cfg, documented, stop,
                         books, via_proxy=proxy is not None and i % 2 == 1, text=i >= cfg.robots)
                  for i in range(cfg.robots + texts)]
        start = loop.time()
        samples: list[ResourceSample] = []
        first = read_process(pid, 0.0)
        if first is not None:
            samples.append(first)
        tasks = [loop.create_task(r.run()) for r in robots]
        last = 0.0
        while (t := loop.time() - start) < cfg.duration_s:
            if plan is not None and proxy is not None:
                for event in plan.starting(last, t):
                    await asyncio.to_thread(apply_fault, proxy, event, True)
                for event in plan.ending(last, t):
                    await asyncio.to_thread(apply_fault, proxy, event, False)
            last = t
            if not samples or t - samples[-1].t >= cfg.sample_period_s:
                s = read_process(pid, t)
                if s is not None:
                    samples.append(s)
            await asyncio.sleep(0.05)
        stop.set()
        if proxy is not None:
            await asyncio.to_thread(proxy.set, {}, {})
        await asyncio.gather(*tasks)
        if proxy is not None:
            report.proxy = {k: v for k, v in (await asyncio.to_thread(proxy.stats)).items() if k not in ("ok", "now")}
    finally:
        if proxy is not None:
            await asyncio.to_thread(proxy.__exit__, None, None, None)
    # Every session is closed: descriptors must be back where they started.
    settle = loop.time() + 5.0
    end = read_process(pid, loop.time() - start)
    while end is not None and samples and end.fds > samples[0].fds and loop.time() < settle:
        await asyncio.sleep(0.1)
        end = read_process(pid, loop.time() - start)
    report.connect_failures = sum(r.connect_failures for r in robots)
    if plan is not None:
        report.network_faults = plan.counts()
    if samples and end is not None:
        warm = [s for s in samples if s.t >= min(5.0, cfg.duration_s * 0.2)] or samples
        report.rss_mib_start = round(warm[0].rss_bytes / 2**20, 1)
        report.rss_mib_end = round(end.rss_bytes / 2**20, 1)
        report.rss_slope_kib_per_min = round(slope((s.t, s.rss_bytes / 1024) for s in warm) * 60, 1)
        late = [s for s in samples if s.t >= cfg.duration_s / 2] or samples
        report.rss_slope_late_kib_per_min = round(slope((s.t, s.rss_bytes / 1024) for s in late) * 60, 1)
        step = max(1, int(30.0 / cfg.sample_period_s))
        report.rss_mib_samples = [(round(s.t), round(s.rss_bytes / 2**20, 1)) for s in samples[::step]]
        report.fds_start, report.fds_end = samples[0].fds, end.fds
        report.fd_slope_per_min = round(slope((s.t, s.fds) for s in warm) * 60, 2)
    return books


def text_served(cfg: SoakConfig) -> bool:
    """Whether the run has text streams: asked for, and ``chunkline serve`` can serve text."""
    from chunkline.server.config import ServerConfig

    return cfg.text_streams > 0 and "text" in ServerConfig.model_fields


async def _warm_up(uri: str) -> str:
    """One request before the baseline is taken, so that what the server opens once (the
    ledger's WAL files, the lanes) is not mistaken for growth; then wait for the ledger flush.
    Returns the warm-up session's id."""
    from chunkline.client import AsyncClient

    async with AsyncClient(uri) as client:
        await client.infer({"state": np.zeros(14, np.float32), "prompt": "warm-up"}, deadline_ms=5000)
        session = client.hello.session if client.hello is not None else ""
    await asyncio.sleep(1.5)
    return session


def run_soak(cfg: SoakConfig, *, log_path: Path | None = None) -> SoakReport:
    """Start a server, run the soak, drain the server with SIGTERM, reconcile its ledger.

    Args:
        cfg: the run.
        log_path: keep the server's log here (default: a temp file, removed after).
    """
    from chunkline.bench.fuzz import documented_codes
    from chunkline.bench.serverproc import ServerProcess, http_get

    documented = documented_codes()
    report = SoakReport(duration_s=cfg.duration_s, robots=cfg.robots)
    args = ["--policy", FAULT_POLICY_REF, "--lanes", "2", "--hang-timeout", "1", "--metrics-port", "0",
            "--max-message-bytes", str(cfg.max_message_bytes), "--shutdown-grace", "5", "--send-timeout", "5",
            *cfg.server_args]
    if text_served(cfg):
        args += ["--text-model", cfg.text_model]
    else:
        report.notes.append("robots only: this server does not serve text (no `text` in ServerConfig)")
    server = ServerProcess(args, log_path=log_path, env=dict(cfg.server_env))
    with server:
        assert server.proc is not None
        books = asyncio.run(_drive(cfg, server.host, server.port, server.proc.pid, documented.errors, report))
        status, body = http_get(server.host, server.metrics_port, "/metrics")
        gauges = _gauges(body.decode()) if status == 200 else {}
        for name in ("chunkline_queue_depth", "chunkline_in_flight", "chunkline_sessions"):
            if gauges.get(name, 0.0) != 0.0:
                report.problems.append(f"{name} is {gauges[name]} after every session closed")
        server.terminate()
        report.server_exit = server.proc.wait(30)
        log = server.log_path.read_text(errors="replace")
        rows = read_ledger(server.ledger_path)
    report.sessions = len(books)
    for book in books:
        report.text_requests += sum(n for k, n in book.kinds.items() if k == "generate" or k.startswith("text_"))
        report.tokens += book.tokens
        report.requests += book.sent
        report.answers += book.answers
        report.outcomes = dict(collections.Counter(report.outcomes) + book.outcomes)
        report.injected = dict(collections.Counter(report.injected) + book.kinds)
        report.lost += book.lost
        report.duplicated += book.duplicated
        report.abandoned += book.abandoned
        report.collateral += book.collateral
        code = str(book.close_code)
        report.close_codes[code] = report.close_codes.get(code, 0) + 1
        report.problems += [f"session {book.session}: {p}" for p in book.problems]
    report.chunks = report.outcomes.get("chunk", 0)
    report.admitted = sum(sum(b.admitted.values()) for b in books)
    report.refusals = report.answers - report.chunks - sum(
        sum(n for o, n in b.admitted.items() if o in ADMITTED_ERRORS) for b in books)
    rec = reconcile(rows, books, ignore=[report.warm_up_session])
    report.ledger = dataclasses.asdict(rec)
    report.problems += [f"ledger: {m}" for m in rec.mismatches]
    if rec.phantom_rows:
        report.problems.append(f"ledger: {rec.phantom_rows} rows of sessions nobody opened")
    if report.lost:
        report.problems.append(f"{report.lost} requests lost")
    if report.duplicated:
        report.problems.append(f"{report.duplicated} answers duplicated")
    if report.server_exit != 0:
        report.problems.append(f"server exited with {report.server_exit} after SIGTERM")
    if cfg.duration_s >= cfg.min_duration_for_slopes_s and report.rss_slope_late_kib_per_min > cfg.max_rss_slope_kib_per_min:
        report.problems.append(f"memory still grows by {report.rss_slope_late_kib_per_min} KiB/min in the second half")
    if report.fds_end > report.fds_start >= 0:
        report.problems.append(f"file descriptors grew from {report.fds_start} to {report.fds_end}")
    report.problems += _log_problems(log)
    return report


def _gauges(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


#: Log lines that a soak with faults produces on purpose.
_EXPECTED_ERRORS = ("has run past the hang timeout",)


def _log_problems(log: str) -> list[str]:
    problems = []
    for line in log.splitlines():
        if any(s in line for s in ("connection handler failed", "Task exception was never retrieved", "Exception in callback")):
            problems.append(f"server log: {line[:200]}")
        elif (" ERROR " in line or " CRITICAL " in line) and not any(s in line for s in _EXPECTED_ERRORS):
            problems.append(f"server log: {line[:200]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """``chunkline bench soak``: prints the report as JSON; exit status 1 if it found problems."""
    p = argparse.ArgumentParser(prog="chunkline bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the robots run (default 10)")
    p.add_argument("--robots", type=int, default=16)
    p.add_argument("--rate-hz", type=float, default=10.0, help="requests per robot per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-faults", action="store_true", help="normal requests only (a baseline)")
    p.add_argument("--no-proxy", action="store_true", help="no network faults")
    p.add_argument("--text-streams", type=int, default=4, help="text sessions beside the robots (0: robots only)")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--server-log", type=Path, default=None, help="keep the server's log here")
    p.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment for the server process (repeatable), e.g. MALLOC_ARENA_MAX=2")
    args = p.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.server_env)
    cfg = SoakConfig(duration_s=args.minutes * 60.0, robots=args.robots, rate_hz=args.rate_hz, seed=args.seed,
                     faults=not args.no_faults, proxy=not args.no_proxy, server_env=env, text_streams=args.text_streams)
    report = run_soak(cfg, log_path=args.server_log)
    text = json.dumps(report.as_dict(), indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
