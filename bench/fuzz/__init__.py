"""Fuzzing the wire: structure-aware frames against a live server, and a coverage-guided run.

Two fuzzers share this package:

* **live, structure-aware** (hypothesis): msgpack trees, array maps with dtype/shape/length lies,
  deep nesting, huge claimed sizes, wrong types in every field, truncated, concatenated and
  bit-flipped frames, oversize frames, and WebSocket-level abuse (text frames, fragmented
  messages, reserved opcodes, unmasked frames, ...), sent to a real ``chunkline serve``. Each
  frame is checked against an oracle (:func:`expect_native`): the server answers with exactly
  the documented error or close code, every request id exactly once, never hangs a session, and
  a bystander session keeps being served.
* **coverage-guided** (atheris, libFuzzer): the codec and the message parser in-process
  (:func:`fuzz_one_input`), starting from the corpus kept in ``tests/fuzz_corpus/``.

``chunkline bench fuzz`` runs both at full size; the test suite runs them briefly
(``tests/client/test_fuzz_codec.py``, ``tests/live/test_fuzz_protocol.py``). hypothesis and atheris
are imported only by the functions that need them, so a server process can load :func:`fuzz_policy` without either installed.

The package, by responsibility: :mod:`.policy` (the fuzz server's policy, spec and limits),
:mod:`.oracle` (what the server must answer), :mod:`.rawws` (a client that writes any WebSocket
frame), :mod:`.strategies` (hypothesis strategies), :mod:`.live` (the live driver),
:mod:`.harness` (the atheris harness and its corpus), :mod:`.cli` (the command and its report).
"""

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
