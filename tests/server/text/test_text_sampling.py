"""Tokenizer, sampling and streamed output text: pure functions, property-tested."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.server.text.sampling import (
    OutputText,
    SamplingParams,
    new_generator,
    sample_next,
)
from chunkline.server.text.tokenizer import (
    BOS,
    END,
    EOS,
    ROLE_TOKENS,
    VOCAB_SIZE,
    ByteTokenizer,
    ChatMessage,
)

tok = ByteTokenizer()


@given(st.text(max_size=200))
@settings(max_examples=60, deadline=None)
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text.encode("utf-8", errors="replace").decode("utf-8")


def test_chat_template_and_specials() -> None:
    ids = tok.chat_prompt([ChatMessage("system", "be brief"), ChatMessage("user", "hi")])
    assert ids[0] == BOS and ids[-1] == ROLE_TOKENS["assistant"]
    assert ids.count(END) == 2
    assert tok.decode(ids) == "be briefhi"  # special tokens never reach the text
    assert tok.completion_prompt("ab") == [BOS, 97, 98]


def _stream(data: bytes, stops: list[str], split: list[int]) -> tuple[str, bool]:
    out = OutputText(stops)
    text = ""
    i = 0
    for n in split:
        if i >= len(data):
            break
        text += out.push(data[i : i + n])
        i += n
        if out.stopped:
            return text, True
    while i < len(data) and not out.stopped:
        text += out.push(data[i : i + 1])
        i += 1
    return text + out.finish(), out.stopped


def _reference(data: bytes, stops: list[str]) -> str:
    """One-shot semantics: cut at the earliest stop occurrence, decode with replacement."""
    cut = len(data)
    for s in stops:
        if s:
            j = data.find(s.encode("utf-8"))
            if 0 <= j < cut:
                cut = j
    return data[:cut].decode("utf-8", errors="replace")


alphabet = st.sampled_from([b"a", b"b", b"\n", "é".encode(), "€".encode(), b"\xff", b"\xe2", b"\x82"])


@given(
    st.lists(alphabet, max_size=40).map(b"".join),
    st.lists(st.sampled_from(["ab", "b\n", "€", "é!", "aab", "x"]), max_size=3),
    st.lists(st.integers(1, 4), max_size=40),
)
@settings(max_examples=150, deadline=None)
def test_streamed_text_equals_one_shot_text_with_stops(data: bytes, stops: list[str], split: list[int]) -> None:
    streamed, _ = _stream(data, stops, split)
    assert streamed == _reference(data, stops)


def test_stop_string_is_held_back_then_released() -> None:
    out = OutputText(["END"])
    assert out.push(b"x") == "x"
    assert out.push(b"E") == ""  # could be the start of END
    assert out.push(b"N") == ""
    assert out.push(b"d") == "ENd"  # it was not
    assert out.push(b"E") + out.push(b"N") + out.push(b"D") == ""
    assert out.stopped and out.text == "xENd"


def test_split_utf8_character_waits_for_its_last_byte() -> None:
    out = OutputText()
    euro = "€".encode()
    assert out.push(euro[:1]) == "" and out.push(euro[1:2]) == ""
    assert out.push(euro[2:]) == "€"


def _logits(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, VOCAB_SIZE)).astype(np.float32) * 3


@given(st.integers(0, 1000), st.integers(1, 6), st.floats(0.1, 2.0), st.floats(0.05, 1.0))
@settings(max_examples=40, deadline=None)
def test_each_row_samples_the_same_alone_or_batched(seed: int, n: int, temperature: float, top_p: float) -> None:
    logits = _logits(seed, n)
    params = [SamplingParams(temperature=temperature if i % 3 else 0.0, top_p=top_p if i % 2 else 1.0, seed=seed + i) for i in range(n)]
    batched_rngs = [new_generator(p.seed) for p in params]
    alone_rngs = [new_generator(p.seed) for p in params]
    for _ in range(3):  # several steps: generators advance identically
        together = sample_next(logits, params, batched_rngs)
        alone = [sample_next(logits[i : i + 1], [params[i]], [alone_rngs[i]])[0] for i in range(n)]
        assert together == alone


def test_sampling_rules() -> None:
    logits = _logits(1, 1)
    greedy = sample_next(logits, [SamplingParams(temperature=0.0)], [new_generator(0)])[0]
    masked = logits.astype(np.float64).copy()
    for special in (BOS, *ROLE_TOKENS.values()):
        masked[0, special] = -np.inf
    assert greedy == int(np.argmax(masked[0]))
    # a tiny nucleus keeps only the most likely token, whatever the draw
    assert {sample_next(logits, [SamplingParams(top_p=1e-6)], [new_generator(s)])[0] for s in range(20)} == {greedy}
    # seeded sampling is reproducible, unseeded differs between requests (with overwhelming probability)
    def draw(seed):
        return [sample_next(logits, [SamplingParams(seed=seed)], [g])[0] for g in [new_generator(seed)] for _ in range(30)]
    assert draw(7) == draw(7)
    forced = np.full((1, VOCAB_SIZE), -50.0, np.float32)
    forced[0, EOS] = 50.0
    assert sample_next(forced, [SamplingParams()], [new_generator(0)])[0] == EOS
    assert sample_next(forced, [SamplingParams(ignore_eos=True)], [new_generator(0)])[0] not in (EOS, END)


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(stop=("a",) * 5)


@given(st.lists(alphabet, max_size=40).map(b"".join))
@settings(max_examples=80, deadline=None)
def test_without_stop_strings_every_byte_goes_straight_to_the_decoder(data: bytes) -> None:
    out = OutputText()
    pieces = [out.push(data[i : i + 1]) for i in range(len(data))]
    tail = out.finish()
    assert "".join(pieces) + tail == data.decode("utf-8", errors="replace") == out.text
    assert out.stopped and out.push(b"a") == "" and out.finish() == ""
