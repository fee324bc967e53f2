"""The action timeline: the actions of the current and incoming chunks, on the robot's clock.

The timeline holds one *plan*: rows of actions on a regular grid (row ``k`` due at
``t0 + k * dt``), each with an expiry and the sequence number of the newest chunk that
contributed to it. A new chunk is merged into the plan once, when it arrives (``O(H)``);
looking up the action due now is pure arithmetic (``O(1)``)::

    k = floor((now - t0) / dt)          # the latest row whose due time has come
    valid iff 0 <= k < n  and  now - due_k <= tolerance  and  now <= expires_k

Rows before the slot due at arrival time are never kept: a chunk that arrives late has its
past actions discarded, and nothing ever runs before its due time (unless ``lead_s`` allows
a small early start).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import numpy as np

from ..safety.watchdog import FallbackReason
from .chunk import ActionChunk
from .config import MergeMode
from .exceptions import BrokerConfigError, ChunkError

__all__ = ["MergeOutcome", "TimelineAction", "Join", "Timeline", "fade_weight"]

_NEG_INF = -math.inf
_EPS_SLOTS = 1e-9  # float round-off allowance when dividing a time by dt


class MergeOutcome(str, enum.Enum):
    """What happened to a chunk handed to :meth:`Timeline.add`."""

    MERGED = "merged"
    LATE = "late"  # every action's due time had already passed
    FAR = "far"  # its switch would need a longer cross-fade than allowed (refused by the broker)
    EXPIRED = "expired"  # arrived after its own expiry
    OUT_OF_ORDER = "out_of_order"  # older (earlier t0) than a chunk already merged


def fade_weight(i: Any, transition: int) -> Any:
    """The new chunk's weight at row ``i`` (0-based, an int or an array) of a ``transition``-row
    cross-fade: smootherstep, ``6x^5 - 15x^4 + 10x^3`` at ``x = (i + 1) / (transition + 1)``."""
    x = (i + 1.0) / (transition + 1.0)
    return x * x * x * (10.0 + x * (6.0 * x - 15.0))


@dataclasses.dataclass(frozen=True)
class TimelineAction:
    """A valid action due now (what :meth:`Timeline.act` returns when one exists).

    Args:
        action: the action ``[A]`` (float64, read-only view of the plan).
        index: its row in the plan.
        due: its due time.
        age: ``now - due`` (negative only within ``lead_s``).
        seq: sequence number of the newest chunk that contributed to it.
        expires: its expiry.
    """

    action: np.ndarray
    index: int
    due: float
    age: float
    seq: int
    expires: float


@dataclasses.dataclass(frozen=True)
class Join:
    """A switch that joins the chunk's trajectory instead of cross-fading into it: the commands
    that lead from the command state onto the chunk (:func:`chunkline.broker.catchup.catch_up`),
    one per control tick, played in place of the chunk's rows from ``first`` on; the chunk's
    own rows follow them exactly.

    Args:
        rows: ``[n, A]`` the join's commands.
        first: the chunk's row the first of them replaces (the one due at the join's first tick).
    """

    rows: np.ndarray
    first: int


class Timeline:
    """Actions on the robot clock, merged from chunks, looked up in ``O(1)`` per tick.

    Its attributes are the settings above plus the merged plan's arrays and hand-over state that the
    per-tick lookup reads; the tick's cost is why they stay on one object.

    Args:
        action_dim: ``A``; chunks of another width are refused.
        merge: how a new chunk combines with the plan (:class:`MergeMode`).
        blend_weights: for ``blend``, the new chunk's weight in the first hand-over slots.
        ensemble_decay: for ``ensemble``, ``m`` in ``exp(-m * i)``.
        max_age_s: lateness tolerance; ``None`` for one chunk ``dt``.
        lead_s: how early an action may be taken.
    """

    def __init__(
        self,
        action_dim: int,
        *,
        merge: MergeMode | str = MergeMode.REPLACE,
        blend_weights: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8),
        ensemble_decay: float = 0.01,
        max_age_s: float | None = None,
        lead_s: float = 0.0,
    ) -> None:
        if action_dim < 1:
            raise BrokerConfigError("action_dim must be >= 1")
        self.action_dim = int(action_dim)
        self.merge = MergeMode(merge)
        self.blend_weights = tuple(float(w) for w in blend_weights)
        self.ensemble_decay = float(ensemble_decay)
        self.max_age_s = max_age_s
        self.lead_s = float(lead_s)
        self.clear()

    def clear(self) -> None:
        """Drop every action (e.g. on reset)."""
        self._n = 0
        self._t0 = 0.0
        self._dt = 1.0
        self._inv_dt = 1.0
        self._tol = 0.0
        self._eps = _EPS_SLOTS
        self._actions = np.zeros((0, self.action_dim))
        self._actions32 = np.zeros((0, self.action_dim), dtype=np.float32)
        self._exp = np.zeros(0)
        self._seq = np.zeros(0, dtype=np.int64)
        # Per row: the ensemble's weighted sum, total weight and prediction count.
        self._ens_sum: np.ndarray = np.zeros((0, self.action_dim))
        self._ens_wsum: np.ndarray = np.zeros(0)
        self._ens_count: np.ndarray = np.zeros(0, dtype=np.int64)
        self._rows: list[np.ndarray] = []
        self._exp_list: list[float] = []
        self._seq_list: list[int] = []
        self._run_end: list[int] = []
        self._valid_until = _NEG_INF
        self._newest_t0 = _NEG_INF

    # ------------------------------------------------------------------ per-tick path

    def lookup(self, now: float) -> int | FallbackReason:
        """The row due at ``now``, or why none is valid. ``O(1)``, no allocation.

        Returns:
            the row index (an ``int``) or a :class:`FallbackReason` (``no_chunk``, ``stale``,
            ``expired``).
        """
        n = self._n
        if n == 0:
            return FallbackReason.NO_CHUNK
        x = (now - self._t0) * self._inv_dt + self._eps
        if x < 0.0:
            return FallbackReason.NO_CHUNK  # the plan starts later (a chunk with a future t0)
        k = int(x)
        if k >= n:
            return FallbackReason.EXPIRED if now > self._exp_list[n - 1] else FallbackReason.STALE
        exp = self._exp_list[k]
        if now > exp:
            return FallbackReason.STALE if exp == _NEG_INF else FallbackReason.EXPIRED
        if now - (self._t0 + k * self._dt) > self._tol:
            return FallbackReason.STALE
        return k

    def row(self, k: int) -> np.ndarray:
        """Action of row ``k`` (read-only view)."""
        return self._rows[k]

    def row_seq(self, k: int) -> int:
        """Sequence number of the newest chunk that contributed to row ``k``."""
        return self._seq_list[k]

    def due(self, k: int) -> float:
        """Due time of row ``k``."""
        return self._t0 + k * self._dt

    def act(self, now: float) -> TimelineAction | FallbackReason:
        """The action due at ``now`` with its metadata, or why none is valid."""
        k = self.lookup(now)
        if isinstance(k, FallbackReason):
            return k
        due = self.due(k)
        return TimelineAction(self._rows[k], k, due, now - due, self._seq_list[k], self._exp_list[k])

    # ------------------------------------------------------------------ queries

    @property
    def empty(self) -> bool:
        """No action at all on the timeline."""
        return self._n == 0

    @property
    def valid_until(self) -> float:
        """When the plan runs dry: the end of the contiguous run of valid rows (``-inf`` if empty)."""
        return self._valid_until

    @property
    def dt(self) -> float:
        """Spacing of the plan's rows (the newest chunk's ``dt``)."""
        return self._dt

    @property
    def newest_t0(self) -> float:
        """``t0`` of the newest merged chunk (``-inf`` before any)."""
        return self._newest_t0

    def __len__(self) -> int:
        return self._n

    def prefix(self, now: float, duration: float) -> np.ndarray | None:
        """The actions that will run from ``now`` for ``duration`` seconds, one per plan row.

        Row ``j`` of the result is what the robot will execute at ``now + j * dt`` (the plan's
        ``dt``): the frozen prefix a real-time-chunking policy inpaints. Stops at the first
        invalid row; ``None`` when nothing is valid now. A read-only float32 view of the plan
        (valid for as long as the caller keeps it: a merge installs a new plan, never writes
        into this one).
        """
        k = self.lookup(now)
        if isinstance(k, FallbackReason):
            return None
        count = max(1, math.ceil(duration * self._inv_dt - _EPS_SLOTS))
        end = min(k + count, self._run_end[k])
        # A read-only view of the plan's float32 copy (made once per merge): no copy per request.
        return self._actions32[k:end]

    # ------------------------------------------------------------------ merging

    def switch_slot(self, chunk: ActionChunk, now: float) -> int:
        """The chunk's row due at ``now`` (where :meth:`add` would hand over; negative: later)."""
        return math.floor((now - chunk.t0) / chunk.dt + _EPS_SLOTS + self.lead_s / chunk.dt)

    def plan_at(self, t: float) -> np.ndarray | None:
        """The plan's action due at ``t`` (a read-only row), or ``None`` when no valid row is due then."""
        k = self.lookup(t)
        return None if isinstance(k, FallbackReason) else self._rows[k]

    def continued_at(self, t: float) -> np.ndarray | None:
        """The plan at ``t``, continued past its end at its final velocity (on its grid).

        What a hand-over fades from when the plan ends before the fade does: holding the last
        row instead would stop the arm dead inside the fade (the jump the fade exists to avoid).
        ``None`` when no valid row is due at ``t`` and it is not after the plan's end either.
        """
        row = self.plan_at(t)
        # lookup() counts a time within its round-off allowance of the next row as that row's: a
        # tick a hair before the plan's end (tick times are sums of float periods) is past it too.
        if row is not None or not t + self._eps * self._dt >= self._valid_until > _NEG_INF:
            return row
        # The last row: just before the end, less the lead lookup() adds (it would name the row after).
        last = self.lookup(self._valid_until - (self._eps + 1e-6) * self._dt)
        if isinstance(last, FallbackReason):
            return None
        end = self._rows[last]
        before = self._rows[last - 1] if last >= 1 and self._run_end[last - 1] > last else end
        steps = math.floor((t - self.due(last)) * self._inv_dt + self._eps)
        return np.asarray(end + (end - before) * steps)

    def add(self, chunk: ActionChunk, seq: int, now: float, transition: int | Join = 0, tick: float | None = None,
            take_from: int = 0) -> MergeOutcome:
        """Merge ``chunk`` (arrived at ``now``) into the plan. ``O(H)``.

        Args:
            chunk: the chunk.
            seq: its sequence number (increasing per received chunk).
            now: the arrival time.
            transition: cross-fade from the old plan to the new chunk over this many slots from
                the switch (smoothstep weights; ``replace``, ``rtc``, and ``blend`` when longer than
                its own weights); 0: the merge mode's own hand-over; a :class:`Join`: its
                commands replace the chunk's rows they stand for (the chunk is computed to be
                joined, nothing of the old plan is read there).
            tick: a control tick time (the next one): the cross-fade starts from what the old plan
                commands at the ticks (which may fall part-way through the new chunk's slots).
            take_from: the chunk's first row that takes over (``replace``/``rtc``); before it the
                old plan runs on where it is valid (the chunk's own rows where it is not), and a
                cross-fade starts there. 0: from the slot due now.

        Raises:
            ChunkError: the chunk's width differs from the timeline's.
        """
        if chunk.action_dim != self.action_dim:
            raise ChunkError(f"chunk actions are {chunk.action_dim} wide, the timeline expects {self.action_dim}")
        if chunk.t0 < self._newest_t0:
            return MergeOutcome.OUT_OF_ORDER
        t0, dt, exp_c, h = chunk.t0, chunk.dt, chunk.expiry, chunk.horizon
        if now > exp_c:
            return MergeOutcome.EXPIRED
        eps = _EPS_SLOTS + self.lead_s / dt
        s = math.floor((now - t0) / dt + eps)  # slot of the new chunk due now (negative: starts later)
        if s >= h:
            return MergeOutcome.LATE
        self._newest_t0 = t0
        has_old = self._n > 0
        ks = s if (s < 0 and has_old) else max(s, 0)
        ks = max(ks, -100_000)  # a chunk starting absurdly far ahead: keep the buffer bounded
        takes_later = take_from > max(ks, 0) and self.merge in (MergeMode.REPLACE, MergeMode.RTC)
        join = transition if isinstance(transition, Join) else None
        fade = transition if isinstance(transition, int) else 0
        if ks >= 0 and fade <= 0 and join is None and not takes_later and self.merge in (MergeMode.REPLACE, MergeMode.RTC):
            # The common hand-over (rtc's every few ticks): the chunk has started and takes over
            # as it is, so nothing of the old plan is read: its rows from now, and nothing else
            # allocated (what the general path below computes comes to the same).
            n = h - ks
            self._install(t0 + ks * dt, dt, chunk.actions[ks:h].astype(np.float64), np.full(n, exp_c),
                          np.full(n, seq, dtype=np.int64), None, None, None)
            return MergeOutcome.MERGED
        k = np.arange(ks, h)
        due = t0 + k * dt
        n = h - ks
        new_rows = k >= (take_from if takes_later else 0)
        first_new = max(s, 0, take_from if takes_later else 0)
        a_new = np.zeros((n, self.action_dim))
        a_new[new_rows] = chunk.actions[k[new_rows]]

        if has_old:
            # What the old plan would command at the ticks that use each new slot (zero-order
            # hold on its grid): a tick at `tick` uses the slot due at or before it, so every
            # tick sits `phase` into its slot. Sampling the old plan there (not at the slots' due
            # times) keeps a merge from shifting the commands by a fraction of a slot.
            phase = 0.0 if tick is None else (tick - t0) - math.floor((tick - t0) / dt + eps) * dt
            at = due + min(max(phase, 0.0), dt)
            j = np.floor((at - self._t0) * self._inv_dt + self._eps).astype(np.int64)
            in_range = (j >= 0) & (j < self._n)
            jc = np.clip(j, 0, max(self._n - 1, 0))
            old_exp = np.where(in_range, self._exp[jc], _NEG_INF)
            old_due = self._t0 + jc * self._dt
            old_ok = in_range & (at <= old_exp) & (at - old_due <= max(self._tol, self._dt))
            old_a = self._actions[jc]
            if self.merge in (MergeMode.BLEND, MergeMode.ENSEMBLE):
                # A non-finite old action (or ensemble sum) must not poison the new chunk's
                # rows: the new prediction stands alone there.
                src = self._ens_sum[jc] if self.merge is MergeMode.ENSEMBLE else old_a
                old_ok &= np.isfinite(src).all(axis=1)
            # Where the chunk covers a slot (frozen rows, a blend, a fade), an old row valid at the
            # tick that uses the slot stands to the slot's end (within the chunk's expiry): the old
            # expiry lies on the old plan's grid, a tick's jitter off the chunk's, and would end the
            # plan inside the slot, short of the chunk's rows after it.
            held = old_ok & (k >= 0)
            old_exp[held] = np.maximum(old_exp[held], np.minimum(due[held] + dt, exp_c))
        else:
            at = due
            old_ok = np.zeros(n, dtype=bool)
            old_exp = np.full(n, _NEG_INF)
            old_a = np.zeros((n, self.action_dim))
            jc = np.zeros(n, dtype=np.int64)

        actions = np.empty((n, self.action_dim))
        exp = np.full(n, exp_c)
        seqs = np.full(n, seq, dtype=np.int64)
        old_part = ~new_rows  # rows before the new chunk starts: the old plan continues
        actions[old_part] = old_a[old_part]
        exp[old_part] = np.where(old_ok[old_part], old_exp[old_part], _NEG_INF)
        if has_old:
            seqs[old_part] = self._seq[jc[old_part]]
        if takes_later:
            # Rows the chunk has but does not take over yet: the old plan where it is valid.
            own = old_part & (k >= 0) & ~old_ok
            actions[own] = chunk.actions[k[own]]
            exp[own] = exp_c
            seqs[own] = seq

        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf in a bad chunk: NaN, refused later
            ens_sum, ens_wsum, ens_count = self._mix(
                actions, exp, a_new, old_a, old_ok, old_exp, old_part, new_rows, k, first_new, jc, has_old, exp_c, n
            )
            if fade > 0 and has_old:
                i = k - first_new
                from_a, from_ok, from_exp = old_a, old_ok, old_exp
                beyond = new_rows & ~old_ok & (i < fade) & (at + self._eps * self._dt >= self._valid_until)
                if beyond.any() and math.isfinite(self._valid_until):
                    # The old plan ends inside the fade: fade from it continued at its final velocity.
                    from_a, from_ok, from_exp = old_a.copy(), old_ok.copy(), old_exp.copy()
                    for r in np.flatnonzero(beyond):
                        cont = self.continued_at(float(at[r]))
                        if cont is not None:
                            from_a[r], from_ok[r], from_exp[r] = cont, True, exp_c
                self._fade(actions, exp, from_a, from_ok, from_exp, new_rows, i, fade, exp_c)
        if join is not None and len(join.rows):
            # The join's commands stand for the chunk's rows from its first on (rows of the plan
            # before ks never play again; the chunk's own rows follow the join).
            lo = max(join.first, ks)
            hi = min(join.first + len(join.rows), h)
            if hi > lo:
                actions[lo - ks:hi - ks] = join.rows[lo - join.first:hi - join.first]
                exp[lo - ks:hi - ks] = exp_c
                seqs[lo - ks:hi - ks] = seq
        self._install(t0 + ks * dt, dt, actions, exp, seqs, ens_sum, ens_wsum, ens_count)
        return MergeOutcome.MERGED

    def _mix(
        self,
        actions: np.ndarray,
        exp: np.ndarray,
        a_new: np.ndarray,
        old_a: np.ndarray,
        old_ok: np.ndarray,
        old_exp: np.ndarray,
        old_part: np.ndarray,
        new_rows: np.ndarray,
        k: np.ndarray,
        first_new: int,
        jc: np.ndarray,
        has_old: bool,
        exp_c: float,
        n: int,
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """Fill the new chunk's rows according to the merge mode (in place); for ``ensemble``,
        return the per-row weighted sums, weight sums and prediction counts."""
        if self.merge in (MergeMode.REPLACE, MergeMode.RTC):
            actions[new_rows] = a_new[new_rows]
        elif self.merge is MergeMode.BLEND:
            i = k - first_new
            weights = np.ones(n)
            in_window = new_rows & (i < len(self.blend_weights))
            weights[in_window] = np.asarray(self.blend_weights)[i[in_window]]
            mix = new_rows & old_ok & (weights < 1.0)
            w = weights[:, None]
            actions[new_rows] = a_new[new_rows]
            actions[mix] = (1.0 - w[mix]) * old_a[mix] + w[mix] * a_new[mix]
            exp[mix] = np.minimum(exp_c, old_exp[mix])
        if self.merge is not MergeMode.ENSEMBLE:
            return None, None, None
        # ENSEMBLE
        ens_sum = np.zeros((n, self.action_dim))
        ens_wsum = np.zeros(n)
        ens_count = np.zeros(n, dtype=np.int64)
        if has_old:
            ens_sum[old_part] = self._ens_sum[jc[old_part]]
            ens_wsum[old_part] = self._ens_wsum[jc[old_part]]
            ens_count[old_part] = self._ens_count[jc[old_part]]
        cont = new_rows & old_ok
        fresh = new_rows & ~old_ok
        # ACT: the i-th prediction of a slot (i = 0 the oldest) weighs exp(-m * i).
        prev_count = self._ens_count[jc[cont]] if has_old else np.zeros(0, dtype=np.int64)
        w = np.exp(-self.ensemble_decay * prev_count)
        ens_sum[cont] = self._ens_sum[jc[cont]] + w[:, None] * a_new[cont]
        ens_wsum[cont] = self._ens_wsum[jc[cont]] + w
        ens_count[cont] = prev_count + 1
        ens_sum[fresh] = a_new[fresh]
        ens_wsum[fresh] = 1.0
        ens_count[fresh] = 1
        valid_sum = ens_wsum > 0
        actions[valid_sum] = ens_sum[valid_sum] / ens_wsum[valid_sum, None]
        exp[cont] = np.minimum(exp_c, old_exp[cont])
        return ens_sum, ens_wsum, ens_count

    def _fade(self, actions: np.ndarray, exp: np.ndarray, old_a: np.ndarray, old_ok: np.ndarray, old_exp: np.ndarray,
              new_rows: np.ndarray, i: np.ndarray, transition: int, exp_c: float) -> None:
        """Cross-fade the first ``transition`` new rows from the old plan to what the merge mode
        made of them (smootherstep weights, ``6x^5 - 15x^4 + 10x^3``: neither a velocity nor an
        acceleration step at either end of the hand-over, so the switch itself does not jerk)."""
        fade = new_rows & old_ok & (i < transition) & np.isfinite(old_a).all(axis=1)
        w = fade_weight(i[fade], transition)[:, None]
        actions[fade] = (1.0 - w) * old_a[fade] + w * actions[fade]
        exp[fade] = np.minimum(exp_c, old_exp[fade])

    def _install(
        self,
        t0: float,
        dt: float,
        actions: np.ndarray,
        exp: np.ndarray,
        seqs: np.ndarray,
        ens_sum: np.ndarray | None,
        ens_wsum: np.ndarray | None,
        ens_count: np.ndarray | None,
    ) -> None:
        n = actions.shape[0]
        actions.setflags(write=False)
        self._n = n
        self._t0 = t0
        self._dt = dt
        self._inv_dt = 1.0 / dt
        self._tol = self.max_age_s if self.max_age_s is not None else dt
        self._eps = _EPS_SLOTS + self.lead_s / dt
        self._actions = actions
        actions32 = actions.astype(np.float32)
        actions32.setflags(write=False)
        self._actions32 = actions32
        self._exp = exp
        self._seq = seqs
        if ens_sum is not None and ens_wsum is not None and ens_count is not None:  # given together or not at all
            self._ens_sum, self._ens_wsum, self._ens_count = ens_sum, ens_wsum, ens_count
        else:
            # A plan built by replace/blend starts a fresh ensemble: each row one prediction.
            self._ens_sum = actions.copy()
            self._ens_wsum = np.where(exp > _NEG_INF, 1.0, 0.0)
            self._ens_count = (exp > _NEG_INF).astype(np.int64)
        self._rows = list(actions)
        self._exp_list = exp.tolist()
        self._seq_list = seqs.tolist()
        # When the plan runs dry: walk the rows from the first valid one until coverage breaks.
        # A tolerance below dt leaves a gap inside every slot; that is not "running dry", so the
        # coverage of a row is at least one dt here.
        due = t0 + np.arange(n) * dt
        end = np.minimum(due + max(self._tol, dt), exp)
        valid = end >= due
        # run_end[k]: one past the last row of the contiguous valid run starting at row k
        # (for the prefix: what will run without a gap from row k on).
        # Rows join within a slot's round-off (relative to dt: on a robot clock that has run for
        # hours, due times differ from their sums by more than any absolute 1e-12).
        gap = 1e-6 * dt
        joined = np.append(end[:-1] >= due[1:] - gap, False) & valid
        # A run stops at an invalid row (run_end = that row) or after a valid row the next one
        # does not join (one past it); a joined row's run ends where the next row's does: the
        # suffix minimum of those stops (no per-row Python loop in the merge).
        idx = np.arange(n)
        stops = np.where(valid, np.where(joined, n, idx + 1), idx)
        self._run_end = np.minimum.accumulate(stops[::-1])[::-1].tolist()
        if not valid.any():
            self._valid_until = _NEG_INF
            return
        first = int(np.argmax(valid))
        breaks = np.flatnonzero(end[first:-1] < due[first + 1 :] - gap)
        last = first + int(breaks[0]) if breaks.size else n - 1
        self._valid_until = float(end[last])
