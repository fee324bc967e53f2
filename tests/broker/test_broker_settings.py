"""Robot-side configuration files: validated into the broker's dataclasses."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from chunkline.broker import Broker, BrokerConfig, BrokerConfigError, MergeMode
from chunkline.broker.settings import load_settings
from chunkline.safety import HoldBehaviour, SafePoseBehaviour

TOML = """
[broker]
control_period_s = 0.02
merge = "blend"
prefetch_margin_s = 0.03

[limits]
lower = [-2.0, -1.0, 0.0]
upper = [2.0, 1.0, 0.08]
max_velocity = 1.5
max_acceleration = 15.0

[fallback]
kind = "safe_pose"
pose = [0.0, -0.5, 0.04]
max_speed = 0.5
"""


def test_toml_file_builds_a_working_broker(tmp_path) -> None:
    path = tmp_path / "robot.toml"
    path.write_text(TOML)
    s = load_settings(path)
    config = s.broker_config()
    assert config.merge is MergeMode.BLEND and config.prefetch_margin_s == 0.03
    limits = s.build_limits()
    assert limits is not None and limits.dt == 0.02 and limits.max_velocity.tolist() == [1.5] * 3
    fallback = s.build_fallback(limits)
    assert isinstance(fallback, SafePoseBehaviour)
    broker = Broker(config, initial_position=np.zeros(3) + [0, 0, 0.01], limits=limits, fallback=fallback)
    assert broker.watchdog.verification is not None


def test_json_and_mapping_and_defaults(tmp_path) -> None:
    path = tmp_path / "robot.json"
    path.write_text(json.dumps({"broker": {"resume_steps": 3}}))
    s = load_settings(path)
    assert s.broker_config().resume_steps == 3 and s.build_limits() is None
    assert isinstance(s.build_fallback(None), HoldBehaviour)
    assert load_settings({}).broker_config().merge is MergeMode.RTC


@pytest.mark.parametrize(
    "data, where",
    [
        ({"broker": {"merge_mode": "blend"}}, "merge_mode"),  # a typo is refused, not ignored
        ({"broker": {"control_period_s": -1}}, "control_period_s"),
        ({"broker": {"merge": "average"}}, "merge"),
        ({"limits": {"lower": [1.0], "upper": [0.0], "max_velocity": 1, "max_acceleration": 1}}, "limits"),
        ({"fallback": {"kind": "teleport"}}, "kind"),
    ],
)
def test_invalid_settings_name_the_field(data, where) -> None:
    with pytest.raises(BrokerConfigError, match=where):
        s = load_settings(data)
        s.build_limits()


def test_safe_pose_needs_limits_and_a_valid_pose(tmp_path) -> None:
    with pytest.raises(BrokerConfigError):
        load_settings({"fallback": {"kind": "safe_pose", "pose": [0.0]}}).build_fallback(None)
    s = load_settings({"limits": {"lower": [-1.0], "upper": [1.0], "max_velocity": 1, "max_acceleration": 1},
                       "fallback": {"kind": "safe_pose", "pose": [5.0]}})
    with pytest.raises(BrokerConfigError, match="fallback"):
        s.build_fallback(s.build_limits())
    with pytest.raises(BrokerConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.json")
    bad = tmp_path / "bad.toml"
    bad.write_text("[broker\n")
    with pytest.raises(BrokerConfigError, match="cannot read"):
        load_settings(bad)


def test_the_file_and_the_config_share_one_definition() -> None:
    """Every BrokerConfig field is a [broker] key with the same default and the same checks."""
    defaults = BrokerConfig()
    assert load_settings({"broker": dataclasses.asdict(defaults)}).broker_config() == defaults
    for field in dataclasses.fields(BrokerConfig):
        assert load_settings({"broker": {field.name: getattr(defaults, field.name)}}).broker_config() == defaults
    with pytest.raises(BrokerConfigError, match="max_switch_steps"):
        load_settings({"broker": {"max_switch_steps": 0}})
