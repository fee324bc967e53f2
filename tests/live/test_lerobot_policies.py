"""LeRobot checkpoints served by chunkline: small random-initialised ACT and Diffusion Policy
checkpoints built with LeRobot's own config classes, checked against LeRobot's own pipeline,
batched against alone, and through a real server to the native client and openpi-client.

These run in ``.venv-lerobot`` (``make test`` builds it; see docs/policies.md for why a second
environment). Where lerobot is not installed they skip, unless ``CHUNKLINE_REQUIRE_LEROBOT`` is set
(as ``make test`` sets it), where a missing lerobot fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

if os.environ.get("CHUNKLINE_REQUIRE_LEROBOT"):
    import lerobot  # noqa: F401  - required: fail, never skip
else:
    pytest.importorskip("lerobot", reason="LeRobot runs in .venv-lerobot (make test)")

from chunkline.bench.lerobot_models import CAMERA, build_act, build_diffusion, lerobot_reference, robot_observation
from chunkline.bench.serverproc import ServerProcess
from chunkline.client import Client
from chunkline.client.lerobot_mapping import LeRobotMapping
from chunkline.policies import PolicyLoadError, load_policy, stack_observations, validate_observation
from chunkline.policies.lerobot_policy import LeRobotPolicy
from chunkline.policies.prefix import ActionPrefix, stack_prefixes

KINDS = {"act": build_act, "diffusion": build_diffusion}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lerobot")
    return {kind: build(root / kind) for kind, build in KINDS.items()}


def _load(path: Path) -> LeRobotPolicy:
    policy = load_policy(f"lerobot:{path}", args={"fps": 30})
    assert isinstance(policy, LeRobotPolicy)
    return policy


def _alone(policy: LeRobotPolicy, observations: list[dict[str, Any]]) -> np.ndarray:
    """One robot's session: its observations one after another, each alone in its batch."""
    state = policy.new_session_state()
    chunks = []
    for obs in observations:
        batch = stack_observations(policy.spec, [validate_observation(policy.spec, obs)])
        actions, [state] = policy.infer_batch_with_state(batch, [state])
        chunks.append(actions[0])
    return np.stack(chunks)


@pytest.mark.parametrize("kind", list(KINDS))
def test_spec_from_the_checkpoint(checkpoints: dict[str, Path], kind: str) -> None:
    policy = _load(checkpoints[kind])
    spec = policy.spec
    assert spec.observation["observation.state"].shape == (6,) and spec.observation["observation.state"].dtype == "float32"
    assert spec.observation[CAMERA].shape == (None, None, 3) and spec.observation[CAMERA].dtype == "uint8"
    assert not spec.observation["task"].required
    assert spec.action_dim == 6 and spec.horizon == (10 if kind == "act" else 8) and spec.dt == pytest.approx(1 / 30)
    assert policy.stateful == (kind == "diffusion")


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunks_equal_lerobots_own_pipeline(checkpoints: dict[str, Path], kind: str) -> None:
    observations = [robot_observation(i) for i in range(3)]  # 96x128 frames: resized to the checkpoint's 48x64
    ours = _alone(_load(checkpoints[kind]), observations)
    theirs = lerobot_reference(checkpoints[kind], observations)
    assert ours.shape == theirs.shape
    assert np.array_equal(ours, theirs), float(np.abs(ours - theirs).max())


@pytest.mark.parametrize("kind", list(KINDS))
def test_batched_equals_alone(checkpoints: dict[str, Path], kind: str) -> None:
    policy = _load(checkpoints[kind])
    robots = 4
    steps = [[robot_observation(100 * r + t) for t in range(3)] for r in range(robots)]
    alone = [_alone(policy, steps[r]) for r in range(robots)]
    states = [policy.new_session_state() for _ in range(robots)]
    for t in range(3):
        batch = stack_observations(policy.spec, [validate_observation(policy.spec, steps[r][t]) for r in range(robots)])
        actions, states = policy.infer_batch_with_state(batch, states)
        for r in range(robots):
            np.testing.assert_allclose(actions[r], alone[r][t], rtol=1e-5, atol=1e-5)


