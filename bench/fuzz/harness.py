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

from chunkline.client.codec import CodecLimits, Encoder
from chunkline.client.exceptions import CodecError, ProtocolError

from .errors import FuzzFailure
from .oracle import embed_in_infer
from .policy import FUZZ_SPEC, make_fuzz_spec

__all__ = [
    "check_decoded",
    "same_tree",
    "fuzz_one_input",
    "seed_corpus",
    "write_seed_corpus",
    "replay_corpus",
    "run_atheris",
]


# ---------------------------------------------------------------------------------- in-process invariants


_OK_SCALARS = (str, bytes, int, float, bool, type(None))


def check_decoded(obj: Any, limits: CodecLimits, depth: int = 0) -> int:
    """Check what :func:`decode` returned obeys its own rules; returns the arrays counted.

    Raises:
        FuzzFailure: a decoded tree breaks a rule (a writable array, a refused dtype, ...).
    """
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
    codec = modules["codec"] if modules else sys.modules["chunkline.client.codec"]
    protocol = modules["protocol"] if modules else sys.modules["chunkline.client.protocol"]
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
        "pickle": b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.",
    }
    return seeds


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

    names = ("chunkline.client.codec", "chunkline.client.protocol", "chunkline.policies.base")
    # The codec module re-exports its parts; they are instrumented (and re-imported) with it.
    parts = ("chunkline.client.wire_format", "chunkline.client.decoder", "chunkline.client.encoder")
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
