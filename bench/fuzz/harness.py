"""The coverage-guided fuzzer (atheris, libFuzzer) of the codec and parser, in-process, and its corpus."""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from chunkline.client.wire.codec import CodecLimits, Encoder
from chunkline.client.wire.encodings import COMPRESSED, EncodedArray, encode_array, payload_limit
from chunkline.client.wire.errors import CodecError, ProtocolError

from .errors import FuzzFailure
from .oracle import embed_in_infer
from .policy import FUZZ_SPEC, make_fuzz_spec

__all__ = [
    "check_decoded",
    "check_encoded",
    "fuzz_image_input",
    "same_tree",
    "fuzz_one_input",
    "seed_corpus",
    "write_seed_corpus",
    "replay_corpus",
    "run_atheris",
]


# ---------------------------------------------------------------------------------- in-process invariants


_OK_SCALARS = (str, bytes, int, float, bool, type(None))


def check_encoded(field: Any, limits: CodecLimits) -> None:
    """Check a compressed field the codec handed over, then decode it: the image decoders may
    refuse only with :class:`CodecError`, and what they return has exactly the declared dtype and
    shape. (The encodings module is looked up at call time: under atheris, the instrumented one.)

    Raises:
        FuzzFailure: a broken rule, or any other exception from the decoders.
    """
    encodings = sys.modules["chunkline.client.wire.encodings"]
    if field.encoding not in COMPRESSED or not 0 < len(field.payload) <= payload_limit(field.raw_nbytes):
        raise FuzzFailure(f"the codec handed over {field!r}")
    if len(field.shape) > limits.max_dims or field.raw_nbytes // field.dtype.itemsize > limits.max_elements:
        raise FuzzFailure(f"a compressed field of shape {field.shape} beyond the caps")
    try:
        image = encodings.decode_array(field)
    except CodecError:
        return
    except Exception as exc:
        raise FuzzFailure(f"an image decoder raised {type(exc).__name__}: {exc}") from None
    if not isinstance(image, np.ndarray) or image.shape != field.shape or image.dtype != field.dtype:
        raise FuzzFailure(f"{field!r} decoded to {getattr(image, 'dtype', '?')}{getattr(image, 'shape', '?')}")


#: declared (encoding, dtype, shape) of :func:`fuzz_image_input`, picked by the input's first byte
_IMAGE_TARGETS = (("jpeg", "|u1", (8, 8, 3)), ("jpeg", "|u1", (16, 8, 1)), ("jpeg", "|u1", (32, 32, 3)),
                  ("png", "|u1", (8, 8, 3)), ("png", "|u1", (8, 8)), ("png", "<u2", (16, 8)), ("png", "|u1", (8, 8, 1)))


def fuzz_image_input(data: bytes) -> None:
    """One input for the image decoders alone: the first byte picks a declared encoding, dtype and
    shape, the rest is the payload.

    Raises:
        FuzzFailure: as :func:`check_encoded`.
    """
    if not data:
        return
    encoding, dtype, shape = _IMAGE_TARGETS[data[0] % len(_IMAGE_TARGETS)]
    field = EncodedArray(encoding, np.dtype(dtype), shape, memoryview(data[1:]))
    if not 0 < len(field.payload) <= payload_limit(field.raw_nbytes):
        return
    check_encoded(field, _FUZZ_LIMITS)


