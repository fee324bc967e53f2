"""The hardened codec: round trips, compatibility with openpi and msgpack-numpy, refusals."""

from __future__ import annotations

import pickle

import msgpack
import msgpack_numpy
import numpy as np
import pytest
from codec_helpers import array_strategy, refusal_reason
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.client.wire.codec import CodecLimits, Encoded, Encoder, check_dtype, decode, encode
from chunkline.client.wire.errors import CodecError, CodecErrorReason


@settings(max_examples=150, deadline=None)
@given(array_strategy())
def test_every_supported_dtype_and_shape_round_trips(arr: np.ndarray) -> None:
    out = decode(encode({"x": arr}))["x"]
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)  # NaNs compare equal here


@settings(max_examples=60, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=20,
    )
)
def test_plain_msgpack_trees_round_trip(tree) -> None:
    out = decode(encode(tree))
    assert msgpack.packb(out) == msgpack.packb(tree)


def test_numpy_scalars_round_trip_as_numpy_scalars() -> None:
    for value in (np.float32(1.5), np.int16(-3), np.uint64(2**64 - 1), np.bool_(True), np.float16(0.25)):
        out = decode(encode({"v": value}))["v"]
        assert type(out) is type(value) and out == value


def test_non_contiguous_arrays_are_sent_as_their_values() -> None:
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    np.testing.assert_array_equal(decode(encode(arr)), arr)


def test_decoded_arrays_are_read_only_views() -> None:
    out = decode(encode(np.zeros(8, np.uint8)))
    assert not out.flags.writeable
    assert out.base is not None  # a view of the received bytes, not a second copy


