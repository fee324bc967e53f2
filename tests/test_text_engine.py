"""Continuous batching core: joins and leaves between steps, batch-invariant outputs, cancellation,
stopping rules, deadlines; and the worker-thread shell with the robots-first gate."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
from chunkline.server.text.engine import (
    BatchEngine,
    EngineThread,
    FinishEvent,
    FinishReason,
    TextSequence,
    TokenEvent,
)
from chunkline.server.text.model import TinyLM, TinyLMConfig
from chunkline.server.text.sampling import SamplingParams
from chunkline.server.text.tokenizer import EOS, VOCAB_SIZE, ByteTokenizer

tok = ByteTokenizer()
CFG = TinyLMConfig(d_model=64, n_layers=2, n_heads=2, d_ff=128, context=128, seed=3)


@pytest.fixture(scope="module")
def model() -> TinyLM:
    # The engine thread runs torch with one intra-op thread (TextModelConfig.threads); run these
    # checks the same way, whatever thread count earlier tests left on this thread.
    import torch

    torch.set_num_threads(1)
    return TinyLM(CFG, max_slots=4)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def seq(key: str, prompt: str, **params: object) -> TextSequence:
    p = {"max_tokens": 24, "seed": hash(key) % 1000, "temperature": 0.9, "top_p": 0.95, **params}
    return TextSequence(key, tok.completion_prompt(prompt), SamplingParams(**p))  # type: ignore[arg-type]


def drive(engine: BatchEngine, schedule: Sequence[tuple[int, TextSequence]]) -> tuple[dict[str, list[int]], dict[str, FinishEvent], list[list[object]]]:
    """Add each sequence at its step; step until idle. Returns tokens per key (from the engine's
    own record), finish events and the events of every step."""
    pending = sorted(schedule, key=lambda x: x[0])
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishEvent] = {}
    steps: list[list[object]] = []
    step = 0
    live: dict[str, TextSequence] = {}
    while pending or engine.has_work:
        while pending and pending[0][0] <= step and engine.free_slots > 0:
            s = pending.pop(0)[1]
            engine.add(s)
            live[s.key] = s
        events = engine.step()
        steps.append(events)
        for ev in events:
            if isinstance(ev, FinishEvent):
                finished[ev.key] = ev
                tokens[ev.key] = list(live[ev.key].generated) if ev.key in live else []
        step += 1
    return tokens, finished, steps


def test_concurrent_outputs_equal_outputs_alone(model: TinyLM) -> None:
    prompts = {"a": "the quick brown fox", "b": "hello", "c": "a much longer prompt about robots and text " * 2, "d": "x", "e": "zz"}
    alone = {k: drive(BatchEngine(model), [(0, seq(k, p))])[0][k] for k, p in prompts.items()}
    greedy_alone = drive(BatchEngine(model), [(0, seq("g", "greedy", temperature=0.0))])[0]["g"]
    # Five requests on four slots, joining at different steps: the batch changes every few steps.
    schedule = [(0, seq("a", prompts["a"])), (0, seq("g", "greedy", temperature=0.0)), (3, seq("b", prompts["b"])),
                (5, seq("c", prompts["c"])), (9, seq("d", prompts["d"])), (30, seq("e", prompts["e"]))]
    together, finished, _ = drive(BatchEngine(model), schedule)
    assert {k: together[k] for k in alone} == alone
    assert together["g"] == greedy_alone
    assert all(f.reason is FinishReason.LENGTH and f.completion_tokens == 24 for f in finished.values())


def test_a_joiner_gets_its_first_token_in_the_next_step(model: TinyLM) -> None:
    engine = BatchEngine(model)
    engine.add(seq("long", "running already", max_tokens=40))
    engine.step()
    engine.step()
    engine.add(seq("new", "joins mid-batch", max_tokens=5))
    events = engine.step()
    new_tokens = [e for e in events if isinstance(e, TokenEvent) and e.key == "new"]
    long_tokens = [e for e in events if isinstance(e, TokenEvent) and e.key == "long"]
    assert len(new_tokens) == 1 and new_tokens[0].tokens == 1  # prefill gave its first token
    assert len(long_tokens) == 1  # and the running sequence advanced in the same step
    # the short one leaves while the long one goes on: slots are reused without waiting for the batch
    for _ in range(4):
        events = engine.step()
    assert any(isinstance(e, FinishEvent) and e.key == "new" for e in events)
    assert engine.sequence("long") is not None and engine.free_slots == 3


def test_cancel_frees_the_slot_at_the_next_step(model: TinyLM) -> None:
    engine = BatchEngine(model)
    for i in range(4):
        engine.add(seq(f"s{i}", f"prompt {i}", max_tokens=50))
    engine.step()
    assert engine.free_slots == 0
    with pytest.raises(ValueError):
        engine.add(seq("late", "no room"))
    assert engine.cancel("s2")
    events = engine.step()
    fin = [e for e in events if isinstance(e, FinishEvent)]
    assert [(f.key, f.reason) for f in fin] == [("s2", FinishReason.CANCELLED)]
    assert fin[0].completion_tokens == 1 and fin[0].prefilled
    assert not any(isinstance(e, TokenEvent) and e.key == "s2" for e in events)
    engine.add(seq("late", "now there is room", max_tokens=3))
    assert any(isinstance(e, TokenEvent) and e.key == "late" for e in engine.step())
    assert not engine.cancel("nobody")


class ScriptedModel:
    """Logits that force a scripted token sequence per slot (prefill gives the first)."""

    def __init__(self, scripts: dict[int, list[int]], context: int = 64, max_slots: int = 2) -> None:
        self.scripts = scripts
        self.max_slots = max_slots
        self.context = context
        self.calls: list[str] = []
        self._pos: dict[int, int] = {}

    def _force(self, slot: int) -> np.ndarray:
        i = self._pos.get(slot, 0)
        self._pos[slot] = i + 1
        out = np.full(VOCAB_SIZE, -30.0, np.float32)
        script = self.scripts[slot]
        out[script[min(i, len(script) - 1)]] = 30.0
        return out

    def prefill(self, slot: int, tokens: Sequence[int]) -> np.ndarray:
        self.calls.append(f"prefill{slot}:{len(tokens)}")
        self._pos[slot] = 0
        return self._force(slot)

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        self.calls.append(f"decode{len(slots)}")
        return np.stack([self._force(s) for s in slots])


def _text_of(events: list[list[object]], key: str) -> str:
    return "".join(e.text for step in events for e in step if isinstance(e, TokenEvent) and e.key == key)


def test_stop_token_stop_string_and_length() -> None:
    scripts = {0: [ord("h"), ord("i"), EOS, ord("x")], 1: [ord(c) for c in "ab##cd"]}
    engine = BatchEngine(ScriptedModel(scripts))
    _, fin, steps = drive(engine, [(0, seq("eos", "p", temperature=0.0)), (0, seq("str", "q", temperature=0.0, stop=("##",)))])
    assert fin["eos"].reason is FinishReason.STOP and fin["eos"].completion_tokens == 3 and _text_of(steps, "eos") == "hi"
    assert fin["str"].reason is FinishReason.STOP and _text_of(steps, "str") == "ab"
    engine = BatchEngine(ScriptedModel({0: [ord("z")]}))
    _, fin, steps = drive(engine, [(0, seq("len", "p", temperature=0.0, max_tokens=5))])
    assert fin["len"].reason is FinishReason.LENGTH and _text_of(steps, "len") == "zzzzz"
    engine = BatchEngine(ScriptedModel({0: [EOS, ord("k")]}))
    _, fin, steps = drive(engine, [(0, seq("ign", "p", temperature=0.0, max_tokens=3, ignore_eos=True))])
    assert fin["ign"].reason is FinishReason.LENGTH and fin["ign"].completion_tokens == 3


def test_context_and_prompt_limits() -> None:
    engine = BatchEngine(ScriptedModel({0: [ord("a")]}, context=16))
    with pytest.raises(ValueError):
        engine.add(TextSequence("big", list(range(10)), SamplingParams(max_tokens=7)))
    with pytest.raises(ValueError):
        engine.add(TextSequence("empty", [], SamplingParams(max_tokens=1)))
    engine.add(TextSequence("fits", list(range(10)), SamplingParams(max_tokens=6, temperature=0.0)))
    _, fin, _ = drive(engine, [])
    assert fin["fits"].completion_tokens == 6


def test_waiting_past_the_deadline_is_not_run() -> None:
    clock = Clock()
    model = ScriptedModel({0: [ord("a")], 1: [ord("b")]})
    engine = BatchEngine(model, clock=clock)
    s = seq("late", "p", temperature=0.0)
    s.deadline = 1.0
    engine.add(s)
    clock.t = 2.0
    events = engine.step()
    assert [(e.key, e.reason, e.prefilled) for e in events if isinstance(e, FinishEvent)] == [("late", FinishReason.DEADLINE, False)]
    assert model.calls == []


def test_prefill_budget_spreads_a_burst_of_joins_over_steps() -> None:
    model = ScriptedModel({0: [ord("a")], 1: [ord("b")]}, max_slots=2)
    engine = BatchEngine(model, max_prefill_tokens=4)
    engine.add(TextSequence("p1", [1] * 6, SamplingParams(max_tokens=3, temperature=0.0)))
    engine.add(TextSequence("p2", [1] * 6, SamplingParams(max_tokens=3, temperature=0.0)))
    engine.step()
    assert model.calls == ["prefill0:6"]  # the budget allows one prompt this step
    engine.step()
    assert model.calls == ["prefill0:6", "prefill1:6", "decode1"]


class CountingModel(ScriptedModel):
    def __init__(self) -> None:
        super().__init__({0: [ord("a")], 1: [ord("b")]}, context=4096)
        self.stepped = threading.Event()

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        self.stepped.set()
        return super().decode(slots, tokens, positions)


def test_engine_thread_yields_while_the_gate_is_closed_and_still_retires_cancels() -> None:
    model = CountingModel()
    gate_closed = threading.Event()
    gate_closed.set()
    asked: list[int] = []

    def gate(priority: int) -> bool:
        asked.append(priority)
        return gate_closed.is_set()

    finished = threading.Event()
    seen: list[object] = []

    def on_events(events: list[object]) -> None:
        seen.extend(events)
        if any(isinstance(e, FinishEvent) for e in events):
            finished.set()

    thread = EngineThread(BatchEngine(model), on_events, yield_to=gate)
    thread.start()
    try:
        s = TextSequence("t", [1, 2, 3], SamplingParams(max_tokens=1000, temperature=0.0), priority=3)
        thread.submit(s)
        thread.cancel("t")
        assert finished.wait(10.0)
        assert model.calls == [] and not model.stepped.is_set()  # never stepped while gated
        assert [e.reason for e in seen if isinstance(e, FinishEvent)] == [FinishReason.CANCELLED]
        assert 3 in asked
        finished.clear()
        thread.submit(TextSequence("u", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0)))
        gate_closed.clear()  # gate opens: it runs to completion
        assert finished.wait(10.0)
        assert model.stepped.is_set()
    finally:
        thread.stop()
