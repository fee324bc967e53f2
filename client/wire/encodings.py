"""Per-field encodings of observation arrays: ``raw`` (the default), ``jpeg`` and lossless ``png``.

The policy's spec says which fields may be compressed and how, the session agrees which encodings
both ends speak (docs/protocol.md, "Encodings"), and this module encodes and decodes. The image
libraries are optional on robots and imported on first use (a missing one raises
:class:`CodecUnavailable` with the install line). Decoding never trusts the payload: the declared
dtype and shape must be ones the encoding can carry, the payload may not exceed the raw array plus
a small allowance, the image's own header must announce exactly the declared size before a pixel is
decoded, and JPEG is read in its baseline form only (a progressive one can demand many passes from
a small payload). Every refusal is a :class:`CodecError`."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import io
import math
from types import ModuleType
from typing import Any

import numpy as np

from .errors import ChunklineError, CodecError, CodecErrorReason

__all__ = [
    "RAW",
    "JPEG",
    "PNG",
    "ENCODINGS",
    "COMPRESSED",
    "ENCODINGS_HEADER",
    "PAYLOAD_SLACK_BYTES",
    "CodecUnavailable",
    "EncodedArray",
    "unfit_reason",
    "payload_limit",
    "available",
    "available_encodings",
    "require",
    "encode_array",
    "decode_array",
]

RAW = "raw"
JPEG = "jpeg"
PNG = "png"
ENCODINGS: tuple[str, ...] = (RAW, JPEG, PNG)
#: the encodings that carry a payload other than the array's bytes
COMPRESSED: tuple[str, ...] = (JPEG, PNG)
#: the handshake header in which a client offers the compressed encodings it can send
ENCODINGS_HEADER = "X-Chunkline-Encodings"
#: what a compressed payload may have beyond the raw array's size (the headers of a tiny image);
#: a sender whose encoding would be larger than that sends the array raw
PAYLOAD_SLACK_BYTES = 4096
#: the largest image side either codec is asked to handle (JPEG's own limit)
MAX_SIDE = 65_500

_INSTALL = "pip install 'chunkline[jpeg]'"
_LIBRARIES = {JPEG: ("simplejpeg", "PIL"), PNG: ("PIL",)}


class CodecUnavailable(ChunklineError, ImportError):
    """An encoding was asked for whose optional library is not installed."""


@dataclasses.dataclass(frozen=True, slots=True)
class EncodedArray:
    """An array in its compressed form: what the decoder hands over for an encoded field, and
    what a sender puts in a message in place of the array.

    Args:
        encoding: ``jpeg`` or ``png``.
        dtype: the array's dtype once decoded.
        shape: its shape once decoded.
        payload: the compressed bytes (a read-only view of the received frame on the server).
        quality: the JPEG quality it was encoded at (sender side; never read from the wire).
    """

    encoding: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    payload: bytes | memoryview
    quality: int | None = None

    @property
    def raw_nbytes(self) -> int:
        """The size of the decoded array (exact: Python integers do not wrap)."""
        return math.prod(map(int, self.shape)) * self.dtype.itemsize

    def __repr__(self) -> str:
        shape = "x".join(str(d) for d in self.shape)
        return f"EncodedArray({self.encoding}, {self.dtype.str}[{shape}], {len(self.payload)} bytes)"


def unfit_reason(encoding: str, dtype: np.dtype[Any], shape: tuple[int | None, ...]) -> str | None:
    """Why ``encoding`` cannot carry arrays of ``dtype`` and ``shape`` (``None``: it can).

    ``jpeg``: uint8 ``[H, W, 3]`` or ``[H, W, 1]``. ``png``: uint8 ``[H, W]``, ``[H, W, 1]``,
    ``[H, W, 3]``, or uint16 ``[H, W]``, ``[H, W, 1]`` (depth maps). A ``None`` side (a free
    dimension of a spec) fits; a concrete side must be 1 to 65 500.
    """
    if encoding == RAW:
        return None
    if encoding not in COMPRESSED:
        return f"unknown encoding {encoding!r} (known: {', '.join(ENCODINGS)})"
    dtype = np.dtype(dtype)
    if len(shape) not in (2, 3):
        return f"{encoding} carries images [H, W] or [H, W, C], not {len(shape)}-D arrays"
    for side in shape[:2]:
        if side is not None and not 1 <= side <= MAX_SIDE:
            return f"{encoding} carries image sides of 1 to {MAX_SIDE} pixels"
    channels = 1 if len(shape) == 2 else shape[2]
    if encoding == JPEG:
        if dtype != np.uint8 or len(shape) != 3 or channels not in (1, 3):
            return "jpeg carries uint8 [H, W, 3] or [H, W, 1] images"
        return None
    if dtype == np.uint8 and channels in (1, 3):
        return None
    if dtype == np.dtype("uint16") and channels == 1:
        return None
    return "png carries uint8 [H, W], [H, W, 1], [H, W, 3] or uint16 [H, W], [H, W, 1] images"


def payload_limit(raw_nbytes: int) -> int:
    """The largest compressed payload accepted for an array of ``raw_nbytes``."""
    return raw_nbytes + PAYLOAD_SLACK_BYTES


def available(encoding: str) -> bool:
    """Whether ``encoding`` can be used here (its library is installed; nothing is imported)."""
    if encoding == RAW:
        return True
    return any(importlib.util.find_spec(lib) is not None for lib in _LIBRARIES.get(encoding, ()))


def available_encodings() -> tuple[str, ...]:
    """The encodings this installation can encode and decode, ``raw`` first."""
    return tuple(e for e in ENCODINGS if available(e))


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def require(encoding: str) -> None:
    """Raise :class:`CodecUnavailable` (with the install line) unless ``encoding`` can be used here."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r} (known: {', '.join(ENCODINGS)})")
    if not available(encoding):
        raise CodecUnavailable(f"the {encoding} encoding needs an optional library: {_INSTALL}")


