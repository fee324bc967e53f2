"""A LeRobot checkpoint is data from a hub: its processor files may name only LeRobot's registered
steps. A step naming a class path (here ``subprocess.Popen``, which LeRobot would import and call
with the file's ``config``) is refused before LeRobot reads the file, so this runs without LeRobot.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from chunkline.policies import PolicyLoadError, UnregisteredProcessorStep, load_policy
from chunkline.policies.lerobot_steps import check_processor_files


def _checkpoint(folder: Path, steps: list[object], file: str = "policy_preprocessor.json") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"type": "act"}))
    (folder / file).write_text(json.dumps({"name": "policy_preprocessor", "steps": steps}))
    return folder


def _popen_step(marker: Path) -> dict[str, object]:
    return {"class": "subprocess.Popen", "config": {"args": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]}}


@pytest.mark.parametrize("file", ["policy_preprocessor.json", "policy_postprocessor.json"])
def test_a_class_path_step_is_refused_and_never_run(tmp_path: Path, file: str) -> None:
    marker = tmp_path / "ran"
    ckpt = _checkpoint(tmp_path / "ckpt", [{"registry_name": "to_batch_processor"}, _popen_step(marker)], file)
    with pytest.raises(UnregisteredProcessorStep) as err:
        load_policy(f"lerobot:{ckpt}", args={"fps": 30})
    assert err.value.step == "subprocess.Popen" and err.value.index == 1 and err.value.file == file
    assert "subprocess.Popen" in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_a_name_outside_the_registry_is_refused(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, [{"registry_name": "normalizer_processor"}, {"registry_name": "os.system"}])
    with pytest.raises(UnregisteredProcessorStep, match="os.system"):
        check_processor_files(ckpt, frozenset({"normalizer_processor"}))
    check_processor_files(ckpt)  # without the registry only the form is checked


@pytest.mark.parametrize("state_file", ["../../etc/passwd.safetensors", "/etc/x.safetensors", "a/b.safetensors", 7])
def test_a_state_file_outside_the_checkpoint_is_refused(tmp_path: Path, state_file: object) -> None:
    ckpt = _checkpoint(tmp_path, [{"registry_name": "normalizer_processor", "state_file": state_file}])
    with pytest.raises(UnregisteredProcessorStep, match="state_file"):
        check_processor_files(ckpt)


@pytest.mark.parametrize("steps", [[{"config": {}}], ["subprocess.Popen"], [{"registry_name": 3, "class": "os.system"}]])
def test_malformed_steps_are_refused(tmp_path: Path, steps: list[object]) -> None:
    with pytest.raises(UnregisteredProcessorStep):
        check_processor_files(_checkpoint(tmp_path, steps))


def test_a_file_that_is_not_a_pipeline_is_a_load_error(tmp_path: Path) -> None:
    _checkpoint(tmp_path, [])
    (tmp_path / "policy_postprocessor.json").write_text("[1, 2")
    with pytest.raises(PolicyLoadError, match="policy_postprocessor.json"):
        check_processor_files(tmp_path)
