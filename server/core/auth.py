"""API-key authentication (sans-I/O): one ``Authorization`` header in, a tenant or a typed failure out.

The shell calls ``authenticate_headers`` at the WebSocket handshake and at the start of every HTTP
request, before reading any payload, and answers a failure at once with its status (400 for two
headers, 401, 429 while rate-limited) and headers. ``Api-Key`` and ``Bearer`` schemes are accepted.
The presented key's digest is compared with every active key's in constant time, without stopping
at a match. Failures are rate-limited per client address group at two levels, per credential and
per address counting distinct failing credentials; while an address is limited only keys that
already authenticated from it get in, so a guesser learns nothing. Both tables are bounded. On
SIGHUP ``swap`` installs the new registry and calls back whatever :meth:`Authenticator.watch`
registered for a revoked key or removed tenant. ``--no-auth`` uses :class:`NoAuth` (print
:data:`NO_AUTH_WARNING`)."""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import hmac
import ipaddress
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

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
    "address_group",
    "MAX_KEY_LENGTH",
    "NO_CREDENTIAL",
    "SEVERAL_CREDENTIALS",
]

#: Longer credentials are refused without hashing (chunkline keys are 46 characters).
MAX_KEY_LENGTH = 256

NO_AUTH_WARNING = (
    "AUTHENTICATION IS DISABLED (--no-auth): anyone who can reach this port can run the served "
    "policies, with no limits. Use only on a trusted local machine."
)

_SCHEMES = ("api-key", "bearer")
_K = TypeVar("_K", str, tuple[str, bytes])


class AuthFailure(str, enum.Enum):
    """Why authentication failed (stable strings, safe as a metrics label)."""

    MISSING = "missing"
    INVALID = "invalid"
    MALFORMED = "malformed"  # more than one Authorization header: which one would count is ambiguous
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
        """200 on success, 400 for several ``Authorization`` headers, 401 for a missing or invalid
        key, 429 when rate-limited."""
        if self.failure is None:
            return 200
        return {AuthFailure.RATE_LIMITED: 429, AuthFailure.MALFORMED: 400}.get(self.failure, 401)

    def headers(self) -> list[tuple[str, str]]:
        """Response headers for a refusal (``WWW-Authenticate`` on 401, ``Retry-After`` on 429)."""
        if self.failure is None:
            return []
        if self.failure is AuthFailure.RATE_LIMITED:
            return [("Retry-After", str(max(1, math.ceil(self.retry_after_s or 1.0))))]
        if self.failure is AuthFailure.MALFORMED:
            return []
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
        if self.failure is AuthFailure.MALFORMED:
            return "send one Authorization header, not several"
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


def address_group(peer: str) -> str:
    """The group ``peer`` is limited with: an IPv4 address (IPv4-mapped IPv6 included) or an IPv6 /64."""
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


#: The credential a missing, unusable or too long ``Authorization`` value counts as.
NO_CREDENTIAL = b""
#: The credential a request with several ``Authorization`` headers counts as.
SEVERAL_CREDENTIALS = b"several"