def _pil_image() -> Any:
    image = _module("PIL.Image")
    if image is None:
        raise CodecUnavailable(f"png (and jpeg without simplejpeg) needs Pillow: {_INSTALL}")
    return image


# ------------------------------------------------------------------------------------ encoding


def encode_array(arr: np.ndarray, encoding: str, quality: int = 90) -> EncodedArray:
    """Compress one array.

    Args:
        arr: the array (see :func:`unfit_reason` for what each encoding carries).
        encoding: ``jpeg`` or ``png``.
        quality: JPEG quality, 1 to 100 (ignored by ``png``).

    Raises:
        CodecError: ``unencodable``: the encoding cannot carry this array.
        CodecUnavailable: the encoding's library is not installed.
    """
    reason = unfit_reason(encoding, arr.dtype, arr.shape) if encoding in COMPRESSED else f"{encoding!r} is not a compressed encoding"
    if reason is not None:
        raise CodecError(CodecErrorReason.UNENCODABLE, reason)
    if not 1 <= quality <= 100:
        raise CodecError(CodecErrorReason.UNENCODABLE, f"jpeg quality must be 1 to 100, got {quality}")
    image = np.ascontiguousarray(arr)
    if encoding == JPEG:
        payload = _encode_jpeg(image, quality)
        return EncodedArray(JPEG, arr.dtype, tuple(arr.shape), payload, quality)
    return EncodedArray(PNG, arr.dtype, tuple(arr.shape), _encode_png(image))


def _encode_jpeg(image: np.ndarray, quality: int) -> bytes:
    gray = image.shape[2] == 1
    simplejpeg = _module("simplejpeg")
    if simplejpeg is not None:
        data: bytes = simplejpeg.encode_jpeg(image, quality=quality, colorspace="GRAY" if gray else "RGB",
                                             colorsubsampling="Gray" if gray else "420")
        return data
    out = io.BytesIO()
    _pil_image().fromarray(image[:, :, 0] if gray else image).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def _encode_png(image: np.ndarray) -> bytes:
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    out = io.BytesIO()
    # Level 1: most of zlib's gain on depth maps and masks for a fraction of its time.
    _pil_image().fromarray(image).save(out, format="PNG", compress_level=1)
    return out.getvalue()


# ------------------------------------------------------------------------------------ decoding


def _refuse(detail: str) -> CodecError:
    return CodecError(CodecErrorReason.BAD_ENCODING, detail)


def decode_array(field: EncodedArray) -> np.ndarray:
    """Decompress one field after checking it, into exactly its declared dtype and shape.

    Raises:
        CodecError: ``bad_encoding`` for anything refused or any decoder failure.
        CodecUnavailable: the encoding's library is not installed here.
    """
    reason = unfit_reason(field.encoding, field.dtype, field.shape) if field.encoding in COMPRESSED else "not a compressed encoding"
    if reason is not None:
        raise _refuse(reason)
    size = len(field.payload)
    if not 0 < size <= payload_limit(field.raw_nbytes):
        raise _refuse(f"a {field.encoding} payload of {size} bytes for {field.raw_nbytes} raw bytes")
    try:
        image = _decode_jpeg(field) if field.encoding == JPEG else _decode_png(field)
    except (CodecError, CodecUnavailable):
        raise
    except Exception as exc:  # any failure of a third-party decoder means a malformed payload
        raise _refuse(f"the {field.encoding} payload does not decode ({type(exc).__name__})") from None
    if image.shape != field.shape or image.dtype != field.dtype:
        raise _refuse(f"the {field.encoding} payload decoded to {image.dtype.str}{list(image.shape)}, "
                      f"declared {field.dtype.str}{list(field.shape)}")
    return image


#: JPEG start-of-frame markers of the sequential (baseline and extended) Huffman processes
_SEQUENTIAL_SOF = (0xC0, 0xC1)
_SOS = 0xDA
#: marker segments and fill bytes read before the first scan (an encoder writes about ten):
#: the walk runs in Python, holding the GIL, so a payload of tiny segments must not prolong it
MAX_JPEG_HEADER_STEPS = 128
#: bytes searched for scan headers per numpy step; each step runs without the GIL
_SCAN_SEARCH_CHUNK = 1 << 20


