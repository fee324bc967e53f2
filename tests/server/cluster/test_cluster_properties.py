"""Property tests of the fleet scale-out cores (hypothesis, injected clocks).

* tokens: any input at all is either a valid token or refused with a ``PlacementTokenError``;
  any claims round-trip;
* placement: over random fleets and report/placement sequences it never places on a draining,
  unready, stale or wrong-model replica, never plans a replica beyond its capacity, refuses only
  when no eligible replica has room, and gives canaries their share within one session;
* fleet quota: over random opens, connects, closes, reports and replica deaths the sessions
  actually open never exceed a tenant's fleet cap, and leases always add up to the fleet limits;
* autoscaler: the count stays within bounds and changes no faster than its delays allow.
"""

from __future__ import annotations

import math
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkline.server.cluster import (
    AutoscaleConfig,
    Autoscaler,
    FleetQuota,
    Placement,
    PlacementDecision,
    PlacementRefusal,
    PlacementSigner,
    PlacementTokenError,
    RefusalReason,
    ReplicaState,
    SessionRequest,
)
from chunkline.server.cluster.tokens import MAX_TOKEN_CHARS
from chunkline.server.core.tenants import TenantLimits

SECRET = b"fleet-secret-for-property-tests!"
T0 = 1_700_000_000.0
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ============================================================================ tokens


B64 = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"


def _mutations(token: str) -> st.SearchStrategy[str]:
    alphabet = string.ascii_letters + string.digits + "-_.=+/ %é\x00"
    i = st.integers(0, max(0, len(token) - 1))
    return st.one_of(
        # The same bytes spelled differently: the tag's last character has 2 unused bits.
        st.integers(1, 3).map(lambda x: token[:-1] + B64[B64.index(token[-1]) ^ x]),
        st.tuples(i, st.sampled_from(alphabet)).map(lambda p: token[: p[0]] + p[1] + token[p[0] + 1 :]),
        st.tuples(i, st.sampled_from(alphabet)).map(lambda p: token[: p[0]] + p[1] + token[p[0] :]),
        i.map(lambda k: token[:k] + token[k + 1 :]),
        i.map(lambda k: token[:k]),
        st.integers(1, 3000).map(lambda n: token + "A" * n),
    )


@FAST
@given(junk=st.one_of(st.text(max_size=300), st.binary(max_size=300), st.text(alphabet=string.ascii_letters + string.digits + "-_.", max_size=3000), st.none(), st.integers()))
def test_arbitrary_input_only_raises_token_errors(junk: object) -> None:
    signer = PlacementSigner(SECRET)
    with pytest.raises(PlacementTokenError):
        signer.verify(junk, "r1", T0)


@FAST
@given(data=st.data())
def test_mutated_tokens_are_refused_or_unchanged(data: st.DataObject) -> None:
    signer = PlacementSigner(SECRET)
    token, claims = signer.issue("acme", "r1", "m", T0)
    mutated = data.draw(_mutations(token))
    if mutated == token:
        assert signer.verify(mutated, "r1", T0) == claims
    else:
        with pytest.raises(PlacementTokenError):
            signer.verify(mutated, "r1", T0)


@FAST
# 30 characters even if all astral (12 JSON-escaped bytes each) keep the token under the cap.
@given(tenant=st.text(max_size=30), replica=st.text(max_size=30), model=st.none() | st.text(max_size=30), now=st.floats(0, 4e9))
def test_any_claims_round_trip(tenant: str, replica: str, model: str | None, now: float) -> None:
    issuer, verifier = PlacementSigner(SECRET), PlacementSigner(SECRET)
    token, claims = issuer.issue(tenant, replica, model, now)
    assert len(token) <= MAX_TOKEN_CHARS
    assert verifier.verify(token, replica, now) == claims


# ============================================================================ placement

NAMES = ("r0", "r1", "r2", "r3")
_curve = st.dictionaries(st.integers(1, 32), st.floats(0.001, 0.2), min_size=0, max_size=4)


@st.composite
def _state(draw: st.DrawFn, name: str, now: float) -> ReplicaState:
    return ReplicaState(
        name=name,
        uri=f"ws://{name}",
        fingerprint="A",
        models=draw(st.sampled_from([frozenset({"m"}), frozenset({"m", "x"}), frozenset({"x"})])),
        service_s=draw(_curve),
        max_batch_size=draw(st.integers(1, 32)),
        lanes=draw(st.integers(1, 3)),
        sessions=draw(st.integers(0, 50)),
        load_rps=draw(st.floats(0, 500)),
        ready=draw(st.booleans() | st.just(True)),
        draining=draw(st.booleans() | st.just(False)),
        updated=now - draw(st.sampled_from([0.0, 1.0, 4.9, 5.1, 30.0])),
        canary=draw(st.booleans() | st.just(False)),
    )


