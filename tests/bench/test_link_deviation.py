"""``chunkline bench link --deviation``: JPEG's effect on the actions of the policy a server serves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from chunkline.bench.link.deviation import action_deviation, camera_fields, observations_for
from chunkline.bench.link.suite import main
from chunkline.bench.link.vision import CAMERAS, VisionCNN, render_frames, vision_spec
from chunkline.bench.serverproc import ServerProcess

pytestmark = pytest.mark.live  # starts a server on loopback


@pytest.fixture(scope="module")
def frames() -> list[dict[str, np.ndarray]]:
    try:
        return render_frames(2)
    except RuntimeError as exc:
        pytest.skip(str(exc))


def test_the_served_vision_policy_deviates_as_the_same_network_in_process(frames: list[dict[str, np.ndarray]],
                                                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ServerProcess(["--policy", "chunkline.bench.link.vision:vision_policy"]) as server:
        code = main(["--deviation", "--uri", server.uri, "--frames", "2", "--qualities", "95,50", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    by = {r["quality"]: r for r in records if r["kind"] == "served_deviation"}
    assert set(by) == {"raw again", 95, 50} and by["raw again"]["rel_max"] == 0.0  # a deterministic policy
    # The same observations through the same network here: the same figures.
    spec = vision_spec().to_wire()
    observations = observations_for(spec, frames)
    here = {r["quality"]: r for r in action_deviation(VisionCNN(), observations, (95, 50))}
    for q in (95, 50):
        assert by[q]["rel_median"] == pytest.approx(here[q]["rel_median"], rel=1e-3, abs=1e-6)
        assert by[q]["bytes"] == here[q]["bytes"]
    assert 0.0 < by[95]["rel_median"] < by[50]["rel_median"]
    assert "action deviation of the served model" in out and "raw sent twice" in out


def test_camera_fields_are_the_uint8_frames_of_the_spec() -> None:
    assert camera_fields(vision_spec().to_wire()) == list(CAMERAS)


def test_a_model_without_cameras_has_nothing_to_measure(capsys: pytest.CaptureFixture[str]) -> None:
    with ServerProcess(["--policy", "noop", "--name", "arm"]) as server:
        code = main(["--deviation", "--uri", server.uri, "--model", "nope"])
    assert code == 2 and "no model 'nope'" in capsys.readouterr().out
