"""Compression a user can turn on: ``--policy-arg jpeg=Q`` on a served policy, ``Compression``
from ``chunkline.client``, and a warning when what the client asks for is not allowed."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from chunkline.bench.serverproc import ServerProcess
from chunkline.client import Client, Compression
from chunkline.policies import ArraySpec, PolicySpec
from chunkline.policies.exceptions import PolicyLoadError
from chunkline.policies.registry import allow_jpeg, load_policy

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback


def _obs() -> dict[str, object]:
    frame = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    return {"images/cam_high": frame, "images/cam_left_wrist": frame, "images/cam_right_wrist": frame,
            "state": np.zeros(14, np.float32), "prompt": "x"}


def test_jpeg_arg_allows_the_camera_fields_only() -> None:
    spec = load_policy("noop", args={"jpeg": 80}).spec
    cameras = {n: (f.encodings, f.jpeg_min_quality) for n, f in spec.observation.items() if n.startswith("images/")}
    assert cameras and all(v == (("raw", "jpeg"), 80) for v in cameras.values())
    assert spec.observation["state"].encodings == ("raw",)
    assert load_policy("noop").spec.observation["images/cam_high"].encodings == ("raw",)


def test_jpeg_arg_changes_the_fingerprint_and_nothing_else() -> None:
    """A client comparing fingerprints sees when the server lets cameras travel as JPEG, and at
    which quality; the policy stays what it was (its class, its actions)."""
    raw, q80, q80_again, q60 = (load_policy("loadtest", backend="numpy", args=a)
                                for a in ({}, {"jpeg": 80}, {"jpeg": 80}, {"jpeg": 60}))
    prints = [p.fingerprint for p in (raw, q80, q80_again, q60)]
    assert prints[1] == prints[2] and len({prints[0], prints[1], prints[3]}) == 3
    assert all(p.startswith("sha256:") and len(p) == len(prints[0]) for p in prints)
    assert q80.metadata()["fingerprint"] == prints[1]
    assert isinstance(q80, type(raw)) and type(q80).__name__ == type(raw).__name__
    obs = {n: np.stack([v]) if isinstance(v, np.ndarray) else [v] for n, v in _obs().items() if n in raw.spec.observation}
    np.testing.assert_array_equal(q80.infer_batch(obs), raw.infer_batch(obs))


@pytest.mark.parametrize("value", [0, 101, "high", True])
def test_a_bad_jpeg_quality_is_refused(value: object) -> None:
    with pytest.raises(PolicyLoadError, match="1 to 100"):
        load_policy("noop", args={"jpeg": value})


def test_a_policy_without_cameras_refuses_jpeg() -> None:
    spec = PolicySpec(observation={"state": ArraySpec((7,), "float32")}, action_dim=7, horizon=10, dt=0.02)
    with pytest.raises(PolicyLoadError, match="no camera field"):
        allow_jpeg(spec, 80)


def test_a_served_policy_with_jpeg_gets_jpeg_and_one_without_warns(caplog: pytest.LogCaptureFixture) -> None:
    args = ["--policy", "noop", "--name", "cams", "--policy-arg", "jpeg=80", "--policy", "noop", "--name", "raw"]
    with ServerProcess(args) as server, Client.connect(server.uri, compression=Compression(mode="jpeg", quality=85)) as client:
        assert client.hello is not None and "jpeg" in client.hello.encodings
        reply = client.infer(_obs(), obs_time=time.monotonic(), model="cams")
        assert "image_decode_ms" in reply.timing  # the cameras arrived compressed
        with caplog.at_level(logging.WARNING, logger="chunkline.client"):
            for _ in range(2):
                reply = client.infer(_obs(), obs_time=time.monotonic(), model="raw")
        assert "image_decode_ms" not in reply.timing
    warnings = [r.getMessage() for r in caplog.records if "sending raw" in r.getMessage()]
    assert len(warnings) == 1 and "model 'raw' allows no compressed field" in warnings[0]
