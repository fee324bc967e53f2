"""Authentication: header forms, constant-time matching over every key, failure rate limiting."""

from __future__ import annotations

import datetime as dt
import hmac

import pytest

from chunkline.server.core import auth as auth_mod
from chunkline.server.core.auth import (
    Authenticator,
    AuthFailure,
    FailureLimiter,
    NoAuth,
    parse_authorization,
)
from chunkline.server.core.tenants import KeyEntry, TenantConfig, TenantRegistry, TenantsFile, generate_key, hash_key, key_id


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _registry(**tenant_keys: list[tuple[str, bool]]) -> TenantRegistry:
    tenants = {}
    for name, keys in tenant_keys.items():
        tenants[name] = TenantConfig(
            keys=[
                KeyEntry(id=key_id(k), hash=hash_key(k), created=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), revoked=rev)
                for k, rev in keys
            ]
        )
    return TenantRegistry.from_file(TenantsFile(tenants=tenants))


@pytest.fixture()
def keys() -> dict[str, str]:
    return {"a1": generate_key(), "a2": generate_key(), "b1": generate_key(), "old": generate_key()}


@pytest.fixture()
def authn(keys: dict[str, str]) -> tuple[Authenticator, Clock]:
    reg = _registry(acme=[(keys["a1"], False), (keys["a2"], False), (keys["old"], True)], beta=[(keys["b1"], False)])
    clock = Clock()
    return Authenticator(reg, clock, FailureLimiter(rate_per_s=1.0, burst=3, max_addresses=4)), clock


