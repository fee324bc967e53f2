"""Admitted requests' promises at one priority level, for admission's promise check (internal).

Each queued request keeps the completion admission predicted for it, moved a slot later each time
a request with an earlier deadline is admitted ahead of it; a newcomer that would push one past its
deadline is refused. Request by request, the check and the move would cost O(m) for the m requests
a newcomer overtakes (hundreds under a retry storm, deadlines out of arrival order).

:class:`Promises` keeps the level in deadline order in blocks of at most ``2 * BLOCK``, each with
an offset added to all of it at once and its tightest promise, so a move touches one block request
by request and later blocks once, and the check opens only blocks that could break: O(log n +
BLOCK + m / BLOCK). A block-wide slot sum may round differently in the last place from adding one
slot at a time; every comparison with a deadline is still made request by request.
"""

from __future__ import annotations

import bisect
import math

from chunkline.server.core.admission.flows import EPS

__all__ = ["BLOCK", "Promises"]

#: a block's usual size: split above twice this, merged with a neighbour at a quarter of it or less
BLOCK = 32

# A block is opened when its tightest promise is within this of breaking, not only when it
# breaks: the block's maximum may round differently from the request-by-request sums.
_PRUNE = 1e-6

#: a request's place: its deadline, then its arrival (the controller's sequence number)
Key = tuple[float, int]


class _Block:
    __slots__ = ("keys", "promised", "offset", "tightest")

    def __init__(self, keys: list[Key], promised: list[float], tightest: float | None = None) -> None:
        self.keys = keys  # ascending
        self.promised = promised  # each less ``offset``
        self.offset = 0.0
        self.tightest = -math.inf
        if tightest is None:
            self.refresh()
        else:
            self.tightest = tightest  # the caller's (a block of one: its own promise less deadline)

    def refresh(self) -> None:
        self.tightest = max((p - k[0] for k, p in zip(self.keys, self.promised, strict=True)), default=-math.inf)

    def settle(self) -> None:
        """Fold the offset into each promise (before the block is changed request by request)."""
        if self.offset:
            off = self.offset
            self.promised = [p + off for p in self.promised]
            self.tightest += off
            self.offset = 0.0


class Promises:
    """The promises of one priority level's queued requests (see the module docstring).

    Args:
        block: the usual block size (tests make it small, to exercise many blocks).
    """

    __slots__ = ("_block", "_blocks", "_firsts", "_n")

    def __init__(self, block: int = BLOCK) -> None:
        self._block = max(2, block)
        self._blocks: list[_Block] = []
        self._firsts: list[Key] = []  # each block's first key, to find a key's block by bisection
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _locate(self, key: tuple[float, float]) -> int:
        i = bisect.bisect_right(self._firsts, key) - 1
        return i if i > 0 else 0

    def add(self, deadline: float, seq: int, promised: float) -> None:
        """Queue request ``seq`` (deadline ``deadline``), promised to finish at ``promised``."""
        key = (deadline, seq)
        self._n += 1
        if not self._blocks:
            # The first queued at its level (each request, on a queue that empties between them).
            self._blocks.append(_Block([key], [promised], promised - deadline))
            self._firsts.append(key)
            return
        blocks = self._blocks
        i = self._locate(key) if len(blocks) > 1 else 0  # (one block: it is the key's)
        b = blocks[i]
        b.settle()
        j = bisect.bisect_right(b.keys, key)
        b.keys.insert(j, key)
        b.promised.insert(j, promised)
        b.tightest = max(b.tightest, promised - deadline)
        if j == 0:
            self._firsts[i] = key
        if len(b.keys) > 2 * self._block:
            self._split(i)

    def remove(self, deadline: float, seq: int) -> None:
        """Forget request ``seq`` (it ran, expired or was cancelled or evicted).

        Raises:
            KeyError: it is not here.
        """
        key = (deadline, seq)
        blocks = self._blocks
        i = self._locate(key) if len(blocks) > 1 else 0  # (one block: it is the key's)
        b = blocks[i] if blocks else None
        j = bisect.bisect_left(b.keys, key) if b is not None else 0
        if b is None or j >= len(b.keys) or b.keys[j] != key:
            raise KeyError(key)
        del b.keys[j]
        p = b.promised.pop(j)
        self._n -= 1
        if not b.keys:
            del self._blocks[i], self._firsts[i]
            return
        if j == 0:
            self._firsts[i] = b.keys[0]
        if p - deadline >= b.tightest:
            b.refresh()  # it may have been the tightest
        if len(b.keys) <= self._block // 4 and len(self._blocks) > 1:
            self._merge(i if i + 1 < len(self._blocks) else i - 1)

    def promised(self, deadline: float, seq: int) -> float:
        """Request ``seq``'s promise now.

        Raises:
            KeyError: it is not here.
        """
        key = (deadline, seq)
        b = self._blocks[self._locate(key)] if self._blocks else None
        j = bisect.bisect_left(b.keys, key) if b is not None else 0
        if b is None or j >= len(b.keys) or b.keys[j] != key:
            raise KeyError(key)
        return b.promised[j] + b.offset

    def breaking(self, deadline: float, slot: float) -> list[float]:
        """The promises of the requests with a later deadline than ``deadline`` that one more
        slot would break (``promised + slot`` past their deadline)."""
        out: list[float] = []
        if not self._blocks or self._blocks[-1].keys[-1][0] <= deadline:
            return out  # it overtakes nothing: deadlines arriving in order, the usual case
        i = self._locate((deadline, math.inf))
        j = bisect.bisect_right(self._blocks[i].keys, (deadline, math.inf))
        near = EPS - slot - _PRUNE
        for b in self._blocks[i:]:
            off = b.offset
            if b.tightest + off > near:
                keys, promised = b.keys, b.promised
                for k in range(j, len(keys)):
                    p = promised[k] + off
                    if p + slot > keys[k][0] + EPS:
                        out.append(p)
            j = 0
        return out

    def overtake(self, deadline: float, slot: float) -> None:
        """A request with deadline ``deadline`` goes ahead: every request with a later one
        finishes ``slot`` later."""
        if not self._blocks or self._blocks[-1].keys[-1][0] <= deadline:
            return
        i = self._locate((deadline, math.inf))
        b = self._blocks[i]
        j = bisect.bisect_right(b.keys, (deadline, math.inf))
        if j < len(b.keys):
            b.settle()
            moved = [p + slot for p in b.promised[j:]]
            b.promised[j:] = moved
            # Promises only move later (slot >= 0): the block's tightest is its old one or one moved now.
            b.tightest = max(b.tightest, max(p - k[0] for p, k in zip(moved, b.keys[j:], strict=True)))
        for later in self._blocks[i + 1:]:
            later.offset += slot

    def _split(self, i: int) -> None:
        b = self._blocks[i]
        b.settle()
        half = len(b.keys) // 2
        tail = _Block(b.keys[half:], b.promised[half:])
        del b.keys[half:], b.promised[half:]
        b.refresh()
        self._blocks.insert(i + 1, tail)
        self._firsts.insert(i + 1, tail.keys[0])

    def _merge(self, i: int) -> None:
        """Merge block ``i + 1`` into block ``i`` (then split it if it grew too large)."""
        a, b = self._blocks[i], self._blocks[i + 1]
        a.settle()
        b.settle()
        a.keys += b.keys
        a.promised += b.promised
        a.tightest = max(a.tightest, b.tightest)
        del self._blocks[i + 1], self._firsts[i + 1]
        if len(a.keys) > 2 * self._block:
            self._split(i)
