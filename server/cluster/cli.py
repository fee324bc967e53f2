"""``chunkline cluster``: run a fleet of replicas on Ray (``up``), inspect it, roll out, stop it."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import time
from typing import Any

from chunkline.server.entrypoints.cli_errors import UsageError
from chunkline.server.entrypoints.server_flags import add_server_flags, check_before_start, check_port_free, server_config_from_args

__all__ = ["add_cluster_parser", "register"]


def add_cluster_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cluster", help="scale out on Ray: replicas, a directory robots dial, autoscaling, rollouts",
                       description="Fleet scale-out on Ray.")
    csub = p.add_subparsers(dest="cluster_cmd", required=True)

    up = csub.add_parser("up", help="start a fleet (replicas from the same flags as `chunkline serve`)")
    add_server_flags(up)
    where = up.add_mutually_exclusive_group()
    where.add_argument("--address", default=None, help="Ray cluster to join (e.g. auto)")
    where.add_argument("--local", action="store_true", help="start a local Ray instance (development)")
    up.add_argument("--replicas", type=int, default=1, help="replicas to start (default 1)")
    up.add_argument("--min-replicas", type=int, default=None, help="with --max-replicas: autoscale in this range")
    up.add_argument("--max-replicas", type=int, default=None, help="with --min-replicas: the autoscaling ceiling")
    up.add_argument("--directory-host", default="127.0.0.1", help="address the directory listens on (default 127.0.0.1)")
    up.add_argument("--directory-port", type=int, default=8000, help="port robots dial (0: any free)")
    up.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs each replica reserves")
    up.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs each replica reserves (fractions allowed)")
    up.add_argument("--detach", action="store_true", help="leave the fleet running after this command exits")
    up.set_defaults(func=_cmd_up)

    for name, helptext, func in (("status", "print the fleet's replicas and recent events", _cmd_status),
                                 ("down", "drain and stop a detached fleet", _cmd_down)):
        c = csub.add_parser(name, help=helptext)
        c.add_argument("--address", default="auto", help="the Ray cluster the fleet runs on (default auto)")
        c.set_defaults(func=func)

    ro = csub.add_parser("rollout", help="replace replicas with a new policy: canary first, automatic rollback")
    ro.add_argument("--address", default="auto", help="the Ray cluster the fleet runs on (default auto)")
    ro.add_argument("--policy", required=True, action="append", metavar="REF", help="the new policy (repeatable)")
    ro.add_argument("--wait", action="store_true", help="wait until the rollout is done or rolled back")
    ro.set_defaults(func=_cmd_rollout)


def _cmd_up(args: argparse.Namespace) -> int:
    from chunkline.server.cluster.autoscale import AutoscaleConfig
    from chunkline.server.cluster.config import FleetConfig
    from chunkline.server.cluster.ray_fleet import connect, fleet_up

    server = server_config_from_args(args)
    check_before_start(server.model_copy(update={"port": 0, "metrics_port": None, "http_port": None}))  # replicas pick their own ports
    check_port_free(args.directory_host, args.directory_port, "the directory", "--directory-port")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    autoscale = None
    if (args.min_replicas is None) != (args.max_replicas is None):
        raise UsageError("--min-replicas without --max-replicas (or the other way round)", "give both to autoscale, or neither")
    if args.min_replicas is not None:
        autoscale = AutoscaleConfig(min_replicas=args.min_replicas, max_replicas=args.max_replicas)
    tenants_text = server.tenants.read_text() if server.tenants is not None else None
    try:
        config = FleetConfig(server=server, replicas=args.replicas, autoscale=autoscale, directory_host=args.directory_host,
                             directory_port=args.directory_port, replica_cpus=args.replica_cpus,
                             replica_gpus=args.replica_gpus, ledger=server.ledger)
    except ValueError as exc:
        raise UsageError(" ".join(str(exc).split())) from exc
    connect(args.address, args.local or args.address is None)
    import ray

    actor, uri = fleet_up(config, tenants_text, detached=args.detach)
    print(f"fleet up: robots dial {uri} ({args.replicas} replicas)", flush=True)
    if args.detach:
        return 0
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    while not stop:
        time.sleep(0.2)
    print("stopping the fleet: draining replicas", flush=True)
    ray.get(actor.stop.remote())
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from chunkline.server.cluster.ray_fleet import connect, find_fleet

    connect(args.address, False)
    import ray

    print(json.dumps(ray.get(find_fleet().status.remote()), indent=2))
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from chunkline.server.cluster.ray_fleet import connect, find_fleet

    connect(args.address, False)
    import ray

    actor = find_fleet()
    ray.get(actor.stop.remote())
    ray.kill(actor)
    return 0


def _cmd_rollout(args: argparse.Namespace) -> int:
    from chunkline.server.cluster.ray_fleet import connect, find_fleet

    connect(args.address, False)
    import ray

    actor = find_fleet()
    label = ray.get(actor.start_rollout.remote({"policies": [{"ref": r} for r in args.policy]}))
    print(f"rollout to {label} started", flush=True)
    while args.wait:
        status = ray.get(actor.status.remote())
        if status["rollout"] is None:
            print(f"rollout: {status['rollout_result']}")
            return 0 if status["rollout_result"] == "done" else 1
        time.sleep(1.0)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``chunkline.commands`` entry point: add ``chunkline cluster``."""
    add_cluster_parser(sub)
