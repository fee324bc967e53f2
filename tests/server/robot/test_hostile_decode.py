"""Compressed images as an attacker sends them: a small payload declaring a huge decoded size, a
tenant holding decoded arrays, and a flood of decodes from one tenant. Each is refused before any
pixel is decoded, charged to the tenant that caused it, or queued behind that tenant's own work.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
from typing import Any

import numpy as np
import pytest

from chunkline.client.wire.encodings import EncodedArray, encode_array
from chunkline.client.wire.errors import ErrorCode
from chunkline.policies.base import ArraySpec, PolicySpec
from chunkline.server.core.fair_pool import FairPool, FairQueue
from chunkline.server.errors import Refusal
from chunkline.server.robot import field_decode
from chunkline.server.robot.field_decode import DecodeLimits, FieldDecoder, decoded_nbytes

#: a camera the spec lets the robot send at any size
ANY_SIZE = PolicySpec(observation={"cam": ArraySpec((None, None, 3), "uint8", encodings=("raw", "jpeg"))}, action_dim=2, horizon=4, dt=0.02)
AGREED = {"raw", "jpeg"}


def _jpeg(side: int) -> EncodedArray:
    field = encode_array(np.zeros((side, side, 3), np.uint8), "jpeg", 50)
    return EncodedArray(field.encoding, field.dtype, field.shape, memoryview(bytes(field.payload)))


def test_a_small_payload_declaring_a_huge_image_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = _jpeg(4736)  # 64 MiB decoded from a few hundred KiB
    assert len(bomb.payload) < 1 << 20 and bomb.raw_nbytes > 64 << 20
    decoded: list[EncodedArray] = []
    monkeypatch.setattr(field_decode, "decode_array", lambda f: decoded.append(f))
    decoder = FieldDecoder(FairPool(1), DecodeLimits(max_request_bytes=32 << 20))
    with pytest.raises(Refusal) as info:
        decoder.check(ANY_SIZE, AGREED, {"cam": bomb})
    assert info.value.code is ErrorCode.INVALID_OBSERVATION and str(32 << 20) in info.value.message
    assert not decoded
    small = _jpeg(64)
    assert decoder.check(ANY_SIZE, AGREED, {"cam": small}) == {"cam": small}
    assert decoded_nbytes({"cam": small}) == 64 * 64 * 3


def test_decoded_arrays_are_charged_to_their_tenant_until_freed() -> None:
    field = _jpeg(128)
    decoder = FieldDecoder(FairPool(1), DecodeLimits(max_tenant_bytes=2 * field.raw_nbytes))

    async def decode(tenant: str) -> dict[str, Any]:
        obs: dict[str, Any] = {}
        await decoder.decode(obs, {"cam": field}, tenant)
        return obs

    async def go() -> None:
        held = [await decode("a"), await decode("a")]
        assert decoder.held.held_by("a") == 2 * field.raw_nbytes
        with pytest.raises(Refusal) as info:
            await decode("a")
        assert info.value.code is ErrorCode.OVERLOADED and info.value.retry_after_ms is not None and info.value.retry_after_ms > 0
        assert (await decode("b"))["cam"].shape == (128, 128, 3)  # another tenant is not charged for it
        view = held[0]["cam"][1:]  # a view keeps its array's bytes held
        held.clear()
        gc.collect()
        assert decoder.held.held_by("a") == field.raw_nbytes
        del view
        gc.collect()
        assert decoder.held.held_by("a") == 0
        await decode("a")

    try:
        asyncio.run(go())
    finally:
        decoder.close()


def test_a_refused_payload_releases_its_charge() -> None:
    decoder = FieldDecoder(FairPool(1))
    broken = EncodedArray("jpeg", np.dtype("u1"), (64, 64, 3), memoryview(b"\xff\xd8\xff\xe0 broken"))
    try:
        with pytest.raises(Refusal):
            asyncio.run(decoder.decode({}, {"cam": broken}, "a"))
    finally:
        decoder.close()
    assert decoder.held.held_by("a") == 0


def test_the_queue_serves_tenants_in_turn() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(100):
        queue.push("flood", f"f{i}")
    queue.push("robot", "r0")
    queue.push("robot", "r1")
    order = [queue.pop() for _ in range(len(queue))]
    assert queue.pop() is None
    places = [i for i, popped in enumerate(order) if popped is not None and popped[0] == "robot"]
    assert places == [1, 3]  # each waits for one flood job, not a hundred
    assert [p[1] for p in order if p is not None and p[0] == "flood"] == [f"f{i}" for i in range(100)]


def test_a_tenant_passed_over_keeps_its_turn() -> None:
    queue: FairQueue[str] = FairQueue()
    for tenant in ("a", "b", "c"):
        queue.push(tenant, f"{tenant}0")
        queue.push(tenant, f"{tenant}1")
    assert queue.pop(lambda tenant: tenant != "a") == ("b", "b0")
    assert queue.pop(lambda tenant: tenant == "z") is None
    assert [queue.pop() for _ in range(len(queue))] == [("a", "a0"), ("c", "c0"), ("b", "b1"), ("a", "a1"), ("c", "c1")]


def test_a_flooding_tenant_leaves_a_thread_so_another_tenants_job_starts_at_once() -> None:
    pool = FairPool(2, max_pending_per_tenant=8)
    flood_gate, robot_gate = threading.Event(), threading.Event()

    def job(name: str, gate: threading.Event) -> str:
        gate.wait(10)
        return name

    async def go() -> None:
        flood = [asyncio.ensure_future(pool.run("flood", job, f"f{i}", flood_gate)) for i in range(4)]
        await asyncio.sleep(0)
        assert pool.running("flood") == 1  # the second thread is kept
        robot = asyncio.ensure_future(pool.run("robot", job, "r0", robot_gate))
        await asyncio.sleep(0)
        assert pool.running("robot") == 1  # started beside the flood's running job, not after it
        robot_gate.set()
        assert await robot == "r0"
        flood_gate.set()
        assert await asyncio.gather(*flood) == ["f0", "f1", "f2", "f3"]
        assert pool.running("flood") == 0 and pool.pending("flood") == 0

    try:
        asyncio.run(go())
    finally:
        flood_gate.set()
        robot_gate.set()
        pool.close()


def test_a_tenants_flood_waits_behind_itself_and_is_bounded() -> None:
    pool = FairPool(1, max_pending_per_tenant=4)
    gate = threading.Event()
    ran: list[str] = []

    def job(name: str) -> str:
        gate.wait(10)
        ran.append(name)
        return name

    async def go() -> None:
        flood = [asyncio.ensure_future(pool.run("flood", job, f"f{i}")) for i in range(4)]
        await asyncio.sleep(0)
        with pytest.raises(Refusal) as info:
            await pool.run("flood", job, "f4")
        assert info.value.code is ErrorCode.OVERLOADED and info.value.retry_after_ms is not None
        assert pool.refused == 1
        robot = asyncio.ensure_future(pool.run("robot", job, "r0"))
        await asyncio.sleep(0)
        gate.set()
        assert await robot == "r0"
        await asyncio.gather(*flood)
        assert pool.pending("flood") == 0 and pool.pending("robot") == 0

    try:
        asyncio.run(go())
    finally:
        pool.close()
    assert ran.index("r0") <= 2  # behind the running flood job and at most one more


def test_a_cancelled_callers_job_is_skipped_and_its_place_freed() -> None:
    pool = FairPool(1, max_pending_per_tenant=2)
    gate = threading.Event()
    ran: list[str] = []

    def job(name: str) -> None:
        gate.wait(10)
        ran.append(name)

    async def go() -> None:
        first = asyncio.ensure_future(pool.run("a", job, "first"))
        second = asyncio.ensure_future(pool.run("a", job, "second"))
        await asyncio.sleep(0)
        second.cancel()
        gate.set()
        await first
        await asyncio.sleep(0)
        assert pool.pending("a") == 0
        await pool.run("a", job, "third")

    try:
        asyncio.run(go())
    finally:
        pool.close()
    assert ran == ["first", "third"]


def test_a_field_of_fixed_size_is_bounded_by_its_spec_not_the_request_cap() -> None:
    fixed = PolicySpec(observation={"cam": ArraySpec((256, 256, 3), "uint8", encodings=("raw", "jpeg"))}, action_dim=2, horizon=4, dt=0.02)
    field = _jpeg(256)
    decoder = FieldDecoder(FairPool(1), DecodeLimits(max_request_bytes=1024))
    try:
        assert decoder.check(fixed, AGREED, {"cam": field}) == {"cam": field}
        with pytest.raises(Refusal):
            decoder.check(ANY_SIZE, AGREED, {"cam": field})
    finally:
        decoder.close()


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own scheduling policy is Linux's")
def test_the_pools_threads_run_in_the_background_so_a_flood_of_preparation_gives_way_to_the_loop() -> None:
    def policy_of_this_thread() -> int:
        return os.sched_getscheduler(0)

    async def main(pool: FairPool) -> int:
        try:
            return await pool.run("acme", policy_of_this_thread)
        finally:
            pool.close()

    assert asyncio.run(main(FairPool(1))) == os.SCHED_IDLE != os.sched_getscheduler(0)
    assert asyncio.run(main(FairPool(1, background=False))) == os.sched_getscheduler(0)