class FailureLimiter:
    """Token buckets of allowed authentication failures, per address group and credential, and
    per address group for distinct credentials; bounded in memory.

    Args:
        rate_per_s: failures (of one credential; distinct credentials, for an address) an
            address may add per second, sustained.
        burst: failures it may make in a row before it is limited.
        max_addresses: most addresses (and address-credential pairs) remembered; the least
            recently seen is forgotten first.
    """

    def __init__(self, rate_per_s: float = 0.2, burst: int = 10, max_addresses: int = 10_000) -> None:
        if rate_per_s <= 0 or burst < 1 or max_addresses < 1:
            raise ValueError("rate_per_s, burst and max_addresses must be positive")
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.max_addresses = max_addresses
        self._addresses: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self._credentials: collections.OrderedDict[tuple[str, bytes], TokenBucket] = collections.OrderedDict()

    def __len__(self) -> int:
        """Addresses remembered."""
        return len(self._addresses)

    def address_blocked_for(self, peer: str, now: float) -> float:
        """Seconds until ``peer``'s address may present a credential it has not used there (0: now)."""
        bucket = self._addresses.get(address_group(peer))
        return 0.0 if bucket is None else bucket.wait_time(1.0, now)

    def blocked_for(self, peer: str, now: float, credential: bytes = NO_CREDENTIAL) -> float:
        """Seconds until ``peer`` may fail with ``credential`` again (0: it may try now): that
        credential's own limit, or the address's when the credential is new there."""
        group = address_group(peer)
        bucket = self._credentials.get((group, credential))
        if bucket is not None:
            return bucket.wait_time(1.0, now)
        return self.address_blocked_for(peer, now)

    def record_failure(self, peer: str, now: float, credential: bytes = NO_CREDENTIAL) -> None:
        """Count one failed authentication from ``peer`` with ``credential`` (a digest, or a
        sentinel for a missing one)."""
        group = address_group(peer)
        known = self._credentials.get((group, credential))
        # A credential failing here for the first time (or again after a full refill) is a
        # distinct one: only those count against the address, so a repeated stale key does not.
        distinct = known is None or known.available(now) >= self.burst
        self._take(self._credentials, (group, credential), now)
        if distinct:
            self._take(self._addresses, group, now)
        elif group in self._addresses:
            self._addresses.move_to_end(group)

    def _take(self, table: collections.OrderedDict[_K, TokenBucket], key: _K, now: float) -> None:
        bucket = table.get(key)
        if bucket is None:
            bucket = TokenBucket(self.rate_per_s, self.burst, stamp=now)
            table[key] = bucket
            while len(table) > self.max_addresses:
                table.popitem(last=False)
        else:
            table.move_to_end(key)
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
        # (address group, key id) pairs that authenticated: let in while their address is limited.
        self._known_good: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._watches: dict[int, tuple[str, str | None, Callable[[], None]]] = {}
        self._watch_ids = 0

    @property
    def registry(self) -> TenantRegistry:
        """The registry in force."""
        return self._registry

    def swap(self, registry: TenantRegistry) -> None:
        """Use a reloaded registry from now on, and call back (once) every watch whose key it no
        longer holds or whose tenant it removed."""
        self._registry = registry
        gone = [w for w, (tenant, key_id, _) in self._watches.items()
                if registry.get(tenant) is None or (key_id is not None and not registry.key_active(tenant, key_id))]
        for watch in gone:
            on_revoked = self._watches.pop(watch)[2]
            on_revoked()

    def watch(self, result: AuthResult, on_revoked: Callable[[], None]) -> Callable[[], None]:
        """Call ``on_revoked`` when the credential of ``result`` (a success) is revoked.

        Returns:
            a function that ends the watch (call it when the stream or session ends).
        """
        if result.tenant is None:
            raise ValueError("only a successful authentication can be watched")
        self._watch_ids += 1
        watch = self._watch_ids
        self._watches[watch] = (result.tenant.name, result.key_id, on_revoked)
        def end() -> None:
            self._watches.pop(watch, None)

        return end

    @property
    def watching(self) -> int:
        """Streams and sessions registered with :meth:`watch` (a leak check)."""
        return len(self._watches)

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
        return self.authenticate_headers(() if authorization_header is None else (authorization_header,), peer)

    def authenticate_headers(self, values: Sequence[str], peer: str) -> AuthResult:
        """Authenticate one request or handshake from **every** ``Authorization`` value it carried.

        More than one value is ``malformed`` (400) and counts as a failure: which one a proxy in
        front would have checked is ambiguous.

        Args:
            values: the ``Authorization`` headers' values, in order (empty if there was none).
            peer: the client's IP address (without port).
        """
        now = self._clock()
        if len(values) > 1:
            return self._failed(peer, now, SEVERAL_CREDENTIALS, AuthFailure.MALFORMED)
        key = parse_authorization(values[0]) if values else None
        digest = _digest(key) if key is not None and len(key) <= MAX_KEY_LENGTH else None
        match = self._match(digest) if digest is not None else None
        tenant = self._registry.get(match[0]) if match is not None else None
        if match is None or tenant is None:
            return self._failed(peer, now, digest or NO_CREDENTIAL, AuthFailure.MISSING if key is None else AuthFailure.INVALID)
        group = address_group(peer)
        known = (group, match[1])
        # While the address is limited for new credentials (a guesser), only a key that already
        # worked from there gets in; answering any other valid key would tell the guesser it hit.
        wait = self.limiter.address_blocked_for(peer, now)
        if wait > 0 and known not in self._known_good:
            return AuthResult(None, failure=AuthFailure.RATE_LIMITED, retry_after_s=wait)
        self._known_good[known] = None
        self._known_good.move_to_end(known)
        while len(self._known_good) > self.limiter.max_addresses:
            self._known_good.popitem(last=False)
        return AuthResult(tenant, key_id=match[1])

    def _failed(self, peer: str, now: float, credential: bytes, failure: AuthFailure) -> AuthResult:
        wait = self.limiter.blocked_for(peer, now, credential)
        if wait > 0:  # a limited attempt is not counted again, so waiting always ends the block
            return AuthResult(None, failure=AuthFailure.RATE_LIMITED, retry_after_s=wait)
        self.limiter.record_failure(peer, now, credential)
        return AuthResult(None, failure=failure)

    def _match(self, digest: bytes) -> tuple[str, str] | None:
        found: tuple[str, str] | None = None
        # Compare with every key and never break: timing must not reveal which entry matched.
        for rec in self._registry.keys:
            if hmac.compare_digest(digest, rec.digest) and found is None:
                found = (rec.tenant, rec.key_id)
        return found


def _digest(key: str) -> bytes | None:
    try:
        return hashlib.sha256(key.encode("utf-8")).digest()
    except UnicodeEncodeError:  # lone surrogates from a hostile header decoder
        return None


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

    def watch(self, result: AuthResult, on_revoked: Callable[[], None]) -> Callable[[], None]:
        """Nothing is ever revoked without authentication: a no-op watch."""
        return _nothing

    @property
    def watching(self) -> int:
        return 0

    def authenticate(self, authorization_header: str | None, peer: str) -> AuthResult:
        """Accept anyone as the anonymous tenant (any header is ignored).

        Args:
            authorization_header: ignored.
            peer: ignored.
        """
        return AuthResult(self._tenant, key_id=None)

    def authenticate_headers(self, values: Sequence[str], peer: str) -> AuthResult:
        """Accept anyone as the anonymous tenant (headers are ignored).

        Args:
            values: ignored.
            peer: ignored.
        """
        return AuthResult(self._tenant, key_id=None)


def _nothing() -> None:
    return None
