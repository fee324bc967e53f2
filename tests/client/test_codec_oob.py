"""The out-of-band array layout: round trips, zero-copy aligned read-only views, every lie refused,
the server's peek reading it as it reads the msgpack layout, and clients using it when offered."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from codec_helpers import array_strategy
from helpers import aloha_obs
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.bench.serverproc import ServerProcess
from chunkline.client import Client
from chunkline.client.wire.codec import CodecLimits, Encoder, decode
from chunkline.client.wire.errors import CodecError, CodecErrorReason
from chunkline.client.wire.format import OOB_ALIGN, OOB_MAGIC, OOB_PREFIX, oob_data_start
from chunkline.server.robot.peek import Skipped, peek_map


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8), array_strategy(), max_size=5), st.integers(0, 2**40))
def test_every_array_round_trips_as_an_aligned_read_only_view(arrays: dict[str, np.ndarray], request_id: int) -> None:
    frame = Encoder().encode_oob({"type": "infer", "id": request_id, "obs": arrays})
    assert frame[:4] == OOB_MAGIC
    out = decode(frame)
    assert out["id"] == request_id and set(out["obs"]) == set(arrays)
    for key, arr in arrays.items():
        got = out["obs"][key]
        assert got.dtype == arr.dtype and got.shape == arr.shape and not got.flags.writeable
        np.testing.assert_array_equal(got, arr)
        if got.nbytes:
            assert got.flags.aligned and got.base is not None  # a view of the frame, not a copy


def test_the_array_bytes_are_viewed_in_place() -> None:
    frame = Encoder().encode_oob({"obs": {"x": np.arange(32, dtype=np.float32)}})
    view = decode(frame)["obs"]["x"]
    start = oob_data_start(int.from_bytes(frame[4:OOB_PREFIX], "little"))
    assert view.__array_interface__["data"][0] == np.frombuffer(frame, np.uint8)[start:].__array_interface__["data"][0]


def _frame(header: dict, data: bytes = b"", pad_to: int | None = None) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    start = oob_data_start(len(body)) if pad_to is None else pad_to
    return OOB_MAGIC + len(body).to_bytes(4, "little") + body + bytes(max(0, start - OOB_PREFIX - len(body))) + data


def _arr(dtype: str, shape: list[int], where: object, inline: bytes | None = None) -> dict:
    out = {b"__ndarray__": True, b"dtype": dtype, b"shape": shape, b"oob": where}
    if inline is not None:
        out[b"data"] = inline
    return out


@pytest.mark.parametrize("frame, reason", [
    (OOB_MAGIC + b"\x01", CodecErrorReason.MALFORMED),  # truncated prefix
    (OOB_MAGIC + (10_000).to_bytes(4, "little") + b"\x80", CodecErrorReason.MALFORMED),  # header past the end
    (_frame({"x": _arr("<f4", [4], [0, 16])}, b"\0" * 8), CodecErrorReason.LENGTH_MISMATCH),  # data past the end
    (_frame({"x": _arr("<f4", [4], [0, 12])}, b"\0" * 16), CodecErrorReason.LENGTH_MISMATCH),  # nbytes lies
    (_frame({"x": _arr("<f4", [4], [8, 16])}, b"\0" * 64), CodecErrorReason.MALFORMED),  # misaligned
    (_frame({"x": _arr("<f4", [4], [0, 16]), "y": _arr("<f4", [4], [0, 16])}, b"\0" * 64), CodecErrorReason.MALFORMED),  # overlap
    (_frame({"x": _arr("<f4", [4], [-64, 16])}, b"\0" * 64), CodecErrorReason.MALFORMED),  # negative offset
    (_frame({"x": _arr("<f4", [4], "0")}, b"\0" * 64), CodecErrorReason.MALFORMED),  # not [offset, nbytes]
    (_frame({"x": _arr("<f4", [4], [0, 16], b"\0" * 16)}, b"\0" * 64), CodecErrorReason.MALFORMED),  # both
    (_frame({"x": _arr("|O", [1], [0, 8])}, b"\0" * 64), CodecErrorReason.UNSUPPORTED_DTYPE),  # objects
    (_frame({"x": _arr("<f4", [2**31, 2**31], [0, 0])}), CodecErrorReason.TOO_MANY_ELEMENTS),  # a huge claimed shape
])
def test_every_lie_in_an_out_of_band_frame_is_refused_with_a_reason(frame: bytes, reason: CodecErrorReason) -> None:
    with pytest.raises(CodecError) as info:
        decode(frame)
    assert info.value.reason is reason


def test_out_of_band_placeholders_outside_an_out_of_band_frame_are_refused() -> None:
    with pytest.raises(CodecError) as info:
        decode(msgpack.packb({"x": _arr("<f4", [4], [0, 16])}, use_bin_type=True))
    assert info.value.reason is CodecErrorReason.MALFORMED


def test_the_size_cap_applies_to_the_whole_frame() -> None:
    frame = Encoder().encode_oob({"x": np.zeros(4096, np.uint8)})
    with pytest.raises(CodecError) as info:
        decode(frame, CodecLimits(max_message_bytes=1024))
    assert info.value.reason is CodecErrorReason.MESSAGE_TOO_LARGE


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=128))
def test_arbitrary_bytes_after_the_magic_give_typed_errors_only(tail: bytes) -> None:
    try:
        decode(OOB_MAGIC + tail)
    except CodecError:
        pass


def test_peek_reads_an_out_of_band_frame_as_the_msgpack_one() -> None:
    msg = {"type": "infer", "id": 7, "obs": aloha_obs(0), "deadline_ms": 80.0, "model": "m"}
    enc = Encoder()
    expected = {"type": "infer", "id": 7, "obs": Skipped.MAP, "deadline_ms": 80.0, "model": "m"}
    assert peek_map(enc.encode(msg)) == peek_map(enc.encode_oob(msg)) == expected
    frame = enc.encode_oob(msg)
    assert peek_map(frame[: OOB_PREFIX + 3]) is None  # a header cut short


def test_the_data_section_starts_aligned() -> None:
    assert all(oob_data_start(n) % OOB_ALIGN == 0 and oob_data_start(n) >= OOB_PREFIX + n for n in range(0, 300))


def test_native_clients_send_out_of_band_when_the_server_offers_it(noop_server: ServerProcess) -> None:
    with Client.connect(noop_server.uri) as client:
        assert client.hello is not None and "oob" in client.hello.layouts
        chunk = client.infer(aloha_obs(3), deadline_ms=2000)
        assert chunk.actions.shape == (50, 14)
