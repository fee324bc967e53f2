"""The msgpack + numpy encoder: one reused packer, array bytes copied once, pre-encoded values.

:meth:`Encoder.preencode` packs a value once (an observation a load generator re-sends) into an
:class:`Encoded` that later messages embed as is. The layout is :mod:`chunkline.client.wire.format`'s.
"""

from __future__ import annotations

from typing import Any, cast

import msgpack
import numpy as np

from .encodings import EncodedArray
from .errors import CodecError, CodecErrorReason
from .format import ENC_KEY, GENERIC_KEY, ND_KEY, OOB_ALIGN, OOB_KEY, OOB_MAGIC, OOB_PREFIX, oob_data_start

__all__ = ["Encoded", "Encoder", "encode"]


def _encode_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise CodecError(CodecErrorReason.UNENCODABLE, f"cannot send arrays of dtype {obj.dtype}")
        if not obj.flags.c_contiguous:
            obj = np.ascontiguousarray(obj)
        # A flat byte view: msgpack copies it straight into its buffer, with no tobytes() copy first.
        data = obj.reshape(-1).data.cast("B") if obj.size else b""
        return {ND_KEY: True, b"data": data, b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in "biuf":
            raise CodecError(CodecErrorReason.UNENCODABLE, f"cannot send scalars of dtype {obj.dtype}")
        return {GENERIC_KEY: True, b"data": obj.item(), b"dtype": obj.dtype.str}
    if isinstance(obj, tuple):
        return list(obj)
    raise CodecError(CodecErrorReason.UNENCODABLE, f"cannot send values of type {type(obj).__name__}")


class Encoded:
    """One value already packed by :meth:`Encoder.preencode`; an :class:`Encoder` embeds its
    bytes as they are wherever the value appears in a message.

    Only an encoder makes these (the constructor is not for wire bytes): the bytes are always
    exactly one complete msgpack object, so a message that embeds them stays well-formed.

    Args:
        data: the packed bytes.
        _token: the encoder's private proof of origin.

    Raises:
        TypeError: made by anything but :meth:`Encoder.preencode`.
    """

    __slots__ = ("_data",)

    def __init__(self, data: bytes, _token: object = None) -> None:
        if _token is not _PREENCODED:
            raise TypeError("use Encoder.preencode() to make an Encoded value")
        self._data = data

    @property
    def data(self) -> bytes:
        """The packed bytes."""
        return self._data

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"Encoded({len(self._data)} bytes)"


_PREENCODED = object()


#: Values msgpack packs by itself, exactly as :meth:`Encoder._emit` would one by one.
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})


def _map_body(packed: bytes) -> bytes:
    """A packed map without its header (fixmap: 1 byte, map 16: 3, map 32: 5): its entries."""
    first = packed[0]
    return packed[1:] if first < 0xDE else packed[3:] if first == 0xDE else packed[5:]


def _bin_header(n: int) -> bytes:
    if n < 0x100:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