@pytest.mark.parametrize(
    "header, expected",
    [
        ("Api-Key abc", "abc"),
        ("api-key abc", "abc"),
        ("Bearer abc", "abc"),
        ("BEARER   abc  ", "abc"),
        ("Basic abc", None),
        ("abc", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_authorization(header: str | None, expected: str | None) -> None:
    assert parse_authorization(header) == expected


def test_both_header_forms_authenticate_the_right_tenant(authn: tuple[Authenticator, Clock], keys: dict[str, str]) -> None:
    a, _ = authn
    r = a.authenticate(f"Api-Key {keys['a2']}", "10.0.0.1")
    assert r.ok and r.tenant is not None and r.tenant.name == "acme" and r.key_id == key_id(keys["a2"])
    assert r.http_status == 200 and r.headers() == []
    r = a.authenticate(f"Bearer {keys['b1']}", "10.0.0.1")
    assert r.ok and r.tenant is not None and r.tenant.name == "beta"


def test_missing_wrong_and_revoked_keys_fail_with_401(authn: tuple[Authenticator, Clock], keys: dict[str, str]) -> None:
    a, _ = authn
    r = a.authenticate(None, "10.0.0.2")
    assert not r.ok and r.failure is AuthFailure.MISSING and r.http_status == 401
    assert ("WWW-Authenticate", 'Bearer realm="chunkline"') in r.headers()
    r = a.authenticate("Bearer " + generate_key(), "10.0.0.3")
    assert r.failure is AuthFailure.INVALID and r.http_status == 401 and "invalid" in r.message
    assert a.authenticate(f"Bearer {keys['old']}", "10.0.0.4").failure is AuthFailure.INVALID
    assert a.authenticate("Bearer " + "x" * 10_000, "10.0.0.5").failure is AuthFailure.INVALID
    assert a.authenticate("Bearer \udcff", "10.0.0.6").failure is AuthFailure.INVALID
    # a near miss (one character changed) is just invalid
    k = keys["a1"]
    assert a.authenticate("Bearer " + k[:-1] + ("A" if k[-1] != "A" else "B"), "10.0.0.7").failure is AuthFailure.INVALID


def test_every_key_is_compared_even_after_a_match(authn: tuple[Authenticator, Clock], keys: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = authn
    calls: list[bytes] = []
    real = hmac.compare_digest

    def spy(x: bytes, y: bytes) -> bool:
        calls.append(y)
        return real(x, y)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", spy)
    n_active = len(a.registry.keys)
    assert n_active == 3
    for key in (keys["a1"], keys["b1"], generate_key()):
        calls.clear()
        a.authenticate(f"Bearer {key}", "10.0.0.1")
        assert len(calls) == n_active  # no early exit, whichever key (if any) matches


def test_failures_are_rate_limited_per_address(authn: tuple[Authenticator, Clock], keys: dict[str, str]) -> None:
    a, clock = authn
    for i in range(3):  # distinct guesses: the address's budget of new credentials
        assert a.authenticate(f"Bearer nope{i}", "192.0.2.1").failure is AuthFailure.INVALID
    r = a.authenticate(f"Bearer {keys['a1']}", "192.0.2.1")
    # blocked even with a valid key never used from there: a guesser cannot test keys while limited
    assert r.failure is AuthFailure.RATE_LIMITED and r.http_status == 429
    assert r.retry_after_s == pytest.approx(1.0)
    assert ("Retry-After", "1") in r.headers()
    # other addresses are not affected
    assert a.authenticate(f"Bearer {keys['a1']}", "192.0.2.2").ok
    clock.t = 1.0  # one failure's worth refilled
    assert a.authenticate(f"Bearer {keys['a1']}", "192.0.2.1").ok
    assert a.authenticate("Bearer nope3", "192.0.2.1").failure is AuthFailure.INVALID
    assert a.authenticate("Bearer nope4", "192.0.2.1").failure is AuthFailure.RATE_LIMITED
    # rate-limited attempts are not counted, so waiting always ends the block
    for i in range(50):
        a.authenticate(f"Bearer new-guess{i}", "192.0.2.1")
    clock.t = 2.0
    assert a.authenticate(f"Bearer {keys['b1']}", "192.0.2.1").ok


def test_a_stale_key_behind_a_shared_address_limits_only_itself(authn: tuple[Authenticator, Clock], keys: dict[str, str]) -> None:
    """A fleet behind one NAT: one robot retries a revoked key for ever; the others keep working,
    even a robot whose key was never seen from that address."""
    a, clock = authn
    nat = "203.0.113.7"
    results = [a.authenticate(f"Api-Key {keys['old']}", nat).failure for _ in range(10)]
    assert results[:3] == [AuthFailure.INVALID] * 3 and set(results[3:]) == {AuthFailure.RATE_LIMITED}
    assert a.authenticate(f"Api-Key {keys['a1']}", nat).ok
    assert a.authenticate(f"Bearer {keys['b1']}", nat).ok
    for _ in range(20):  # one retry a second: the stale key stays limited, the fleet stays in
        clock.t += 1.0
        a.authenticate(f"Api-Key {keys['old']}", nat)
        assert a.authenticate(f"Api-Key {keys['a2']}", nat).ok
    assert a.authenticate(f"Api-Key {keys['old']}", nat).failure is AuthFailure.RATE_LIMITED
    # a robot without a key is one more credential, limited by itself too
    assert [a.authenticate(None, nat).failure for _ in range(4)][-1] is AuthFailure.RATE_LIMITED
    assert a.authenticate(f"Api-Key {keys['a1']}", nat).ok


def test_keys_in_use_at_an_address_keep_working_while_a_guesser_there_is_limited(
        authn: tuple[Authenticator, Clock], keys: dict[str, str]) -> None:
    a, _ = authn
    nat = "198.51.100.200"
    assert a.authenticate(f"Api-Key {keys['a1']}", nat).ok  # a robot of the fleet, connected before
    for i in range(5):
        a.authenticate(f"Api-Key guess{i}", nat)
    assert a.authenticate("Api-Key guess9", nat).failure is AuthFailure.RATE_LIMITED
    assert a.authenticate(f"Api-Key {keys['a1']}", nat).ok  # reconnects
    assert a.authenticate(f"Api-Key {keys['b1']}", nat).failure is AuthFailure.RATE_LIMITED  # never seen here: waits


def test_several_authorization_headers_are_a_counted_400(authn: tuple[Authenticator, Clock], keys: dict[str, str]) -> None:
    a, _ = authn
    r = a.authenticate_headers([f"Bearer {keys['a1']}", f"Bearer {keys['a1']}"], "192.0.2.50")
    assert r.failure is AuthFailure.MALFORMED and r.http_status == 400 and "one Authorization header" in r.message
    assert r.headers() == []
    assert [a.authenticate_headers(["Bearer x", "Bearer y"], "192.0.2.50").failure for _ in range(3)][-1] is AuthFailure.RATE_LIMITED
    assert a.authenticate_headers([f"Bearer {keys['a1']}"], "192.0.2.50").ok  # known there: still in
    assert NoAuth().authenticate_headers(["a", "b"], "192.0.2.50").ok


def test_ipv6_addresses_share_a_limit_per_64() -> None:
    lim = FailureLimiter(rate_per_s=1.0, burst=2)
    lim.record_failure("2001:db8:1:2::1", 0.0)
    lim.record_failure("2001:db8:1:2:ffff::9", 0.0)
    assert lim.blocked_for("2001:db8:1:2::77", 0.0) > 0
    assert lim.blocked_for("2001:db8:1:3::1", 0.0) == 0
    lim.record_failure("::ffff:192.0.2.9", 0.0)
    lim.record_failure("192.0.2.9", 0.0)
    assert lim.blocked_for("192.0.2.9", 0.0) > 0


def test_address_table_is_bounded(authn: tuple[Authenticator, Clock]) -> None:
    a, _ = authn
    for i in range(100):
        a.authenticate(None, f"198.51.100.{i}")
    assert len(a.limiter) == 4


def test_swap_registry_applies_to_new_authentications(authn: tuple[Authenticator, Clock], keys: dict[str, str]) -> None:
    a, _ = authn
    assert a.authenticate(f"Bearer {keys['b1']}", "10.0.0.1").ok
    a.swap(_registry(acme=[(keys["a1"], False)]))
    assert a.authenticate(f"Bearer {keys['b1']}", "10.0.0.1").failure is AuthFailure.INVALID
    assert a.authenticate(f"Bearer {keys['a1']}", "10.0.0.1").ok


def test_no_auth_accepts_everyone_as_anonymous() -> None:
    n = NoAuth()
    assert not n.enabled
    for header in (None, "Bearer whatever", "garbage"):
        r = n.authenticate(header, "203.0.113.1")
        assert r.ok and r.tenant is not None and r.tenant.name == "anonymous"
    assert n.registry.get("anonymous") is not None
    assert "no-auth" in auth_mod.NO_AUTH_WARNING


def test_a_watch_is_called_back_once_when_its_key_is_revoked_or_its_tenant_removed(authn: tuple[Authenticator, Clock],
                                                                                    keys: dict[str, str]) -> None:
    a, _ = authn
    called: list[str] = []
    a1, a2, b1 = (a.authenticate(f"Bearer {keys[k]}", "10.0.0.1") for k in ("a1", "a2", "b1"))
    a.watch(a1, lambda: called.append("a1"))
    a.watch(a2, lambda: called.append("a2"))
    end_b = a.watch(b1, lambda: called.append("b1"))
    a.watch(a1, lambda: called.append("a1 again"))
    assert a.watching == 4
    a.swap(_registry(acme=[(keys["a1"], True), (keys["a2"], False)], beta=[(keys["b1"], False)]))  # a1 revoked
    assert called == ["a1", "a1 again"] and a.watching == 2
    end_b()
    a.swap(_registry(acme=[(keys["a2"], False)]))  # beta removed: its ended watch is not called
    assert called == ["a1", "a1 again"] and a.watching == 1
    a.swap(_registry(beta=[(keys["b1"], False)]))  # acme removed
    assert called == ["a1", "a1 again", "a2"] and a.watching == 0
    with pytest.raises(ValueError):
        a.watch(a.authenticate("Bearer nope", "10.0.0.2"), lambda: None)
    n = NoAuth()
    n.watch(n.authenticate(None, "10.0.0.1"), lambda: called.append("never"))()
    assert n.watching == 0
