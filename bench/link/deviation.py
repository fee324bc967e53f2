"""``chunkline bench link --deviation``: what JPEG does to the actions of the policy a server
serves. Every camera field of the model's spec (uint8 ``[H, W, 3]`` or ``[H, W, 1]``) gets a
MuJoCo render (resized); the other fields a seeded example. The observations are sent raw, raw
again (the policy's own spread: a sampling policy's floor), then once per JPEG quality with the
cameras through a JPEG round trip made here: the policy sees exactly the pixels a compressed
session would give it, whatever the server allows on the wire."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from chunkline.bench.report import Column, ResultsDir, format_table
from chunkline.client import ChunklineError, Client
from chunkline.client.wire.encodings import JPEG, decode_array, encode_array, unfit_reason
from chunkline.server.entrypoints.cli import example_from_wire_spec

from .vision import CAMERAS, render_frames

__all__ = ["QUALITIES", "action_deviation", "camera_fields", "deviation_of", "observations_for", "served_deviation"]

#: the JPEG qualities measured by default
QUALITIES = (95, 90, 85, 80, 70, 60, 50)


def action_deviation(policy: Any, observations: list[dict[str, np.ndarray]],
                     qualities: tuple[int, ...] = QUALITIES, cameras: tuple[str, ...] = CAMERAS) -> list[dict[str, float]]:
    """Per quality, how far the policy's actions move when the cameras go through JPEG.

    Args:
        policy: ``policy(batch) -> [B, H, A]`` on stacked observations.
        observations: raw observations (camera fields uint8 ``[H, W, 3]``).
        qualities: the JPEG qualities.
        cameras: the camera fields.

    Returns:
        One row per quality: ``quality``, ``bytes`` (mean per camera), ``rel_median`` and
        ``rel_max`` (``|a_q - a_raw| / |a_raw|``), ``abs_mean`` (mean ``|a_q - a_raw|``).
    """
    batch = {name: np.stack([o[name] for o in observations]) for name in observations[0]}
    reference = policy(batch)
    rows = []
    for quality in qualities:
        sizes: list[int] = []
        lossy = dict(batch)
        for cam in cameras:
            frames = []
            for frame in batch[cam]:
                encoded = encode_array(frame, "jpeg", quality)
                sizes.append(len(encoded.payload))
                frames.append(decode_array(encoded))
            lossy[cam] = np.stack(frames)
        rows.append({"quality": quality, "bytes": float(np.mean(sizes)), **deviation_of(policy(lossy), reference)})
    return rows


def deviation_of(actions: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """``rel_median`` and ``rel_max`` of ``|a - a_ref| / |a_ref|`` per observation, ``abs_mean`` of ``|a - a_ref|``."""
    diff = (actions - reference).reshape(len(reference), -1)
    rel = np.linalg.norm(diff, axis=1) / np.maximum(np.linalg.norm(reference.reshape(len(reference), -1), axis=1), 1e-12)
    return {"rel_median": float(np.median(rel)), "rel_max": float(np.max(rel)), "abs_mean": float(np.abs(diff).mean())}


def camera_fields(spec: Mapping[str, Any]) -> list[str]:
    """The fields of a model's wire spec that JPEG could carry (uint8 ``[H, W, 3]`` or ``[H, W, 1]``)."""
    out = []
    for name, field in spec["observation"].items():
        shape = field.get("shape")
        if field.get("kind") == "text" or shape is None or any(d is None for d in shape):
            continue
        if unfit_reason(JPEG, np.dtype(field["dtype"]), tuple(shape)) is None:
            out.append(name)
    return out


def _resized(frame: np.ndarray, height: int, width: int, channels: int) -> np.ndarray:
    out = frame[np.arange(height) * frame.shape[0] // height][:, np.arange(width) * frame.shape[1] // width]
    if channels == 1:
        out = out.mean(axis=2, keepdims=True).astype(np.uint8)
    return np.ascontiguousarray(out)


def observations_for(spec: Mapping[str, Any], frames: list[dict[str, np.ndarray]], seed: int = 0) -> list[dict[str, Any]]:
    """One observation per rendered frame set: the i-th camera field from the i-th rendered
    camera (cycling), the other fields from a seeded example."""
    cameras = camera_fields(spec)
    rng = np.random.default_rng(seed)
    out = []
    for frame_set in frames:
        obs = example_from_wire_spec(dict(spec), rng)
        for i, name in enumerate(cameras):
            h, w, c = spec["observation"][name]["shape"]
            obs[name] = _resized(frame_set[CAMERAS[i % len(CAMERAS)]], h, w, c)
        out.append(obs)
    return out


def _served(client: Client, model: str, observations: list[dict[str, Any]]) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """``policy(batch) -> [B, H, A]``: one request per observation, its cameras from ``batch``."""

    def policy(batch: dict[str, np.ndarray]) -> np.ndarray:
        return np.stack([client.infer({**obs, **{cam: batch[cam][i] for cam in batch}}, obs_time=time.monotonic(), model=model).actions
                         for i, obs in enumerate(observations)])

    return policy


def served_deviation(uri: str | None, api_key: str | None, model: str | None, frames: int, qualities: tuple[int, ...],
                     out: ResultsDir) -> int:
    """Measure on the server at ``uri``: prints the table, returns the exit status (2: nothing to measure)."""
    try:
        with Client.connect(uri, api_key=api_key, connect_timeout=10) as client:
            assert client.hello is not None
            name = model or client.hello.default_model
            if name not in client.hello.models:
                print(f"error: the server has no model {name!r}; pick one of {', '.join(sorted(client.hello.models))} with --model")
                return 2
            spec = client.hello.models[name]
            cameras = camera_fields(spec)
            if not cameras:
                print(f"error: model {name!r} has no camera field (uint8 [H, W, 3]) that JPEG could carry")
                return 2
            print(f"rendering MuJoCo frames ... (model {name}, cameras {', '.join(cameras)})", flush=True)
            observations = observations_for(spec, render_frames(frames))
            policy = _served(client, name, observations)
            raw = [{cam: o[cam] for cam in cameras} for o in observations]
            batch = {cam: np.stack([o[cam] for o in raw]) for cam in cameras}
            floor = deviation_of(policy(batch), policy(batch))
            rows = action_deviation(policy, raw, qualities, tuple(cameras))
    except ChunklineError as exc:
        print(f"error: {exc}; is a server running there? (--uri, or $CHUNKLINE_URI)")
        return 2
    out.write("served_deviation", {"model": name, "quality": "raw again", **floor})
    for row in rows:
        out.write("served_deviation", {"model": name, **row})
    print(format_table(rows, [
        Column("jpeg quality", "quality"), Column("bytes/camera", "bytes", ".0f"), Column("rel. deviation p50", "rel_median", ".4f"),
        Column("rel. deviation max", "rel_max", ".4f"), Column("mean |da|", "abs_mean", ".5f"),
    ], title=f"action deviation of the served model {name!r}, jpeg vs raw, on MuJoCo renders ({len(observations)} observations)"))
    print(f"raw sent twice: rel. deviation p50 {floor['rel_median']:.4f}, max {floor['rel_max']:.4f} "
          "(the policy's own spread: a deviation at or below it is not JPEG's)")
    return 0
