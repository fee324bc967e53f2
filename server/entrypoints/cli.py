"""The ``chunkline`` command: ``serve``, ``infer``, the admin tools (``keys``, ``ledger``, ``cluster``),
and the subcommands other packages plug in (``demo``, ``bench``, ``capacity``, ``top``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from chunkline.server.entrypoints.cli_errors import USAGE_EXIT, UsageError, port_in_use_error
from chunkline.server.entrypoints.server_flags import add_server_flags, check_before_start, server_config_from_args
from chunkline.server.entrypoints.stop_signals import StopSignals, command_word

if TYPE_CHECKING:
    import numpy as np

# The console entry point (launch.py) catches SIGTERM before this module is imported; run any
# other way (python -c, python -m), main()'s first line does.

__all__ = ["main", "build_parser", "retry_as_told"]

T = TypeVar("T")


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="serve one or more policies over WebSocket", description="Serve policies.")
    add_server_flags(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    stop_signals: StopSignals | None = getattr(args, "stop_signals", None)
    try:
        config = _serve_config(args)
        if stop_signals is not None:
            stop_signals.exit_at_once = False  # from here the server's loop drains on a signal
            if stop_signals.received.is_set():
                return 0
        _run(config, stop_signals.received if stop_signals is not None else None)
    finally:
        if stop_signals is not None:
            stop_signals.restore(deliver=False)  # a signal noted here was this server's to drain on
    return 0


def _serve_config(args: argparse.Namespace) -> Any:
    from chunkline.server.entrypoints import app  # noqa: F401 -- imported while a signal still ends the process at once
    from chunkline.server.entrypoints.logging_setup import configure_logging

    config = server_config_from_args(args)
    check_before_start(config)
    configure_logging(args.log_level, args.log_format)
    return config


def _run(config: Any, stop_requested: threading.Event | None) -> None:
    from chunkline.server.entrypoints.app import StartFailed, run_server

    try:
        run_server(config, stop_requested=stop_requested)
    except StartFailed as exc:
        # A port taken after check_before_start is still the user's to fix, in the same words.
        cause = exc.__cause__
        busy = port_in_use_error(cause, "a port the server needs", "--port, --metrics-port or --http-port") \
            if isinstance(cause, OSError) else None
        if busy is not None:
            raise busy from cause
        raise UsageError(f"could not start: {exc}", "--debug shows the traceback") from cause


def example_from_wire_spec(spec: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """An observation matching a policy's wire metadata (free dimensions get size 1)."""
    import numpy as np

    obs: dict[str, Any] = {}
    for name, field in spec["observation"].items():
        if field["kind"] == "text":
            obs[name] = "pick up the cube"
            continue
        shape = tuple(1 if d is None else int(d) for d in field["shape"])
        dtype = np.dtype(field["dtype"])
        if dtype.kind == "f":
            obs[name] = rng.standard_normal(shape).astype(dtype)
        else:
            obs[name] = rng.integers(0, 2 if dtype.kind == "b" else 256, shape).astype(dtype)
    return obs


def _add_infer(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("infer", help="send one observation (random, matching the policy's spec) and print the chunk",
                       description="One request against a running server.")
    add_connection_flags(p)
    p.add_argument("--model", default=None, help="model to ask (default: the server's default model)")
    p.add_argument("--deadline-ms", type=float, default=None, help="the request's deadline budget in ms (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random observation")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to keep trying to connect")
    p.add_argument("--retry-s", type=float, default=10.0,
                   help="seconds to keep retrying a refusal that says when to retry (a server still timing its batch "
                        "sizes, or busy: deadline_unmeetable, overloaded), as it says; 0: never")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_infer)


