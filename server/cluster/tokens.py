"""Signed, one-use placement tokens: the directory's word to a replica (sans-I/O).

The directory answers a robot's handshake with a 307 to a replica carrying this token, since the
``websockets`` client drops ``Authorization`` on a cross-origin redirect. ``<body>.<tag>``: compact
JSON claims and an HMAC-SHA256 over a domain-separation prefix plus the body. Nothing
unauthenticated is parsed as JSON: size, alphabet, canonical base64, the tag (constant time), then
claims, expiry, replica and nonce. Each accepted nonce is kept until its token expires (a heap by
expiry; expiries beyond ``ttl_s + max_skew_s`` are refused, so memory is bounded). Times are epoch
seconds (directory and replicas are different hosts) and the verifier's "now" never goes backwards."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import heapq
import hmac
import json
import math
import re
import secrets
from typing import Any

__all__ = [
    "MAX_TOKEN_CHARS",
    "PlacementClaims",
    "PlacementSigner",
    "PlacementTokenError",
    "TokenMalformed",
    "TokenBadSignature",
    "TokenExpired",
    "TokenWrongReplica",
    "TokenReused",
]

#: Tokens longer than this are refused before any decoding (they travel in a URI).
MAX_TOKEN_CHARS = 2048
_DOMAIN = b"chunkline.placement.v1\x00"
_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
_TAG_BYTES = 32


class PlacementTokenError(Exception):
    """A placement token was refused. The message is safe to log; it never echoes the token."""


class TokenMalformed(PlacementTokenError):
    """Not a placement token: too long, wrong shape or alphabet, or claims that do not parse."""


class TokenBadSignature(PlacementTokenError):
    """The tag does not match the body under this secret (forged, altered, or another fleet's)."""


class TokenExpired(PlacementTokenError):
    """The token's lifetime is over."""


class TokenWrongReplica(PlacementTokenError):
    """The token places the session on another replica."""


class TokenReused(PlacementTokenError):
    """The token was already used for a handshake."""


@dataclasses.dataclass(frozen=True)
class PlacementClaims:
    """What a placement token asserts.

    Args:
        tenant: the authenticated tenant.
        replica: the replica the session is placed on.
        session: a random id for the session (the fleet quota tracks the placement by it).
        model: the model asked for, or ``None`` for the replica's default.
        expires: wall-clock epoch seconds after which the token is refused.
        nonce: random; makes the token one-use.
    """

    tenant: str
    replica: str
    session: str
    model: str | None
    expires: float
    nonce: str


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    # Unused low bits in the last character give several spellings of the same bytes; accept
    # only the canonical one so that a token has a single textual form.
    if _b64encode(raw) != text:
        raise ValueError("non-canonical base64")
    return raw


def _claims_from(obj: Any) -> PlacementClaims:
    if not isinstance(obj, dict) or set(obj) != {"t", "r", "s", "m", "e", "n"}:
        raise TokenMalformed("placement token claims have the wrong fields")
    strings = [obj["t"], obj["r"], obj["s"], obj["n"]]
    if not all(isinstance(v, str) for v in strings):
        raise TokenMalformed("placement token claims have the wrong types")
    model, expires = obj["m"], obj["e"]
    if model is not None and not isinstance(model, str):
        raise TokenMalformed("placement token model is not a string")
    if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
        raise TokenMalformed("placement token expiry is not a finite number")
    return PlacementClaims(obj["t"], obj["r"], obj["s"], model, float(expires), obj["n"])


class PlacementSigner:
    """Issues placement tokens (directory side) and verifies them (replica side).

    Both sides build one from the same secret. Verification is stateful (used nonces), so each
    replica keeps one signer for its lifetime.

    Args:
        secret: the fleet's shared HMAC key, at least 16 bytes (32 random bytes recommended).
        ttl_s: lifetime of an issued token; long enough for a redirect and a reconnect, short
            enough that a leaked URI is soon useless.
        max_skew_s: how far apart the directory's and replicas' wall clocks may be; a token
            expiring later than ``now + ttl_s + max_skew_s`` is refused as malformed.
    """

    def __init__(self, secret: bytes, ttl_s: float = 30.0, *, max_skew_s: float = 5.0) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise ValueError("the placement secret must be at least 16 bytes")
        if not (math.isfinite(ttl_s) and ttl_s > 0) or not (math.isfinite(max_skew_s) and max_skew_s >= 0):
            raise ValueError("ttl_s must be positive and max_skew_s non-negative")
        self._secret = bytes(secret)
        self.ttl_s = float(ttl_s)
        self.max_skew_s = float(max_skew_s)
        self._used: dict[str, float] = {}
        self._expiry_heap: list[tuple[float, str]] = []
        self._high_water = -math.inf

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self._secret, _DOMAIN + body, hashlib.sha256).digest()

    def issue(self, tenant: str, replica: str, model: str | None, now: float) -> tuple[str, PlacementClaims]:
        """Sign a placement of a new session of ``tenant`` on ``replica``.

        Args:
            tenant: the authenticated tenant.
            replica: the chosen replica's name.
            model: the model the robot asked for (``None``: default).
            now: wall-clock epoch seconds.

        Returns:
            ``(token, claims)``: the URL-safe token and what it asserts (``claims.session`` is
            the id under which the fleet quota tracks this placement).
        """
        claims = PlacementClaims(
            tenant=tenant,
            replica=replica,
            session=secrets.token_urlsafe(12),
            model=model,
            expires=float(now) + self.ttl_s,
            nonce=secrets.token_urlsafe(12),
        )
        obj = {"t": claims.tenant, "r": claims.replica, "s": claims.session, "m": claims.model, "e": claims.expires, "n": claims.nonce}
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
        token = f"{_b64encode(body)}.{_b64encode(self._tag(body))}"
        if len(token) > MAX_TOKEN_CHARS:
            raise ValueError("placement claims too long for a token (tenant, replica or model name)")
        return token, claims

    def _decode(self, token: object) -> PlacementClaims:
        if isinstance(token, (bytes, bytearray, memoryview)):
            if len(token) > MAX_TOKEN_CHARS:
                raise TokenMalformed("placement token too long")
            try:
                token = bytes(token).decode("ascii")
            except UnicodeDecodeError:
                raise TokenMalformed("placement token is not ASCII") from None
        if not isinstance(token, str):
            raise TokenMalformed("placement token is not a string")
        if len(token) > MAX_TOKEN_CHARS:
            raise TokenMalformed("placement token too long")
        if _SHAPE.fullmatch(token) is None:
            raise TokenMalformed("placement token has the wrong shape")
        body_text, tag_text = token.split(".")
        try:
            body = _b64decode(body_text)
            tag = _b64decode(tag_text)
        except (ValueError, binascii.Error):
            raise TokenMalformed("placement token is not valid base64url") from None
        if len(tag) != _TAG_BYTES:
            raise TokenMalformed("placement token tag has the wrong length")
        if not hmac.compare_digest(tag, self._tag(body)):
            raise TokenBadSignature("placement token signature does not match")
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            raise TokenMalformed("placement token claims are not JSON") from None
        return _claims_from(obj)

    def _prune(self, now: float) -> None:
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, nonce = heapq.heappop(heap)
            self._used.pop(nonce, None)

    def verify(self, token: object, replica: str, now: float) -> PlacementClaims:
        """Check a token presented at ``replica``'s handshake and consume it.

        Args:
            token: the token from the URI (``str``; ASCII ``bytes`` are accepted too).
            replica: this replica's name.
            now: wall-clock epoch seconds.

        Returns:
            The claims; the token cannot be used again.

        Raises:
            TokenMalformed: too long, wrong shape or claims.
            TokenBadSignature: not signed with this secret.
            TokenExpired: past its expiry.
            TokenWrongReplica: placed on another replica.
            TokenReused: already used.
        """
        if not math.isfinite(now):
            raise ValueError("now must be a finite time")
        claims = self._decode(token)
        # Never let "now" step back: a nonce pruned at a later time must stay dead.
        now = self._high_water = max(self._high_water, float(now))
        if now >= claims.expires:
            raise TokenExpired("placement token expired")
        if claims.expires > now + self.ttl_s + self.max_skew_s:
            raise TokenMalformed("placement token lives longer than this fleet's tokens")
        if claims.replica != replica:
            raise TokenWrongReplica("placement token is for another replica")
        self._prune(now)
        if claims.nonce in self._used:
            raise TokenReused("placement token already used")
        self._used[claims.nonce] = claims.expires
        heapq.heappush(self._expiry_heap, (claims.expires, claims.nonce))
        return claims

    @property
    def remembered(self) -> int:
        """How many used nonces are held now (bounded by the tokens accepted within one ttl)."""
        return len(self._used)
