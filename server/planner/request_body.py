"""The upstream planner's request body, built in pieces: camera images as PNG data URLs and the
JSON around them, each step a short C call or one that releases the GIL.

Invariant: no step holds the GIL for longer than encoding :data:`YIELD_BYTES` (a fraction of a
millisecond), so a pool thread encoding a 2048x2048 image leaves the event loop its turns: one
``base64`` or ``json.dumps`` call over a 16 MB string holds the GIL for tens of milliseconds, and
so do short calls in a row (a thread waiting for the GIL gets it only after the switch interval).
The image rows are compressed by ``zlib`` (which releases the GIL) a block at a time; the base64
text is made a piece at a time, the GIL given up between every few pieces; a data URL's pieces are
spliced into the JSON text unescaped (base64 needs no escaping), at markers no input can forge.
"""

from __future__ import annotations

import binascii
import dataclasses
import json
import secrets
import struct
import time
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["DataUrl", "PIECE_BYTES", "png_data_url", "json_pieces"]

#: Bytes of PNG encoded to base64 per call (a multiple of 3: the pieces join without padding).
PIECE_BYTES = 3 * 16 * 1024
#: Bytes encoded to base64 between two releases of the GIL (:func:`yield_gil`).
YIELD_BYTES = 8 * PIECE_BYTES
#: Image rows filtered and compressed per block.
_ROW_BLOCK_BYTES = 1 << 20
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_URL_PREFIX = b"data:image/png;base64,"


@dataclasses.dataclass(frozen=True, slots=True)
class DataUrl:
    """A ``data:image/png;base64,...`` URL as ASCII pieces, in order."""

    pieces: tuple[bytes, ...]

    def __len__(self) -> int:
        return sum(len(p) for p in self.pieces)

    def text(self) -> str:
        """The URL as one string (tests and small images; the body splices the pieces)."""
        return b"".join(self.pieces).decode("ascii")


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def _png_pieces(image: np.ndarray) -> list[bytes]:
    """An ``[H, W, 3]`` uint8 image as PNG (filter 0 on every row, one IDAT chunk), in pieces."""
    h, w, _ = image.shape
    pixels = np.ascontiguousarray(image, np.uint8).reshape(h, w * 3)
    rows_per_block = max(1, _ROW_BLOCK_BYTES // (w * 3 + 1))
    compressor = zlib.compressobj(6)
    idat: list[bytes] = []
    crc = zlib.crc32(b"IDAT")
    for top in range(0, h, rows_per_block):
        block = pixels[top:top + rows_per_block]
        rows = np.empty((len(block), w * 3 + 1), np.uint8)
        rows[:, 0] = 0
        rows[:, 1:] = block
        out = compressor.compress(memoryview(rows))  # type: ignore[arg-type]  # numpy arrays export buffers
        if out:
            idat.append(out)
            crc = zlib.crc32(out, crc)
    tail = compressor.flush()
    idat.append(tail)
    crc = zlib.crc32(tail, crc)
    length = sum(len(p) for p in idat)
    return [_PNG_SIGNATURE + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + struct.pack(">I", length) + b"IDAT",
            *idat, struct.pack(">I", crc & 0xFFFFFFFF) + _chunk(b"IEND", b"")]


def yield_gil() -> None:
    """Release the GIL for a moment: a thread waiting for it takes it now."""
    time.sleep(0)


def _base64_pieces(pieces: Iterable[bytes]) -> list[bytes]:
    """The base64 text of the concatenated ``pieces``, a call per :data:`PIECE_BYTES` at most and
    the GIL released after every :data:`YIELD_BYTES`."""
    out: list[bytes] = []
    since_yield = 0
    carry = b""  # fewer than 3 bytes left over from the last piece
    for piece in pieces:
        view = memoryview(piece)
        if carry:
            need = 3 - len(carry)
            carry += bytes(view[:need])
            view = view[need:]
            if len(carry) < 3:
                continue
            out.append(binascii.b2a_base64(carry, newline=False))
            carry = b""
        whole = len(view) - len(view) % 3
        for start in range(0, whole, PIECE_BYTES):
            out.append(binascii.b2a_base64(view[start:min(whole, start + PIECE_BYTES)], newline=False))
            since_yield += PIECE_BYTES
            if since_yield >= YIELD_BYTES:
                since_yield = 0
                yield_gil()
        carry = bytes(view[whole:])
    if carry:
        out.append(binascii.b2a_base64(carry, newline=False))
    return out


def png_data_url(image: np.ndarray) -> DataUrl:
    """An ``[H, W, 3]`` uint8 image as a PNG data URL (no imaging library needed)."""
    return DataUrl((_URL_PREFIX, *_base64_pieces(_png_pieces(image))))


def json_pieces(document: Any) -> list[bytes]:
    """``document`` as JSON (UTF-8) in pieces, each :class:`DataUrl` in it as a string whose
    pieces are spliced in as they are."""
    urls: list[DataUrl] = []
    nonce = secrets.token_hex(16)

    def marker(value: Any) -> str:
        if not isinstance(value, DataUrl):
            raise TypeError(f"{type(value).__name__} is not JSON serializable")
        urls.append(value)
        return f"{nonce}:{len(urls) - 1}"

    text = json.dumps(document, default=marker).encode()
    pieces: list[bytes] = []
    for i, url in enumerate(urls):
        before, text = text.split(f'"{nonce}:{i}"'.encode(), 1)
        pieces += [before + b'"', *url.pieces, b'"']
    pieces.append(text)
    return pieces
