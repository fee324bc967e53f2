"""API-key authentication (sans-I/O): one ``Authorization`` header in, a tenant or a typed failure out.

How the shell drives it: at the WebSocket handshake (``process_request`` in ``websockets``) and
at the start of every HTTP request, **before reading or decoding any payload**, call
``authenticator.authenticate(headers.get("Authorization"), peer_ip)``. On failure answer at once
with :attr:`AuthResult.http_status` (401 for a missing or wrong key, 429 when the address is
rate-limited) and :meth:`AuthResult.headers` (``WWW-Authenticate`` / ``Retry-After``); on
success keep :attr:`AuthResult.tenant` on the session. On SIGHUP, ``authenticator.swap(registry)``
with the reloaded :class:`~chunkline.server.core.tenants.TenantRegistry`; open sessions are not touched
(:meth:`TenantRegistry.key_active` lets the shell re-check them if it wants to).

Accepted forms: ``Authorization: Api-Key <key>`` (what ``openpi-client`` sends) and
``Authorization: Bearer <key>`` (OpenAI-style clients); the scheme is case-insensitive (RFC 9110).

Timing: the presented key is hashed once and its digest compared with **every** active key's
digest with :func:`hmac.compare_digest`, without stopping at a match, so the time taken does not
depend on which key (or how much of one) matched.

Failures (missing and invalid alike) are rate-limited per client address with a token bucket of
allowed failures; an address whose bucket is empty gets ``rate_limited`` without its key being
checked, until the bucket refills. IPv6 addresses are grouped by /64 (one host usually owns a
whole /64), and the table of addresses is bounded (least recently seen evicted first).

``--no-auth`` uses :class:`NoAuth`: every caller is the single ``anonymous`` tenant, without limits.
The shell must print :data:`NO_AUTH_WARNING` at start.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import hmac
import ipaddress
import math
from collections.abc import Callable

from chunkline.server.core.quotas import TokenBucket
from chunkline.server.core.tenants import ANONYMOUS_TENANT, TenantInfo, TenantRegistry

__all__ = [
    "AuthFailure",
    "AuthResult",
    "FailureLimiter",
    "Authenticator",
    "NoAuth",
    "NO_AUTH_WARNING",
    "parse_authorization",
    "MAX_KEY_LENGTH",
]

#: Longer credentials are refused without hashing (chunkline keys are 46 characters).
MAX_KEY_LENGTH = 256

NO_AUTH_WARNING = (
    "AUTHENTICATION IS DISABLED (--no-auth): anyone who can reach this port can run the served "
    "policies, with no limits. Use only on a trusted local machine."
)

_SCHEMES = ("api-key", "bearer")


class AuthFailure(str, enum.Enum):
    """Why authentication failed (stable strings, safe as a metrics label)."""

    MISSING = "missing"
    INVALID = "invalid"
    RATE_LIMITED = "rate_limited"


@dataclasses.dataclass(frozen=True)
class AuthResult:
    """The outcome of one authentication.

    Args:
        tenant: the authenticated tenant, or ``None`` on failure.
        key_id: the id of the key that matched (for logs; never the key).
        failure: why it failed, or ``None`` on success.
        retry_after_s: for ``rate_limited``, when the address may try again.
    """

    tenant: TenantInfo | None
    key_id: str | None = None
    failure: AuthFailure | None = None
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        """Whether a tenant was authenticated."""
        return self.tenant is not None

    @property
    def http_status(self) -> int:
        """200 on success, 401 for a missing or invalid key, 429 when rate-limited."""
        if self.failure is None:
            return 200
        return 429 if self.failure is AuthFailure.RATE_LIMITED else 401

    def headers(self) -> list[tuple[str, str]]:
        """Response headers for a refusal (``WWW-Authenticate`` on 401, ``Retry-After`` on 429)."""
        if self.failure is None:
            return []
        if self.failure is AuthFailure.RATE_LIMITED:
            return [("Retry-After", str(max(1, math.ceil(self.retry_after_s or 1.0))))]
        return [("WWW-Authenticate", 'Bearer realm="chunkline"'), ("WWW-Authenticate", 'Api-Key realm="chunkline"')]

    @property
    def message(self) -> str:
        """A short explanation for the response body (names no key)."""
        if self.failure is None:
            return "ok"
        if self.failure is AuthFailure.MISSING:
            return "missing API key: send 'Authorization: Api-Key <key>' or 'Authorization: Bearer <key>'"
        if self.failure is AuthFailure.INVALID:
            return "invalid API key"
        return f"too many failed authentications from this address; retry in {self.retry_after_s or 0:.0f} s"


def parse_authorization(header: str | None) -> str | None:
    """The key in an ``Authorization`` header, or ``None`` when there is no usable credential.

    Args:
        header: the raw header value (``Api-Key <key>`` or ``Bearer <key>``).
    """
    if header is None:
        return None
    parts = header.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() not in _SCHEMES:
        return None
    key = parts[1].strip()
    return key or None


def _address_group(peer: str) -> str:
    # One attacker host owns a whole IPv6 /64; counting per address would let it rotate freely.
    try:
        ip = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


class FailureLimiter:
    """Per-address token buckets of allowed authentication failures, bounded in memory.

    Args:
        rate_per_s: failures an address may add per second, sustained.
        burst: failures an address may make in a row before it is limited.
        max_addresses: most addresses remembered; the least recently seen is forgotten first.
    """

    def __init__(self, rate_per_s: float = 0.2, burst: int = 10, max_addresses: int = 10_000) -> None:
        if rate_per_s <= 0 or burst < 1 or max_addresses < 1:
            raise ValueError("rate_per_s, burst and max_addresses must be positive")
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.max_addresses = max_addresses
        self._table: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def blocked_for(self, peer: str, now: float) -> float:
        """Seconds until ``peer`` may try again (0: it may try now)."""
        bucket = self._table.get(_address_group(peer))
        if bucket is None:
            return 0.0
        return bucket.wait_time(1.0, now)

    def record_failure(self, peer: str, now: float) -> None:
        """Count one failed authentication from ``peer``."""
        group = _address_group(peer)
        bucket = self._table.get(group)
        if bucket is None:
            bucket = TokenBucket(self.rate_per_s, self.burst, stamp=now)
            self._table[group] = bucket
            while len(self._table) > self.max_addresses:
                self._table.popitem(last=False)
        else:
            self._table.move_to_end(group)
        bucket.force_take(1.0, now)
        # Never let debt grow without bound: a limited address is blocked at most burst/rate.
        bucket.tokens = max(bucket.tokens, 1.0 - self.burst)


class Authenticator:
    """Checks API keys against a :class:`TenantRegistry`.

    Args:
        registry: the tenants and their active keys.
        clock: the time in seconds (monotonic), used by the failure rate limit.
        limiter: the per-address failure limit (default :class:`FailureLimiter`).
    """

    def __init__(
        self,
        registry: TenantRegistry,
        clock: Callable[[], float],
        limiter: FailureLimiter | None = None,
    ) -> None:
        self._registry = registry
        self._clock = clock
        self.limiter = limiter if limiter is not None else FailureLimiter()

    @property
    def registry(self) -> TenantRegistry:
        """The registry in force."""
        return self._registry

    def swap(self, registry: TenantRegistry) -> None:
        """Use a reloaded registry from now on (sessions already authenticated are unaffected)."""
        self._registry = registry

    @property
    def enabled(self) -> bool:
        """Always true (``NoAuth`` says false)."""
        return True

    def authenticate(self, authorization_header: str | None, peer: str) -> AuthResult:
        """Authenticate one request or handshake.

        Args:
            authorization_header: the ``Authorization`` header's value, or ``None`` if absent.
            peer: the client's IP address (without port).

        Returns:
            an :class:`AuthResult` with the tenant, or with ``failure`` set.
        """
        now = self._clock()
        wait = self.limiter.blocked_for(peer, now)
        if wait > 0:
            return AuthResult(None, failure=AuthFailure.RATE_LIMITED, retry_after_s=wait)
        key = parse_authorization(authorization_header)
        if key is None:
            self.limiter.record_failure(peer, now)
            return AuthResult(None, failure=AuthFailure.MISSING)
        match = self._match(key) if len(key) <= MAX_KEY_LENGTH else None
        tenant = self._registry.get(match[0]) if match is not None else None
        if match is None or tenant is None:
            self.limiter.record_failure(peer, now)
            return AuthResult(None, failure=AuthFailure.INVALID)
        return AuthResult(tenant, key_id=match[1])

    def _match(self, key: str) -> tuple[str, str] | None:
        try:
            digest = hashlib.sha256(key.encode("utf-8")).digest()
        except UnicodeEncodeError:  # lone surrogates from a hostile header decoder
            return None
        found: tuple[str, str] | None = None
        # Compare with every key and never break: timing must not reveal which entry matched.
        for rec in self._registry.keys:
            if hmac.compare_digest(digest, rec.digest) and found is None:
                found = (rec.tenant, rec.key_id)
        return found


class NoAuth:
    """``--no-auth``: everyone is the ``anonymous`` tenant, without limits. Local use only.

    Args:
        tenant: the tenant every caller becomes (default: anonymous, unlimited).
    """

    def __init__(self, tenant: TenantInfo = ANONYMOUS_TENANT) -> None:
        self._tenant = tenant
        self._registry = TenantRegistry({tenant.name: tenant}, (), "--no-auth")

    @property
    def registry(self) -> TenantRegistry:
        """A registry holding only the anonymous tenant."""
        return self._registry

    @property
    def enabled(self) -> bool:
        """False: authentication is off."""
        return False

    def swap(self, registry: TenantRegistry) -> None:
        """Ignored: there is nothing to reload without authentication."""

    def authenticate(self, authorization_header: str | None, peer: str) -> AuthResult:
        """Accept anyone as the anonymous tenant (any header is ignored).

        Args:
            authorization_header: ignored.
            peer: ignored.
        """
        return AuthResult(self._tenant, key_id=None)
