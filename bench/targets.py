"""The servers a suite measures: one configuration, or one against a named baseline.

A comparison always runs in one process, against servers started side by side, measured in
alternation (A B A B ...), so that machine noise (other jobs, thermal state) hits both alike.
A configuration is a list of ``chunkline serve`` arguments (``--server-args``,
``--baseline-args``), or the URI of a server already running (``--uri``, ``--baseline-uri``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
from collections.abc import Iterator, Sequence

from .serverproc import ServerProcess

__all__ = ["Target", "RunningTarget", "TargetError", "add_target_arguments", "targets_from_args", "alternation",
           "start_targets"]


class TargetError(ValueError):
    """Inconsistent server options on the command line."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A server configuration to measure.

    Args:
        label: its name in tables and plots.
        server_args: ``chunkline serve`` arguments (``None`` when ``uri`` names a running server).
        uri: a server already running.
        pid: that server's process id, for CPU and memory figures.
        env: environment additions of the server this suite starts (another checkout's
            ``PYTHONPATH``: :func:`chunkline.bench.overhead.baseline_env`).
    """

    label: str
    server_args: tuple[str, ...] | None = None
    uri: str | None = None
    pid: int | None = None
    env: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class RunningTarget:
    """A target with a live server: where to send and which process to watch."""

    target: Target
    uri: str
    pid: int | None

    @property
    def label(self) -> str:
        return self.target.label


def add_target_arguments(parser: argparse.ArgumentParser, *, default_policy: str = "loadtest",
                         baseline: bool = True) -> None:
    """The server options every live suite takes.

    Args:
        parser: the suite's parser.
        default_policy: ``--policy`` default.
        baseline: also offer ``--baseline-args`` / ``--baseline-uri``.
    """
    g = parser.add_argument_group("servers")
    g.add_argument("--policy", default=default_policy,
                   help=f"policy to serve (default {default_policy}); added to each argument list that has no --policy")
    g.add_argument("--server-args", default="", metavar="ARGS",
                   help="extra 'chunkline serve' arguments of the measured configuration, one quoted string")
    g.add_argument("--label", default=None, help="name of the measured configuration (default: its arguments)")
    g.add_argument("--uri", default=None, help="measure a server already running here instead of starting one")
    g.add_argument("--server-pid", type=int, default=None, help="with --uri: its process id, for CPU and memory")
    g.add_argument("--api-key", default=None, help="API key for every session (default: $CHUNKLINE_API_KEY)")
    if baseline:
        g.add_argument("--baseline-args", default=None, metavar="ARGS",
                       help="compare against a second server started with these arguments (alternated A B A B), "
                            "e.g. \"--max-batch-size 1\" (one-at-a-time serving)")
        g.add_argument("--baseline-label", default=None, help="name of the baseline (default: its arguments)")
        g.add_argument("--baseline-uri", default=None, help="compare against a server already running here")
        g.add_argument("--baseline-pid", type=int, default=None, help="with --baseline-uri: its process id")


def _serve_args(policy: str, extra: str) -> tuple[str, ...]:
    args = shlex.split(extra)
    # `serve --policy` appends: adding ours to a list that names one would serve two policies.
    return tuple(args if "--policy" in args else ["--policy", policy, *args])


def targets_from_args(args: argparse.Namespace) -> list[Target]:
    """The measured configuration first, then the baseline if one was asked for.

    Args:
        args: parsed options of :func:`add_target_arguments`.

    Raises:
        TargetError: both a URI and server arguments for one side, or twice the same label.
    """
    if args.uri and args.server_args:
        raise TargetError("--uri measures a running server: --server-args cannot apply to it")
    targets = []
    if args.uri:
        targets.append(Target(label=args.label or "server", uri=args.uri, pid=args.server_pid))
    else:
        a = _serve_args(args.policy, args.server_args)
        targets.append(Target(label=args.label or (args.server_args.strip() or "default"), server_args=a))
    b_args, b_uri = getattr(args, "baseline_args", None), getattr(args, "baseline_uri", None)
    if b_args is not None and b_uri:
        raise TargetError("give --baseline-args or --baseline-uri, not both")
    if b_uri:
        targets.append(Target(label=args.baseline_label or "baseline", uri=b_uri, pid=args.baseline_pid))
    elif b_args is not None:
        b = _serve_args(args.policy, b_args)
        targets.append(Target(label=args.baseline_label or (b_args.strip() or "baseline"), server_args=b))
    if len({t.label for t in targets}) != len(targets):
        raise TargetError(f"two configurations are both labelled {targets[0].label!r}: give --label/--baseline-label")
    return targets


def alternation(labels: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """The measuring order: ``rounds`` rounds, each visiting every label in turn (A B A B ...).

    Args:
        labels: the configurations.
        rounds: how many times each is measured.
    """
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    return [(r, label) for r in range(rounds) for label in labels]


@contextlib.contextmanager
def start_targets(targets: Sequence[Target], *, ready_timeout: float = 180.0) -> Iterator[list[RunningTarget]]:
    """Start a server for each target that needs one (all before any measurement), stop them after.

    Args:
        targets: the configurations.
        ready_timeout: seconds to wait for each server's ``/readyz``.
    """
    with contextlib.ExitStack() as stack:
        running = []
        for t in targets:
            if t.server_args is None:
                assert t.uri is not None
                running.append(RunningTarget(t, t.uri, t.pid))
                continue
            server = stack.enter_context(ServerProcess(list(t.server_args), ready_timeout=ready_timeout, env=dict(t.env)))
            assert server.proc is not None
            running.append(RunningTarget(t, server.uri, server.proc.pid))
        yield running
