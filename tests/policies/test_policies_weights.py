"""Dummy weights from a seed, and the .npz format: round trip, and refusal of anything else."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.policies import PolicyConfigError, WeightsFormatError, example_observation, stack_observations
from chunkline.policies.embedded import (
    ComputeConfig,
    LoadtestConfig,
    build_embedded,
    config_from_dict,
    config_to_dict,
    default_weights,
    generate_weights,
    load_weights,
    save_weights,
)
from chunkline.policies.embedded.weights import FORMAT, HEADER_KEY

SMALL = [LoadtestConfig(width=32, blocks=1, expansion=2), ComputeConfig(width=16, layers=1, heads=2, expansion=1)]


def test_generation_is_deterministic_and_seeded() -> None:
    cfg = SMALL[0]
    a, b, c = generate_weights(cfg, 1), generate_weights(cfg, 1), generate_weights(cfg, 2)
    assert a.digest() == b.digest() != c.digest()
    assert set(a.arrays) == set(cfg.param_shapes())
    for name, shape in cfg.param_shapes().items():
        assert a.arrays[name].shape == shape and a.arrays[name].dtype == np.float32


def test_a_parameter_does_not_depend_on_the_others() -> None:
    # per-parameter seeds: adding blocks leaves the shared parameters unchanged
    one = generate_weights(LoadtestConfig(width=32, blocks=1), 0)
    two = generate_weights(LoadtestConfig(width=32, blocks=2), 0)
    for name in one.arrays:
        np.testing.assert_array_equal(one.arrays[name], two.arrays[name])


def test_default_weights_are_cached_and_read_only() -> None:
    a = default_weights("loadtest-compute")
    assert default_weights("loadtest-compute") is a
    with pytest.raises(ValueError):
        a.arrays["pos"][0, 0] = 1.0
    with pytest.raises(PolicyConfigError):
        default_weights("nope")


@pytest.mark.parametrize("config", SMALL, ids=["loadtest", "compute"])
def test_round_trip(tmp_path: Path, config: Any) -> None:
    w = generate_weights(config, seed=7)
    path = tmp_path / "w.npz"
    save_weights(path, w)
    back = load_weights(path)
    assert back.config == config and back.seed == 7 and back.digest() == w.digest()
    # and it behaves the same once served
    spec = config.spec()
    obs = stack_observations(spec, [example_observation(spec, np.random.default_rng(0))])
    np.testing.assert_array_equal(build_embedded(w, backend="numpy").infer_batch(obs),
                                  build_embedded(back, backend="numpy").infer_batch(obs))


def _rewrite(path: Path, out: Path, **changes: Any) -> None:
    """Copy an npz, replacing (value) or dropping (None) entries."""
    with np.load(path, allow_pickle=False) as npz:
        entries = {k: npz[k] for k in npz.files}
    for k, v in changes.items():
        if v is None:
            entries.pop(k, None)
        else:
            entries[k] = v
    np.savez(out, **entries)


def _header(**fields: Any) -> np.ndarray:
    doc = {"format": FORMAT, "version": 1, "config": config_to_dict(SMALL[0]), "seed": 0, **fields}
    return np.frombuffer(json.dumps(doc).encode(), np.uint8)


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "good.npz"
    save_weights(path, generate_weights(SMALL[0], seed=0))
    return path


def test_object_array_refused_never_unpickled(saved: Path, tmp_path: Path) -> None:
    bad = tmp_path / "obj.npz"
    _rewrite(saved, bad, **{"head.b": np.array([{"x": 1}, None], dtype=object)})
    with pytest.raises(WeightsFormatError):
        load_weights(bad)
    hdr = tmp_path / "objhdr.npz"
    _rewrite(saved, hdr, **{HEADER_KEY: np.array(["x"], dtype=object)})
    with pytest.raises(WeightsFormatError):
        load_weights(hdr)


@pytest.mark.parametrize(
    "changes",
    [
        {HEADER_KEY: None},  # no header
        {HEADER_KEY: np.frombuffer(b"\xff\xfe not json", np.uint8)},
        {HEADER_KEY: np.zeros(3, np.float32)},
        {HEADER_KEY: _header(format="other")},
        {HEADER_KEY: _header(version=2)},
        {HEADER_KEY: _header(seed="zero")},
        {HEADER_KEY: _header(config={"kind": "loadtest", "width": "32"})},
        {HEADER_KEY: _header(config={**config_to_dict(SMALL[0]), "blocks": 2})},  # params missing for block 1
        {"in.w": None},  # missing parameter
        {"extra.w": np.zeros(3, np.float32)},  # unexpected entry
        {"in.b": np.zeros(5, np.float32)},  # wrong shape
        {"in.b": np.zeros(32, np.float64)},  # wrong dtype
    ],
    ids=["no-header", "not-json", "header-dtype", "format", "version", "seed", "config-type", "config-shape",
         "missing", "extra", "shape", "dtype"],
)
def test_malformed_files_refused(saved: Path, tmp_path: Path, changes: dict[str, Any]) -> None:
    bad = tmp_path / "bad.npz"
    _rewrite(saved, bad, **changes)
    with pytest.raises(WeightsFormatError):
        load_weights(bad)


def test_not_an_npz_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"PK\x03\x04 truncated zip")
    with pytest.raises(WeightsFormatError):
        load_weights(junk)
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(WeightsFormatError):
        load_weights(single)
    with pytest.raises(WeightsFormatError):
        load_weights(tmp_path / "absent.npz")
    text = tmp_path / "text.npz"
    with zipfile.ZipFile(text, "w") as zf:
        zf.writestr("__chunkline__.npy", b"not an npy file")
    with pytest.raises(WeightsFormatError):
        load_weights(text)


@settings(max_examples=30, deadline=None)
@given(
    width=st.integers(1, 64),
    blocks=st.integers(0, 3),
    tokens=st.integers(1, 4),
    grid=st.sampled_from([1, 2, 7, 8, 14]),
    cameras=st.lists(st.text("abcxyz_", min_size=1, max_size=8), min_size=1, max_size=4, unique=True),
)
def test_config_dict_round_trip(width: int, blocks: int, tokens: int, grid: int, cameras: list[str]) -> None:
    cfg = LoadtestConfig(width=width, blocks=blocks, tokens=tokens, pool_grid=grid, cameras=tuple(cameras))
    doc = json.loads(json.dumps(config_to_dict(cfg)))  # through JSON, as in the file
    assert config_from_dict(doc) == cfg


@pytest.mark.parametrize(
    "doc",
    [None, [], {"kind": "nope"}, {"kind": "loadtest", "bogus": 1}, {"kind": "loadtest", "width": 0},
     {"kind": "loadtest", "pool_grid": 5}, {"kind": "loadtest-compute", "heads": 3},
     {"kind": "loadtest", "cameras": "cam"}, {"kind": "loadtest", "width": 1.5}],
)
def test_bad_configs_refused(doc: Any) -> None:
    with pytest.raises(PolicyConfigError):
        config_from_dict(doc)