@FAST
@given(data=st.data())
def test_placement_only_eligible_replicas_with_room(data: st.DataObject) -> None:
    p = Placement(stale_after_s=5.0, headroom=0.8, pending_timeout_s=10.0)
    now = 100.0
    for name in NAMES:
        p.update(data.draw(_state(name, now)))
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["place", "place", "place", "update", "tick", "share"]))
        if op == "update":
            p.update(data.draw(_state(data.draw(st.sampled_from(NAMES)), now)))
        elif op == "tick":
            now += data.draw(st.floats(0, 6))
        elif op == "share":
            p.set_canary_share(data.draw(st.floats(0, 1)))
        else:
            req = SessionRequest("t", data.draw(st.sampled_from(["m", "x", None])), data.draw(st.floats(0, 200)), data.draw(st.floats(0.005, 0.5)))
            prefer = data.draw(st.none() | st.sampled_from(NAMES))
            states = p.replicas
            eligible = {
                n
                for n, s in states.items()
                if s.ready and not s.draining and 0 <= now - s.updated <= 5.0 and (req.model is None or req.model in s.models)
            }
            spare = {n: p.spare_rps(n, req.deadline_s, now) for n in eligible}
            out = p.place(req, now, prefer=prefer)
            if isinstance(out, PlacementDecision):
                assert out.replica in eligible
                assert spare[out.replica] - req.rate_hz >= 0.0  # never planned over capacity
                assert out.spare_rps == pytest.approx(spare[out.replica] - req.rate_hz)
                if out.sticky:
                    assert out.replica == prefer
                elif prefer in eligible and spare[prefer] >= req.rate_hz:
                    raise AssertionError("a reconnect with room was moved")
            else:
                assert isinstance(out, PlacementRefusal)
                if out.reason is RefusalReason.NO_REPLICA:
                    assert not eligible
                else:
                    assert eligible and all(spare[n] < req.rate_hz for n in eligible)