def test_fingerprint_covers_normalisation_statistics(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(checkpoints["act"], tmp_path / "act"))
    assert _load(copy).fingerprint == _load(checkpoints["act"]).fingerprint
    stats_file = next(copy.glob("policy_postprocessor_step_*.safetensors"))
    stats = load_file(str(stats_file))
    stats = {k: v + 1 if k.endswith("mean") else v for k, v in stats.items()}
    save_file({k: torch.as_tensor(v).contiguous() for k, v in stats.items()}, str(stats_file))
    assert _load(copy).fingerprint != _load(checkpoints["act"]).fingerprint


def test_fps_is_required_and_says_how(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(PolicyLoadError, match="--policy-arg fps=30"):
        load_policy(f"lerobot:{checkpoints['act']}")
    with pytest.raises(PolicyLoadError, match="no LeRobot checkpoint"):
        load_policy("lerobot:/nonexistent/checkpoint", args={"fps": 30})


@pytest.mark.parametrize("step", [{"class": "subprocess.Popen"}, {"registry_name": "no_such_step"}])
def test_a_checkpoint_naming_a_step_outside_lerobots_registry_is_refused(checkpoints: dict[str, Path], tmp_path: Path,
                                                                          step: dict[str, Any]) -> None:
    import shutil
    import sys

    from chunkline.policies import UnregisteredProcessorStep

    copy = Path(shutil.copytree(checkpoints["act"], tmp_path / "act"))
    marker = tmp_path / "ran"
    config = json.loads((copy / "policy_preprocessor.json").read_text())
    config["steps"].append({**step, "config": {"args": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]}})
    (copy / "policy_preprocessor.json").write_text(json.dumps(config))
    with pytest.raises(UnregisteredProcessorStep, match=next(iter(step.values()))):
        load_policy(f"lerobot:{copy}", args={"fps": 30})
    assert not marker.exists()


MOTORS = ["shoulder_pan.pos", "shoulder_lift.pos", "elbow_flex.pos", "wrist_flex.pos", "wrist_roll.pos", "gripper.pos"]


def test_motor_names_from_a_dataset_or_arguments_reach_metadata_and_fingerprint(checkpoints: dict[str, Path],
                                                                                   tmp_path: Path) -> None:
    (tmp_path / "meta").mkdir()
    features = {"observation.state": {"dtype": "float32", "shape": [6], "names": MOTORS},
                "action": {"dtype": "float32", "shape": [6], "names": MOTORS[::-1]},
                CAMERA: {"dtype": "video", "shape": [96, 128, 3], "names": ["height", "width", "channels"]}}
    (tmp_path / "meta" / "info.json").write_text(json.dumps({"features": features}))
    named = load_policy(f"lerobot:{checkpoints['act']}", args={"fps": 30, "dataset": str(tmp_path)})
    assert named.metadata()["names"] == {"observation.state": MOTORS, "action": MOTORS[::-1]}
    assert named.fingerprint != _load(checkpoints["act"]).fingerprint, "the names change what a robot does"
    assert "names" not in _load(checkpoints["act"]).metadata()
    args = {"fps": 30, "dataset": str(tmp_path), "action_names": ",".join(MOTORS)}
    assert load_policy(f"lerobot:{checkpoints['act']}", args=args).metadata()["names"]["action"] == MOTORS, "arguments win"
    with pytest.raises(PolicyLoadError, match="6 entries but 5 names"):
        load_policy(f"lerobot:{checkpoints['act']}", args={"fps": 30, "state_names": ",".join(MOTORS[:5]),
                                                           "action_names": ",".join(MOTORS)})


# ---------------------------------------------------------------------- real-time chunking


@pytest.fixture(scope="module")
def rtc_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lerobot_rtc_act import build_rtc_act

    return build_rtc_act(tmp_path_factory.mktemp("rtc") / "rtc_act")


def _prefix(seed: int, rows: int, delay: int) -> ActionPrefix:
    actions = np.random.default_rng(seed).uniform(-1.5, 1.5, (rows, 6)).astype(np.float32)
    return ActionPrefix.from_wire(actions, t0=None, dt=1 / 30, action_dim=6, horizon=10, delay_steps=delay)


def _with_prefixes(policy: LeRobotPolicy, observations: list[dict[str, Any]], prefixes: list[ActionPrefix | None]) -> np.ndarray:
    batch = stack_observations(policy.spec, [validate_observation(policy.spec, o) for o in observations])
    actions, states = policy.infer_batch_with_prefix(batch, stack_prefixes(prefixes, horizon=10, action_dim=6), None)
    assert states is None
    return actions


