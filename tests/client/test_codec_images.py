"""Compressed observation fields (jpeg, png): round trips, the wire layouts, and every refusal
before or while decoding (typed errors only), the optional libraries, and the spec's declaration."""

from __future__ import annotations

import io
import subprocess
import sys

import msgpack
import numpy as np
import pytest
from PIL import Image

from chunkline.client.compression import Compression
from chunkline.client.wire import encodings
from chunkline.client.wire.codec import Encoder, decode
from chunkline.client.wire.encodings import EncodedArray, decode_array, encode_array
from chunkline.client.wire.errors import CodecError, CodecErrorReason
from chunkline.client.wire.format import ENC_KEY, ND_KEY
from chunkline.policies.base import ArraySpec


def smooth_image(h: int = 96, w: int = 128, channels: int = 3, seed: int = 0) -> np.ndarray:
    """A camera-like frame: gradients and a little noise (noise alone is JPEG's worst case)."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (h + w) * 2][:channels], -1)
    noise = np.random.default_rng(seed).integers(-6, 7, base.shape)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def jpeg_bytes(img: np.ndarray, **save: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(img[:, :, 0] if img.shape[2] == 1 else img).save(out, format="JPEG", **save)
    return out.getvalue()


def png_bytes(img: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(img).save(out, format="PNG")
    return out.getvalue()


def refused(field: EncodedArray) -> CodecError:
    with pytest.raises(CodecError) as info:
        decode_array(field)
    assert info.value.reason is CodecErrorReason.BAD_ENCODING
    return info.value


# ------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("channels", [3, 1])
def test_jpeg_round_trip_is_close_and_exactly_shaped(channels: int) -> None:
    img = smooth_image(channels=channels)
    enc = encode_array(img, "jpeg", 90)
    assert enc.quality == 90 and len(enc.payload) < img.nbytes / 4
    out = decode_array(enc)
    assert out.shape == img.shape and out.dtype == np.uint8
    assert np.abs(out.astype(int) - img).mean() < 4.0


@pytest.mark.parametrize("arr", [
    np.random.default_rng(1).integers(0, 5000, (40, 60)).astype(np.uint16),  # depth map
    np.random.default_rng(2).integers(0, 2, (40, 60, 1)).astype(np.uint8),  # mask
    np.random.default_rng(3).integers(0, 256, (40, 60)).astype(np.uint8),
    smooth_image(40, 60),
], ids=["depth-u16", "mask-hw1", "gray-u8", "rgb"])
def test_png_round_trip_is_lossless(arr: np.ndarray) -> None:
    out = decode_array(encode_array(arr, "png"))
    assert out.dtype == arr.dtype and out.shape == arr.shape and np.array_equal(out, arr)


@pytest.mark.parametrize("oob", [False, True])
def test_encoded_fields_cross_both_wire_layouts_still_compressed(oob: bool) -> None:
    img, depth = smooth_image(), np.arange(12, dtype=np.uint16).reshape(3, 4)
    msg = {"obs": {"cam": encode_array(img, "jpeg", 80), "depth": encode_array(depth, "png"), "state": np.ones(3, np.float32)}}
    enc = Encoder()
    got = decode(enc.encode_oob(msg) if oob else enc.encode(msg))["obs"]
    assert isinstance(got["cam"], EncodedArray) and isinstance(got["depth"], EncodedArray)
    assert got["cam"].shape == img.shape and got["cam"].dtype == np.uint8 and got["cam"].encoding == "jpeg"
    assert bytes(got["cam"].payload) == bytes(msg["obs"]["cam"].payload)
    assert np.array_equal(decode_array(got["depth"]), depth)
    assert np.array_equal(got["state"], np.ones(3, np.float32))


# ------------------------------------------------------------------------------------ refusals


def test_a_payload_announcing_another_size_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoder(name: str) -> None:
        raise AssertionError(f"{name} was loaded to decode a payload that should have been refused from its header")

    monkeypatch.setattr(encodings, "_module", no_decoder)
    big = jpeg_bytes(smooth_image(960, 1280), quality=5)
    assert len(big) < 96 * 128 * 3  # small enough to pass the size check: the header check must catch it
    # A small declared shape with a large image behind it (a decompression bomb), and the reverse.
    assert "declared" in str(refused(EncodedArray("jpeg", np.dtype("u1"), (96, 128, 3), big)))
    small = jpeg_bytes(smooth_image(48, 64))
    refused(EncodedArray("jpeg", np.dtype("u1"), (480, 640, 3), small))
    refused(EncodedArray("jpeg", np.dtype("u1"), (48, 64, 1), small))  # colour declared gray
    png = png_bytes(smooth_image(48, 64))
    refused(EncodedArray("png", np.dtype("u1"), (64, 48, 3), png))
    refused(EncodedArray("png", np.dtype("<u2"), (48, 64), png))  # 8-bit RGB declared 16-bit depth


def test_progressive_jpeg_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    img = smooth_image()
    monkeypatch.setattr(encodings, "_module", lambda name: pytest.fail(f"{name} loaded for a refused payload"))
    assert "sequential" in str(refused(EncodedArray("jpeg", np.dtype("u1"), img.shape, jpeg_bytes(img, progressive=True))))


def test_a_jpeg_padded_with_marker_segments_is_refused_after_a_bounded_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    img = smooth_image()
    data = jpeg_bytes(img)
    comment = b"\xff\xfe\x00\x02"  # an empty comment segment: four bytes each
    assert decode_array(EncodedArray("jpeg", np.dtype("u1"), img.shape, data[:2] + comment * 8 + data[2:])).shape == img.shape
    monkeypatch.setattr(encodings, "_module", lambda name: pytest.fail(f"{name} loaded for a refused payload"))
    padded = data[:2] + comment * encodings.MAX_JPEG_HEADER_STEPS + data[2:]
    assert "marker segments" in str(refused(EncodedArray("jpeg", np.dtype("u1"), img.shape, padded)))


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 20])
def test_scan_headers_are_counted_across_search_chunks(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(encodings, "_SCAN_SEARCH_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    for _ in range(20):
        data = rng.choice(np.array([0xFF, 0xDA, 0x00], np.uint8), int(rng.integers(0, 40))).tobytes()
        assert encodings._count_scans(memoryview(data), 0) == data.count(b"\xff\xda")
    img = smooth_image(channels=1)
    data = jpeg_bytes(img)
    sos = data.index(b"\xff\xda")
    scan_header = data[sos:sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")]
    assert decode_array(EncodedArray("jpeg", np.dtype("u1"), img.shape, data)).shape == img.shape
    two_scans = data[:-2] + scan_header + data[-2:]  # a gray image has one component: one scan
    assert "2 scans" in str(refused(EncodedArray("jpeg", np.dtype("u1"), img.shape, two_scans)))


@pytest.mark.parametrize("payload", [
    b"", b"\xff\xd8", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\0" * 40,
], ids=["empty", "soi-only", "garbage", "png-signature-only"])
@pytest.mark.parametrize("encoding", ["jpeg", "png"])
def test_malformed_payloads_get_a_typed_error(payload: bytes, encoding: str) -> None:
    refused(EncodedArray(encoding, np.dtype("u1"), (96, 128, 3), payload))


def test_truncated_and_corrupted_payloads_get_a_typed_error() -> None:
    img = smooth_image()
    for data in (jpeg_bytes(img), png_bytes(img)):
        kind = "jpeg" if data[:2] == b"\xff\xd8" else "png"
        refused(EncodedArray(kind, np.dtype("u1"), img.shape, data[: len(data) // 2]))
        corrupt = bytearray(data)
        corrupt[len(corrupt) // 2: len(corrupt) // 2 + 64] = b"\xff" * 64
        try:
            out = decode_array(EncodedArray(kind, np.dtype("u1"), img.shape, bytes(corrupt)))
        except CodecError as exc:
            assert exc.reason is CodecErrorReason.BAD_ENCODING
        else:  # a decoder may recover garbage pixels; it may never change the shape
            assert out.shape == img.shape


def test_a_declared_size_is_exact_however_large_the_sides() -> None:
    # int64 arithmetic would wrap 2**32 x 2**32 x 3 to 0 bytes: under every decoded-size limit
    assert EncodedArray("jpeg", np.dtype("u1"), (2**32, 2**32, 3), b"").raw_nbytes == 3 * 2**64
    assert EncodedArray("png", np.dtype("<u2"), (480, 640), b"").raw_nbytes == 480 * 640 * 2


def test_unfit_declarations_are_refused() -> None:
    data = jpeg_bytes(smooth_image())
    refused(EncodedArray("jpeg", np.dtype("<f4"), (96, 128, 3), data))  # a float image
    refused(EncodedArray("jpeg", np.dtype("u1"), (96, 128, 3, 1), data))
    refused(EncodedArray("webp", np.dtype("u1"), (96, 128, 3), data))


def _wire_array(payload: bytes, encoding: object = "jpeg", shape: list[int] | None = None) -> bytes:
    return msgpack.packb({"cam": {ND_KEY: True, b"dtype": "|u1", b"shape": shape or [8, 8, 3], ENC_KEY: encoding,
                                  b"data": payload}}, use_bin_type=True)


def test_the_codec_refuses_oversized_payloads_and_unknown_encodings() -> None:
    with pytest.raises(CodecError) as info:
        decode(_wire_array(b"\0" * (8 * 8 * 3 + encodings.PAYLOAD_SLACK_BYTES + 1)))
    assert info.value.reason is CodecErrorReason.BAD_ENCODING
    for name in ("webp", "raw", 7, None):
        with pytest.raises(CodecError) as info:
            decode(_wire_array(b"\xff\xd8", encoding=name))
        assert info.value.reason is CodecErrorReason.BAD_ENCODING
    with pytest.raises(CodecError):
        decode(_wire_array(b""))


def test_an_out_of_band_payload_past_the_frame_is_refused() -> None:
    frame = bytearray(Encoder().encode_oob({"cam": encode_array(smooth_image(), "jpeg", 80)}))
    with pytest.raises(CodecError):
        decode(bytes(frame[: len(frame) - 200]))


def test_encoding_refuses_arrays_the_codec_cannot_carry() -> None:
    with pytest.raises(CodecError):
        encode_array(np.zeros((4, 4, 3), np.float32), "jpeg")
    with pytest.raises(CodecError):
        encode_array(np.zeros((4, 4, 3), np.uint16), "png")
    with pytest.raises(CodecError):
        encode_array(smooth_image(), "jpeg", quality=0)


# ------------------------------------------------------------------------------------ optional libraries


def test_robot_side_imports_load_no_image_library() -> None:
    code = "import sys, chunkline.client, chunkline.client.compression; print(sorted({'simplejpeg', 'PIL'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_missing_codec_libraries_give_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encodings.importlib.util, "find_spec", lambda name, *a: None)
    for name in ("simplejpeg", "PIL", "PIL.Image"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails, as without the package
    assert encodings.available_encodings() == ("raw",)
    with pytest.raises(encodings.CodecUnavailable, match=r"chunkline\[jpeg\]"):
        Compression(mode="jpeg")
    with pytest.raises(ImportError, match=r"chunkline\[jpeg\]"):
        encode_array(smooth_image(), "png")
    assert Compression().offered == []  # raw needs nothing


def test_jpeg_falls_back_to_pillow_without_simplejpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # an import of it fails, as without the package
    img = smooth_image()
    out = decode_array(encode_array(img, "jpeg", 90))
    assert out.shape == img.shape and np.abs(out.astype(int) - img).mean() < 4.0


# ------------------------------------------------------------------------------------ the spec's declaration


def test_array_spec_declares_fitting_encodings_only() -> None:
    cam = ArraySpec((224, 224, 3), "uint8", encodings=("raw", "jpeg"), jpeg_min_quality=70)
    assert cam.to_wire()["encodings"] == ["raw", "jpeg"] and cam.to_wire()["jpeg_min_quality"] == 70
    assert "encodings" not in ArraySpec((14,), "float32").to_wire()  # raw-only metadata (and fingerprints) unchanged
    assert ArraySpec((None, None), "uint16", encodings=("raw", "png")).to_wire()["encodings"] == ["raw", "png"]
    with pytest.raises(ValueError, match="does not fit"):
        ArraySpec((14,), "float32", encodings=("raw", "jpeg"))
    with pytest.raises(ValueError, match="does not fit"):
        ArraySpec((64, 64), "uint16", encodings=("raw", "jpeg"))
    with pytest.raises(ValueError, match="raw"):
        ArraySpec((64, 64, 3), "uint8", encodings=("jpeg",))
    with pytest.raises(ValueError, match="unknown encoding"):
        ArraySpec((64, 64, 3), "uint8", encodings=("raw", "webp"))
