"""Scenario tests of the fleet scale-out cores: placement tokens, replica choice, fleet quotas,
autoscaling and rolling updates. Everything runs on injected clocks; nothing sleeps."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import urllib.parse
from fractions import Fraction

import pytest
from pydantic import ValidationError

from chunkline.server.cluster import (
    AutoscaleConfig,
    Autoscaler,
    Done,
    DrainReplica,
    FleetQuota,
    Placement,
    PlacementDecision,
    PlacementRefusal,
    PlacementSigner,
    Promote,
    RefusalReason,
    ReplicaState,
    RolledBack,
    Rollout,
    RolloutConfig,
    RolloutPhase,
    ScaleReason,
    SessionRequest,
    SetCanaryShare,
    StartReplica,
    TokenBadSignature,
    TokenExpired,
    TokenMalformed,
    TokenReused,
    TokenWrongReplica,
    VersionStats,
    capacity_rps,
    service_time,
    split_integer,
)
from chunkline.server.core.tenants import TenantLimits
from chunkline.server.errors import QuotaLimit

SECRET = b"0123456789abcdef0123456789abcdef"
T0 = 1_700_000_000.0  # wall-clock epoch seconds for the token tests


def replica(name: str, **kw: object) -> ReplicaState:
    """A ready replica serving model ``m`` at 400 req/s raw (batch 8 in 20 ms)."""
    base: dict[str, object] = dict(
        uri=f"ws://{name}:8000",
        fingerprint="A",
        models=frozenset({"m"}),
        service_s={1: 0.01, 8: 0.02},
        max_batch_size=8,
        lanes=1,
        updated=0.0,
    )
    base.update(kw)
    return ReplicaState(name=name, **base)  # type: ignore[arg-type]


# ============================================================================ tokens


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def test_token_round_trip_and_url_safe() -> None:
    signer = PlacementSigner(SECRET, ttl_s=30.0)
    token, claims = signer.issue("acme", "r1", "pi0", T0)
    assert urllib.parse.quote(token, safe="") == token
    assert claims.expires == T0 + 30.0 and claims.replica == "r1" and claims.model == "pi0"
    verifier = PlacementSigner(SECRET, ttl_s=30.0)  # the replica's own instance
    assert verifier.verify(token, "r1", T0 + 1.0) == claims
    assert verifier.verify(signer.issue("acme", "r1", None, T0)[0].encode(), "r1", T0).model is None


def test_token_is_one_use() -> None:
    signer = PlacementSigner(SECRET)
    token, _ = signer.issue("acme", "r1", None, T0)
    signer.verify(token, "r1", T0)
    with pytest.raises(TokenReused):
        signer.verify(token, "r1", T0 + 1.0)


def test_token_expiry_and_wrong_replica_do_not_consume() -> None:
    signer = PlacementSigner(SECRET, ttl_s=30.0)
    token, _ = signer.issue("acme", "r1", None, T0)
    with pytest.raises(TokenWrongReplica):
        signer.verify(token, "r2", T0)
    signer.verify(token, "r1", T0 + 29.9)  # the wrong-replica attempt did not burn the nonce
    late, _ = signer.issue("acme", "r1", None, T0)
    with pytest.raises(TokenExpired):
        signer.verify(late, "r1", T0 + 30.0)


def test_token_forgery_is_refused() -> None:
    signer = PlacementSigner(SECRET)
    token, _ = signer.issue("acme", "r1", None, T0)
    body, tag = token.split(".")
    obj = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    obj["t"] = "victim"
    forged = _b64(json.dumps(obj, separators=(",", ":")).encode()) + "." + tag
    with pytest.raises(TokenBadSignature):
        signer.verify(forged, "r1", T0)
    other = PlacementSigner(b"another-secret-of-32-bytes......")
    with pytest.raises(TokenBadSignature):
        other.verify(token, "r1", T0)


def test_token_malformed_inputs() -> None:
    signer = PlacementSigner(SECRET)
    token, _ = signer.issue("acme", "r1", None, T0)
    body, tag = token.split(".")
    bad = [
        "",
        "abc",
        token + ".x",
        token.replace(".", "!"),
        "A" * 3000 + "." + "A" * 43,  # over the cap: refused before decoding
        body + "." + tag[:-2],  # tag of the wrong length
        body + "=." + tag,
        "é" + token,
        b"\xff\xfe",
        None,
        12,
    ]
    for t in bad:
        with pytest.raises(TokenMalformed):
            signer.verify(t, "r1", T0)


def test_token_has_one_spelling() -> None:
    # A 32-byte tag is 43 characters whose last one carries 2 unused bits: flipping them spells
    # the same bytes differently, which must not pass.
    signer = PlacementSigner(SECRET)
    token, _ = signer.issue("acme", "r1", None, T0)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    last = alphabet.index(token[-1])
    twin = token[:-1] + alphabet[last ^ 1]
    assert base64.urlsafe_b64decode(twin.split(".")[1] + "=") == base64.urlsafe_b64decode(token.split(".")[1] + "=")
    with pytest.raises(TokenMalformed):
        signer.verify(twin, "r1", T0)
    signer.verify(token, "r1", T0)


def test_token_claims_checked_after_signature() -> None:
    # Signed with the right secret but not placement claims (a signer bug, a future format).
    signer = PlacementSigner(SECRET)
    for obj in ({"t": "a"}, [1, 2], {"t": "a", "r": "r1", "s": "s", "m": 3, "e": T0 + 5, "n": "x"}, {"t": "a", "r": "r1", "s": "s", "m": None, "e": True, "n": "x"}):
        body = json.dumps(obj).encode()
        token = _b64(body) + "." + _b64(signer._tag(body))
        with pytest.raises(TokenMalformed):
            signer.verify(token, "r1", T0)


def test_token_nonce_memory_is_bounded_and_clock_steps_back_safely() -> None:
    issuer = PlacementSigner(SECRET, ttl_s=30.0)
    verifier = PlacementSigner(SECRET, ttl_s=30.0)
    first, _ = issuer.issue("acme", "r1", None, T0)
    verifier.verify(first, "r1", T0)
    for i in range(200):  # one token a second for 200 s
        tok, _ = issuer.issue("acme", "r1", None, T0 + i)
        verifier.verify(tok, "r1", T0 + i)
        assert verifier.remembered <= 31
    # The wall clock steps back 190 s: the first token (nonce pruned long ago) stays dead.
    with pytest.raises(TokenExpired):
        verifier.verify(first, "r1", T0 + 10.0)


def test_token_longer_lived_than_ours_is_refused() -> None:
    long_lived = PlacementSigner(SECRET, ttl_s=3600.0)
    token, _ = long_lived.issue("acme", "r1", None, T0)
    with pytest.raises(TokenMalformed):
        PlacementSigner(SECRET, ttl_s=30.0, max_skew_s=5.0).verify(token, "r1", T0)


def test_signer_rejects_weak_secret_and_oversized_claims() -> None:
    with pytest.raises(ValueError):
        PlacementSigner(b"short")
    with pytest.raises(ValueError):
        PlacementSigner(SECRET).issue("acme" * 500, "r1", None, T0)


# ============================================================================ placement


def test_service_time_interpolates_and_extrapolates_cautiously() -> None:
    curve = {2: 0.010, 4: 0.014}
    assert service_time(curve, 1) == pytest.approx(0.010)  # below the smallest: its time
    assert service_time(curve, 3) == pytest.approx(0.012)
    # Above: proportional (0.014 * 8 / 4 = 0.028) beats the last segment (0.014 + 4 * 0.002).
    assert service_time(curve, 8) == pytest.approx(0.028)
    steep = {1: 0.01, 2: 0.03}  # superlinear: the last segment is the cautious one
    assert service_time(steep, 4) == pytest.approx(0.07)
    assert service_time({4: 0.02}, 16) == pytest.approx(0.08)


def test_capacity_rps_follows_the_deadline() -> None:
    st = replica("a")
    # Deadline 100 ms: batch 8 (20 ms) fits with a batch ahead: 8 / 0.02 = 400/s, 80% planned.
    assert capacity_rps(st, 0.1) == pytest.approx(320.0)
    # Deadline 30 ms: service must be <= 15 ms: batch 4 (14.29 ms interpolated).
    assert capacity_rps(st, 0.03, 1.0) == pytest.approx(4 / (0.01 + 3 / 7 * 0.01))
    assert capacity_rps(st, 0.019) == 0.0  # even one request does not fit
    assert capacity_rps(dataclasses.replace(st, lanes=2), 0.1) == pytest.approx(640.0)
    assert capacity_rps(dataclasses.replace(st, service_s={}), 0.1) == 0.0


def _place(p: Placement, now: float = 1.0, **kw: object) -> PlacementDecision:
    d = p.place(SessionRequest("acme", "m", **kw), now)  # type: ignore[arg-type]
    assert isinstance(d, PlacementDecision), d
    return d


def test_place_spreads_by_spare_capacity_and_counts_pending() -> None:
    p = Placement()
    p.update(replica("a", load_rps=200.0))
    p.update(replica("b", load_rps=100.0))
    p.update(replica("c", load_rps=100.0, service_s={1: 0.005, 8: 0.01}))  # twice as fast
    # c: 640 planned - 100 = 540 spare; b: 220; a: 120. Without pending accounting every
    # session would go to c until the next report.
    picks = [_place(p, rate_hz=50.0).replica for _ in range(12)]
    assert picks[0] == "c"
    assert picks.count("c") >= 7 and "b" in picks and "a" in picks
    assert p.pending_rps("c", 1.0) == pytest.approx(50.0 * picks.count("c"))


def test_place_spreads_in_proportion_to_capacity() -> None:
    p = Placement()
    p.update(replica("slow"))  # 320 req/s planned
    p.update(replica("fast", service_s={1: 0.005, 8: 0.01}))  # 640 req/s planned
    picks = [_place(p, rate_hz=10.0).replica for _ in range(90)]
    assert picks.count("fast") == 60 and picks.count("slow") == 30


def test_open_sessions_count_at_least_their_nominal_rate() -> None:
    # 30 sessions connected but not asking yet (load 0): at 10 Hz each they will need 300 of
    # the 320 req/s planned, leaving no room for a 30 Hz robot.
    p = Placement(session_rate_hz=10.0)
    p.update(replica("a", sessions=30, load_rps=0.0))
    assert isinstance(p.place(SessionRequest("acme", "m", rate_hz=30.0), 1.0), PlacementRefusal)
    trusting = Placement(session_rate_hz=0.0)
    trusting.update(replica("a", sessions=30, load_rps=0.0))
    assert isinstance(trusting.place(SessionRequest("acme", "m", rate_hz=30.0), 1.0), PlacementDecision)


def test_cancelled_placement_stops_counting() -> None:
    p = Placement()
    p.update(replica("a"))
    kept = _place(p, rate_hz=30.0)
    dropped = _place(p, rate_hz=50.0)
    assert kept.rate_hz == 30.0 and p.pending_rps("a", 1.0) == pytest.approx(80.0)
    p.cancel(dropped)
    assert p.pending_rps("a", 1.0) == pytest.approx(30.0)
    p.cancel(dropped)  # twice: nothing more to take back
    assert p.pending_rps("a", 1.0) == pytest.approx(30.0)
    assert f"{RefusalReason.NO_CAPACITY}" == "no_capacity" and str(ScaleReason.UNDERUSED) == "underused"


def test_place_ties_go_to_the_smallest_name() -> None:
    p = Placement()
    for name in ("zz", "mm", "aa"):
        p.update(replica(name))
    assert _place(p, rate_hz=0.0).replica == "aa"


def test_pending_released_by_reports_or_timeout() -> None:
    p = Placement(pending_timeout_s=10.0)
    p.update(replica("a", sessions=3, updated=0.0))
    for _ in range(3):
        _place(p, rate_hz=20.0)
    assert p.pending_rps("a", 1.0) == pytest.approx(60.0)
    p.update(replica("a", sessions=5, updated=2.0))  # two of them arrived
    assert p.pending_rps("a", 2.0) == pytest.approx(20.0)
    p.update(replica("a", sessions=4, updated=3.0))  # one left: shows nothing about the third
    assert p.pending_rps("a", 3.0) == pytest.approx(20.0)
    assert p.pending_rps("a", 11.0) == 0.0  # the robot never came
    p.update(replica("a", sessions=9, updated=1.0))  # an older report is ignored
    assert p.replicas["a"].sessions == 4


def test_place_skips_ineligible_replicas() -> None:
    p = Placement(stale_after_s=5.0)
    p.update(replica("draining", draining=True, updated=10.0))
    p.update(replica("warming", ready=False, updated=10.0))
    p.update(replica("stale", updated=1.0))
    p.update(replica("other", models=frozenset({"x"}), updated=10.0))
    r = p.place(SessionRequest("acme", "m"), 10.0)
    assert isinstance(r, PlacementRefusal) and r.reason is RefusalReason.NO_REPLICA
    p.update(replica("good", updated=9.0))
    assert _place(p, 10.0).replica == "good"
    assert p.place(SessionRequest("acme", None), 10.0).replica in {"good", "other"}  # type: ignore[union-attr]
    p.remove("good")
    assert isinstance(p.place(SessionRequest("acme", "m"), 10.0), PlacementRefusal)


def test_place_refuses_when_full_with_retry_after() -> None:
    p = Placement(retry_after_ms=750)
    p.update(replica("a", load_rps=300.0))
    p.update(replica("b", load_rps=310.0))
    assert _place(p, rate_hz=15.0).replica == "a"  # 320 - 300 = 20 spare
    r = p.place(SessionRequest("acme", "m", rate_hz=15.0), 1.0)
    assert isinstance(r, PlacementRefusal)
    assert r.reason is RefusalReason.NO_CAPACITY and r.retry_after_ms == 750
    # A tighter deadline shrinks capacity: 20 ms deadline fits only batch 1 (100/s, 80 planned).
    p2 = Placement()
    p2.update(replica("a", load_rps=70.0))
    assert isinstance(p2.place(SessionRequest("acme", "m", rate_hz=15.0, deadline_s=0.02), 1.0), PlacementRefusal)


def test_place_keeps_a_reconnecting_robot_where_it_was() -> None:
    p = Placement()
    p.update(replica("a", load_rps=250.0))
    p.update(replica("b"))
    d = p.place(SessionRequest("acme", "m"), 1.0, prefer="a")
    assert isinstance(d, PlacementDecision) and d.replica == "a" and d.sticky
    p.update(replica("a", load_rps=315.0, updated=0.5))  # no room for 10 more
    d = p.place(SessionRequest("acme", "m"), 1.0, prefer="a")
    assert isinstance(d, PlacementDecision) and d.replica == "b" and not d.sticky
    p.update(replica("a", draining=True, updated=0.6))
    d = p.place(SessionRequest("acme", "m"), 1.0, prefer="a")
    assert isinstance(d, PlacementDecision) and d.replica == "b"


def test_canary_share_is_a_deterministic_counter() -> None:
    p = Placement()
    p.update(replica("stable1"))
    p.update(replica("stable2"))
    p.update(replica("canary", canary=True))
    assert all(not _place(p, rate_hz=0.0).canary for _ in range(20))  # share 0: stable first
    p.set_canary_share(0.25)
    flags = [_place(p, rate_hz=0.0).canary for _ in range(16)]
    assert flags == [False, False, False, True] * 4
    # A reconnect kept on its replica is not a new session and takes no turn.
    d = p.place(SessionRequest("acme", "m", rate_hz=0.0), 1.0, prefer="stable2")
    assert isinstance(d, PlacementDecision) and d.sticky
    assert [_place(p, rate_hz=0.0).canary for _ in range(4)] == [False, False, False, True]


def test_canary_is_last_resort_without_a_share() -> None:
    p = Placement()
    p.update(replica("stable", load_rps=315.0))
    p.update(replica("canary", canary=True))
    d = _place(p)
    assert d.replica == "canary" and d.canary


# ============================================================================ fleet quota


def _limits(**kw: object) -> TenantLimits:
    return TenantLimits(**kw)  # type: ignore[arg-type]


def test_fleet_sessions_count_pending_and_refuse_at_the_cap() -> None:
    fq = FleetQuota(lambda t: _limits(max_sessions=3), confirm_s=35.0)
    assert fq.try_open("acme", "r1", "s1", 0.0) is None
    assert fq.try_open("acme", "r2", "s2", 0.0) is None
    assert fq.try_open("acme", "r2", "s2", 0.5) is None  # same id: counted once
    fq.report("r1", {"acme": 1}, 1.0)  # s1 is (probably) this one, but unconfirmed
    assert fq.sessions("acme", 1.0) == 3  # counted twice until confirmed: the cautious side
    refusal = fq.try_open("acme", "r1", "s3", 1.0)
    assert refusal is not None and refusal.limit is QuotaLimit.MAX_SESSIONS
    assert refusal.retry_after_ms == pytest.approx(34000.0)
    fq.report("r1", {"acme": 1}, 2.0, confirmed=["s1", "unknown"])
    assert fq.sessions("acme", 2.0) == 2
    assert fq.try_open("acme", "r1", "s3", 2.0) is None
    assert fq.try_open("other", "r1", "x", 2.0) is None  # another tenant has its own cap


def test_fleet_pending_resolved_by_late_report_or_forget() -> None:
    fq = FleetQuota(lambda t: _limits(max_sessions=2), confirm_s=35.0, abandon_s=300.0)
    fq.try_open("acme", "r1", "s1", 0.0)
    fq.try_open("acme", "r2", "s2", 0.0)
    fq.report("r1", {}, 34.0)  # could still connect: keep counting
    assert fq.sessions("acme", 34.0) == 2
    fq.report("r1", {}, 35.0)  # token long expired, not in the counts: it never came
    assert fq.sessions("acme", 35.0) == 1
    fq.report("r1", {"acme": 5}, 20.0)  # older than the held report: ignored
    assert fq.sessions("acme", 35.0) == 1
    fq.forget_replica("r2")
    assert fq.sessions("acme", 36.0) == 0
    fq.try_open("acme", "r3", "s4", 40.0)  # r3 never reports again
    assert fq.sessions("acme", 339.0) == 1
    assert fq.sessions("acme", 340.0) == 0  # abandoned at last


def test_fleet_leases_split_by_sessions_with_floor() -> None:
    limits = _limits(max_sessions=10, max_in_flight=10, rate_per_s=100.0, burst=20.0, text_tokens_per_window=1000, text_window_s=30.0)
    fq = FleetQuota(lambda t: limits, floor_share=0.05)
    fq.report("r0", {"acme": 3}, 0.0)
    fq.report("r1", {"acme": 1}, 0.0)
    fq.report("r2", {}, 0.0)
    leases = fq.leases(0.0)
    got = {r: leases[r]["acme"] for r in ("r0", "r1", "r2")}
    # weights: 0.95 * 3/4, 0.95 * 1/4, 0.05
    assert [got[r].rate_per_s for r in ("r0", "r1", "r2")] == pytest.approx([71.25, 23.75, 5.0])
    assert [got[r].max_in_flight for r in ("r0", "r1", "r2")] == [7, 2, 1]  # 7.125, 2.375, 0.5
    assert [got[r].text_tokens_per_window for r in ("r0", "r1", "r2")] == [713, 237, 50]
    assert [got[r].max_sessions for r in ("r0", "r1", "r2")] == [9, 7, 6]
    assert [got[r].burst for r in ("r0", "r1", "r2")] == pytest.approx([14.25, 4.75, 1.0])
    assert all(g.text_window_s == 30.0 for g in got.values())


def test_fleet_leases_unlimited_stays_unlimited_and_unseen_tenants_split_evenly() -> None:
    fq = FleetQuota(lambda t: _limits(rate_per_s=90.0) if t == "rated" else _limits())
    fq.report("r0", {"free": 2}, 0.0)
    fq.report("r1", {}, 0.0)
    fq.report("r2", {}, 0.0)
    leases = fq.leases(0.0, tenants=["rated"])
    assert leases["r0"]["free"] == TenantLimits()
    assert [leases[r]["rated"].rate_per_s for r in ("r0", "r1", "r2")] == pytest.approx([30.0, 30.0, 30.0])
    assert leases["r0"]["rated"].burst == pytest.approx(30.0)  # default burst ceil(90), split
    assert fq.lease("rated", "r9", 0.0).rate_per_s == pytest.approx(22.5)  # a fourth replica joining


def test_split_integer_largest_remainder() -> None:
    w = {"a": Fraction(1, 3), "b": Fraction(1, 3), "c": Fraction(1, 3)}
    assert split_integer(10, w) == {"a": 4, "b": 3, "c": 3}
    assert split_integer(0, w) == {"a": 0, "b": 0, "c": 0}
    assert split_integer(7, {"x": Fraction(1)}) == {"x": 7}


# ============================================================================ autoscaler


def _fleet(n: int, load_per: float, now: float, **kw: object) -> list[ReplicaState]:
    # Each replica: 400 req/s raw at a 100 ms deadline.
    return [replica(f"r{i}", load_rps=load_per, updated=now, **kw) for i in range(n)]  # type: ignore[arg-type]


CFG = AutoscaleConfig(min_replicas=2, max_replicas=6, upscale_delay_s=10.0, downscale_delay_s=60.0, step=2, target_utilisation=0.7, hysteresis=0.15)


def test_autoscale_load_ramp_scales_up_after_the_delay_and_counts_warming() -> None:
    a = Autoscaler(CFG)
    assert a.observe(_fleet(2, 200.0, 0.0), 0.0).desired == 2  # 50% used
    for t in range(1, 10):
        d = a.observe(_fleet(2, 320.0, float(t)), float(t))  # 80%: over target, not yet 10 s
        assert d.desired == 2
    d = a.observe(_fleet(2, 320.0, 11.0), 11.0)
    # 640 req/s at 70% of 400 needs ceil(2.29) = 3 replicas.
    assert d.desired == 3 and d.reason is ScaleReason.UTILISATION
    # The new replica warms (or is not even reported yet): it counts as capacity coming, so
    # the same load does not ask for more.
    for t in range(12, 60):
        states = _fleet(2, 320.0, float(t))
        if t > 20:
            states.append(replica("r2", ready=False, updated=float(t), service_s={}))
        assert a.observe(states, float(t)).desired == 3


def test_autoscale_step_and_max() -> None:
    a = Autoscaler(CFG)
    a.observe(_fleet(2, 390.0, 0.0), 0.0)
    d = a.observe(_fleet(2, 390.0, 10.0), 10.0)
    assert d.desired == 3  # 780 req/s at 70% of 400 each: ceil(2.79)
    a2 = Autoscaler(CFG)
    a2.observe(_fleet(2, 2000.0, 0.0), 0.0)
    assert a2.observe(_fleet(2, 2000.0, 10.0), 10.0).desired == 4  # +step only
    a3 = Autoscaler(AutoscaleConfig(min_replicas=1, max_replicas=3, upscale_delay_s=0.0))
    assert a3.observe(_fleet(3, 2000.0, 0.0), 0.0).desired == 3


def test_autoscale_burst_shorter_than_the_delay_does_nothing() -> None:
    a = Autoscaler(CFG)
    loads = [200.0] * 5 + [390.0] * 8 + [200.0] * 5 + [390.0] * 8 + [200.0] * 5
    for t, load in enumerate(loads):
        assert a.observe(_fleet(2, load, float(t)), float(t)).desired == 2


def test_autoscale_flapping_input_never_flaps() -> None:
    a = Autoscaler(CFG)
    a.observe(_fleet(4, 100.0, 0.0), 0.0)
    seen = set()
    for t in range(1, 600):
        load = 40.0 if t % 2 else 300.0  # alternately idle and hot, every second
        seen.add(a.observe(_fleet(4, load, float(t)), float(t)).desired)
    assert seen == {4}


def test_autoscale_scales_down_slowly_draining_the_emptiest_non_canary() -> None:
    a = Autoscaler(CFG)
    states = [
        replica("r0", load_rps=40.0, sessions=4),
        replica("r1", load_rps=10.0, sessions=1, canary=True),
        replica("r2", load_rps=30.0, sessions=2),
    ]
    decisions = []
    for t in range(0, 61):
        for s in states:
            s.updated = float(t)
        decisions.append(a.observe(states, float(t)))
    assert all(d.desired == 3 for d in decisions[:-1])
    last = decisions[-1]
    assert last.desired == 2 and last.reason is ScaleReason.UNDERUSED and last.drain == "r2"
    # Never below min_replicas, however idle.
    states[2].draining = True
    for t in range(61, 400):
        for s in states:
            s.updated = float(t)
        assert a.observe(states, float(t)).desired == 2


def test_autoscale_no_downscale_when_removing_one_would_overload() -> None:
    a = Autoscaler(CFG)
    for t in range(0, 200):
        # 3 x 400 raw; removing one leaves 800 for 500 req/s = 62.5%, over 0.7 * 0.85 = 59.5%.
        assert a.observe(_fleet(3, 500.0 / 3, float(t)), float(t)).desired == 3


def test_autoscale_pressure_adds_a_replica_but_not_while_one_warms() -> None:
    a = Autoscaler(CFG)
    for t in range(0, 11):
        d = a.observe(_fleet(2, 100.0, float(t), deadline_miss_rate=0.05), float(t))
    assert d.desired == 3 and d.reason is ScaleReason.MISS_RATE
    for t in range(11, 100):
        states = _fleet(2, 100.0, float(t), queue_wait_p99_s=0.05)
        states.append(replica("new", ready=False, updated=float(t)))
        assert a.observe(states, float(t)).desired == 3


def test_autoscale_min_max_and_no_signal() -> None:
    a = Autoscaler(CFG)
    d = a.observe([replica("r0", updated=0.0)], 0.0)
    assert d.desired == 2 and d.reason is ScaleReason.BELOW_MIN
    a2 = Autoscaler(CFG)
    assert a2.observe(_fleet(8, 1.0, 0.0), 0.0).desired == 6
    a3 = Autoscaler(CFG)
    d = a3.observe(_fleet(3, 100.0, 0.0, ready=False), 0.0)
    assert d.desired == 3 and d.reason is ScaleReason.NO_SIGNAL
    with pytest.raises(ValidationError):
        AutoscaleConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError):
        AutoscaleConfig(min_replicas=0)


# ============================================================================ rollout


@dataclasses.dataclass
class FakeReplica:
    fingerprint: str
    state: str  # starting | ready | draining
    since: float


class FakeFleet:
    """The shell: carries out actions on a simulated fleet and reports events back.

    A replica takes ``start_s`` to become ready (or never, for fingerprints in ``broken``) and
    ``drain_s`` to go after a drain. Each ready replica serves 100 requests a second, missing
    deadlines at its fingerprint's ``miss`` rate.
    """

    def __init__(self, n: int, miss: dict[str, float], broken: frozenset[str] = frozenset(), start_s: float = 20.0, drain_s: float = 30.0) -> None:
        self.replicas = {f"a{i}": FakeReplica("A", "ready", 0.0) for i in range(n)}
        self.miss = miss
        self.broken = broken
        self.start_s = start_s
        self.drain_s = drain_s
        self.stats: dict[str, VersionStats] = {}
        self.share = 0.0
        self.stable = "A"
        self.serial = 0
        self.actions: list[object] = []
        self.min_ready = n

    def ready(self) -> list[str]:
        return [n for n, r in self.replicas.items() if r.state == "ready"]

    def fingerprints(self) -> set[str]:
        return {r.fingerprint for r in self.replicas.values() if r.state == "ready"}

    def run(self, rollout: Rollout, until: float, kill: tuple[float, str] | None = None) -> None:
        t = 0.0
        while t <= until:
            for name, r in list(self.replicas.items()):
                if r.state == "starting" and t - r.since >= self.start_s and r.fingerprint not in self.broken:
                    r.state = "ready"
                    rollout.replica_started(name, r.fingerprint, t)
                elif r.state == "draining" and t - r.since >= self.drain_s:
                    del self.replicas[name]
                    rollout.replica_removed(name, t)
            if kill is not None and t == kill[0]:
                victim = next(n for n, r in sorted(self.replicas.items()) if r.fingerprint == kill[1] and r.state == "ready")
                del self.replicas[victim]
                rollout.replica_failed(victim, t)
            if self.share > 0 or self.stable != "A":
                for name in self.ready():
                    fp = self.replicas[name].fingerprint
                    old = self.stats.get(fp, VersionStats())
                    self.stats[fp] = VersionStats(old.requests + 100, old.errors, old.deadline_misses + round(100 * self.miss[fp]))
            for act in rollout.next_actions(t, dict(self.stats)):
                self.actions.append(act)
                if isinstance(act, StartReplica):
                    self.serial += 1
                    self.replicas[f"{act.fingerprint.lower()}{self.serial}"] = FakeReplica(act.fingerprint, "starting", t)
                elif isinstance(act, DrainReplica):
                    r = self.replicas[act.name]
                    assert r.state == "ready"
                    r.state, r.since = "draining", t
                elif isinstance(act, SetCanaryShare):
                    self.share = act.share
                elif isinstance(act, Promote):
                    self.stable = act.fingerprint
            if kill is None or t < kill[0]:
                self.min_ready = min(self.min_ready, len(self.ready()))
            t += 1.0


ROLL = RolloutConfig(canary_replicas=1, canary_share=0.1, observe_s=60.0, min_requests=1000, max_miss_rate_delta=0.01, max_error_rate_delta=0.01, batch=2, start_timeout_s=120.0)


def test_rollout_healthy_version_completes() -> None:
    fleet = FakeFleet(5, {"A": 0.01, "B": 0.012})
    r = Rollout("A", "B", list(fleet.replicas), ROLL)
    fleet.run(r, 1000.0)
    assert r.phase is RolloutPhase.DONE and isinstance(fleet.actions[-1], Done)
    assert fleet.fingerprints() == {"B"} and len(fleet.ready()) == 5
    assert fleet.min_ready >= 5  # never below the original count of ready replicas
    assert fleet.replicas.keys() == set(fleet.ready())  # the old ones drained and gone
    assert Promote("B") in fleet.actions and SetCanaryShare(0.1) in fleet.actions
    starts = [a for a in fleet.actions if isinstance(a, StartReplica)]
    assert len(starts) == 5 and all(a.fingerprint == "B" for a in starts)


def test_rollout_worse_version_is_rolled_back() -> None:
    fleet = FakeFleet(4, {"A": 0.01, "B": 0.05})
    r = Rollout("A", "B", list(fleet.replicas), ROLL)
    fleet.run(r, 600.0)
    assert r.phase is RolloutPhase.ROLLED_BACK
    last = fleet.actions[-1]
    assert isinstance(last, RolledBack) and "miss" in last.reason
    assert fleet.fingerprints() == {"A"} and len(fleet.ready()) == 4 and fleet.min_ready >= 4
    assert not any(isinstance(a, Promote) and a.fingerprint == "B" for a in fleet.actions)
    assert fleet.share == 0.0


def test_rollout_version_that_fails_to_start_is_rolled_back() -> None:
    fleet = FakeFleet(3, {"A": 0.0, "B": 0.0}, broken=frozenset({"B"}))
    r = Rollout("A", "B", list(fleet.replicas), ROLL)
    fleet.run(r, 200.0)
    assert r.phase is RolloutPhase.ROLLED_BACK and "failed" in (r.reason or "")
    assert fleet.fingerprints() == {"A"} and len(fleet.ready()) == 3


def test_rollout_reported_start_failure_rolls_back_at_once() -> None:
    r = Rollout("A", "B", ["a0", "a1"], ROLL)
    assert r.next_actions(0.0, {}) == [StartReplica("B")]
    r.replica_failed("b-whatever-the-shell-called-it", 5.0)
    acts = r.next_actions(6.0, {})
    assert acts[:2] == [SetCanaryShare(0.0), Promote("A")] and isinstance(acts[-1], RolledBack)
    r.replica_started("b-late", "B", 50.0)  # it showed up after all: drained
    assert r.next_actions(51.0, {}) == [DrainReplica("b-late")]


def test_rollout_new_replica_dying_mid_update_restores_the_old_version() -> None:
    fleet = FakeFleet(4, {"A": 0.01, "B": 0.01})
    r = Rollout("A", "B", list(fleet.replicas), ROLL)
    # Canary ready at 20 s, passes at 80 s (60 s watched, 1000+ requests each); at 90 s the
    # replacement is under way (two old replicas drained) when the canary replica dies.
    fleet.run(r, 1000.0, kill=(90.0, "B"))
    assert r.phase is RolloutPhase.ROLLED_BACK
    assert sum(isinstance(a, DrainReplica) for a in fleet.actions[: fleet.actions.index(Promote("A"))]) >= 1
    assert fleet.fingerprints() == {"A"} and len(fleet.ready()) == 4


def test_rollout_needs_evidence_before_judging() -> None:
    r = Rollout("A", "B", ["a0"], ROLL)
    assert r.next_actions(0.0, {}) == [StartReplica("B")]
    r.replica_started("b1", "B", 20.0)
    assert r.next_actions(20.0, {}) == [SetCanaryShare(0.1)]
    bad = {"A": VersionStats(3, 0, 0), "B": VersionStats(3, 3, 3)}  # 100% misses, 3 requests
    for t in range(21, 2000, 10):
        assert r.next_actions(float(t), bad) == []
    assert r.phase is RolloutPhase.CANARY
    # Enough requests but not yet observe_s: a healthy canary keeps being watched...
    r2 = Rollout("A", "B", ["a0"], ROLL)
    r2.next_actions(0.0, {})
    r2.replica_started("b1", "B", 1.0)
    r2.next_actions(1.0, {})
    good = {"A": VersionStats(5000, 1, 50), "B": VersionStats(1000, 0, 10)}
    assert r2.next_actions(30.0, good) == []
    # ... while a bad one with enough evidence is rolled back at once.
    acts = r2.next_actions(31.0, {"A": VersionStats(5000, 1, 50), "B": VersionStats(1000, 30, 10)})
    assert isinstance(acts[-1], DrainReplica) or isinstance(acts[-1], RolledBack)
    assert r2.phase in (RolloutPhase.ROLLING_BACK, RolloutPhase.ROLLED_BACK) and "error" in (r2.reason or "")


def test_rollout_start_timeout_counts_as_failure() -> None:
    r = Rollout("A", "B", ["a0"], ROLL)
    r.next_actions(0.0, {})
    assert r.next_actions(119.0, {}) == []
    acts = r.next_actions(120.0, {})
    assert isinstance(acts[-1], RolledBack)


def test_rollout_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        Rollout("A", "A", ["a0"], ROLL)
    with pytest.raises(ValueError):
        Rollout("A", "B", [], ROLL)
    with pytest.raises(ValidationError):
        RolloutConfig(canary_share=0.0)
    assert math.isclose(VersionStats(200, 2, 4).miss_rate, 0.02) and VersionStats().error_rate == 0.0