def test_openpi_layout_decodes() -> None:
    # openpi-client's msgpack_numpy: bytes keys, dtype.str, shape as a list.
    arr = np.arange(6, dtype="<f4").reshape(2, 3)
    payload = msgpack.packb(
        {"a": {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": arr.dtype.str, b"shape": arr.shape},
         "s": {b"__npgeneric__": True, b"data": 7, b"dtype": "<i8"}}
    )
    out = decode(payload)
    np.testing.assert_array_equal(out["a"], arr)
    assert out["s"] == 7 and out["s"].dtype == np.int64


def test_encoded_arrays_decode_with_openpis_own_unpacker() -> None:
    # What openpi-client does with our replies (its unpack_array, re-stated: bytes keys).
    def openpi_unpack(obj):
        if b"__ndarray__" in obj:
            return np.ndarray(buffer=obj[b"data"], dtype=np.dtype(obj[b"dtype"]), shape=obj[b"shape"])
        return obj

    arr = np.random.default_rng(0).standard_normal((50, 14)).astype(np.float32)
    out = msgpack.unpackb(encode({"actions": arr}), object_hook=openpi_unpack)
    np.testing.assert_array_equal(out["actions"], arr)


def test_msgpack_numpy_package_layout_decodes() -> None:
    obj = {"img": np.arange(12, dtype=np.uint8).reshape(2, 2, 3), "v": np.float32(2.5), "i": np.int8(-4), "b": np.bool_(False)}
    out = decode(msgpack.packb(obj, default=msgpack_numpy.encode))
    np.testing.assert_array_equal(out["img"], obj["img"])
    assert out["v"] == np.float32(2.5) and out["i"] == -4 and out["b"] == np.bool_(False)


def _nd(dtype: object, shape: object, data: bytes) -> bytes:
    return msgpack.packb({"x": {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}})


@pytest.mark.parametrize("dtype", ["|O", "<c8", "<c16", "|V8", "<M8[s]", "<U4", "|S4", "object", "<f4,<i4", "", 5, None, "<f4\n", " <f4"])
def test_non_numeric_dtypes_are_refused(dtype: object) -> None:
    assert refusal_reason(_nd(dtype, [1], b"\x00" * 8)) == CodecErrorReason.UNSUPPORTED_DTYPE


def test_msgpack_numpy_object_arrays_are_refused_without_unpickling() -> None:
    # msgpack-numpy sends object arrays as pickles; decoding them must never reach pickle.
    payload = msgpack.packb(np.array([{"a": 1}], dtype=object), default=msgpack_numpy.encode)
    assert refusal_reason(payload) == CodecErrorReason.UNSUPPORTED_DTYPE


def test_a_pickle_payload_is_refused() -> None:
    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    assert refusal_reason(pickle.dumps(Boom())) == CodecErrorReason.MALFORMED


@pytest.mark.parametrize(
    "shape, data, reason",
    [
        ([4], b"\x00" * 15, CodecErrorReason.LENGTH_MISMATCH),
        ([4], b"\x00" * 17, CodecErrorReason.LENGTH_MISMATCH),
        ([2**40, 2**40], b"", CodecErrorReason.TOO_MANY_ELEMENTS),
        ([-1], b"", CodecErrorReason.BAD_SHAPE),
        ([1.5], b"\x00" * 4, CodecErrorReason.BAD_SHAPE),
        ([True], b"\x00" * 4, CodecErrorReason.BAD_SHAPE),
        ("4", b"\x00" * 16, CodecErrorReason.BAD_SHAPE),
        ([1] * 9, b"\x00" * 4, CodecErrorReason.TOO_MANY_DIMS),
    ],
)
def test_shape_and_length_lies_are_refused(shape: object, data: bytes, reason: CodecErrorReason) -> None:
    assert refusal_reason(_nd("<f4", shape, data)) == reason


def test_truncated_and_concatenated_frames_are_refused() -> None:
    payload = encode({"x": np.zeros((10, 10), np.float32)})
    for cut in (1, 10, len(payload) // 2, len(payload) - 1):
        assert refusal_reason(payload[:cut]) == CodecErrorReason.MALFORMED
    assert refusal_reason(payload + payload) == CodecErrorReason.MALFORMED


def test_caps() -> None:
    small = CodecLimits(max_message_bytes=1000, max_arrays=2, max_depth=4, max_container_len=10, max_str_bytes=8)
    assert refusal_reason(encode(np.zeros(2000, np.uint8)), small) == CodecErrorReason.MESSAGE_TOO_LARGE
    assert refusal_reason(encode([np.zeros(1)] * 3), small) == CodecErrorReason.TOO_MANY_ARRAYS
    assert refusal_reason(encode({"a": np.zeros(1), "b": np.zeros(1), "c": np.zeros(1)}), small) == CodecErrorReason.TOO_MANY_ARRAYS
    assert refusal_reason(encode([[[[[1]]]]]), small) == CodecErrorReason.TOO_DEEP
    assert refusal_reason(encode(list(range(11))), small) == CodecErrorReason.MALFORMED
    assert refusal_reason(encode("x" * 9), small) == CodecErrorReason.MALFORMED


def test_deep_nesting_never_crashes() -> None:
    payload = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    assert refusal_reason(payload) in (CodecErrorReason.MALFORMED, CodecErrorReason.TOO_DEEP)


def test_extension_types_and_timestamps_are_refused() -> None:
    assert refusal_reason(msgpack.packb(msgpack.ExtType(5, b"abc"))) in (CodecErrorReason.UNSUPPORTED_TYPE, CodecErrorReason.MALFORMED)
    assert refusal_reason(msgpack.packb({"t": msgpack.Timestamp(1, 0)})) in (CodecErrorReason.UNSUPPORTED_TYPE, CodecErrorReason.MALFORMED)


def test_non_string_map_keys_are_refused() -> None:
    assert refusal_reason(msgpack.packb({1: 2})) == CodecErrorReason.UNSUPPORTED_TYPE
    assert refusal_reason(msgpack.packb({b"k": 2})) == CodecErrorReason.UNSUPPORTED_TYPE


def test_scalar_lies_are_refused() -> None:
    assert refusal_reason(msgpack.packb({b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"})) == CodecErrorReason.MALFORMED
    assert refusal_reason(msgpack.packb({b"__npgeneric__": True, b"data": "x", b"dtype": "<f4"})) == CodecErrorReason.MALFORMED
    assert refusal_reason(msgpack.packb({b"nd": False, b"type": "<f8", b"data": b"\x00" * 4})) == CodecErrorReason.LENGTH_MISMATCH


def test_encoder_refuses_what_it_cannot_send_safely() -> None:
    enc = Encoder()
    for bad in (np.array([1 + 2j]), np.array(["a"]), np.array([object()]), object(), {1, 2}):
        with pytest.raises(CodecError) as info:
            enc.encode({"x": bad})
        assert info.value.reason == CodecErrorReason.UNENCODABLE
    # The packer is still usable after a refusal.
    assert decode(enc.encode({"ok": 1})) == {"ok": 1}


def test_check_dtype_accepts_only_numeric_strings() -> None:
    assert check_dtype("<f4") == np.float32
    assert check_dtype(b"|u1") == np.uint8
    with pytest.raises(CodecError):
        check_dtype("float32")  # names are not wire dtypes


def test_map_prefix_encoding_forms_one_map() -> None:
    enc = Encoder()
    data = enc.encode_map_prefix(3, {"a": 1, "b": np.arange(3)}) + enc.encode_map_entries({"c": "x"})
    out = decode(data)
    assert out["a"] == 1 and out["c"] == "x" and list(out["b"]) == [0, 1, 2]



# ------------------------------------------------------------------ pre-encoded values


def test_preencoded_values_are_embedded_byte_for_byte() -> None:
    enc = Encoder()
    obs = {"img": np.arange(12, dtype=np.uint8).reshape(2, 2, 3), "state": np.ones(3, np.float32), "prompt": "go"}
    packed = enc.preencode(obs)
    assert len(packed) == len(packed.data) == len(enc.encode(obs))
    assert enc.encode({"type": "infer", "id": 7, "obs": packed}) == enc.encode({"type": "infer", "id": 7, "obs": obs})
    assert enc.encode([packed, packed]) == enc.encode([obs, obs])
    out = decode(enc.encode({"obs": packed}))
    np.testing.assert_array_equal(out["obs"]["img"], obs["img"])
    with pytest.raises(TypeError):
        Encoded(b"\xc1")  # only an encoder makes them: they always hold one whole msgpack object
    with pytest.raises(CodecError):
        enc.preencode({"x": np.array(["a"])})


@pytest.mark.parametrize("run", [1, 15, 16, 70_000])  # fixmap, map 16 and map 32 headers dropped from a run
def test_runs_of_scalar_entries_packed_together_keep_the_maps_order(run: int) -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    obj = {"first": arr, **{f"k{i}": (i if i % 3 else f"s{i}" if i % 2 else 0.5) for i in range(run)}, "mid": [arr],
           "flag": True, "none": None, "last": arr}
    out = decode(encode(obj))
    assert list(out) == list(obj)
    assert all(out[k] == v for k, v in obj.items() if not isinstance(v, (np.ndarray, list)))
    np.testing.assert_array_equal(out["last"], arr)
    np.testing.assert_array_equal(out["mid"][0], arr)