class Encoder:
    """Encodes messages with one reused msgpack ``Packer`` (much faster than a packer per call).

    Array data is copied exactly once: maps, lists and array headers are packed piece by piece
    (each run of scalar-valued map entries in one call), the arrays' bytes are referenced in
    place, and one ``join`` builds the message.

    Not thread-safe: give each thread or connection its own encoder.
    """

    _CACHE_MAX = 256  # robots send the same keys and array shapes every time: cache their headers

    def __init__(self) -> None:
        self._packer = msgpack.Packer(default=_encode_hook, use_bin_type=True, autoreset=True)
        self._array_keys = [self._packer.pack(k) for k in (ND_KEY, True, b"dtype", b"shape", b"data")]
        self._headers: dict[tuple[np.dtype[Any], tuple[int, ...]], bytes] = {}
        self._keys: dict[str, bytes] = {}
        self._oob_key = self._packer.pack(OOB_KEY)
        self._enc_key = self._packer.pack(ENC_KEY)
        self._oob: list[memoryview] | None = None  # while encode_oob runs: the arrays' bytes

    def _array(self, arr: np.ndarray, parts: list[Any]) -> None:
        # The header is cached by dtype and shape (the dtype's kind checked when it is made), and
        # the bytes go out as a flat view of the array's buffer taken with memoryview, not numpy's
        # reshape and flags: on a reply's path, with cold caches, those numpy calls cost 7.9 us
        # (in-process A/B of the server's replies).
        cache_key = (arr.dtype, arr.shape)
        header = self._headers.get(cache_key)
        if header is None:
            if arr.dtype.kind not in "biuf":
                raise CodecError(CodecErrorReason.UNENCODABLE, f"cannot send arrays of dtype {arr.dtype}")
            nd, true, dtype, shape, data = self._array_keys
            pack = self._packer.pack
            header = b"".join((b"\x84", nd, true, dtype, pack(arr.dtype.str), shape, pack(list(arr.shape)),
                               data, _bin_header(arr.nbytes)))
            if len(self._headers) < self._CACHE_MAX:
                self._headers[cache_key] = header
        view = memoryview(arr)  # type: ignore[arg-type]  # numpy arrays export buffers
        if not view.c_contiguous:
            view = memoryview(np.ascontiguousarray(arr))  # type: ignore[arg-type]
        parts.append(header)
        if view.nbytes:
            parts.append(view.cast("B"))

    def _oob_array(self, arr: np.ndarray, parts: list[Any], buffers: list[memoryview]) -> None:
        """An array's placeholder in an out-of-band header; its bytes go to ``buffers``."""
        if arr.dtype.kind not in "biuf":
            raise CodecError(CodecErrorReason.UNENCODABLE, f"cannot send arrays of dtype {arr.dtype}")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        offset = sum(-(-len(b) // OOB_ALIGN) * OOB_ALIGN for b in buffers)
        nd, true, dtype, shape, _ = self._array_keys
        pack = self._packer.pack
        parts.append(b"".join((b"\x84", nd, true, dtype, pack(arr.dtype.str), shape, pack(list(arr.shape)),
                               self._oob_key, pack([offset, arr.nbytes]))))
        buffers.append(arr.reshape(-1).data.cast("B") if arr.nbytes else memoryview(b""))

    def _encoded(self, field: EncodedArray, parts: list[Any]) -> None:
        """A compressed field: the decoded array's dtype and shape, its encoding, the payload
        inline or (in an out-of-band frame) in the data section."""
        nd, true, dtype, shape, data = self._array_keys
        pack = self._packer.pack
        payload = memoryview(field.payload).cast("B")
        head = [b"\x85", nd, true, dtype, pack(field.dtype.str), shape, pack(list(field.shape)), self._enc_key, pack(field.encoding)]
        if self._oob is None:
            parts.append(b"".join((*head, data, _bin_header(len(payload)))))
            parts.append(payload)
            return
        offset = sum(-(-len(b) // OOB_ALIGN) * OOB_ALIGN for b in self._oob)
        parts.append(b"".join((*head, self._oob_key, pack([offset, len(payload)]))))
        self._oob.append(payload)

    def _key(self, key: Any) -> bytes:
        if type(key) is str:
            packed = self._keys.get(key)
            if packed is None:
                packed = cast(bytes, self._packer.pack(key))  # msgpack ships no type hints
                if len(self._keys) < self._CACHE_MAX and len(key) <= 64:
                    self._keys[key] = packed
            return packed
        return cast(bytes, self._packer.pack(key))

    def _entries(self, obj: dict[Any, Any], parts: list[Any]) -> None:
        """A map's entries in order; each run of scalar-valued ones packed in one call (as a map,
        whose header is then dropped) rather than two calls per entry."""
        run: dict[Any, Any] = {}
        for key, value in obj.items():
            if type(value) in _SCALARS:
                run[key] = value
                continue
            if run:
                parts.append(_map_body(self._packer.pack(run)))
                run = {}
            parts.append(self._key(key))
            self._emit(value, parts)
        if run:
            parts.append(_map_body(self._packer.pack(run)))

    def _emit(self, obj: Any, parts: list[Any]) -> None:
        kind = type(obj)
        if kind is dict:
            if _SCALARS.issuperset(map(type, obj.values())):
                # Numbers, strings, flags (a reply's header fields, its timing): one pack call
                # for the whole map rather than two per entry.
                parts.append(self._packer.pack(obj))
                return
            parts.append(self._packer.pack_map_header(len(obj)))
            self._entries(obj, parts)
        elif kind is np.ndarray:
            if self._oob is None:
                self._array(obj, parts)
            else:
                self._oob_array(obj, parts, self._oob)
        elif kind is list or kind is tuple:
            parts.append(self._packer.pack_array_header(len(obj)))
            for value in obj:
                self._emit(value, parts)
        elif kind is Encoded:
            parts.append(obj.data)
        elif kind is EncodedArray:
            self._encoded(obj, parts)
        else:  # scalars, strings, bytes, numpy scalars (through the hook)
            parts.append(self._packer.pack(obj))

    def _join(self, parts: list[Any]) -> bytes:
        return b"".join(parts)

    def encode(self, obj: Any) -> bytes:
        """Encode ``obj`` (maps, lists, str, bytes, numbers, bool, None, numpy arrays and scalars)."""
        parts: list[Any] = []
        try:
            self._emit(obj, parts)
        except CodecError:
            self._packer.reset()
            raise
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            self._packer.reset()
            raise CodecError(CodecErrorReason.UNENCODABLE, str(exc)) from None
        return self._join(parts)

    def encode_oob(self, obj: Any) -> bytes:
        """Encode ``obj`` in the out-of-band layout (:mod:`chunkline.client.wire.format`): a
        small header, then each array's bytes 64-byte aligned, for a receiver to view in place.
        Values pre-encoded with :meth:`preencode` are embedded in the header as they are."""
        buffers: list[memoryview] = []
        self._oob = buffers
        try:
            header = self.encode(obj)
        finally:
            self._oob = None
        start = oob_data_start(len(header))
        parts: list[Any] = [OOB_MAGIC, len(header).to_bytes(4, "little"), header, bytes(start - OOB_PREFIX - len(header))]
        for buf in buffers:
            parts.append(buf)
            pad = -len(buf) % OOB_ALIGN
            if pad:
                parts.append(bytes(pad))
        return b"".join(parts)

    def preencode(self, obj: Any) -> Encoded:
        """Pack ``obj`` once, for messages that carry the same value again and again (a load
        generator re-sending one observation per robot): they embed the bytes as they are.

        Args:
            obj: anything :meth:`encode` takes.

        Raises:
            CodecError: ``unencodable``, as :meth:`encode`.
        """
        return Encoded(self.encode(obj), _PREENCODED)

    def encode_map_prefix(self, n_entries: int, entries: dict[str, Any]) -> bytes:
        """Encode the header of an ``n_entries`` map followed by ``entries``.

        The caller appends the remaining ``n_entries - len(entries)`` key/value pairs with
        :meth:`encode_map_entries`. This lets a server time the encoding of a reply and still
        put that time into the same reply.
        """
        header: bytes = self._packer.pack_map_header(n_entries)  # annotated, not cast(): no call per reply
        return header + self.encode_map_entries(entries)

    def encode_map_entries(self, entries: dict[str, Any]) -> bytes:
        """Encode ``entries`` as bare key/value pairs (see :meth:`encode_map_prefix`)."""
        parts: list[Any] = []
        try:
            self._entries(entries, parts)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            self._packer.reset()
            raise CodecError(CodecErrorReason.UNENCODABLE, str(exc)) from None
        return b"".join(parts)


_default_encoder = Encoder()


def encode(obj: Any) -> bytes:
    """Encode with a module-level encoder. Prefer an :class:`Encoder` per thread in servers."""
    return _default_encoder.encode(obj)

