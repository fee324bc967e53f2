"""Every refusal of a request carries its id when one could be read (issue #34 item 9), on a live
server: planner input edges and refused compressed image fields are answered ``invalid_message``
with the request's id, so that a client can match the refusal to its request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from wire_helpers import native_session

from chunkline.bench.serverproc import ServerProcess
from chunkline.client.wire.codec import encode
from chunkline.client.wire.protocol import MAX_INSTRUCTION_LENGTH

ND = b"__ndarray__"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(["--no-auth", "--policy", "noop", "--planner", "tour"]) as proc:
        yield proc


def _plan(request_id: Any, **fields: Any) -> bytes:
    obs = {"position": np.zeros(2, np.float32), "targets": np.array([[1, 0.1, 0.0]], np.float32)}
    return encode({"type": "plan", "id": request_id, "obs": obs, **fields})


def _nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"leaf": 1}
    for _ in range(depth - 1):
        node = {"deeper": node}
    return node


def _image(**fields: Any) -> dict[bytes, Any]:
    """A compressed camera field as the wire carries it (the decoder checks it before any pixel)."""
    return {ND: True, b"dtype": "|u1", b"shape": [224, 224, 3], b"enc": "jpeg", b"data": b"\xff\xd8",
            **{key.encode(): value for key, value in fields.items()}}


def _infer(request_id: Any, image: dict[bytes, Any]) -> bytes:
    return encode({"type": "infer", "id": request_id, "obs": {"camera": image}, "obs_time": 0.0})


CASES = {
    "instruction over the limit": _plan("p-long", instruction="x" * (MAX_INSTRUCTION_LENGTH + 1)),
    "a 1 MiB instruction": _plan(7, instruction="y" * (1 << 20) + "z"),
    "context nested 20 deep": _plan("p-deep", context=_nested(20)),
    "payload over raw + 4 KiB": _infer("i-big", _image(data=b"\xff" * (224 * 224 * 3 + 8192))),
    "unknown encoding": _infer(11, _image(enc="webp")),
    "shape over the element limit": _infer("i-shape", _image(shape=[100_000, 100_000, 3])),
}
IDS = {"instruction over the limit": "p-long", "a 1 MiB instruction": 7, "context nested 20 deep": "p-deep",
       "payload over raw + 4 KiB": "i-big", "unknown encoding": 11, "shape over the element limit": "i-shape"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_request_is_answered_with_its_id(server: ServerProcess, case: str) -> None:
    (reply,) = asyncio.run(native_session(server, [CASES[case]], 1))
    assert reply["type"] == "error" and reply["code"] == "invalid_message"
    assert reply["id"] == IDS[case]


def test_an_unreadable_id_is_still_refused_without_one(server: ServerProcess) -> None:
    # An id the protocol would not accept is never echoed: the error must itself be valid.
    frame = encode({"type": "plan", "id": [1, 2], "obs": {}, "context": _nested(20)})
    (reply,) = asyncio.run(native_session(server, [frame], 1))
    assert reply["type"] == "error" and reply["code"] == "invalid_message" and reply.get("id") is None
