"""API keys: ``ck_<43 url-safe characters>`` (256 random bits), stored only as a SHA-256 digest."""

from __future__ import annotations

import hashlib
import secrets

__all__ = ["KEY_PREFIX", "generate_key", "hash_key", "key_id"]

KEY_PREFIX = "ck_"
#: Characters of the random part shown in a key id (``ck_`` + 8 = 48 of the 256 bits): enough to
#: tell keys apart in a listing, and 208 secret bits remain.
_ID_CHARS = 8


def generate_key() -> str:
    """A new API key: ``ck_`` + 43 url-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The stored form of ``key``: ``sha256:<hex>``.

    One unsalted SHA-256 is right here, unlike for passwords: keys are 256-bit random strings, so
    neither salting nor a slow hash adds anything against guessing or precomputation (2^256 is out
    of reach either way), while a fast hash keeps authentication cheap on every request.
    """
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id(key: str) -> str:
    """The public id of ``key``: ``ck_`` + its first 8 random characters."""
    if not key.startswith(KEY_PREFIX) or len(key) <= len(KEY_PREFIX) + _ID_CHARS:
        raise ValueError("not a chunkline key")
    return key[: len(KEY_PREFIX) + _ID_CHARS]