def retry_as_told(send: Callable[[], T], within_s: float, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> T:
    """``send()``, sent again after each refusal's ``retry_after_ms`` while the retry falls within
    ``within_s`` of the first try; a refusal that gives no retry time, or one past it, is raised.
    Each wait is said on stderr: a one-off request right after start-up may land on a server
    still timing its batch sizes, which refuses it for its deadline and says when to retry."""
    from chunkline.client import ServerError

    give_up = clock() + within_s
    for _ in range(_MOST_RETRIES):  # bounded whatever retry times the server gives
        try:
            return send()
        except ServerError as exc:
            wait_s = None if exc.retry_after_ms is None else exc.retry_after_ms / 1000.0
            if wait_s is None or clock() + wait_s > give_up:
                raise
            code = getattr(exc.code, "value", exc.code)
            print(f"refused {code}: {exc.message}; retrying in {wait_s * 1000:.0f} ms, as the server asks", file=sys.stderr)
            sleep(wait_s)
    return send()


_MOST_RETRIES = 100


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """``--uri`` and ``--api-key``, read from ``$CHUNKLINE_URI`` and ``$CHUNKLINE_API_KEY`` when not given."""
    from chunkline.client.environment import API_KEY_ENV, URI_ENV

    p.add_argument("--uri", default=None, help=f"server to dial (default: ${URI_ENV}, else ws://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help=f"API key (default: ${API_KEY_ENV}; none for a --no-auth server)")


def _cmd_infer(args: argparse.Namespace) -> int:
    import numpy as np

    from chunkline.client import ChunklineError, Client, ConnectionLost, ErrorCode, ServerError

    try:
        with Client.connect(args.uri, api_key=args.api_key, connect_timeout=args.connect_timeout) as client:
            assert client.hello is not None
            model = args.model or client.hello.default_model
            if model not in client.hello.models:
                raise UsageError(f"the server has no model {model!r}", f"pick one of {', '.join(sorted(client.hello.models))} with --model")
            obs = example_from_wire_spec(client.hello.models[model], np.random.default_rng(args.seed))
            reply = retry_as_told(lambda: client.infer(obs, obs_time=time.monotonic(), deadline_ms=args.deadline_ms, model=model),
                                  args.retry_s)
    except ConnectionLost as exc:
        raise UsageError(str(exc), "is the server running? check --uri (or $CHUNKLINE_URI)") from exc
    except ServerError as exc:
        if exc.code is ErrorCode.UNAUTHENTICATED:
            raise UsageError(str(exc), "give a valid key with --api-key (or $CHUNKLINE_API_KEY)") from exc
        raise UsageError(str(exc)) from exc
    except ChunklineError as exc:
        raise UsageError(str(exc)) from exc
    summary = {
        "model": reply.model,
        "fingerprint": reply.fingerprint,
        "actions_shape": list(reply.actions.shape),
        "dt": reply.dt,
        "late": reply.late,
        "server_timing_ms": reply.timing,
        "client_timing_ms": reply.client_timing,
    }
    if args.json:
        print(json.dumps({**summary, "actions": reply.actions.tolist()}))
    else:
        np.set_printoptions(precision=3, suppress=True, linewidth=120)
        for k, v in summary.items():
            print(f"{k:>17}: {v}")
        print("first actions:\n", reply.actions[:3])
    return 0


#: Subcommands other packages add (``demo``, ``bench``, ``capacity``, ``top`` from ``chunkline.bench``;
#: ``cluster`` from ``chunkline.server.cluster``): each entry point is ``register(subparsers)``.
#: Loading them by entry point keeps the entrypoints from importing the packages built on them
#: (the benchmarks and the fleet both run servers), and leaves out what is not installed.
COMMANDS_GROUP = "chunkline.commands"


def _add_plugin_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for entry in sorted(importlib.metadata.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            register = entry.load()
        except ImportError as exc:  # an optional part that is not installed (e.g. the bench extra)
            logging.getLogger("chunkline").debug("commands %r not available: %s", entry.name, exc)
            continue
        register(sub)


_DEBUG_HELP = "on an error, show the traceback instead of one line"


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases share a parser
                yield from _parsers(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkline", description="Remote robot-policy inference with deadlines.")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_infer(sub)
    from chunkline.server.entrypoints.keys_cli import add_keys_parser, add_ledger_parser

    add_keys_parser(sub)
    add_ledger_parser(sub)
    _add_plugin_commands(sub)
    # --debug anywhere on the line (`chunkline serve ... --debug` too); SUPPRESS keeps a
    # subcommand from resetting what the top level parsed.
    for child in list(_parsers(parser))[1:]:
        if "--debug" not in child._option_string_actions:
            child.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return parser


def _quiet_stdout() -> None:
    # The reader went away (`chunkline infer | head`): whatever is still buffered must not raise
    # again when Python flushes stdout at exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None, stop_signals: StopSignals | None = None) -> int:
    """Run one ``chunkline`` command: its exit status, 2 (and one line on stderr) for an expected failure.

    ``stop_signals``: the console entry point's (:mod:`.launch`), installed before this module was
    imported; without it, ``main`` installs them itself when it runs on the main thread (a signal
    ends a starting ``serve`` at once only for a process's own command line, ``argv`` None)."""
    if stop_signals is None and threading.current_thread() is threading.main_thread():
        stop_signals = StopSignals(exit_at_once=argv is None and command_word(sys.argv[1:]) == "serve")
    try:
        args = build_parser().parse_args(argv)
    except BaseException:
        if stop_signals is not None:
            stop_signals.restore()
        raise
    args.stop_signals = stop_signals
    try:
        if stop_signals is not None and args.func is not _cmd_serve:
            stop_signals.restore()  # the default meaning back (a signal noted meanwhile raised again)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError as exc:
        _quiet_stdout()
        error = UsageError("the output was closed before the command finished writing (broken pipe)")
        if args.debug:
            raise error from exc
        print(f"error: {error}", file=sys.stderr)
        return USAGE_EXIT
    except UsageError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_EXIT


if __name__ == "__main__":
    sys.exit(main())
