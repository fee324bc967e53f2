"""The image decoders under mutated payloads: bit flips, truncations, insertions and header
edits of valid JPEG and PNG images, through the fuzz harness's image target. Typed errors only
(:class:`CodecError`), and never an array of another shape. (The coverage-guided run reaches the
same decoders through the kept corpus's compressed-field seeds: tests/client/test_fuzz_codec.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from chunkline.bench.fuzz import harness
from chunkline.bench.fuzz.errors import FuzzFailure
from chunkline.client.wire.encodings import encode_array


def _payloads() -> list[tuple[int, bytes]]:
    """(target index, payload) of valid images matching each of the harness's declared targets."""
    out = []
    for index, (encoding, dtype, shape) in enumerate(harness._IMAGE_TARGETS):
        rng = np.random.default_rng(index)
        arr = rng.integers(0, 256 if dtype == "|u1" else 60000, shape).astype(dtype)
        out.append((index, bytes(encode_array(arr, encoding, 80).payload)))
    return out


def mutate(rng: np.random.Generator, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 6))):
        kind = int(rng.integers(0, 5))
        pos = int(rng.integers(0, len(buf))) if buf else 0
        if kind == 0 and buf:  # flip a bit
            buf[pos] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:  # truncate
            del buf[pos:]
        elif kind == 2:  # insert bytes
            buf[pos:pos] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
        elif kind == 3 and len(buf) > 30:  # a header field: JPEG's frame size or PNG's IHDR
            buf[int(rng.integers(2, 30))] = int(rng.integers(0, 256))
        elif buf:  # a marker byte
            buf[pos] = 0xFF
    return bytes(buf)


def test_valid_payloads_decode_through_the_harness() -> None:
    for index, payload in _payloads():
        harness.fuzz_image_input(bytes([index]) + payload)


def test_mutated_payloads_get_typed_errors_only() -> None:
    rng = np.random.default_rng(20)
    seeds = _payloads()
    for _ in range(3000):  # bounded
        index, payload = seeds[int(rng.integers(0, len(seeds)))]
        harness.fuzz_image_input(bytes([index]) + mutate(rng, payload))


def test_the_harness_reports_a_decoder_that_raises_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    from chunkline.client.wire import encodings

    monkeypatch.setattr(encodings, "decode_array", lambda field: [][0])
    index, payload = _payloads()[0]
    with pytest.raises(FuzzFailure, match="IndexError"):
        harness.fuzz_image_input(bytes([index]) + payload)
