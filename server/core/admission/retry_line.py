"""When refused sessions may come back: one after another, not all at once (sans-I/O).

Admission refuses a request that waiting can cure with the time from which it predicts the
request would be admitted. Under overload many sessions are refused while the same room is
ahead, and each would be given the same time: all of them come back together, one is admitted,
the rest are refused again (and upload their observation again). Worse, the one admitted is
whoever arrives first, and a client that ignores the hint and resends at once has its next
message already on the wire when the time comes: it wins against a client that waits as told
and then sends.

The :class:`RetryLine` hands out the times instead, in the order the sessions were refused, and
keeps room for the sessions that have shown they come back when told (*trusted*: the last time
they were given a time, they came back at it, within a slot, without sending before it). Each such session's
place is *reserved*: it counts, for admission, as work queued ahead of every session whose place
comes later or that has none, so a newcomer, or a client that reconnects, does not take the room
promised; and the next session refused gets a time a slot after the last reserved place (a slot:
how often, on average, the model takes one more request), or admission's own earliest time if
that is later. A session not trusted (yet) gets a time the same way but reserves nothing: a
client that does not come back at its time (an open-loop robot whose next request comes when its
control loop wants one, not when told) must not hold room nobody uses.

A session keeps its place until it is admitted, leaves (its connection closes) or does not come
back within ``grace`` of its time (it is then no longer trusted). Refused again, its new time is
its old one or admission's earliest, whichever is later: a session back at its time whose work
ahead ran late is not sent to the back. The server refuses at the door a request sent before its
session's time (see the native session) and calls :meth:`forfeit`: the session keeps its time
(the door still holds it until then) but reserves nothing, and is not trusted again until it has
waited out a time it was given. A storm of clients retrying at once therefore competes only for
the room the ones that wait leave, and among themselves as before.

Costs: ``appoint``, ``forfeit``, ``admitted``, ``leave`` and ``ahead_of`` are O(log n) plus list
moves in the n sessions waiting (sorted lists); places past their grace are dropped as time passes.
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