def check_decoded(obj: Any, limits: CodecLimits, depth: int = 0) -> int:
    """Check what :func:`decode` returned obeys its own rules; returns the arrays counted.
    Compressed fields are decoded too (:func:`check_encoded`).

    Raises:
        FuzzFailure: a decoded tree breaks a rule (a writable array, a refused dtype, ...).
    """
    if type(obj).__name__ == "EncodedArray":  # the class of whichever encodings module decoded it
        check_encoded(obj, limits)
        return 1
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf" or obj.flags.writeable:
            raise FuzzFailure(f"decoded array of dtype {obj.dtype}, writeable={obj.flags.writeable}")
        if obj.ndim > limits.max_dims or obj.size > limits.max_elements:
            raise FuzzFailure(f"decoded array of shape {obj.shape} beyond the caps")
        return 1
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in "biuf":
            raise FuzzFailure(f"decoded scalar of dtype {obj.dtype}")
        return 1
    if isinstance(obj, (dict, list)):
        if depth >= limits.max_depth:
            raise FuzzFailure("decoded tree deeper than max_depth")
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        n = 0
        for k, v in items:
            if isinstance(obj, dict) and not isinstance(k, str):
                raise FuzzFailure(f"decoded map key of type {type(k).__name__}")
            n += check_decoded(v, limits, depth + 1)
        return n
    if not isinstance(obj, _OK_SCALARS):
        raise FuzzFailure(f"decoded value of type {type(obj).__name__}")
    return 0


