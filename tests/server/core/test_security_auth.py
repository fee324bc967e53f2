"""Properties of authentication that must hold for every registry and every caller."""

from __future__ import annotations

import hashlib
import hmac
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.server.core import auth
from chunkline.server.core.auth import Authenticator, FailureLimiter
from chunkline.server.core.tenants import KeyRecord, TenantInfo, TenantRegistry, generate_key, key_id

SETTINGS = settings(max_examples=60, deadline=None, database=None, derandomize=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def registry_with(keys: list[str]) -> TenantRegistry:
    tenants = {f"t{i}": TenantInfo(name=f"t{i}") for i in range(len(keys))}
    records = tuple(KeyRecord(hashlib.sha256(k.encode()).digest(), f"t{i}", key_id(k)) for i, k in enumerate(keys))
    return TenantRegistry(tenants, records)


@SETTINGS
@given(n=st.integers(1, 25), which=st.integers(-1, 24), presented=st.text(max_size=80))
def test_every_key_is_compared_on_fixed_length_digests(n: int, which: int, presented: str) -> None:
    keys = [generate_key() for _ in range(n)]
    authn = Authenticator(registry_with(keys), Clock(), FailureLimiter(burst=1000))
    key = keys[which] if 0 <= which < n else presented
    with mock.patch.object(auth.hmac, "compare_digest", wraps=hmac.compare_digest) as spy:
        result = authn.authenticate(f"Api-Key {key}", "10.0.0.1")
    if not key.strip() or len(key) > auth.MAX_KEY_LENGTH:
        return  # refused before any comparison (no credential, or one too long to hash)
    # The time taken cannot depend on which key matched, or on how much of one: every active
    # key is compared, always, and always as two 32-byte digests (never the raw key).
    assert spy.call_count == n
    assert all(len(a) == 32 and len(b) == 32 for (a, b), _ in spy.call_args_list)
    assert result.ok == (0 <= which < n)
    if result.ok:
        assert result.tenant is not None and result.tenant.name == f"t{which}"


@SETTINGS
@given(n=st.integers(1, 10))
def test_the_registry_and_results_never_hold_the_key(n: int) -> None:
    keys = [generate_key() for _ in range(n)]
    registry = registry_with(keys)
    result = Authenticator(registry, Clock()).authenticate(f"Bearer {keys[-1]}", "10.0.0.1")
    shown = repr(registry) + repr(result) + result.message + "".join(f"{k}{v}" for k, v in result.headers())
    state = repr([(r.digest, r.tenant, r.key_id) for r in registry.keys])
    for key in keys:
        secret = key[len("ck_") + 8:]  # the part a key id never shows
        assert secret not in shown and secret not in state


@SETTINGS
@given(failures=st.lists(st.sampled_from(["10.0.0.1", "10.0.0.2", "2001:db8::1", "2001:db8::2", "2001:db9::1"]),
                         max_size=60),
       gaps=st.lists(st.floats(0.0, 2.0), max_size=60))
def test_failures_of_other_addresses_never_limit_an_address(failures: list[str], gaps: list[float]) -> None:
    key = generate_key()
    clock = Clock()
    authn = Authenticator(registry_with([key]), clock, FailureLimiter(rate_per_s=0.2, burst=5))
    for i, peer in enumerate(failures):
        clock.now += gaps[i] if i < len(gaps) else 0.0
        authn.authenticate("Api-Key wrong", peer)
    # Whatever the others did, an address (and an IPv6 /64) that never failed gets in at once.
    assert authn.authenticate(f"Api-Key {key}", "10.0.0.9").ok
    assert authn.authenticate(f"Api-Key {key}", "2001:dba::9").ok
    # One that tried its burst of distinct keys in a row, at one instant, is limited even with a
    # good key it never used there (a guesser learns nothing while limited) ...
    for i in range(5):
        authn.authenticate(f"Api-Key wrong{i}", "10.9.9.9")
    assert authn.authenticate(f"Api-Key {key}", "10.9.9.9").failure is auth.AuthFailure.RATE_LIMITED
    # ... while one key retried over and over (a stale robot) limits only itself.
    for _ in range(20):
        authn.authenticate("Api-Key stale", "10.8.8.8")
    assert authn.authenticate("Api-Key stale", "10.8.8.8").failure is auth.AuthFailure.RATE_LIMITED
    assert authn.authenticate(f"Api-Key {key}", "10.8.8.8").ok
