"""Per-robot service weights: the tenants file's ``robots`` table and keys' ``robot_weight``,
bounded by the tenant's policy (issue 32, item 4)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from chunkline.server.core.tenants.schema import TenantsFile
from chunkline.server.robot.fleet import RobotPolicies, RobotPolicy, Urgency, UrgencyBounds, UrgencyError, WeightError

_HASH = "sha256:" + "0" * 64


def _file(robots: dict[str, object] | None = None, key_weight: float | None = None) -> TenantsFile:
    key: dict[str, object] = {"id": "ck_fast0", "hash": _HASH, "created": "2026-01-05T10:00:00+00:00"}
    if key_weight is not None:
        key["robot_weight"] = key_weight
    tenant: dict[str, object] = {"keys": [key, {"id": "ck_slow0", "hash": "sha256:" + "1" * 64, "created": "2026-01-05T10:00:00+00:00"}]}
    if robots is not None:
        tenant["robots"] = robots
    return TenantsFile.model_validate({"tenants": {"acme": tenant}})


def test_a_keys_robot_weight_and_the_tenants_default() -> None:
    p = RobotPolicies.from_file(_file({"weight": 1.0, "max_weight": 5.0, "max_dry_in_ms": 2000}, key_weight=5.0))
    assert p.weight_for("acme", "ck_fast0") == 5.0
    assert p.weight_for("acme", "ck_slow0") == 1.0
    assert p.policy("acme").urgency == UrgencyBounds(max_dry_in_s=2.0)
    assert p.weight_for("anonymous", None) == 1.0  # a tenant the file does not name: the defaults


def test_a_session_asks_for_a_weight_within_the_tenants_bound() -> None:
    p = RobotPolicies.from_file(_file({"max_weight": 3.0}))
    assert p.weight_for("acme", "ck_slow0", requested=2) == 2.0
    assert p.weight_for("acme", "ck_slow0", requested=50.0) == 3.0  # clamped to max_weight
    for bad in (0, -1.0, math.nan, math.inf, "5", True):
        with pytest.raises(WeightError):
            p.weight_for("acme", "ck_slow0", requested=bad)


def test_without_a_robots_table_every_robot_weighs_one() -> None:
    p = RobotPolicies.from_file(_file())
    assert p.weight_for("acme", "ck_fast0", requested=5.0) == 1.0
    assert RobotPolicy().weight_for() == 1.0


@pytest.mark.parametrize("bad", [
    {"robots": {"weight": 2.0}},  # above the default max_weight of 1
    {"robots": {"weight": 0}},
    {"robots": {"max_weight": math.inf}},
    {"robots": {"bogus": 1}},
    {"key_weight": 2.0},  # a key above its tenant's max_weight
])
def test_the_tenants_file_refuses_weights_beyond_its_bounds(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        _file(bad.get("robots"), bad.get("key_weight"))  # type: ignore[arg-type]


def test_a_tenants_urgency_bounds_clamp_its_robots_claims() -> None:
    p = RobotPolicies.from_file(_file({"max_dry_in_ms": 500, "max_rows": 20}))
    assert p.urgency_for("acme", None) is None
    assert p.urgency_for("acme", {"dry_in_ms": 1e9, "rows": 999, "period_ms": 50}) == Urgency(0.5, 20, 0.05)
    assert p.urgency_for("anonymous", {"dry_in_ms": 1e9, "rows": 999, "period_ms": 50}) == Urgency(5.0, 256, 0.05)
    with pytest.raises(UrgencyError):
        p.urgency_for("acme", {"dry_in_ms": -5, "rows": 8, "period_ms": 50})  # a plan that ran dry in the past
