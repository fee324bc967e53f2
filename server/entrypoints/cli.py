"""The ``chunkline`` command: ``serve``, ``infer``, the admin tools (``keys``, ``ledger``, ``cluster``),
and the subcommands other packages plug in (``demo``, ``bench``, ``capacity``, ``top``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
import time
from typing import Any

import numpy as np

from chunkline.server.entrypoints.keys_cli import add_keys_parser, add_ledger_parser
from chunkline.server.entrypoints.server_flags import add_server_flags, server_config_from_args

__all__ = ["main", "build_parser"]


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="serve one or more policies over WebSocket", description="Serve policies.")
    add_server_flags(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from chunkline.server.entrypoints.app import run_server
    from chunkline.server.entrypoints.logging_setup import configure_logging

    config = server_config_from_args(args)
    if isinstance(config, int):
        return config
    configure_logging(args.log_level, args.log_format)
    run_server(config)
    return 0


def example_from_wire_spec(spec: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """An observation matching a policy's wire metadata (free dimensions get size 1)."""
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
    p.add_argument("--uri", default="ws://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--deadline-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to keep trying to connect")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_infer)


def _cmd_infer(args: argparse.Namespace) -> int:
    from chunkline.client import ChunklineError, Client

    try:
        with Client.connect(args.uri, api_key=args.api_key, connect_timeout=args.connect_timeout) as client:
            assert client.hello is not None
            model = args.model or client.hello.default_model
            if model not in client.hello.models:
                print(f"error: server has no model {model!r} (has {sorted(client.hello.models)})", file=sys.stderr)
                return 2
            obs = example_from_wire_spec(client.hello.models[model], np.random.default_rng(args.seed))
            reply = client.infer(obs, obs_time=time.monotonic(), deadline_ms=args.deadline_ms, model=model)
    except ChunklineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkline", description="Remote robot-policy inference with deadlines.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_infer(sub)
    add_keys_parser(sub)
    add_ledger_parser(sub)
    _add_plugin_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
