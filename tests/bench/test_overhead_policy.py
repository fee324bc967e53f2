"""``chunkline bench overhead --policy``: a real policy served and sent an observation of its own spec."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chunkline.bench import overhead
from chunkline.bench.report import read_jsonl
from chunkline.policies.registry import load_policy


def test_the_request_fits_the_policys_spec() -> None:
    spec = load_policy("reach-bc").spec
    obs = overhead.policy_request("reach-bc")
    assert set(obs) == set(spec.observation)
    for name, value in obs.items():
        field = spec.observation[name]
        assert value.shape == field.shape and value.dtype == np.dtype(field.dtype), name
    assert all(np.array_equal(obs[k], v) for k, v in overhead.policy_request("reach-bc").items())  # seeded


def test_policy_and_lanes_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        overhead.main(["--policy", "reach-bc", "--lanes"])


@pytest.mark.slow
def test_overhead_serves_a_real_policy(tmp_path: Path) -> None:
    assert overhead.main(["--policy", "reach-bc", "--round-trips", "8", "--warmup", "4", "--blocks", "2", "--load-seconds", "0.4",
                          "--connections", "2", "--out", str(tmp_path)]) == 0
    (result,) = read_jsonl(tmp_path / "results.jsonl")
    assert result["policy"] == "reach-bc" and result["request_bytes"] < 200_000  # one camera, not ALOHA's three
    assert all(result["load"][m]["requests"] > 0 for m in result["load"])
