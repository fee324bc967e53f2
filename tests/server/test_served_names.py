"""A served policy's own name is an alias of the name it is served under, never ambiguous."""

from __future__ import annotations

from chunkline.server.robot.service import own_name_aliases


def test_a_policys_own_name_stands_for_its_served_name() -> None:
    assert own_name_aliases({"numpol:make": "numpy-arm", "loadtest": "loadtest"}) == {"numpy-arm": "numpol:make"}


def test_an_own_name_two_policies_share_or_another_is_served_as_is_no_alias() -> None:
    # two openpi objects both called "openpi"; a policy named as another one is served
    assert own_name_aliases({"a:make": "openpi", "b:make": "openpi"}) == {}
    assert own_name_aliases({"v1": "arm", "arm": "arm-v2"}) == {"arm-v2": "arm"}
    assert own_name_aliases({"v1": "v2", "v2": "v1"}) == {}
