"""The ``chunkline`` command: ``serve``, ``infer``, ``demo`` (and the bench and admin tools)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "build_parser"]


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve one or more policies over WebSocket", description="Serve policies.")
    add_server_flags(p)
    p.set_defaults(func=_cmd_serve)


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``chunkline serve`` (also the replica template of ``chunkline cluster up``)."""
    p.add_argument("--policy", action="append", default=None, metavar="REF",
                   help="embedded name (noop, loadtest, loadtest-compute, ...), .npz path or module:factory; repeat to serve several (the first is the default)")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... for every --policy")
    p.add_argument("--backend", default=None, choices=["torch", "jax", "numpy"], help="implementation of embedded policies")
    p.add_argument("--config", type=Path, default=None, help="TOML server config; flags override it")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port here once listening")
    p.add_argument("--max-message-bytes", type=int, default=None, help="largest message accepted (larger: close 1009)")
    p.add_argument("--shutdown-grace", type=float, default=None, dest="shutdown_grace_s",
                   help="seconds SIGTERM waits for in-flight requests")
    auth = p.add_mutually_exclusive_group()
    auth.add_argument("--tenants", type=Path, default=None, help="tenants file (keys, grants, limits); reloaded on SIGHUP")
    auth.add_argument("--no-auth", action="store_true", default=None, help="no authentication: local use only")
    ledger = p.add_mutually_exclusive_group()
    ledger.add_argument("--ledger", type=Path, default=None, help="usage ledger, SQLite (default ./chunkline-ledger.db)")
    ledger.add_argument("--no-ledger", action="store_true", help="keep no usage ledger")
    p.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on this port of 127.0.0.1 (0: any free)")
    p.add_argument("--max-batch-size", type=int, default=None, help="most robots per forward pass (1: one at a time)")
    p.add_argument("--max-batch-wait-ms", type=float, default=None, help="longest wait on an idle lane for a batch to fill")
    p.add_argument("--lanes", type=int, default=None, help="execution threads per policy")
    p.add_argument("--admission", choices=["edf", "fifo"], default=None,
                   help="edf: deadline-aware admission (default); fifo: plain first-come queue (benchmark baseline)")
    p.add_argument("--hang-timeout", type=float, default=None, dest="hang_timeout_s",
                   help="seconds after which a running batch is declared hung and its lane replaced")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: serve wss:// and https://")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    p.add_argument("--max-connections-per-address", type=int, default=None)
    p.add_argument("--send-timeout", type=float, default=None, dest="send_timeout_s",
                   help="seconds a reply may wait for a client that does not read before it is disconnected")
    p.add_argument("--text-model", action="append", default=None, metavar="NAME",
                   help="serve the embedded load-test text model under NAME (repeatable)")
    p.add_argument("--text-upstream", action="append", default=None, metavar="NAME=URL",
                   help="forward text model NAME to an OpenAI-compatible engine at URL (e.g. http://host:8000/v1)")
    p.add_argument("--http-port", type=int, default=None, help="port of the OpenAI-compatible HTTP API (0: any free)")
    p.add_argument("--log-level", default="INFO")


def _cmd_serve(args: argparse.Namespace) -> int:
    from chunkline.server.entrypoints.app import run_server

    config = server_config_from_args(args)
    if isinstance(config, int):
        return config
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_server(config)
    return 0


def server_config_from_args(args: argparse.Namespace) -> Any:
    """A ``ServerConfig`` from :func:`add_server_flags`' flags, or an exit status after an error."""
    from chunkline.server.config import PolicyConfig, ServerConfig, load_config

    if args.config is None and not args.tenants and not args.no_auth:
        print("error: give a tenants file (--tenants FILE) or, for local use only, --no-auth", file=sys.stderr)
        return 2
    base = load_config(args.config) if args.config else None
    updates: dict[str, Any] = {}
    per_policy = {k: getattr(args, k) for k in ("device", "backend", "max_batch_size", "max_batch_wait_ms", "lanes", "admission",
                                                      "hang_timeout_s")
                  if getattr(args, k) is not None}
    policies = [PolicyConfig(ref=r) for r in args.policy] if args.policy else base.policies if base else [PolicyConfig(ref="loadtest")]
    updates["policies"] = [pc.model_copy(update=per_policy) for pc in policies]
    for key in ("host", "port", "port_file", "max_message_bytes", "shutdown_grace_s", "tenants", "no_auth", "ledger",
                "metrics_port", "tls_cert", "tls_key", "max_connections_per_address", "send_timeout_s"):
        if getattr(args, key) is not None:
            updates[key] = getattr(args, key)
    if args.no_ledger:
        updates["ledger"] = None
    if args.http_port is not None:
        updates["http_port"] = args.http_port
    text = [{"name": n} for n in args.text_model or []]
    for spec in args.text_upstream or []:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            print(f"error: --text-upstream wants NAME=URL, got {spec!r}", file=sys.stderr)
            return 2
        text.append({"name": name, "backend": "upstream", "upstream_url": url})
    if text:
        updates["text"] = text
    try:
        return ServerConfig.model_validate({**(base.model_dump(exclude_unset=True) if base else {}), **updates})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


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


def _add_infer(sub: argparse._SubParsersAction) -> None:
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


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a server on the default policy and drive simulated robots against it",
                       description="The main job: a server plus simulated robots, with a summary.")
    p.add_argument("--robots", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rate-hz", type=float, default=10.0, help="inference requests per robot per second")
    p.add_argument("--policy", default="loadtest")
    p.add_argument("--deadline-ms", type=float, default=100.0)
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from chunkline.bench.demo import run_demo

    return run_demo(robots=args.robots, seconds=args.seconds, rate_hz=args.rate_hz, policy=args.policy, deadline_ms=args.deadline_ms)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkline", description="Remote robot-policy inference with deadlines.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_infer(sub)
    _add_demo(sub)
    from chunkline.server.entrypoints.cluster_cli import add_cluster_parser

    add_cluster_parser(sub)
    from chunkline.bench.capacity import add_capacity_parser
    from chunkline.bench.cli import add_bench_parser
    from chunkline.bench.top import add_top_parser
    from chunkline.server.entrypoints.keys_cli import add_keys_parser, add_ledger_parser

    add_keys_parser(sub)
    add_ledger_parser(sub)
    add_bench_parser(sub)
    add_capacity_parser(sub)
    add_top_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
