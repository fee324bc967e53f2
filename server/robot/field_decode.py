"""Compressed observation fields: checked against the policy's spec, the session's agreement and
the decoded-size limits, then decoded on the process's fair pool, never on the event loop.

The codec hands a compressed field over still compressed (an
:class:`~chunkline.client.wire.encodings.EncodedArray`: declared dtype and shape, payload). Before any
pixel is decoded, :meth:`FieldDecoder.check` makes sure the policy reads the field, its spec allows
the encoding, the session agreed to it, the declared dtype and shape are exactly the spec's, and
the declared decoded size of the fields of free size is within ``max_request_bytes``;
:func:`~chunkline.client.wire.encodings.decode_array` then checks the image's own header against the
declared size. :meth:`FieldDecoder.decode` charges that size to the tenant's decoded-bytes account
(refused beyond ``max_tenant_bytes``) for as long as the server holds the decoded arrays, and
decodes on :class:`~chunkline.server.core.fair_pool.FairPool`, in the tenant's turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.client.wire.encodings import CodecUnavailable, EncodedArray, available_encodings, decode_array
from chunkline.client.wire.errors import CodecError, ErrorCode
from chunkline.policies.base import ArraySpec, FieldSpec, PolicySpec
from chunkline.server.core.fair_pool import FairPool
from chunkline.server.errors import Refusal

__all__ = ["FieldDecoder", "DecodeLimits", "DecodedBytes", "encoded_fields", "decoded_nbytes", "check_fields"]


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeLimits:
    """How much compressed fields may decode into.

    Args:
        max_request_bytes: the decoded size of one request's compressed fields whose spec leaves
            a side free (declared shape times dtype, checked before decoding); a field of fixed
            size is bounded by its spec.
        max_tenant_bytes: decoded bytes one tenant's requests may hold at once (from the start
            of their decode until the server drops the arrays).
    """

    max_request_bytes: int = 32 * 1024 * 1024
    max_tenant_bytes: int = 128 * 1024 * 1024


def encoded_fields(obs: Mapping[str, Any]) -> dict[str, EncodedArray]:
    """The fields of a (flattened) observation that arrived compressed."""
    return {name: value for name, value in obs.items() if type(value) is EncodedArray}


def decoded_nbytes(fields: Mapping[str, EncodedArray]) -> int:
    """What ``fields`` decode into, from their declared dtypes and shapes."""
    return sum(field.raw_nbytes for field in fields.values())


def _has_free_side(field: FieldSpec) -> bool:
    return isinstance(field, ArraySpec) and None in field.shape


def _dims_match(spec_shape: tuple[int | None, ...], shape: tuple[int, ...]) -> bool:
    return len(spec_shape) == len(shape) and all(s is None or s == d for s, d in zip(spec_shape, shape, strict=True))


def check_fields(spec: PolicySpec, agreed: frozenset[str] | set[str], fields: Mapping[str, EncodedArray]) -> dict[str, EncodedArray]:
    """The compressed fields the policy reads, each checked against the spec and the session;
    fields it does not read are left out (they are never decoded).

    Raises:
        Refusal: ``invalid_message`` for an encoding this session did not agree to;
            ``invalid_observation`` for an encoding the field's spec does not allow, or a
            declared dtype or shape other than the spec's.
    """
    out: dict[str, EncodedArray] = {}
    for name, field in fields.items():
        spec_field = spec.observation.get(name)
        if spec_field is None:
            continue
        if field.encoding not in agreed:
            raise Refusal(ErrorCode.INVALID_MESSAGE, f"field {name!r}: encoding {field.encoding!r} was not agreed for this session")
        if not isinstance(spec_field, ArraySpec) or field.encoding not in spec_field.encodings:
            raise Refusal(ErrorCode.INVALID_OBSERVATION, f"field {name!r} may not be sent as {field.encoding}")
        if field.dtype != np.dtype(spec_field.dtype) or not _dims_match(spec_field.shape, field.shape):
            raise Refusal(ErrorCode.INVALID_OBSERVATION,
                          f"field {name!r} declares {field.dtype.name}{list(field.shape)}, "
                          f"expected {spec_field.dtype}{list(spec_field.shape)}")
        out[name] = field
    return out


class DecodedBytes:
    """Decoded bytes held per tenant. An array's bytes are released when the array owning its
    memory is freed (by whichever thread drops it last): the count is what the server holds."""

    def __init__(self, max_tenant_bytes: int) -> None:
        self.max_tenant_bytes = max_tenant_bytes
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def held_by(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def charge(self, tenant: str, nbytes: int) -> bool:
        """Charge ``nbytes`` to ``tenant`` unless that takes it past its bound."""
        with self._lock:
            held = self._held.get(tenant, 0)
            if held + nbytes > self.max_tenant_bytes:
                return False
            self._held[tenant] = held + nbytes
            return True

    def release(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            left = self._held.get(tenant, 0) - nbytes
            if left > 0:
                self._held[tenant] = left
            else:
                self._held.pop(tenant, None)

    def hold(self, tenant: str, array: np.ndarray, nbytes: int) -> None:
        """Keep ``nbytes`` charged until ``array`` (the array owning its memory) is freed."""
        owner = array
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        weakref.finalize(owner, self.release, tenant, nbytes)


class FieldDecoder:
    """The checks made before decoding, the decoded-bytes account, and decoding on the pool.

    Args:
        pool: the process's fair pool (shared with the planner's image encoding); a pool of
            its own by default.
        limits: the decoded-size limits.
    """

    def __init__(self, pool: FairPool | None = None, limits: DecodeLimits | None = None) -> None:
        self.pool = pool or FairPool()
        self.limits = limits or DecodeLimits()
        self.held = DecodedBytes(self.limits.max_tenant_bytes)
        #: the compressed encodings this server can decode (a session agrees to a subset)
        self.encodings = frozenset(e for e in available_encodings() if e != "raw")

    def agree(self, offered: str | None) -> list[str]:
        """The encodings a session uses: ``raw``, plus those the client offered (a comma-separated
        handshake header) that this server decodes, in the server's order."""
        names = {part.strip().lower() for part in (offered or "").split(",")[:16]}
        return ["raw", *sorted(self.encodings & names)]

    def check(self, spec: PolicySpec, agreed: frozenset[str] | set[str], fields: Mapping[str, EncodedArray]) -> dict[str, EncodedArray]:
        """:func:`check_fields`, then the request's declared decoded size.

        Raises:
            Refusal: as :func:`check_fields`; ``invalid_observation`` for fields with a side the
                spec leaves free that together declare more than ``max_request_bytes``.
        """
        out = check_fields(spec, agreed, fields)
        # A side the spec fixes is the operator's choice; a free side is the client's.
        free = {n: f for n, f in out.items() if _has_free_side(spec.observation[n])}
        nbytes = decoded_nbytes(free)
        if nbytes > self.limits.max_request_bytes:
            raise Refusal(ErrorCode.INVALID_OBSERVATION, f"the compressed fields declare {nbytes} decoded bytes; "
                          f"this server decodes at most {self.limits.max_request_bytes} per request")
        return out

    async def decode(self, obs: dict[str, Any], fields: Mapping[str, EncodedArray], tenant: str = "") -> float:
        """Decode ``fields`` on the pool in ``tenant``'s turn, in parallel, and put the arrays
        into ``obs``; returns the seconds it took. Their declared size is charged to ``tenant``
        first and stays charged until the server frees the arrays.

        Raises:
            Refusal: ``overloaded`` (with a retry time) when the tenant's decoded bytes or its
                queued jobs are at their bound; ``invalid_message`` naming the first field whose
                payload was refused.
        """
        started = time.perf_counter()
        held = self.held
        names = list(fields)
        sizes = [fields[n].raw_nbytes for n in names]
        if not held.charge(tenant, sum(sizes)):
            raise Refusal(ErrorCode.OVERLOADED, f"this tenant's requests hold {held.held_by(tenant)} decoded bytes "
                          f"(at most {held.max_tenant_bytes}); retry later", retry_after_ms=self.pool.retry_after_ms(tenant))
        charged = dict(zip(names, sizes, strict=True))
        try:
            results = await asyncio.gather(*(self.pool.run(tenant, decode_array, fields[n]) for n in names), return_exceptions=True)
            for name, result in zip(names, results, strict=True):
                if isinstance(result, np.ndarray):
                    held.hold(tenant, result, charged.pop(name))
            for name, result in zip(names, results, strict=True):
                if isinstance(result, Refusal):
                    raise result
                if isinstance(result, (CodecError, CodecUnavailable)):
                    raise Refusal(ErrorCode.INVALID_MESSAGE, f"field {name!r}: {result}")
                if isinstance(result, BaseException):
                    raise result
                obs[name] = result
        finally:
            held.release(tenant, sum(charged.values()))
        return time.perf_counter() - started

    def close(self) -> None:
        self.pool.close()