def _jpeg_frame(data: bytes | memoryview) -> tuple[int, int, int, int]:
    """``(height, width, components, scans)`` read from the markers, refusing anything but a
    sequential Huffman JPEG. Walks at most :data:`MAX_JPEG_HEADER_STEPS` marker segments and
    fill bytes up to the first scan, then counts the scan headers after it."""
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    n = len(view)
    if n < 4 or view[0] != 0xFF or view[1] != 0xD8:
        raise _refuse("not a JPEG (no start-of-image marker)")
    pos = 2
    frame: tuple[int, int, int] | None = None
    for _ in range(MAX_JPEG_HEADER_STEPS):
        if pos + 4 > n:
            break
        if view[pos] != 0xFF:
            raise _refuse("a JPEG marker segment is malformed")
        marker = view[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        length = (view[pos + 2] << 8) | view[pos + 3]
        if length < 2 or pos + 2 + length > n:
            raise _refuse("a JPEG marker segment runs past the payload")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if marker not in _SEQUENTIAL_SOF:
                raise _refuse("only sequential (baseline) JPEG is accepted")
            if frame is not None or length < 8:
                raise _refuse("a JPEG with a malformed or repeated frame header")
            height = (view[pos + 5] << 8) | view[pos + 6]
            width = (view[pos + 7] << 8) | view[pos + 8]
            frame = (height, width, view[pos + 9])
        if marker == _SOS:
            break
        pos += 2 + length
    else:
        raise _refuse(f"a JPEG with more than {MAX_JPEG_HEADER_STEPS} marker segments before its first scan")
    if frame is None:
        raise _refuse("a JPEG without a frame header before its first scan")
    return frame[0], frame[1], frame[2], _count_scans(view, pos)


def _count_scans(view: memoryview, start: int) -> int:
    """The scan headers (FF DA) from ``start`` on. In entropy-coded data 0xFF is always followed
    by 0x00 or a restart marker, so FF DA marks a scan. Counted with numpy a chunk at a time:
    its loops release the GIL, so the event loop runs while a pool thread searches a payload of
    megabytes."""
    data = np.frombuffer(view, np.uint8)
    scans = 0
    for low in range(start, len(data) - 1, _SCAN_SEARCH_CHUNK):
        part = data[low:low + _SCAN_SEARCH_CHUNK + 1]  # one byte more: a pair across chunks is seen once
        scans += int(np.count_nonzero((part[:-1] == 0xFF) & (part[1:] == _SOS)))
    return scans


def _decode_jpeg(field: EncodedArray) -> np.ndarray:
    height, width, components, scans = _jpeg_frame(field.payload)
    channels = field.shape[2]
    if (height, width, components) != (field.shape[0], field.shape[1], channels):
        raise _refuse(f"the JPEG is {height}x{width} with {components} components, declared {list(field.shape)}")
    if not 1 <= scans <= components:  # sequential JPEG: at most one scan per component
        raise _refuse(f"a JPEG with {scans} scans for {components} components")
    gray = channels == 1
    simplejpeg = _module("simplejpeg")
    if simplejpeg is not None:
        # The payload as received (a view of the frame): a copy would run holding the GIL.
        image: np.ndarray = simplejpeg.decode_jpeg(field.payload, colorspace="GRAY" if gray else "RGB", strict=True)
        return image
    pil = _pil_image()
    with pil.open(io.BytesIO(field.payload), formats=["JPEG"]) as img:
        img.load()
        out = np.asarray(img.convert("L" if gray else "RGB"))
    return out[:, :, np.newaxis] if gray else out


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: PNG colour type and bit depth per (dtype, channels) a field may declare
_PNG_FORMAT = {("|u1", 1): (0, 8), ("|u1", 3): (2, 8), ("<u2", 1): (0, 16), (">u2", 1): (0, 16)}


def _decode_png(field: EncodedArray) -> np.ndarray:
    data = bytes(field.payload[:33])
    if len(data) < 33 or data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise _refuse("not a PNG (no signature and header first)")
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    depth, colour = data[24], data[25]
    channels = 1 if len(field.shape) == 2 else field.shape[2]
    if (height, width) != field.shape[:2]:
        raise _refuse(f"the PNG is {height}x{width}, declared {list(field.shape)}")
    if _PNG_FORMAT.get((field.dtype.str, channels)) != (colour, depth):
        raise _refuse(f"a PNG of colour type {colour} and depth {depth} for {field.dtype.str} with {channels} channels")
    pil = _pil_image()
    with pil.open(io.BytesIO(field.payload), formats=["PNG"]) as img:
        if img.size != (width, height):
            raise _refuse("the PNG's size changed between its header and the decoder")
        img.load()
        out = np.asarray(img)
    out = out.astype(field.dtype, copy=False)  # 16-bit PNGs read back native-endian
    return out.reshape(field.shape)
