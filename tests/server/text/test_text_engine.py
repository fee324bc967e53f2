"""Continuous batching core: joins and leaves between steps, batch-invariant outputs, cancellation,
stopping rules, deadlines; and the worker-thread shell with the robots-first gate."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    # A seed from the key that does not change between runs (str hashes are salted per process).
    p = {"max_tokens": 24, "seed": zlib.crc32(key.encode()) % 1000, "temperature": 0.9, "top_p": 0.95, **params}
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


# ---------------------------------------------------------------------- blockwise attention, fused sampling

REF_CFG = TinyLMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, context=200, seed=5)


def _reference_logits(cfg: TinyLMConfig, seq: list[int]) -> np.ndarray:
    """The whole sequence through the architecture in float64, plain softmax attention: the
    last position's logits."""
    import math

    import torch
    import torch.nn.functional as F

    from chunkline.server.text.model import dummy_weights

    w = {k: torch.from_numpy(v).double() for k, v in dummy_weights(cfg).items()}
    t, d, h = len(seq), cfg.d_model, cfg.n_heads
    x = w["tok_emb"][torch.tensor(seq)] + w["pos_emb"][:t]
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    for i in range(cfg.n_layers):
        p = f"layer{i}."
        q, k, v = F.linear(F.layer_norm(x, (d,), w[p + "ln1.g"], w[p + "ln1.b"], 1e-5), w[p + "qkv.w"], w[p + "qkv.b"]).split(d, -1)
        q, k, v = (z.view(t, h, d // h).transpose(0, 1) for z in (q, k, v))
        s = (q @ k.transpose(-1, -2) / math.sqrt(d // h)).masked_fill(causal, float("-inf"))
        x = x + F.linear((torch.softmax(s, -1) @ v).transpose(0, 1).reshape(t, d), w[p + "out.w"], w[p + "out.b"])
        hid = F.gelu(F.linear(F.layer_norm(x, (d,), w[p + "ln2.g"], w[p + "ln2.b"], 1e-5), w[p + "fc1.w"], w[p + "fc1.b"]))
        x = x + F.linear(hid, w[p + "fc2.w"], w[p + "fc2.b"])
    return F.linear(F.layer_norm(x, (d,), w["ln_f.g"], w["ln_f.b"], 1e-5), w["unembed"], w["unembed.b"])[-1].numpy()


@pytest.mark.parametrize(("fixed_shape", "slots"), [(True, 3), (False, 3), (True, 1)])
def test_decode_attention_matches_a_float64_reference(fixed_shape: bool, slots: int) -> None:
    # Sequences whose positions cross the 64-position attention blocks at different steps (in
    # blocks for a batch; in one call over the exact span for a model with a single slot).
    lm = TinyLM(REF_CFG, max_slots=slots, fixed_shape=fixed_shape)
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 60, 127)[-slots:]]
    for slot, s in enumerate(seqs):
        np.testing.assert_allclose(lm.prefill(slot, s), _reference_logits(REF_CFG, s), rtol=0, atol=2e-5)
    for step in range(12):
        toks = [int(t) for t in rng.integers(0, 256, slots)]
        logits = lm.decode(list(range(slots)), toks, [len(s) for s in seqs])
        for slot, s in enumerate(seqs):
            s.append(toks[slot])
            if step % 4 == 3 or len(s) in (65, 129):
                np.testing.assert_allclose(logits[slot], _reference_logits(REF_CFG, s), rtol=0, atol=2e-5)


def test_a_rows_logits_do_not_depend_on_the_other_rows() -> None:
    lm = TinyLM(REF_CFG, max_slots=8)
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, 256, 40)]
    other = [int(t) for t in rng.integers(0, 256, 150)]
    lm.prefill(0, prompt)
    alone = lm.decode([0], [7], [40])  # one attention block
    for slot in (7, 3):
        lm.prefill(slot, prompt)
        lm.prefill(5, other)
        # the same sequence in another slot, next to a row that needs three blocks
        together = lm.decode([5, slot], [9, 7], [150, 40])
        assert np.array_equal(together[1], alone[0])


def _sampler_inputs(seed: int, n: int) -> tuple[np.ndarray, list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((n, VOCAB_SIZE)) * rng.uniform(0.1, 8.0)).astype(np.float32)
    if seed % 3 == 0:
        logits[:, EOS] += 40.0  # a row that would stop, unless it ignores EOS
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.3, 1.0, 1.7])), top_p=float(rng.choice([1.0, 0.9, 0.5, 0.05])),
                             ignore_eos=bool(rng.integers(2)), seed=int(rng.integers(1 << 30))) for _ in range(n)]
    return logits, params


def test_the_in_graph_sampler_picks_what_sample_next_picks() -> None:
    import torch

    from chunkline.server.text.model import _sample_step, _SamplingRows
    from chunkline.server.text.sampling import new_generator, sample_next

    lm = TinyLM(REF_CFG, max_slots=1)
    for seed in range(120):
        logits, params = _sampler_inputs(seed, 1 + seed % 7)
        expected = sample_next(logits, params, [new_generator(p.seed) for p in params])
        rows = _SamplingRows.empty(len(params))
        for i, p in enumerate(params):
            rows.set(i, p, new_generator(p.seed).random() if p.temperature != 0.0 else 0.0)
        picked = _sample_step(torch.from_numpy(logits), rows.tensors(torch.device("cpu")), lm._never, lm._stops, rows.nucleus)
        assert picked.tolist() == expected, seed