def same_tree(a: Any, b: Any) -> bool:
    """Structural equality where NaN equals NaN and arrays compare by dtype, shape and bytes."""
    if type(a).__name__ == "EncodedArray" or type(b).__name__ == "EncodedArray":
        return (type(a) is type(b) and a.encoding == b.encoding and a.dtype == b.dtype and a.shape == b.shape
                and bytes(a.payload) == bytes(b.payload))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, np.float64) or isinstance(b, np.float64):
        # np.float64 is a Python float: msgpack writes it as a plain float (as openpi's codec
        # does), so it comes back as one. Same value, same precision.
        return isinstance(a, float) and isinstance(b, float) and (a == b or (a != a and b != b))
    if isinstance(a, np.generic) or isinstance(b, np.generic):
        return (isinstance(a, np.generic) and isinstance(b, np.generic) and a.dtype == b.dtype
                and (a == b or (a != a and b != b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


_FUZZ_LIMITS = CodecLimits()


def fuzz_one_input(data: bytes, modules: Mapping[str, Any] | None = None) -> None:
    """One input of the coverage-guided fuzzer: decode, check, re-encode, parse, validate.

    Anything the codec or parser refuses must be refused with their own error
    (:class:`CodecError`, :class:`ProtocolError`, :class:`ObservationError`); anything else
    raised, or a decoded tree that breaks the codec's rules or does not survive a round trip,
    is a bug.

    Args:
        data: the input bytes.
        modules: the (instrumented) ``codec``, ``protocol`` and ``base`` modules to use, and the
            ``spec`` built from that ``base`` (default: the ones imported here).

    Raises:
        FuzzFailure: a broken invariant.
    """
    codec = modules["codec"] if modules else sys.modules["chunkline.client.wire.codec"]
    protocol = modules["protocol"] if modules else sys.modules["chunkline.client.wire.protocol"]
    base = modules["base"] if modules else sys.modules["chunkline.policies.base"]
    try:
        obj = codec.decode(data, _FUZZ_LIMITS)
    except CodecError:
        return
    check_decoded(obj, _FUZZ_LIMITS)
    try:
        again = codec.decode(codec.Encoder().encode(obj), _FUZZ_LIMITS)
    except CodecError as exc:
        raise FuzzFailure(f"a decoded message does not survive re-encoding: {exc}", data) from None
    if not same_tree(obj, again):
        raise FuzzFailure("decode(encode(decode(x))) differs from decode(x)", data)
    try:
        msg = protocol.parse_client_message(obj)
    except ProtocolError:
        return
    if isinstance(msg, protocol.Infer):
        try:
            base.validate_observation(modules.get("spec", FUZZ_SPEC) if modules else FUZZ_SPEC, base.flatten_observation(msg.obs))
        except base.ObservationError:
            pass


def seed_corpus() -> dict[str, bytes]:
    """Hand-made seeds: valid messages in both array layouts, each refusal the codec knows, and
    the shapes attackers use (claimed sizes, deep nesting, ext types). Named by content."""
    enc = Encoder()
    state = np.arange(14, dtype=np.float32)
    image = np.zeros((8, 8, 3), np.uint8)
    nd = lambda dtype, shape, data: {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}  # noqa: E731
    mn = {b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [14], b"data": state.tobytes()}
    pk = lambda o: msgpack.packb(o, use_bin_type=True)  # noqa: E731
    seeds = {
        "infer-minimal": enc.encode({"type": "infer", "id": 1, "obs": {"state": state}}),
        "infer-full": enc.encode({"type": "infer", "id": "r-1", "obs": {"state": state, "image": image, "prompt": "pick"},
                                  "obs_time": 12.5, "deadline_ms": 100.0, "model": "fuzz",
                                  "prefix": np.zeros((3, 14), np.float32)}),
        "infer-nested": enc.encode({"type": "infer", "id": 2, "obs": {"robot": {"state": state}, "images": {"cam": image}}}),
        "infer-msgpack-numpy": pk({"type": "infer", "id": 3, "obs": {"state": mn}}),
        "infer-npgeneric": pk({"type": "infer", "id": 4, "obs": {"state": nd("<f8", [14], state.astype("<f8").tobytes()),
                                                                   "s": {b"__npgeneric__": True, b"data": 1.5, b"dtype": "<f4"},
                                                                   "m": {b"nd": False, b"type": "<i4", b"data": b"\x01\0\0\0"}}}),
        "cancel": pk({"type": "cancel", "id": 1}),
        "big-endian": pk({"type": "infer", "id": 5, "obs": {"state": nd(">f4", [14], state.astype(">f4").tobytes())}}),
        "object-dtype": pk({"type": "infer", "id": 6, "obs": {"state": nd("|O", [1], b"\0" * 8)}}),
        "length-lie": pk({"type": "infer", "id": 7, "obs": {"state": nd("<f4", [14], b"\0" * 55)}}),
        "huge-shape": pk({"type": "infer", "id": 8, "obs": {"state": nd("<f4", [2**31, 2**31], b"")}}),
        "negative-shape": pk({"type": "infer", "id": 9, "obs": {"state": nd("<f4", [-1], b"")}}),
        "too-many-dims": pk({"type": "infer", "id": 10, "obs": {"state": nd("|u1", [1] * 9, b"\0")}}),
        "structured-mn": pk({"type": "infer", "id": 11, "obs": {"state": {b"nd": True, b"type": "<f4", b"kind": b"V", b"shape": [1],
                                                                        b"data": b"\0" * 4}}}),
        "ext-type": pk({"type": "infer", "id": 12, "obs": {"x": msgpack.ExtType(5, b"abc")}}),
        "timestamp": pk({"type": "infer", "id": 13, "obs": {"x": msgpack.Timestamp(1, 2)}}),
        "int-key": pk({"type": "infer", "id": 14, "obs": {1: state.tobytes()}}),
        "unknown-field": pk({"type": "infer", "id": 15, "obs": {}, "priority": 9}),
        "unknown-type": pk({"type": "launch", "id": 16}),
        "claimed-bin32": embed_in_infer(b"\xc6\xff\xff\xff\xff" + b"x" * 8),
        "claimed-map32": embed_in_infer(b"\xdf\xff\xff\xff\xff"),
        "claimed-array32": embed_in_infer(b"\x81" + pk("state") + b"\xdd\x7f\xff\xff\xff\xc0"),
        "claimed-str32": embed_in_infer(b"\x81" + pk("prompt") + b"\xdb\xff\xff\xff\xf0ab"),
        "deep-list": b"\x91" * 5000 + b"\xc0",
        "deep-map": b"\x81\xa1k" * 40 + b"\xc0",
        "trailing-bytes": enc.encode({"type": "cancel", "id": 1}) + b"\xc0",
        "truncated": enc.encode({"type": "infer", "id": 1, "obs": {"state": state}})[:40],
        "empty": b"",
        "nan-state": enc.encode({"type": "infer", "id": 17, "obs": {"state": np.full(14, np.nan, np.float32)}}),
        "bad-utf8": b"\x81\xa4type\xa2\xff\xfe",
        **_image_seeds(enc, state),
        "pickle": b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.",
    }
    return seeds


def _image_seeds(enc: Encoder, state: np.ndarray) -> dict[str, bytes]:
    """Messages carrying compressed fields: valid ones in both layouts, and the refusals."""
    import io

    from PIL import Image

    y, x = np.mgrid[0:8, 0:8]
    rgb = np.stack([x * 32, y * 32, (x + y) * 16], -1).astype(np.uint8)
    jpeg = encode_array(rgb, "jpeg", 75)
    depth = encode_array((x * 500 + y).astype(np.uint16), "png")
    progressive = io.BytesIO()
    Image.fromarray(rgb).save(progressive, format="JPEG", progressive=True)
    large = encode_array(np.zeros((64, 64, 3), np.uint8), "jpeg", 10)  # declared 8x8 below: the header says 64x64
    infer = lambda obs: {"type": "infer", "id": 20, "obs": {"state": state, **obs}}  # noqa: E731
    field = lambda payload, encoding="jpeg", shape=(8, 8, 3), dtype="|u1": EncodedArray(  # noqa: E731
        encoding, np.dtype(dtype), shape, payload)
    return {
        "jpeg-field": enc.encode(infer({"image": jpeg})),
        "jpeg-field-oob": enc.encode_oob(infer({"image": jpeg, "depth": depth})),
        "png-depth-field": enc.encode(infer({"depth": depth})),
        "jpeg-progressive": enc.encode(infer({"image": field(progressive.getvalue())})),
        "jpeg-bigger-than-declared": enc.encode(infer({"image": field(large.payload)})),
        "jpeg-truncated": enc.encode(infer({"image": field(bytes(jpeg.payload)[:100])})),
        "png-declared-u8-is-u16": enc.encode(infer({"image": field(depth.payload, "png", (8, 8), "|u1")})),
        "unknown-encoding": enc.encode(infer({"image": field(jpeg.payload, "webp")})),
    }


def write_seed_corpus(folder: Path) -> int:
    """Write :func:`seed_corpus` into ``folder`` (file names are content digests, as libFuzzer's)."""
    folder.mkdir(parents=True, exist_ok=True)
    for data in seed_corpus().values():
        (folder / hashlib.sha1(data).hexdigest()).write_bytes(data)
    return len(seed_corpus())


def replay_corpus(folder: Path, target: Callable[[bytes], None] = fuzz_one_input) -> int:
    """Run ``target`` on every file in ``folder`` (sorted); returns how many."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    for path in files:
        try:
            target(path.read_bytes())
        except FuzzFailure as exc:
            raise FuzzFailure(f"{path.name}: {exc}") from None
    return len(files)


# ---------------------------------------------------------------------------------- atheris


def run_atheris(corpus: list[Path], libfuzzer_args: list[str]) -> None:
    """Coverage-guided fuzzing of the codec and parser (never returns: libFuzzer exits).

    The codec, protocol and policy-base modules are re-imported under atheris' instrumentation
    so that coverage of exactly that code guides the search; numpy, msgpack (C) and pydantic
    (Rust) are not instrumented.

    Args:
        corpus: corpus folders; new interesting inputs go to the first.
        libfuzzer_args: e.g. ``["-runs=10000"]`` or ``["-max_total_time=600"]``.
    """
    import importlib

    import atheris

    names = ("chunkline.client.wire.codec", "chunkline.client.wire.protocol", "chunkline.policies.base")
    # The codec module re-exports its parts; they are instrumented (and re-imported) with it.
    parts = (
        "chunkline.client.wire.encodings", "chunkline.client.wire.format", "chunkline.client.wire.decoder", "chunkline.client.wire.encoder",
    )
    for name in (*parts, *names):
        sys.modules.pop(name, None)
    with atheris.instrument_imports(include=[*parts, *names]):
        modules: dict[str, Any] = {short: importlib.import_module(name)
                                   for short, name in zip(("codec", "protocol", "base"), names, strict=False)}
    modules["spec"] = make_fuzz_spec(modules["base"])

    def target(data: bytes) -> None:
        fuzz_one_input(data, modules)

    atheris.Setup([sys.argv[0], *libfuzzer_args, *(str(c) for c in corpus)], target)
    atheris.Fuzz()
