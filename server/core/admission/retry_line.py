"""When refused sessions may come back: one after another, not all at once (sans-I/O).

Under overload many sessions are refused while the same room is ahead; given the same retry time
they would all come back together, and a client that resends at once would beat one that waits as
told. :class:`RetryLine` hands out times in the order sessions were refused, a slot apart (how
often the model takes one more request). A *trusted* session (it came back at its last time, not
before) has its place *reserved*: it counts as work queued ahead of later sessions, so a newcomer
or a reconnecting client does not take the room promised. An untrusted session gets a time but
reserves nothing: an open-loop robot must not hold room nobody uses.

A place is kept until the session is admitted, leaves, or misses its time by more than ``grace``.
Refused again, its time is its old one or admission's earliest, whichever is later. A session that
sends early (refused at the door, :meth:`forfeit`) keeps its time but reserves nothing until it
has waited one out. Every call is O(log n) plus list moves in the n sessions waiting.
"""

from __future__ import annotations

import bisect
import math

__all__ = ["RetryLine"]

_Place = tuple[float, int, str]  # (time, seq, session): sorted by time, then by when it was given


class RetryLine:
    """The retry times handed out for one model, in time order."""

    def __init__(self) -> None:
        self._line: list[_Place] = []  # every place, ascending
        self._reserved: list[_Place] = []  # the places that keep room for their session
        self._place: dict[str, _Place] = {}
        self._trusted: set[str] = set()  # came back at the last time they were given, not before
        self._early: set[str] = set()  # sent before the time they hold
        self._seq = 0

    def __len__(self) -> int:
        return len(self._line)

    def time_of(self, session: str) -> float | None:
        """The time ``session`` was given, while it holds a place."""
        place = self._place.get(session)
        return None if place is None else place[0]

    def reserved(self, session: str) -> bool:
        """Whether ``session`` holds a place that keeps room for it."""
        place = self._place.get(session)
        return place is not None and _index(self._reserved, place) is not None

    def trusted(self, session: str) -> bool:
        """Whether ``session`` came back at the last time it was given, without sending before it."""
        return session in self._trusted

    def ahead_of(self, session: str, now: float, grace: float) -> int:
        """How many reserved places, not more than ``grace`` past their time, come before
        ``session``'s (before the end of the line if it holds none). Changes nothing."""
        reserved = self._reserved
        first = bisect.bisect_left(reserved, (now - grace,))
        own = self._place.get(session)
        end = bisect.bisect_left(reserved, own) if own is not None else len(reserved)
        return max(0, end - first)

    def appoint(self, session: str, earliest: float, now: float, slot: float, grace: float) -> float:
        """The time ``session``, refused at ``now`` by admission, which would admit it from
        ``earliest`` on, may come back; recorded as the session's place.

        Args:
            session: who was refused.
            earliest: when admission expects room for it (``now`` + its retry time).
            now: the current time.
            slot: seconds between consecutive reserved places.
            grace: how long after its time a place is kept for a session that has not come back.
        """
        self._expire(now, grace)
        own = self._place.get(session)
        if own is not None:
            self._remove(own)
            self._judge(session, abs(now - own[0]) <= slot)
            return self._insert(session, max(own[0], earliest))
        last = self._reserved[-1][0] if self._reserved else -math.inf
        return self._insert(session, max(earliest, last + slot))

    def admitted(self, session: str, now: float, slot: float) -> None:
        """``session`` was admitted at ``now``: it waits no more (and, if it held a place, it
        came back: at its time if within ``slot`` of it)."""
        place = self._place.get(session)
        if place is not None:
            self._remove(place)
            self._judge(session, abs(now - place[0]) <= slot)

    def forfeit(self, session: str) -> None:
        """``session`` sent a request before its time: its place keeps no room, and it is not
        trusted until it has waited out a time it was given."""
        self._early.add(session)
        self._trusted.discard(session)
        place = self._place.get(session)
        if place is not None:
            i = _index(self._reserved, place)
            if i is not None:
                del self._reserved[i]

    def leave(self, session: str) -> None:
        """``session`` is gone: its place and what the line knew of it are dropped."""
        place = self._place.get(session)
        if place is not None:
            self._remove(place)
        self._trusted.discard(session)
        self._early.discard(session)

    def _judge(self, session: str, on_time: bool) -> None:
        """The session's place was taken up: it is trusted if it came back at its time (within
        a slot of it) without sending before it."""
        if on_time and session not in self._early:
            self._trusted.add(session)
        else:
            self._trusted.discard(session)
        self._early.discard(session)

    def _insert(self, session: str, at: float) -> float:
        self._seq += 1
        place = (at, self._seq, session)
        bisect.insort(self._line, place)
        if session in self._trusted:
            bisect.insort(self._reserved, place)
        self._place[session] = place
        return at

    def _remove(self, place: _Place) -> None:
        i = _index(self._line, place)
        if i is not None:
            del self._line[i]
        del self._place[place[2]]
        j = _index(self._reserved, place)
        if j is not None:
            del self._reserved[j]

    def _expire(self, now: float, grace: float) -> None:
        """Drop the places more than ``grace`` past their time: their sessions did not come back."""
        key = (now - grace,)
        n = bisect.bisect_left(self._line, key)
        if n:
            for place in self._line[:n]:
                session = place[2]
                del self._place[session]
                self._trusted.discard(session)
                self._early.discard(session)
            del self._line[:n]
            del self._reserved[:bisect.bisect_left(self._reserved, key)]


def _index(places: list[_Place], place: _Place) -> int | None:
    i = bisect.bisect_left(places, place)
    return i if i < len(places) and places[i] == place else None