class LogitsOnly:
    """The same model without its in-graph sampler: the engine samples the logits itself."""

    def __init__(self, lm: TinyLM) -> None:
        self.lm = lm
        self.max_slots = lm.max_slots
        self.context = lm.context

    def prefill(self, slot: int, tokens: Sequence[int]) -> np.ndarray:
        return self.lm.prefill(slot, tokens)

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        return self.lm.decode(slots, tokens, positions)


def test_sampling_in_the_graph_or_in_the_engine_gives_the_same_tokens(model: TinyLM) -> None:
    def schedule():
        return [(0, seq("a", "first prompt", top_p=0.9)), (0, seq("g", "greedy", temperature=0.0)),
                            (2, seq("b", "second", temperature=1.3, top_p=1.0)), (4, seq("c", "third", ignore_eos=True))]
    fused, _, _ = drive(BatchEngine(model), schedule())
    unfused, _, _ = drive(BatchEngine(LogitsOnly(model)), schedule())
    assert fused == unfused and all(len(t) == 24 for t in fused.values())


@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 120), st.integers(1, 60), st.integers(0, 3)), min_size=2, max_size=6),
       st.integers(0, 10_000))
@settings(max_examples=12, deadline=None, derandomize=True)
def test_tokens_are_the_same_alone_or_batched_across_attention_blocks(plan: list[tuple[int, int, int, int]], seed: int) -> None:
    # Prompts and outputs long enough to cross one or two 64-position blocks, joining at random
    # steps into 5 slots (more requests than slots wait), with every kind of sampling.
    lm = TinyLM(REF_CFG, max_slots=5)
    kinds = [{"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 1.2, "top_p": 0.7}, {"temperature": 1.0, "ignore_eos": True}]

    def make(i: int) -> TextSequence:
        _, plen, out, kind = plan[i]
        prompt = [int(t) for t in np.random.default_rng(seed + i).integers(0, 256, plen)]
        return TextSequence(f"r{i}", prompt, SamplingParams(max_tokens=out, seed=seed + i, **kinds[kind]))  # type: ignore[arg-type]

    alone = {f"r{i}": drive(BatchEngine(lm), [(0, make(i))])[0][f"r{i}"] for i in range(len(plan))}
    together, _, _ = drive(BatchEngine(lm), [(plan[i][0], make(i)) for i in range(len(plan))])
    assert together == alone


# ---------------------------------------------------------------------- the backend's hand-over to the loop


class FakeLoop:
    def __init__(self) -> None:
        self.calls: list[object] = []

    def call_soon_threadsafe(self, fn: object, *args: object) -> None:
        self.calls.append(fn)


def test_engine_events_wake_the_loop_once_and_keep_their_order() -> None:
    from chunkline.server.text.backend import Delta, EmbeddedBackend, Finished
    from chunkline.server.text.config import TextModelConfig

    backend = EmbeddedBackend(TextModelConfig(name="tiny"), clock=lambda: 0.0)
    loop = FakeLoop()
    backend._loop = loop  # type: ignore[assignment]
    got: dict[str, list[object]] = {"a": [], "b": []}
    backend._emit = {"a": got["a"].append, "b": got["b"].append}
    backend._post([TokenEvent("a", "h", 1, 1.0), TokenEvent("b", "x", 1, 1.0)])
    backend._post([TokenEvent("a", "i", 1, 2.0), TokenEvent("b", "y", 1, 2.0)])  # the loop has not run yet
    backend._post([TokenEvent("a", "!", 0, 3.0), FinishEvent("a", FinishReason.LENGTH, 3, 2, True, 3.0, 0.5, 1.0),
                   TokenEvent("gone", "?", 1, 3.0)])
    assert len(loop.calls) == 1  # one wake-up for three steps
    loop.calls.pop()()  # the loop runs the drain
    # Each step's delta as it came (the job merges what its reader has not taken yet), then Finished.
    assert got["a"][:3] == [Delta("h", 1, 1.0), Delta("i", 1, 2.0), Delta("!", 0, 3.0)]
    assert isinstance(got["a"][3], Finished) and len(got["a"]) == 4
    assert got["a"][3].reason == "length" and got["a"][3].completion_tokens == 2  # type: ignore[attr-defined]
    assert got["b"] == [Delta("x", 1, 1.0), Delta("y", 1, 2.0)]
    assert "a" not in backend._emit
    backend._post([TokenEvent("b", "z", 1, 4.0)])
    assert len(loop.calls) == 1  # drained: the next step wakes the loop again
    loop.calls.pop()()
    assert got["b"][-1] == Delta("z", 1, 4.0)


def test_the_bench_measures_the_engine_alone_at_both_batch_sizes() -> None:
    from chunkline.bench.text_bench import engine_ratio

    small = {"name": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 32, "context": 64, "max_prompt_tokens": 32}
    r = engine_ratio(small, 4, prompt_bytes=8, max_tokens=6, seconds=0.1, window_s=0.05, warmup_s=0.05)
    assert r["windows"] == 2 and r["max_batch"] == 4
    assert r["batching_tok_s"] > 0 and r["one_tok_s"] > 0 and r["ratio"] == r["batching_tok_s"] / r["one_tok_s"]
    assert 0 < r["one_step_p50_ms"] <= r["one_step_p99_ms"] and 0 < r["batching_step_p50_ms"] <= r["batching_step_p99_ms"]
