"""The server's header-only peek (server/robot/peek.py) agrees with the hardened decoder."""

from __future__ import annotations

import msgpack
import numpy as np
from codec_helpers import array_strategy, refusal_reason
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.client.wire.codec import CodecLimits, decode, encode
from chunkline.client.wire.errors import CodecErrorReason
from chunkline.server.robot.peek import PEEK_MAX_ITEMS, Skipped, peek_map

_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=40)


def _expected_peek(tree: dict) -> dict:
    def one(v):
        if isinstance(v, (dict, np.ndarray)):
            return Skipped.MAP  # arrays travel as maps
        if isinstance(v, list):
            return Skipped.ARRAY
        if isinstance(v, bytes):
            return Skipped.BINARY
        return v

    return {k: one(v) for k, v in tree.items()}


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(
    st.text(max_size=12),
    _scalars | st.binary(max_size=300) | st.lists(_scalars | st.lists(_scalars, max_size=3), max_size=5)
    | st.dictionaries(st.text(max_size=5), _scalars | st.binary(max_size=40), max_size=4)
    | array_strategy(),
    max_size=8,
))
def test_peek_reads_the_top_level_scalars_decode_reads(tree: dict) -> None:
    data = encode(tree)
    peeked = peek_map(data)
    assert peeked == _expected_peek(tree)
    decoded = decode(data)
    for key, value in peeked.items():
        if not isinstance(value, Skipped):
            assert decoded[key] == value and type(decoded[key]) is type(value)


def test_peek_steps_over_array_bytes_without_reading_them() -> None:
    # Array data full of the one byte msgpack never uses: reading it as msgpack would fail.
    data = encode({"type": "infer", "id": 3, "obs": {"img": np.full((64, 64, 3), 0xC1, np.uint8)}, "deadline_ms": 50.0})
    assert peek_map(data) == {"type": "infer", "id": 3, "obs": Skipped.MAP, "deadline_ms": 50.0}


def test_peek_is_none_for_what_it_cannot_vouch_for() -> None:
    good = encode({"type": "infer", "id": 1, "obs": {"x": np.zeros((4, 4), np.float32)}, "model": "m"})
    for cut in range(len(good)):
        assert peek_map(good[:cut]) is None
    assert peek_map(good + b"\xc0") is None  # trailing bytes
    assert peek_map(encode([1, 2])) is None  # not a map
    assert peek_map(msgpack.packb({1: 2})) is None  # non-string key
    assert peek_map(msgpack.packb({b"k": 2})) is None
    assert peek_map(msgpack.packb({"t": msgpack.ExtType(5, b"abc")})) is None
    assert peek_map(msgpack.packb({"t": [msgpack.Timestamp(1, 0)]})) is None
    assert peek_map(b"\x81\xa1a\xc1") is None  # the never-used type byte
    assert peek_map(msgpack.packb({"s": b"\xff\xfe".decode("latin-1")}).replace(b"\xc3\xbf", b"\xff\xff")) is None  # bad UTF-8
    assert peek_map("not bytes") is None  # type: ignore[arg-type]
    assert peek_map(memoryview(good)) == peek_map(good) == peek_map(bytearray(good))


def test_peek_applies_the_decoders_caps() -> None:
    small = CodecLimits(max_message_bytes=1000, max_depth=4, max_container_len=10, max_str_bytes=8)
    assert peek_map(encode({"a": 1}), small) == {"a": 1}
    assert peek_map(encode({"a": np.zeros(2000, np.uint8)}), small) is None  # message too large
    assert peek_map(encode({"a": list(range(11))}), small) is None  # container too long
    assert peek_map(encode({"a": "x" * 9}), small) is None  # string too long, top level
    assert peek_map(encode({"a": ["x" * 9]}), small) is None  # and nested
    assert peek_map(encode({"a": [[[[1]]]]}), small) is None  # too deep, as for decode
    assert refusal_reason(encode({"a": [[[[1]]]]}), small) == CodecErrorReason.TOO_DEEP
    assert peek_map(encode({"a": [[[1]]]}), small) == {"a": Skipped.ARRAY}
    assert decode(encode({"a": [[[1]]]}), small) == {"a": [[[1]]]}
    assert peek_map(b"\x81\xa1a" + b"\x91" * 100_000 + b"\xc0") is None  # deep nesting: no recursion, no crash
    assert peek_map(encode({"a": [0] * (PEEK_MAX_ITEMS + 1)})) is None  # more items than a peek walks


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_peek_never_raises_on_arbitrary_bytes(data: bytes) -> None:
    for message in (data, b"\x82\xa1a\x01" + data, b"\x81\xa1o" + data):  # also behind a valid start
        out = peek_map(message)
        assert out is None or isinstance(out, dict)
