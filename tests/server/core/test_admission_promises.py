"""Admission's promise check (server/core/admission/promises.py) against the straightforward one.

The oracle is the check as it was written before the blocks: a list of queued requests, each
promise moved one slot at a time, and a scan over every request a newcomer would overtake.
Random queues (adds, removals from anywhere, overtakes, far more than one block's worth) must give
the same verdicts: the same promises found breaking, and each promise equal up to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.server.core.admission.flows import EPS
from chunkline.server.core.admission.promises import BLOCK, Promises


class Oracle:
    """The O(n) check: every queued request's promise, moved request by request."""

    def __init__(self) -> None:
        self.items: dict[tuple[float, int], float] = {}

    def add(self, deadline: float, seq: int, promised: float) -> None:
        self.items[(deadline, seq)] = promised

    def remove(self, deadline: float, seq: int) -> None:
        del self.items[(deadline, seq)]

    def breaking(self, deadline: float, slot: float, margin: float) -> list[float]:
        return [p for (d, _), p in self.items.items() if d > deadline and p + slot + margin > d + EPS]

    def overtake(self, deadline: float, slot: float) -> None:
        for key in self.items:
            if key[0] > deadline:
                self.items[key] += slot


# Deadlines and promises on a grid of half-milliseconds (so that many tie, and promises sit exactly
# on their deadline or a slot away), and anywhere.
_time = st.integers(0, 40).map(lambda k: k * 0.0005) | st.floats(0.0, 0.02)
_slot = st.sampled_from([0.0, 0.0005, 0.0025, 0.004]) | st.floats(0.0, 0.01)
_op = st.one_of(
    st.tuples(st.just("add"), _time, _time),
    st.tuples(st.just("add"), _time, _time),
    st.tuples(st.just("add"), _time, _time),
    st.tuples(st.just("remove"), st.integers(0, 10_000)),
    st.tuples(st.just("remove"), st.integers(0, 10_000)),
    st.tuples(st.just("check"), _time, _slot, st.sampled_from([0.0, 0.002])),
)


def _same_promises(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(sorted(got), sorted(want), strict=True):
        assert math.isclose(g, w, rel_tol=1e-12, abs_tol=1e-12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([2, 4, 8, BLOCK]), st.lists(_op, min_size=40, max_size=200))
def test_blocks_decide_as_the_request_by_request_check(block: int, ops: list[tuple[Any, ...]]) -> None:
    book, oracle = Promises(block), Oracle()
    seq = 0
    for op in ops:
        if op[0] == "add":
            seq += 1
            book.add(op[1], seq, op[1] + op[2] - 0.03)
            oracle.add(op[1], seq, op[1] + op[2] - 0.03)
        elif op[0] == "remove" and oracle.items:
            keys = sorted(oracle.items)
            deadline, s = keys[op[1] % len(keys)]
            book.remove(deadline, s)
            oracle.remove(deadline, s)
        elif op[0] == "check":
            # what admission does with a newcomer: the check, then (if nothing breaks) the move
            _, deadline, slot, margin = op
            broken = book.breaking(deadline, slot + margin)
            _same_promises(broken, oracle.breaking(deadline, slot, margin))
            if not broken:
                book.overtake(deadline, slot)
                oracle.overtake(deadline, slot)
        assert len(book) == len(oracle.items)
    for (deadline, s), p in oracle.items.items():
        assert math.isclose(book.promised(deadline, s), p, rel_tol=1e-12, abs_tol=1e-12)


def test_removing_a_request_that_is_not_queued_is_an_error() -> None:
    book = Promises()
    book.add(0.1, 1, 0.05)
    book.remove(0.1, 1)
    with pytest.raises(KeyError):
        book.remove(0.1, 1)
    book.add(0.1, 2, 0.05)
    with pytest.raises(KeyError):
        book.remove(0.2, 2)
    assert len(book) == 1
