"""Fuzzing the wire: structure-aware frames against a live server, and a coverage-guided run.

* live, structure-aware (hypothesis): msgpack trees, array maps with dtype/shape/length lies, deep
  nesting, huge claimed sizes, wrong types, truncated, concatenated and bit-flipped frames and
  WebSocket-level abuse, sent to a real ``chunkline serve``; an oracle (:func:`expect_native`)
  requires the documented error or close code, every request id answered exactly once, no hung
  session, and a bystander session still served.
* coverage-guided (atheris): the codec and the message parser in-process (:func:`fuzz_one_input`)
  from the corpus in ``tests/fuzz_corpus/``.
hypothesis and atheris are imported only where needed, so a server can load :func:`fuzz_policy`
without them."""

from __future__ import annotations

from .cli import main
from .errors import FuzzFailure
from .harness import check_decoded, fuzz_one_input, replay_corpus, run_atheris, same_tree, seed_corpus, write_seed_corpus
from .live import NativeProbe, check_compat, check_ws_scenario, run_live
from .oracle import (
    DocumentedCodes,
    Expect,
    documented_codes,
    embed_in_infer,
    expect_compat,
    expect_native,
    request_key,
    sentinel_frame,
    valid_request_id,
)
from .policy import CANARY, FUZZ_MAX_MESSAGE_BYTES, FUZZ_POLICY_REF, FUZZ_SPEC, fuzz_limits, fuzz_policy, make_fuzz_spec
from .rawws import RawFrame, RawWebSocket, frame_bytes
from .strategies import WS_KINDS, native_frames, ws_scenarios

__all__ = [
    "FUZZ_SPEC",
    "make_fuzz_spec",
    "FUZZ_POLICY_REF",
    "FUZZ_MAX_MESSAGE_BYTES",
    "CANARY",
    "FuzzFailure",
    "Expect",
    "DocumentedCodes",
    "documented_codes",
    "fuzz_policy",
    "fuzz_limits",
    "expect_native",
    "expect_compat",
    "check_compat",
    "check_ws_scenario",
    "WS_KINDS",
    "valid_request_id",
    "embed_in_infer",
    "sentinel_frame",
    "request_key",
    "NativeProbe",
    "RawWebSocket",
    "RawFrame",
    "frame_bytes",
    "check_decoded",
    "same_tree",
    "fuzz_one_input",
    "seed_corpus",
    "write_seed_corpus",
    "replay_corpus",
    "native_frames",
    "ws_scenarios",
    "run_atheris",
    "run_live",
    "main",
]