def test_rtc_is_refused_for_a_policy_type_without_it(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(PolicyLoadError, match="no real-time chunking"):
        load_policy(f"lerobot:{checkpoints['act']}", args={"fps": 30, "rtc": True})
    assert not _load(checkpoints["act"]).accepts_prefix


def test_rtc_prefix_reaches_lerobots_rtc_processor_normalised(rtc_checkpoint: Path) -> None:
    """The prefix, normalised with the checkpoint's statistics, and its frozen rows reach
    ``predict_action_chunk`` as LeRobot's ``prev_chunk_left_over`` and ``inference_delay``; the chunk
    equals LeRobot's own pipeline called with them, and its frozen rows move towards the prefix."""
    from chunkline.bench.lerobot_models import _stats

    policy = load_policy(f"lerobot:{rtc_checkpoint}", args={"fps": 30, "rtc": True})
    assert isinstance(policy, LeRobotPolicy) and policy.accepts_prefix
    assert policy.fingerprint != load_policy(f"lerobot:{rtc_checkpoint}", args={"fps": 30}).fingerprint
    obs, prefix = robot_observation(3), _prefix(0, rows=6, delay=3)
    plain = _with_prefixes(policy, [obs], [None])[0]
    ours = _with_prefixes(policy, [obs], [prefix])[0]
    call = policy.lerobot_policy.calls[-1]
    stats = _stats()["action"]
    expected_left_over = (torch.tensor(prefix.actions) - stats["mean"]) / stats["std"]
    assert call["inference_delay"] == 3 and call["prev_chunk_left_over"].shape == (1, 6, 6)
    torch.testing.assert_close(call["prev_chunk_left_over"][0], expected_left_over, rtol=1e-5, atol=1e-5)
    assert policy.lerobot_policy.calls[-2] == {}, "no prefix: a plain call"

    # LeRobot's own pipeline with the same arguments
    from lerobot.async_inference.helpers import prepare_image, resize_robot_observation_image
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    config = PreTrainedConfig.from_pretrained(str(rtc_checkpoint), local_files_only=True)
    config.rtc_config = type(policy.lerobot_policy.config.rtc_config)(enabled=True)
    theirs_policy = get_policy_class(config.type).from_pretrained(str(rtc_checkpoint), config=config, local_files_only=True)
    theirs_policy.eval()
    pre, post = make_pre_post_processors(config, pretrained_path=str(rtc_checkpoint))
    with torch.no_grad():
        frame = resize_robot_observation_image(torch.tensor(obs[CAMERA]), config.input_features[CAMERA].shape)
        batch = pre({"observation.state": torch.tensor(obs["observation.state"]).unsqueeze(0),
                     CAMERA: prepare_image(frame).unsqueeze(0), "task": ""})
        chunk = theirs_policy.predict_action_chunk(batch, inference_delay=3, prev_chunk_left_over=expected_left_over.unsqueeze(0))
        theirs = post(chunk)[0].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    frozen = slice(0, 3)
    assert np.abs(ours[frozen] - prefix.actions[frozen]).mean() < 0.5 * np.abs(plain[frozen] - prefix.actions[frozen]).mean()


def test_rtc_batch_runs_one_call_per_delay_group_and_equals_alone(rtc_checkpoint: Path) -> None:
    policy = load_policy(f"lerobot:{rtc_checkpoint}", args={"fps": 30, "rtc": True})
    assert isinstance(policy, LeRobotPolicy)
    observations = [robot_observation(10 + i) for i in range(4)]
    prefixes = [_prefix(1, rows=6, delay=2), None, _prefix(2, rows=6, delay=2), _prefix(3, rows=8, delay=4)]
    alone = [_with_prefixes(policy, [o], [p])[0] for o, p in zip(observations, prefixes, strict=True)]
    policy.lerobot_policy.calls.clear()
    together = _with_prefixes(policy, observations, prefixes)
    delays = sorted(c.get("inference_delay", -1) for c in policy.lerobot_policy.calls)
    assert delays == [-1, 2, 4], "robots 0 and 2 share a call; the robot without a prefix runs plain"
    for i in range(4):
        np.testing.assert_allclose(together[i], alone[i], rtol=1e-5, atol=1e-5)


def test_rtc_prefix_through_the_runner_equals_the_direct_call(rtc_checkpoint: Path) -> None:
    """The server's path: a submitted prefix reaches the lane, is stacked on the chunk's grid and
    handed to the policy (two robots, one with a prefix; batches of mixed prefixes are the test above)."""
    import asyncio
    import time

    from chunkline.server.core.admission import AdmissionConfig, ServiceTimeModel
    from chunkline.server.core.quotas import QuotaManager
    from chunkline.server.core.tenants import TenantRegistry
    from chunkline.server.robot.batching import BatchPolicy
    from chunkline.server.robot.runner import ModelRunner

    policy = load_policy(f"lerobot:{rtc_checkpoint}", args={"fps": 30, "rtc": True})
    assert isinstance(policy, LeRobotPolicy)
    observations, prefixes = [robot_observation(20), robot_observation(21)], [_prefix(5, rows=6, delay=3), None]
    expected = [_with_prefixes(policy, [o], [p])[0] for o, p in zip(observations, prefixes, strict=True)]
    registry = TenantRegistry.anonymous()
    tenant = next(iter(registry.tenants.values()))

    async def go() -> list[Any]:
        runner = ModelRunner("rtc", policy, quotas=QuotaManager(registry), admission=AdmissionConfig(max_batch_size=2),
                             batching=BatchPolicy(max_batch_size=2), service=ServiceTimeModel(initial={1: 0.01}))
        items = [runner.submit(validate_observation(policy.spec, o), tenant=tenant, session=f"s{i}",
                               deadline=time.perf_counter() + 60, prefix=p)
                 for i, (o, p) in enumerate(zip(observations, prefixes, strict=True))]
        results = [await i.future for i in items]
        await runner.stop()
        return results

    results = asyncio.run(go())
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_allclose(result.actions, want, rtol=1e-5, atol=1e-5)


OPENPI_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from openpi_client import websocket_client_policy
    policy = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=int(sys.argv[1]))
    meta = policy.get_server_metadata()
    rng = np.random.default_rng(0)
    out = policy.infer({"observation.state": rng.standard_normal(6), "observation.images.front": rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)})
    print(json.dumps({"name": meta["name"], "shape": list(out["actions"].shape)}))
