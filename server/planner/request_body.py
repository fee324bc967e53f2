"""The upstream planner's request body: camera images as PNG data URLs and the JSON around them.

A data URL's text is read a piece at a time (:class:`DataUrl`, from memory or from a worker's
shared mapping), and :func:`json_pieces` splices it into the JSON text unescaped (base64 needs no
escaping) at markers no input can forge, so the upload streams it without joining the megabytes.
The PNG rows are filtered and compressed a block at a time (:func:`png_pieces`), and the base64
text made a piece at a time (:func:`base64_pieces`), so no step needs the image's size twice over.
"""

from __future__ import annotations

import binascii
import dataclasses
import json
import secrets
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import numpy as np

__all__ = ["DataUrl", "InMemoryText", "UrlText", "PIECE_BYTES", "UPLOAD_PIECE_BYTES", "base64_pieces", "body_length",
           "body_pieces", "json_pieces", "png_data_url", "png_pieces"]

#: Bytes of PNG encoded to base64 per call (a multiple of 3: the pieces join without padding).
PIECE_BYTES = 3 * 16 * 1024
#: Bytes of a data URL's text the upload reads and writes in one step: a fraction of a millisecond
#: of copying, and few enough steps that the HTTP client's per-write work stays small.
UPLOAD_PIECE_BYTES = 256 * 1024
#: Image rows filtered and compressed per block.
_ROW_BLOCK_BYTES = 1 << 20
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_URL_PREFIX = b"data:image/png;base64,"


class UrlText(Protocol):
    """Where a data URL's base64 text is read from."""

    def __len__(self) -> int: ...

    def read(self, start: int, end: int) -> bytes:
        """The text's bytes ``start`` to ``end`` (a copy)."""
        ...

    def close(self) -> None:
        """Let the text go (it is not read after)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class InMemoryText:
    """Base64 text held in memory."""

    data: bytes

    def __len__(self) -> int:
        return len(self.data)

    def read(self, start: int, end: int) -> bytes:
        return self.data[start:end]

    def close(self) -> None:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class DataUrl:
    """A ``data:image/png;base64,...`` URL, its base64 text read a piece at a time."""

    base64: UrlText

    def __len__(self) -> int:
        return len(_URL_PREFIX) + len(self.base64)

    def pieces(self) -> Iterator[bytes]:
        """The URL's ASCII bytes, in pieces of at most :data:`UPLOAD_PIECE_BYTES`."""
        yield _URL_PREFIX
        size = len(self.base64)
        for start in range(0, size, UPLOAD_PIECE_BYTES):
            yield self.base64.read(start, min(size, start + UPLOAD_PIECE_BYTES))

    def close(self) -> None:
        self.base64.close()

    def text(self) -> str:
        """The URL as one string (tests and small images; the body streams the pieces)."""
        return b"".join(self.pieces()).decode("ascii")


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def png_pieces(image: np.ndarray) -> list[bytes]:
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


def base64_pieces(pieces: Iterable[bytes]) -> list[bytes]:
    """The base64 text of the concatenated ``pieces``, a call per :data:`PIECE_BYTES` at most."""
    out: list[bytes] = []
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
        carry = bytes(view[whole:])
    if carry:
        out.append(binascii.b2a_base64(carry, newline=False))
    return out


def png_data_url(image: np.ndarray) -> DataUrl:
    """An ``[H, W, 3]`` uint8 image as a PNG data URL, encoded here (the server encodes in a
    worker process: :mod:`.image_encoder`)."""
    return DataUrl(InMemoryText(b"".join(base64_pieces(png_pieces(image)))))


def json_pieces(document: Any) -> list[bytes | DataUrl]:
    """``document`` as JSON (UTF-8) in parts, each :class:`DataUrl` in it a string whose text
    stays a part of its own (:func:`body_pieces` streams them)."""
    urls: list[DataUrl] = []
    nonce = secrets.token_hex(16)

    def marker(value: Any) -> str:
        if not isinstance(value, DataUrl):
            raise TypeError(f"{type(value).__name__} is not JSON serializable")
        urls.append(value)
        return f"{nonce}:{len(urls) - 1}"

    text = json.dumps(document, default=marker).encode()
    parts: list[bytes | DataUrl] = []
    for i, url in enumerate(urls):
        before, text = text.split(f'"{nonce}:{i}"'.encode(), 1)
        parts += [before + b'"', url, b'"']
    parts.append(text)
    return parts


def body_length(parts: list[bytes | DataUrl]) -> int:
    """The bytes :func:`body_pieces` yields for ``parts``."""
    return sum(len(p) for p in parts)


def body_pieces(parts: list[bytes | DataUrl]) -> Iterator[bytes]:
    """The JSON text of :func:`json_pieces`' ``parts``, a data URL's a piece at a time."""
    for part in parts:
        if isinstance(part, DataUrl):
            yield from part.pieces()
        else:
            yield part
