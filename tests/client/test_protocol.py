"""Message validation (client and server side) and the client's backoff."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.client.backoff import Backoff
from chunkline.client.exceptions import ServerError
from chunkline.client.wire.errors import ErrorCode, ProtocolError
from chunkline.client.wire.protocol import Cancel, Chunk, Error, Infer, error_message, parse_client_message, parse_server_message


def test_valid_infer_and_cancel() -> None:
    msg = parse_client_message({"type": "infer", "id": 7, "obs": {"a": np.zeros(2)}, "obs_time": 1.5, "deadline_ms": 50})
    assert isinstance(msg, Infer) and msg.id == 7 and msg.deadline_ms == 50.0
    assert isinstance(parse_client_message({"type": "cancel", "id": "r-1"}), Cancel)


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "infer", "id": True, "obs": {}},  # bool is not an id
        {"type": "infer", "id": -1, "obs": {}},
        {"type": "infer", "id": "", "obs": {}},
        {"type": "infer", "id": "x" * 65, "obs": {}},
        {"type": "infer", "id": 1.5, "obs": {}},
        {"type": "infer", "id": 1, "obs": []},
        {"type": "infer", "id": 1, "obs": {}, "obs_time": float("nan")},
        {"type": "infer", "id": 1, "obs": {}, "obs_time": float("inf")},
        {"type": "infer", "id": 1, "obs": {}, "deadline_ms": 0},
        {"type": "infer", "id": 1, "obs": {}, "deadline_ms": -5},
        {"type": "infer", "id": 1, "obs": {}, "deadline": 5},  # typo: unknown fields are refused
        {"type": "infer", "obs": {}},
        {"type": "fly", "id": 1},
        {"id": 1},
        [1, 2],
        "infer",
    ],
)
def test_invalid_client_messages_are_refused(bad: object) -> None:
    with pytest.raises(ProtocolError):
        parse_client_message(bad)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "id", "obs", "obs_time", "deadline_ms", "model", "prefix", "zzz"]),
                       st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.just({}),
                       max_size=8))
def test_arbitrary_maps_either_parse_or_raise_protocol_error(obj: dict) -> None:
    try:
        parse_client_message(obj)
    except ProtocolError:
        pass


@pytest.mark.parametrize(
    "field, value",
    [
        ("deadline_ms", "100"),  # a number in a string
        ("deadline_ms", True),  # a bool is not a number
        ("obs_time", "1.5"),
        ("obs_time", False),
    ],
)
def test_numbers_in_an_infer_are_numbers(field: str, value: object) -> None:
    with pytest.raises(ProtocolError, match=field):
        parse_client_message({"type": "infer", "id": 1, "obs": {}, field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("deadline_ms", "100"),
        ("max_tokens", "5"),
        ("max_tokens", 5.0),  # an integer field takes integers only
        ("max_tokens", True),
        ("temperature", "0.5"),
        ("top_p", True),
        ("seed", True),
        ("ignore_eos", 1),  # a bool field takes bools only
        ("ignore_eos", "true"),
    ],
)
def test_numbers_and_flags_in_a_generate_have_their_own_types(field: str, value: object) -> None:
    with pytest.raises(ProtocolError, match=field):
        parse_client_message({"type": "generate", "id": 1, "prompt": "hi", field: value})


def test_ints_are_numbers_and_chat_turns_still_parse() -> None:
    msg = parse_client_message({"type": "generate", "id": 1, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                                "max_tokens": 3, "deadline_ms": 250, "ignore_eos": True})
    assert msg.temperature == 0.0 and msg.deadline_ms == 250.0 and msg.max_tokens == 3


def test_server_messages_parse() -> None:
    chunk = parse_server_message({"type": "chunk", "id": 1, "actions": np.zeros((50, 14), np.float32), "t0": 1.0,
                                  "dt": 0.02, "expires": 2.0, "model": "m", "fingerprint": "f", "timing": {"infer_ms": 1.0}})
    assert isinstance(chunk, Chunk) and not chunk.late
    err = parse_server_message(error_message(ErrorCode.OVERLOADED, "full", 3, retry_after_ms=20))
    assert isinstance(err, Error) and err.retry_after_ms == 20.0 and err.id == 3


def test_server_error_keeps_unknown_codes() -> None:
    assert ServerError("overloaded", "x").code is ErrorCode.OVERLOADED
    assert ServerError("from_the_future", "x").code == "from_the_future"


def test_backoff_grows_caps_and_jitters() -> None:
    b = Backoff(initial=0.1, maximum=1.0, factor=2.0, jitter=0.5, rng=random.Random(1))
    delays = [b.next_delay() for _ in range(10)]
    caps = [min(1.0, 0.1 * 2**i) for i in range(10)]
    assert all(cap * 0.5 <= d <= cap for d, cap in zip(delays, caps, strict=False))
    assert len(set(delays)) == len(delays)  # jittered
    b.reset()
    assert b.next_delay() <= 0.1


def test_backoff_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Backoff(initial=2.0, maximum=1.0)
