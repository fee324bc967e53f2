"""Fuzzing the decoder and the message parser in-process: structure-aware (hypothesis) and
coverage-guided (atheris, replaying the corpus kept in ``tests/fuzz_corpus/``).

The long coverage-guided run is ``chunkline bench fuzz atheris --seconds 600``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import repo_paths
from hypothesis import HealthCheck, given, settings

from chunkline.bench import fuzz
from chunkline.client.wire import codec, protocol
from chunkline.client.wire.errors import CloseCode, ErrorCode
from chunkline.policies import base

CORPUS = repo_paths.TESTS / "fuzz_corpus"


def test_the_kept_corpus_replays_clean() -> None:
    assert fuzz.replay_corpus(CORPUS) >= len(fuzz.seed_corpus())


def test_every_seed_is_kept_in_the_corpus() -> None:
    kept = {p.name for p in CORPUS.iterdir()}
    missing = [name for name, data in fuzz.seed_corpus().items() if hashlib.sha1(data).hexdigest() not in kept]
    assert not missing, f"run `chunkline bench fuzz seed` to add: {missing}"


@settings(max_examples=400, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(fuzz.native_frames())
def test_decoder_and_parser_survive_structured_frames(frame: bytes) -> None:
    fuzz.fuzz_one_input(frame)


def _broken_codec(**overrides: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{"decode": codec.decode, "Encoder": codec.Encoder, **overrides})


def test_the_harness_fails_on_a_decoder_that_breaks_its_rules() -> None:
    # A harness that cannot fail proves nothing: feed it decoders that break the codec's rules.
    writable = _broken_codec(decode=lambda data, limits: {"state": np.zeros(3, np.float32)})
    modules = {"codec": writable, "protocol": protocol, "base": base}
    with pytest.raises(fuzz.FuzzFailure, match="writeable=True"):
        fuzz.fuzz_one_input(b"\x80", modules)
    objects = _broken_codec(decode=lambda data, limits: {"x": np.array([object()])})
    with pytest.raises(fuzz.FuzzFailure, match="dtype object"):
        fuzz.fuzz_one_input(b"\x80", {**modules, "codec": objects})
    lossy = _broken_codec(decode=lambda data, limits: {"x": 1.5} if data == b"\x80" else {"x": 2.5})
    with pytest.raises(fuzz.FuzzFailure, match="differs"):
        fuzz.fuzz_one_input(b"\x80", {**modules, "codec": lossy})
    crashing = _broken_codec(decode=lambda data, limits: [][0])
    with pytest.raises(IndexError):  # anything but CodecError is a crash the fuzzer reports
        fuzz.fuzz_one_input(b"\x80", {**modules, "codec": crashing})


def test_documented_codes_are_the_codes_in_the_code() -> None:
    documented = fuzz.documented_codes()
    assert documented.errors == {c.value for c in ErrorCode}
    assert documented.closes <= {int(c) for c in CloseCode}
    assert {1000, 1001, 1003, 1009, 1011} <= documented.closes


def test_a_short_coverage_guided_run(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    # libFuzzer first runs every input of the kept corpus, then mutates for 20 000 inputs (about
    # a second); new inputs go to a temp folder, never into the repository.
    out = subprocess.run([sys.executable, "-m", "chunkline.bench.fuzz", "atheris", "--runs", "20000",
                          "--corpus", str(CORPUS), "--new-corpus", str(tmp_path / "new")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    report = json.loads(out.stdout)["atheris"]
    assert report["exit"] == 0 and report["inputs"] >= 20000
    assert report["coverage_edges"] > 100  # the corpus reaches deep into decode and parse