""")


def test_native_client_and_openpi_client_receive_chunks(checkpoints: dict[str, Path]) -> None:
    from openpi_helpers import openpi_python

    names = ",".join(MOTORS)
    args = ["--policy", f"lerobot:{checkpoints['act']}", "--policy-arg", "fps=30", "--name", "act",
            "--policy-arg", f"state_names={names}", "--policy-arg", f"action_names={names}",
            "--policy", f"lerobot:{checkpoints['diffusion']}", "--policy-arg", "fps=10", "--name", "diffusion"]
    with ServerProcess(args) as server:
        with Client.connect(server.uri) as client:
            for model, horizon, dt in (("act", 10, 1 / 30), ("diffusion", 8, 0.1)):
                chunk = client.infer(robot_observation(1), model=model, deadline_ms=30_000)
                assert chunk.actions.shape == (horizon, 6) and chunk.dt == pytest.approx(dt)
            # A LeRobot robot's own dicts, through the mapping built from what the server publishes.
            assert client.hello is not None
            mapping = LeRobotMapping.from_metadata(client.hello.models["act"])
            sent = robot_observation(1)
            robot_obs = {**dict(zip(MOTORS, sent["observation.state"].tolist(), strict=True)), "front": sent[CAMERA]}
            mapping.check_robot({**{m: float for m in MOTORS}, "front": (96, 128, 3)}, {m: float for m in MOTORS})
            chunk = client.infer(mapping.observation(robot_obs, task="pick"), model="act", deadline_ms=30_000)
            steps = mapping.actions(chunk.actions)
            assert len(steps) == 10 and list(steps[0]) == MOTORS
            assert [steps[3][m] for m in MOTORS] == pytest.approx(chunk.actions[3].tolist())
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        result = subprocess.run([str(openpi_python()), "-c", OPENPI_SCRIPT, str(server.port)], capture_output=True, text=True,
                                timeout=120, env=env)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1]) == {"name": "lerobot-act", "shape": [10, 6]}