@FAST
@given(
    shares=st.lists(st.floats(0, 1), min_size=1, max_size=4),
    ops=st.lists(st.sampled_from([None, None, None, "s0", "c0", "gone"]), min_size=1, max_size=60),
)
def test_canary_share_within_one_session(shares: list[float], ops: list[str | None]) -> None:
    p = Placement()
    for name, canary in (("s0", False), ("s1", False), ("c0", True), ("c1", True)):
        p.update(ReplicaState(name, "ws://x", "A", frozenset({"m"}), {1: 0.001}, updated=0.0, canary=canary))
    per_share = max(1, len(ops) // len(shares))
    for k, share in enumerate(shares):
        p.set_canary_share(share)
        new = canary = 0
        for prefer in ops[k * per_share : (k + 1) * per_share]:
            d = p.place(SessionRequest("t", "m", rate_hz=0.0), 0.0, prefer=prefer)
            assert isinstance(d, PlacementDecision)
            if d.sticky:
                continue
            new += 1
            canary += d.canary
            assert abs(canary - share * new) <= 1.0 + 1e-9


# ============================================================================ fleet quota

TENANTS = ("t0", "t1")
REPLICAS = ("r0", "r1")
TTL = 30.0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    caps=st.tuples(st.integers(0, 3) | st.none(), st.integers(0, 3)),
    rate=st.floats(0.5, 500),
    ints=st.tuples(st.integers(0, 50), st.integers(1, 5000)),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["open", "open", "connect", "connect", "close", "report", "report_blind", "forget", "tick", "tick", "direct_lease"]),
            st.integers(0, len(REPLICAS) - 1),
            st.integers(0, len(TENANTS) - 1),
            st.sampled_from([0.5, 4.0, 16.0, 31.0]),
        ),
        max_size=80,
    ),
)
def test_fleet_cap_holds_and_leases_add_up(caps: tuple[int | None, int], rate: float, ints: tuple[int, int], ops: list[tuple[str, int, int, float]]) -> None:
    limits = {
        "t0": TenantLimits(max_sessions=caps[0], max_in_flight=ints[0], rate_per_s=rate, burst=max(1.0, rate), text_tokens_per_window=ints[1]),
        "t1": TenantLimits(max_sessions=caps[1]),
    }
    fq = FleetQuota(limits.__getitem__, confirm_s=TTL + 5.0)
    now = 0.0
    serial = 0
    transit: list[tuple[str, str, str, float]] = []  # (session id, tenant, replica, placed at), oldest first
    open_: dict[str, list[tuple[str, str]]] = {r: [] for r in REPLICAS}  # replica -> (session, tenant)
    confirmed: dict[str, list[str]] = {r: [] for r in REPLICAS}
    for op, ri, ti, dt in ops:
        r, t = REPLICAS[ri], TENANTS[ti]
        if op == "open":
            serial += 1
            sid = f"s{serial}"
            if fq.try_open(t, r, sid, now) is None:
                transit.append((sid, t, r, now))
        elif op in ("connect", "direct_lease") and transit:
            sid, t, r, placed = transit.pop(0)
            if now - placed >= TTL:
                continue  # the token has expired: the robot cannot connect any more
            if op == "direct_lease":
                # The replica also checks its lease (as its QuotaManager would).
                cap = fq.leases(now)[r].get(t, TenantLimits()).max_sessions
                if cap is not None and sum(1 for _, tt in open_[r] if tt == t) + 1 > cap:
                    continue
            open_[r].append((sid, t))
            confirmed[r].append(sid)
        elif op == "close" and open_[r]:
            open_[r].pop(0)
        elif op in ("report", "report_blind"):
            counts: dict[str, int] = {}
            for _, tt in open_[r]:
                counts[tt] = counts.get(tt, 0) + 1
            fq.report(r, counts, now, confirmed[r] if op == "report" else ())
            confirmed[r] = []
        elif op == "forget":
            open_[r] = []
            confirmed[r] = []
            transit = [x for x in transit if x[2] != r]
            fq.forget_replica(r)
        elif op == "tick":
            now += dt
        # ---- invariants
        for tenant in TENANTS:
            cap = limits[tenant].max_sessions
            actual = sum(1 for rr in REPLICAS for _, tt in open_[rr] if tt == tenant)
            coming = sum(1 for _, tt, _, placed in transit if tt == tenant and now - placed < TTL)
            # The count never falls under the sessions open plus the robots that may still connect.
            assert fq.sessions(tenant, now) >= actual + coming
            if cap is not None:
                assert actual <= cap
        leases = fq.leases(now, tenants=TENANTS)
        if leases:
            got = [leases[rr]["t0"] for rr in leases]
            assert sum(g.max_in_flight for g in got) == ints[0]  # type: ignore[misc]
            assert sum(g.text_tokens_per_window for g in got) == ints[1]  # type: ignore[misc]
            assert math.isclose(sum(g.rate_per_s for g in got), rate, rel_tol=1e-9)  # type: ignore[misc]
            assert all(g.rate_per_s > 0 for g in got)  # type: ignore[operator]
            for tenant in TENANTS:
                fleet_cap = limits[tenant].max_sessions
                for per in leases.values():
                    lim = per[tenant].max_sessions
                    if fleet_cap is None:
                        assert lim is None
                    else:  # the fleet cap less the sessions elsewhere: between these two
                        assert lim is not None and max(0, fleet_cap - fq.sessions(tenant, now)) <= lim <= fleet_cap
            assert all(per["t1"].rate_per_s is None and per["t1"].max_in_flight is None for per in leases.values())


# ============================================================================ autoscaler


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    loads=st.lists(st.floats(0, 3000), min_size=1, max_size=30),
    hold=st.integers(1, 40),
    misses=st.lists(st.sampled_from([0.0, 0.0, 0.05]), min_size=1, max_size=30),
)
def test_autoscaler_bounds_and_pacing(loads: list[float], hold: int, misses: list[float]) -> None:
    cfg = AutoscaleConfig(min_replicas=2, max_replicas=7, upscale_delay_s=10.0, downscale_delay_s=60.0, step=2)
    a = Autoscaler(cfg)
    count = 2
    last_change: tuple[float, int] | None = None
    t = 0.0
    for i, load in enumerate(loads):
        for _ in range(hold):  # each load level lasts `hold` seconds, observed every second
            states = [
                ReplicaState(f"r{j}", "ws://x", "A", frozenset({"m"}), {1: 0.01, 8: 0.02}, max_batch_size=8, load_rps=load / count, deadline_miss_rate=misses[i % len(misses)], updated=t, sessions=j)
                for j in range(count)
            ]
            d = a.observe(states, t)
            assert cfg.min_replicas <= d.desired <= cfg.max_replicas
            if d.desired != count:
                if last_change is not None:
                    gap = t - last_change[0]
                    assert gap >= (cfg.upscale_delay_s if d.desired > count else cfg.downscale_delay_s)
                if d.desired < count:
                    assert d.drain is not None and d.desired == count - 1
                else:
                    assert d.desired - count <= cfg.step
                last_change = (t, d.desired)
                count = d.desired  # the shell makes it so at once
            t += 1.0
