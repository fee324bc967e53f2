"""The robot side's choice of encoding (plans, the adaptive chooser, the client core) and the
server's checks before decoding, and where it decodes (the pool, never the event loop)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from chunkline.client.compression import AdaptiveChooser, Compression, FieldCompressor, FieldPlan, plan_fields
from chunkline.client.core import ClientCore
from chunkline.client.wire.encodings import ENCODINGS_HEADER, EncodedArray, encode_array
from chunkline.client.wire.errors import ErrorCode
from chunkline.client.wire.protocol import Hello
from chunkline.policies.base import ArraySpec, PolicySpec
from chunkline.server.core.fair_pool import FairPool
from chunkline.server.errors import Refusal
from chunkline.server.robot import field_decode
from chunkline.server.robot.field_decode import FieldDecoder, check_fields, encoded_fields

RAW_BYTES = 3 * 224 * 224 * 3

SPEC = PolicySpec(observation={
    "images/cam": ArraySpec((224, 224, 3), "uint8", encodings=("raw", "jpeg"), jpeg_min_quality=70),
    "depth": ArraySpec((224, 224), "uint16", required=False, encodings=("raw", "png")),
    "state": ArraySpec((14,), "float32"),
}, action_dim=14, horizon=50, dt=0.02)


def obs() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {"images": {"cam": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)},
            "depth": rng.integers(0, 4000, (224, 224)).astype(np.uint16), "state": np.zeros(14, np.float32)}


# ------------------------------------------------------------------------------------ the adaptive chooser


def measured(rate_bytes_per_s: float, budget_s: float = 0.05, ratio: float = 0.05) -> AdaptiveChooser:
    chooser = AdaptiveChooser(budget_s)
    for quality in chooser.qualities:  # each quality measured once, then the link
        chooser.observe(quality, RAW_BYTES, int(RAW_BYTES * ratio), int(RAW_BYTES * ratio), RAW_BYTES * ratio / rate_bytes_per_s, 0.001)
    return chooser


def test_before_any_measurement_the_best_jpeg_quality_goes_first() -> None:
    chooser = AdaptiveChooser(0.05)
    assert chooser.uplink_bytes_per_s is None and chooser.choose(RAW_BYTES) == 95


def test_a_fast_link_sends_raw_and_a_slow_one_the_best_quality_within_budget() -> None:
    assert measured(125e6).choose(RAW_BYTES) is None  # 1 Gbit/s: raw is predicted in a few ms
    slow = measured(25e6 / 8)  # 25 Mbit/s: raw is ~140 ms, every quality fits 50 ms
    assert slow.predict_s(None, RAW_BYTES) > 0.1
    assert slow.choose(RAW_BYTES) == 95


def test_when_nothing_fits_the_fastest_option_is_chosen() -> None:
    chooser = AdaptiveChooser(0.001)
    for quality, ratio in ((95, 0.2), (90, 0.15), (50, 0.04)):
        chooser.observe(quality, RAW_BYTES, int(RAW_BYTES * ratio), int(RAW_BYTES * ratio), RAW_BYTES * ratio / 1e6, 0.001)
    assert chooser.choose(RAW_BYTES) == 50


def test_a_lower_quality_is_tried_when_the_measured_one_does_not_fit() -> None:
    chooser = AdaptiveChooser(0.05)
    # Only quality 95 measured so far: 15 % of raw, at 10 Mbit/s that is ~54 ms, over budget.
    payload = int(RAW_BYTES * 0.15)
    chooser.observe(95, RAW_BYTES, payload, payload, payload / 1.25e6, 0.001)
    assert chooser.predict_s(95, RAW_BYTES) > 0.05
    choice = chooser.choose(RAW_BYTES)
    assert choice is not None and choice < 95 and chooser.predict_s(choice, RAW_BYTES) <= 0.05


def test_the_link_estimate_follows_a_change_of_rate() -> None:
    chooser = measured(125e6)
    assert chooser.choose(RAW_BYTES) is None
    for _ in range(8):  # raw uploads become slow: the robot drove away from the access point
        chooser.observe(None, RAW_BYTES, RAW_BYTES, RAW_BYTES, RAW_BYTES / 1e6, 0.0)
    assert chooser.choose(RAW_BYTES) is not None


# ------------------------------------------------------------------------------------ plans


def test_plans_follow_the_spec_the_session_and_the_quality_floor() -> None:
    published = {name: field.to_wire() for name, field in SPEC.observation.items()}
    agreed = ["raw", "jpeg", "png"]
    plans = plan_fields(obs(), published, agreed, 90)
    assert plans == {"images/cam": FieldPlan("jpeg", 90), "depth": FieldPlan("png")}
    assert plan_fields(obs(), published, agreed, 40)["images/cam"] == FieldPlan("jpeg", 70)  # the spec's floor
    assert plan_fields(obs(), published, agreed, None) == {"depth": FieldPlan("png")}  # raw cameras, lossless depth
    assert plan_fields(obs(), published, ["raw", "png"], 90) == {"depth": FieldPlan("png")}  # jpeg not agreed
    assert plan_fields(obs(), published, ["raw"], 90) == {}
    assert plan_fields(obs(), {"state": published["state"]}, agreed, 90) == {}


def test_compressed_observations_keep_their_nesting_and_fall_back_to_raw_when_bigger() -> None:
    compressor = FieldCompressor(2)
    try:
        noise = np.random.default_rng(5).integers(0, 256, (8, 8, 3), dtype=np.uint8)
        original = {"images": {"cam": noise}, "state": np.zeros(3, np.float32)}
        done = compressor.compress(original, {"images/cam": FieldPlan("jpeg", 100)})
        assert done.obs["images"]["cam"] is noise and done.label == "raw"  # q100 of 8x8 noise is bigger than raw
        smooth = np.full((64, 64, 3), 120, np.uint8)
        done = compressor.compress({"images": {"cam": smooth}}, {"images/cam": FieldPlan("jpeg", 80)})
        assert isinstance(done.obs["images"]["cam"], EncodedArray) and done.label == "jpeg:80" and done.payload_bytes < smooth.nbytes
    finally:
        compressor.close()


def test_the_client_core_offers_what_it_can_and_plans_from_the_hello() -> None:
    core = ClientCore("ws://127.0.0.1:1", compression=Compression(mode="adaptive", latency_budget_ms=50))
    assert core.connect_options()["additional_headers"][ENCODINGS_HEADER] == "jpeg, png"
    assert ClientCore("ws://127.0.0.1:1").connect_options()["additional_headers"] is None
    meta = {"observation": {name: field.to_wire() for name, field in SPEC.observation.items()}}
    core.hello = Hello(server="t", session="s", default_model="m", models={"m": meta}, encodings=["raw", "jpeg", "png"])
    upload = core.plan_upload(obs(), None)
    assert upload is not None and upload.quality == 95 and upload.eligible_bytes == 224 * 224 * 3
    out = core.start_infer(obs(), 1.0, None, None, None, upload, None)
    assert core._pending[out.request_id].timing["jpeg_quality"] == 95.0
    core.hello = Hello(server="t", session="s", default_model="m", models={"m": meta})  # a server that agreed raw only
    assert core.plan_upload(obs(), None) is None


# ------------------------------------------------------------------------------------ the server's checks


def wire(arr: np.ndarray, encoding: str, quality: int = 90) -> EncodedArray:
    """An encoded field as the server's codec hands it over (a view of the received bytes)."""
    field = encode_array(arr, encoding, quality)
    return EncodedArray(field.encoding, field.dtype, field.shape, memoryview(bytes(field.payload)))


