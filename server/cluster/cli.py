"""``chunkline cluster``: run a fleet of replicas on Ray (``up``), inspect it, roll out, stop it."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chunkline.server.entrypoints.cli_errors import UsageError, error_line
from chunkline.server.entrypoints.console import aligned_rows
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
                                 ("down", "drain and stop the fleet (a foreground `cluster up` then exits)", _cmd_down)):
        c = csub.add_parser(name, help=helptext)
        c.add_argument("--address", default="auto", help="the Ray cluster the fleet runs on (default auto)")
        if name == "status":
            c.add_argument("--json", action="store_true", help="print machine-readable JSON (times as Unix seconds)")
        c.set_defaults(func=func)

    ro = csub.add_parser("rollout", help="replace replicas with a new policy: canary first, automatic rollback")
    ro.add_argument("--address", default="auto", help="the Ray cluster the fleet runs on (default auto)")
    ro.add_argument("--policy", required=True, action="append", metavar="REF", help="the new policy (repeatable)")
    ro.add_argument("--wait", action="store_true", help="wait until the rollout is done or rolled back")
    ro.set_defaults(func=_cmd_rollout)


def _cmd_up(args: argparse.Namespace) -> int:
    require_ray()
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
    _quiet_ray()
    connect(args.address, args.local or args.address is None)
    import ray

    actor, uri = fleet_up(config, tenants_text, detached=args.detach)
    print(f"fleet up: robots dial {uri} ({args.replicas} replicas)", flush=True)
    if args.detach:
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def ping() -> None:
        try:
            ray.get(actor.status.remote(), timeout=FLEET_PING_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            pass  # busy, not gone: ask again next time

    if not wait_while_alive(ping, stop, FLEET_PING_S, gone=(ray.exceptions.RayActorError,)):
        print("the fleet was taken down (chunkline cluster down): exiting", flush=True)
        return 0
    print("stopping the fleet: draining replicas", flush=True)
    ray.get(actor.stop.remote())
    return 0


#: how often a foreground ``cluster up`` checks that its fleet is still there, and how long one check may wait.
FLEET_PING_S = 1.0
FLEET_PING_TIMEOUT_S = 10.0


def wait_while_alive(ping: Callable[[], Any], stop: threading.Event, interval_s: float,
                     gone: tuple[type[BaseException], ...]) -> bool:
    """Wait until ``stop`` is set (``True``) or ``ping`` raises one of ``gone`` (``False``).

    Args:
        ping: asks the fleet's manager something.
        stop: set by the signal handlers (Ctrl-C, SIGTERM).
        interval_s: seconds between pings.
        gone: what ``ping`` raises once the manager's actor was killed (``chunkline cluster down``).
    """
    while not stop.wait(interval_s):
        try:
            ping()
        except gone:
            return stop.is_set()
    return True


def _quiet_ray() -> None:
    # Ray logs its start-up banner (dashboard, "Started a local Ray instance") at INFO through the
    # root logger the command configured; an operator wants our lines, and Ray's warnings.
    logging.getLogger("ray").setLevel(logging.WARNING)


def require_ray() -> None:
    """A one-line :class:`UsageError` naming the extra when Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        raise UsageError("chunkline cluster needs Ray, which is not installed in this environment",
                         "install the 'cluster' extra: pip install -e '.[server,cluster]' in a chunkline checkout")


def local_ray_clusters(proc: Path = Path("/proc")) -> list[str]:
    """The GCS addresses (``127.0.0.1:PORT``) of the Ray clusters whose head runs on this machine,
    read from the ``gcs_server`` processes' command lines (empty where there is no ``/proc``)."""
    found = set()
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
        if not argv or not argv[0].endswith(b"gcs_server"):
            continue
        for arg in argv:
            if arg.startswith(b"--gcs_server_port="):
                found.add(f"127.0.0.1:{arg.partition(b'=')[2].decode()}")
    return sorted(found)


def _resolve_address(address: str) -> str:
    """``auto`` as the one Ray cluster on this machine; several make it a :class:`UsageError`
    (Ray's own ``auto`` takes the latest started, which may be another checkout's)."""
    if address != "auto" or os.environ.get("RAY_ADDRESS"):
        return address
    clusters = local_ray_clusters()
    if len(clusters) > 1:
        raise UsageError(f"--address auto: {len(clusters)} Ray clusters run on this machine ({', '.join(clusters)})",
                         "give the one your fleet runs on with --address HOST:PORT")
    return clusters[0] if clusters else address


def _find_fleet(address: str) -> Any:
    """The running fleet's manager, or a :class:`UsageError` saying why there is none."""
    from chunkline.server.cluster.ray_fleet import connect, find_fleet

    require_ray()
    address = _resolve_address(address)
    _quiet_ray()
    try:
        connect(address, False)
    except ConnectionError as exc:
        raise UsageError(f"no Ray cluster at {address!r}", "start a fleet with `chunkline cluster up --detach`, or give --address") from exc
    try:
        return find_fleet()
    except ValueError as exc:
        raise UsageError(f"no chunkline fleet on the Ray cluster at {address!r}", "start one with `chunkline cluster up --detach`") from exc


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def format_status(status: dict[str, Any], now: float, events: int = 10) -> str:
    """The fleet's status for a person: a header, a table of replicas, the latest events with their age.

    Args:
        status: the manager's ``status()``.
        now: the current Unix time (event ages are from it).
        events: how many of the latest events to show.
    """
    rollout = status.get("rollout")
    where = f" on the Ray cluster at {status['ray_address']}" if status.get("ray_address") else ""
    lines = [f"fleet at {status.get('uri')}{where}: version {status.get('version')}, {len(status.get('replicas', []))} replica(s),"
             f" desired {status.get('desired')}"
             + (f"; rollout to {rollout['new']}: {rollout['phase']}" if rollout else "")
             + (f"; last rollout: {status['rollout_result']}" if status.get("rollout_result") and not rollout else "")]
    table = [("REPLICA", "VERSION", "STATE", "SESSIONS", "LOAD/S", "URI")]
    for r in status.get("replicas", []):
        state = "draining" if r.get("draining") else "ready" if r.get("ready") else "starting"
        table.append((str(r["name"]), str(r.get("version")), state, str(r.get("sessions", 0)), f"{r.get('load_rps', 0.0):.1f}",
                      str(r.get("uri") or "-")))
    lines += aligned_rows(table)
    recent = status.get("events", [])[-events:]
    if recent:
        lines.append("recent events:")
        for e in recent:
            fields = " ".join(f"{k}={error_line(str(v))}" for k, v in e.items() if k not in ("t", "event"))
            when = time.strftime("%H:%M:%S", time.localtime(e["t"]))
            lines.append(f"  {when} ({_age(now - e['t'])})  {e['event']}  {fields}".rstrip())
    return "\n".join(lines)


def _cmd_status(args: argparse.Namespace) -> int:
    actor = _find_fleet(args.address)
    import ray

    status = ray.get(actor.status.remote())
    status["ray_address"] = ray.get_runtime_context().gcs_address
    print(json.dumps(status, indent=2) if args.json else format_status(status, time.time()))
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    import ray

    actor = _find_fleet(args.address)
    ray.get(actor.stop.remote())
    ray.kill(actor)
    print("fleet down", flush=True)
    return 0


def _cmd_rollout(args: argparse.Namespace) -> int:
    import ray

    actor = _find_fleet(args.address)
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
