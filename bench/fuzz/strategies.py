"""hypothesis strategies: structure-aware native frames and WebSocket-level scenarios."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from typing import Any

import msgpack
import numpy as np

from .oracle import embed_in_infer, sentinel_frame
from .policy import CANARY, FUZZ_MAX_MESSAGE_BYTES
from .rawws import RawFrame

__all__ = ["native_frames", "WS_KINDS", "ws_scenarios"]


# ---------------------------------------------------------------------------------- hypothesis strategies

_FIELDS = ["type", "id", "obs", "obs_time", "deadline_ms", "model", "prefix", "state", "image", "prompt"]
_GOOD_DTYPES = ["<f4", ">f4", "<f8", ">f8", "<f2", "|u1", "|i1", "<i2", "<i4", "<i8", "<u8", "|b1", "=f4", "f4", "|f4"]
_BAD_DTYPES = ["|O", "O", "<c8", "<c16", "<U4", "|S3", "|V8", "<M8[s]", "<m8", "", "<f16", "float32", "<f3", "f", "<f4,<f4"]


def _itemsize(dtype: object) -> int:
    """The bytes per element ``dtype`` names, 4 when it names none. numpy reads a comma dtype's
    repeat count with ``ast.literal_eval``, so text such as ``"(,)f4"`` raises ``SyntaxError``."""
    try:
        return np.dtype(dtype).itemsize if isinstance(dtype, str) and dtype else 4
    except (TypeError, ValueError, SyntaxError):
        return 4


def _declared_count(shape: object) -> int:
    """The elements a shape of ints declares (0 for anything else)."""
    if isinstance(shape, list) and all(type(d) is int for d in shape):
        return math.prod(shape)
    return 0


def native_frames() -> Any:
    """A hypothesis strategy of native-mode frames (bytes), structure-aware.

    Mixes valid messages, messages with one field wrong, array maps that lie about dtype, shape
    or length, arbitrary msgpack trees, ext types, huge claimed sizes, deep nesting, truncated,
    concatenated and bit-flipped frames, and frames over the size limit.
    """
    from hypothesis import strategies as st

    pk = lambda o: msgpack.packb(o, use_bin_type=True)  # noqa: E731
    ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]))
    scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=12),
                        st.binary(max_size=24))
    # Mostly string keys (anything else is refused at once, so it says little about what follows).
    keys = st.one_of(st.text(max_size=8), st.sampled_from(_FIELDS), st.text(max_size=8), st.sampled_from(_FIELDS),
                     st.binary(max_size=6), st.integers(-3, 3))

    @st.composite
    def array_map(draw: Any) -> Any:
        dtype = draw(st.one_of(st.sampled_from(_GOOD_DTYPES), st.sampled_from(_BAD_DTYPES), st.text(max_size=5),
                               st.binary(max_size=4), ints, st.none()))
        shape = draw(st.one_of(st.lists(st.integers(0, 6), max_size=4), st.lists(ints, max_size=10),
                               st.just([14]), st.just([8, 8, 3]), st.just([2**31, 2**31]), st.just([1] * 12),
                               st.lists(st.floats(), max_size=2), scalars))
        honest = max(0, _declared_count(shape)) * _itemsize(dtype)
        size = draw(st.one_of(st.just(honest), st.just(honest + 1), st.just(max(0, honest - 1)), st.integers(0, 64)))
        data = draw(st.one_of(st.just(bytes(min(size, 4096))), st.binary(min_size=min(size, 64), max_size=min(size, 64)),
                              scalars)) if size <= 4096 else b""
        layout = draw(st.sampled_from(["openpi", "mn", "generic", "mn-scalar"]))
        if layout == "openpi":
            return {b"__ndarray__": draw(st.one_of(st.just(True), scalars)), b"data": data, b"dtype": dtype, b"shape": shape}
        if layout == "mn":
            kind = draw(st.sampled_from([b"", "", b"V", b"O", None]))
            return {b"nd": True, b"type": dtype, b"kind": kind, b"shape": shape, b"data": data}
        if layout == "generic":
            return {b"__npgeneric__": True, b"data": draw(scalars), b"dtype": dtype}
        return {b"nd": False, b"type": dtype, b"data": data}

    trees = st.recursive(st.one_of(scalars, array_map()),
                         lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(keys, kids, max_size=4)),
                         max_leaves=12)

    @st.composite
    def observation(draw: Any) -> Any:
        state_dtype = draw(st.sampled_from(["<f4", "<f8", "<i4", ">f4", "|u1", "<f2"]))
        state = np.arange(14).astype(state_dtype)
        obs: dict[Any, Any] = {"state": {b"__ndarray__": True, b"data": state.tobytes(), b"dtype": state_dtype, b"shape": [14]}}
        if draw(st.booleans()):
            obs["image"] = {b"__ndarray__": True, b"data": bytes(192), b"dtype": "|u1", b"shape": [8, 8, 3]}
        if draw(st.booleans()):
            obs["prompt"] = draw(st.one_of(st.just(CANARY), st.just(CANARY * 10), st.text(max_size=70)))
        if draw(st.booleans()):  # openpi-style nesting
            obs = {"robot": {"state": obs.pop("state")}, **obs}
        if draw(st.integers(0, 2)) == 0:  # break one field, or add strangers
            for _ in range(draw(st.integers(1, 2))):
                key = draw(st.one_of(st.sampled_from(["state", "image", "prompt", "extra", "robot"]), keys))
                obs[key] = draw(st.one_of(trees, array_map(), st.just(CANARY)))
        return obs

    valid_ids = st.one_of(st.integers(0, 2**63 - 1), st.text(min_size=1, max_size=64))
    ids = st.one_of(ints, st.text(max_size=70), st.booleans(), st.floats(), st.none(), st.lists(ints, max_size=2))
    fields = {  # (a valid value, anything)
        "obs_time": (st.floats(allow_nan=False, allow_infinity=False), st.one_of(st.floats(), ints, st.text(max_size=4))),
        "deadline_ms": (st.sampled_from([1e-9, 0.001, 1.0, 5000.0, 3_600_000.0]),
                        st.one_of(st.floats(), st.sampled_from([0.0, -1.0, 3_600_001.0]), ints)),
        "model": (st.just("fuzz"), st.one_of(st.text(max_size=130), scalars)),
        "prefix": (st.builds(lambda n: {b"__ndarray__": True, b"data": bytes(n * 56), b"dtype": "<f4", b"shape": [n, 14]},
                             st.integers(0, 4)), st.one_of(array_map(), scalars)),
    }

    @st.composite
    def message(draw: Any) -> dict[Any, Any]:
        kind = draw(st.sampled_from(["infer", "infer", "infer", "infer", "cancel", "generate", "other"]))
        msg: dict[Any, Any] = {"type": kind if kind != "other" else draw(st.one_of(st.text(max_size=8), scalars))}
        msg["id"] = draw(valid_ids) if draw(st.integers(0, 3)) else draw(ids)
        if kind == "generate":
            for name, value in draw(st.fixed_dictionaries({}, optional={
                    "prompt": st.one_of(st.text(max_size=40), st.just(CANARY), scalars),
                    "messages": st.one_of(st.just([{"role": "user", "content": "hi"}]), trees),
                    "max_tokens": st.one_of(st.integers(1, 8), ints), "temperature": st.one_of(st.floats(0, 2), scalars),
                    "top_p": st.floats(), "seed": ints, "stop": st.one_of(st.lists(st.text(max_size=4), max_size=5), scalars),
                    "ignore_eos": st.booleans(), "deadline_ms": fields["deadline_ms"][1], "model": fields["model"][1]})).items():
                msg[name] = value
        elif kind != "cancel":
            msg["obs"] = draw(observation())
            for name, (good, anything) in fields.items():
                if draw(st.integers(0, 2)) == 0:
                    msg[name] = draw(good) if draw(st.integers(0, 3)) else draw(anything)
        if draw(st.integers(0, 5)) == 0:  # a wrong type in any field, or a missing or unknown one
            victim = draw(st.sampled_from([*msg.keys(), "extra"]))
            if draw(st.booleans()) and victim in msg:
                del msg[victim]
            else:
                msg[victim] = draw(trees)
        return msg

    def packs(obj: Any) -> bytes:
        try:
            return pk(obj)
        except (TypeError, ValueError, OverflowError):  # a tree msgpack itself cannot write
            return pk({"type": "infer", "id": 0, "obs": {}})

    claimed = st.sampled_from([b"\xc6\xff\xff\xff\xff", b"\xc5\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                               b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff", b"\xde\xff\xff"])

    @st.composite
    def frames(draw: Any) -> bytes:
        kind = draw(st.sampled_from(["message"] * 10 + ["tree", "truncated", "concat", "flip",
                                     "random", "deep", "claimed", "ext", "oversize"]))
        if kind == "message":
            return packs(draw(message()))
        if kind == "tree":
            return packs(draw(trees))
        if kind == "truncated":
            full = packs(draw(message()))
            return full[: draw(st.integers(0, max(0, len(full) - 1)))]
        if kind == "concat":
            return packs(draw(message())) + packs(draw(message()))
        if kind == "flip":
            flipped = bytearray(packs(draw(message())))
            for _ in range(draw(st.integers(1, 4))):
                i = draw(st.integers(0, len(flipped) - 1))
                flipped[i] ^= 1 << draw(st.integers(0, 7))
            return bytes(flipped)
        if kind == "random":
            return draw(st.binary(max_size=256))
        if kind == "deep":
            n = draw(st.integers(10, 20_000))
            return draw(st.sampled_from([b"\x91", b"\x81\xa1k", b"\x81\xa3obs"])) * n + b"\xc0"
        if kind == "claimed":
            tail = draw(claimed) + draw(st.binary(max_size=16))
            where = draw(st.sampled_from(["obs", "field", "top"]))
            if where == "obs":
                return embed_in_infer(tail, draw(st.integers(0, 100)))
            if where == "field":
                return embed_in_infer(b"\x81" + pk(draw(st.sampled_from(["state", "prompt", "image"]))) + tail)
            return tail
        if kind == "ext":
            value = draw(st.one_of(st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16)),
                                   st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1), st.integers(0, 999_999_999))))
            return packs({"type": "infer", "id": 1, "obs": {"state": value}})
        size = FUZZ_MAX_MESSAGE_BYTES + draw(st.integers(1, 4096))
        return b"\x00" * size

    return frames()


WS_KINDS = ("fragmented", "fragmented+ping", "concatenated", "ping", "text", "bad-utf8-text", "fragmented-text",
            "reserved-opcode", "rsv-bits", "unmasked", "orphan-continuation", "interleaved-data", "long-control",
            "fragmented-control", "oversize-header", "oversize-fragments", "close")


def ws_scenarios(kinds: Iterable[str] = WS_KINDS) -> Any:
    """A hypothesis strategy of WebSocket-level scenarios: ``(name, frames, expectation)``.

    ``expectation`` is ``("answer", n)`` (``n`` binary answers, the session stays open),
    ``("close", codes)`` or ``("pong", payload)``.

    Args:
        kinds: which scenarios to draw from (default: all of :data:`WS_KINDS`).
    """
    from hypothesis import strategies as st

    chosen = [k for k in WS_KINDS if k in set(kinds)]

    def valid(i: int) -> bytes:
        return sentinel_frame(f"ws-{i}")

    @st.composite
    def scenario(draw: Any) -> tuple[str, list[RawFrame | bytes], tuple[str, Any]]:
        kind = draw(st.sampled_from(chosen))
        i = draw(st.integers(0, 10**6))
        body = valid(i)
        if kind.startswith("fragmented") and kind != "fragmented-text" and kind != "fragmented-control":
            cuts = sorted(set(draw(st.lists(st.integers(1, len(body) - 1), min_size=1, max_size=6))))
            parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=False)]
            frames: list[RawFrame | bytes] = []
            for j, part in enumerate(parts):
                frames.append(RawFrame(2 if j == 0 else 0, part, fin=j == len(parts) - 1))
                if kind == "fragmented+ping" and j < len(parts) - 1:
                    frames.append(RawFrame(9, draw(st.binary(max_size=125))))
            return kind, frames, ("answer", 1)
        if kind == "concatenated":
            n = draw(st.integers(2, 5))
            return kind, [RawFrame(2, valid(i + j)) for j in range(n)], ("answer", n)
        if kind == "ping":
            payload = draw(st.binary(max_size=125))
            return kind, [RawFrame(9, payload)], ("pong", payload)
        if kind == "text":
            return kind, [RawFrame(1, draw(st.text(max_size=200)).encode())], ("close", {1003})
        if kind == "bad-utf8-text":
            bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
            return kind, [RawFrame(1, b"ok" + bad)], ("close", {1007})
        if kind == "fragmented-text":
            return kind, [RawFrame(1, b"he", fin=False), RawFrame(0, b"llo")], ("close", {1003})
        if kind == "reserved-opcode":
            return kind, [RawFrame(draw(st.sampled_from([3, 4, 5, 6, 7, 11, 12, 13, 14, 15])), b"x")], ("close", {1002})
        if kind == "rsv-bits":
            return kind, [RawFrame(2, body, rsv=draw(st.integers(1, 7)))], ("close", {1002})
        if kind == "unmasked":
            return kind, [RawFrame(2, body, masked=False)], ("close", {1002})
        if kind == "orphan-continuation":
            return kind, [RawFrame(0, body)], ("close", {1002})
        if kind == "interleaved-data":
            return kind, [RawFrame(2, body[:5], fin=False), RawFrame(2, body)], ("close", {1002})
        if kind == "long-control":
            return kind, [RawFrame(9, bytes(draw(st.integers(126, 300))))], ("close", {1002})
        if kind == "fragmented-control":
            return kind, [RawFrame(9, b"p", fin=False)], ("close", {1002})
        if kind == "oversize-header":
            n = FUZZ_MAX_MESSAGE_BYTES + draw(st.integers(1, 2**40))
            return kind, [RawFrame(2, b"\x00" * 16, claimed_length=n)], ("close", {1009})
        if kind == "oversize-fragments":
            chunk = FUZZ_MAX_MESSAGE_BYTES // 4 + 1
            fragments: list[RawFrame | bytes] = [RawFrame(2, bytes(chunk), fin=False)]
            fragments += [RawFrame(0, bytes(chunk), fin=False)] * 4
            return kind, fragments, ("close", {1009})
        code = draw(st.sampled_from([1000, 1001, 4000]))
        close: list[RawFrame | bytes] = [RawFrame(8, struct.pack("!H", code))]
        return kind, close, ("close", {code, 1000})

    return scenario()
