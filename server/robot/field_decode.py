"""Compressed observation fields: checked against the policy's spec and the session's agreement,
then decoded in a thread pool, never on the event loop.

The codec hands a compressed field over still compressed (an
:class:`~chunkline.client.encodings.EncodedArray`: declared dtype and shape, payload). Before any
pixel is decoded, :meth:`FieldDecoder.check` makes sure the policy reads the field, its spec allows
the encoding, the session agreed to it, and the declared dtype and shape are exactly the spec's;
:func:`~chunkline.client.encodings.decode_array` then checks the image's own header against the
declared size. The decoders (libjpeg-turbo, zlib) release the GIL, so the fields of one
observation decode in parallel on the pool's threads while the loop serves everyone else.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from chunkline.client.encodings import CodecUnavailable, EncodedArray, available_encodings, decode_array
from chunkline.client.exceptions import CodecError, ErrorCode
from chunkline.policies.base import ArraySpec, PolicySpec
from chunkline.server.errors import Refusal

__all__ = ["FieldDecoder", "encoded_fields", "DEFAULT_DECODE_THREADS"]

#: decode threads by default: the cores, up to four (an observation has a few cameras)
DEFAULT_DECODE_THREADS = max(1, min(4, os.cpu_count() or 1))


def encoded_fields(obs: Mapping[str, Any]) -> dict[str, EncodedArray]:
    """The fields of a (flattened) observation that arrived compressed."""
    return {name: value for name, value in obs.items() if type(value) is EncodedArray}


def _dims_match(spec_shape: tuple[int | None, ...], shape: tuple[int, ...]) -> bool:
    return len(spec_shape) == len(shape) and all(s is None or s == d for s, d in zip(spec_shape, shape, strict=True))


class FieldDecoder:
    """The process's decode pool and the checks made before it runs.

    Args:
        threads: decode threads.
    """

    def __init__(self, threads: int = DEFAULT_DECODE_THREADS) -> None:
        self.threads = threads
        #: the compressed encodings this server can decode (a session agrees to a subset)
        self.encodings = frozenset(e for e in available_encodings() if e != "raw")
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="chunkline-decode")

    def agree(self, offered: str | None) -> list[str]:
        """The encodings a session uses: ``raw``, plus those the client offered (a comma-separated
        handshake header) that this server decodes, in the server's order."""
        names = {part.strip().lower() for part in (offered or "").split(",")[:16]}
        return ["raw", *sorted(self.encodings & names)]

    @staticmethod
    def check(spec: PolicySpec, agreed: frozenset[str] | set[str], fields: Mapping[str, EncodedArray]) -> dict[str, EncodedArray]:
        """The compressed fields the policy reads, each checked; fields it does not read are left
        out (they are never decoded).

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

    async def decode(self, obs: dict[str, Any], fields: Mapping[str, EncodedArray]) -> float:
        """Decode ``fields`` on the pool, in parallel, and put the arrays into ``obs``; returns the
        seconds it took.

        Raises:
            Refusal: ``invalid_message`` naming the first field whose payload was refused.
        """
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        names = list(fields)
        results = await asyncio.gather(*(loop.run_in_executor(self._pool, decode_array, fields[n]) for n in names),
                                       return_exceptions=True)
        for name, result in zip(names, results, strict=True):
            if isinstance(result, (CodecError, CodecUnavailable)):
                raise Refusal(ErrorCode.INVALID_MESSAGE, f"field {name!r}: {result}")
            if isinstance(result, BaseException):
                raise result
            obs[name] = result
        return time.perf_counter() - started

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