def test_checks_refuse_before_decoding() -> None:
    o = obs()
    cam, depth = wire(o["images"]["cam"], "jpeg"), wire(o["depth"], "png")
    agreed = {"raw", "jpeg", "png"}
    fields = {"images/cam": cam, "depth": depth, "unread": cam}
    assert set(check_fields(SPEC, agreed, fields)) == {"images/cam", "depth"}  # a field the policy does not read is not decoded

    def code(spec: PolicySpec, agreed: set[str], fields: dict[str, EncodedArray]) -> ErrorCode:
        with pytest.raises(Refusal) as info:
            check_fields(spec, agreed, fields)
        return info.value.code

    assert code(SPEC, {"raw", "png"}, {"images/cam": cam}) is ErrorCode.INVALID_MESSAGE  # not agreed
    assert code(SPEC, agreed, {"depth": cam}) is ErrorCode.INVALID_OBSERVATION  # jpeg where the spec allows png only
    assert code(SPEC, agreed, {"state": cam}) is ErrorCode.INVALID_OBSERVATION  # a raw-only field
    small = wire(np.zeros((32, 32, 3), np.uint8), "jpeg")
    assert code(SPEC, agreed, {"images/cam": small}) is ErrorCode.INVALID_OBSERVATION  # declared shape differs from the spec


def test_agreement_is_what_both_ends_speak() -> None:
    decoder = FieldDecoder(FairPool(1))
    try:
        assert decoder.agree(None) == ["raw"]
        assert decoder.agree("jpeg") == ["raw", "jpeg"]
        assert decoder.agree(" PNG , jpeg, webp,") == ["raw", "jpeg", "png"]
    finally:
        decoder.close()


def test_fields_decode_on_the_pool_in_parallel_never_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    real = field_decode.decode_array

    def recording(field: EncodedArray) -> np.ndarray:
        threads.append(threading.current_thread().name)
        return real(field)

    monkeypatch.setattr(field_decode, "decode_array", recording)
    decoder = FieldDecoder(FairPool(2))
    o = obs()

    async def go() -> tuple[dict[str, Any], str]:
        flat = {"images/cam": wire(o["images"]["cam"], "jpeg"), "depth": wire(o["depth"], "png"), "state": o["state"]}
        await decoder.decode(flat, encoded_fields(flat))
        return flat, threading.current_thread().name

    try:
        flat, loop_thread = asyncio.run(go())
    finally:
        decoder.close()
    assert len(threads) == 2 and loop_thread not in threads and all(t.startswith("chunkline-cpu") for t in threads)
    assert np.array_equal(flat["depth"], o["depth"]) and flat["images/cam"].shape == (224, 224, 3)


def test_a_malformed_payload_is_refused_naming_its_field() -> None:
    decoder = FieldDecoder(FairPool(1))
    broken = EncodedArray("jpeg", np.dtype("u1"), (224, 224, 3), memoryview(b"\xff\xd8\xff\xe0 broken"))
    try:
        with pytest.raises(Refusal) as info:
            asyncio.run(decoder.decode({"images/cam": broken}, {"images/cam": broken}))
    finally:
        decoder.close()
    assert info.value.code is ErrorCode.INVALID_MESSAGE and "images/cam" in info.value.message
