"""The subcommands the benchmark package adds to ``chunkline`` (the ``chunkline.commands`` entry point).

The server's command line loads this by entry point rather than importing it, so that the server
package never imports the benchmark package (which imports the server).
"""

from __future__ import annotations

import argparse

from chunkline.bench.capacity import add_capacity_parser
from chunkline.bench.cli import add_bench_parser
from chunkline.bench.top import add_top_parser

__all__ = ["register"]


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="start a server on the default policy and drive simulated robots against it",
                       description="The main job: a server plus simulated robots, with a summary.")
    p.add_argument("--robots", type=int, default=4, help="simulated robots")
    p.add_argument("--seconds", type=float, default=20.0, help="how long the robots run")
    p.add_argument("--rate-hz", type=float, default=10.0, help="inference requests per robot per second")
    p.add_argument("--policy", default="loadtest", help="policy the demo server serves")
    p.add_argument("--deadline-ms", type=float, default=100.0, help="each request's deadline budget")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from chunkline.bench.demo import run_demo

    return run_demo(robots=args.robots, seconds=args.seconds, rate_hz=args.rate_hz, policy=args.policy, deadline_ms=args.deadline_ms)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo``, ``bench``, ``capacity`` and ``top`` to the ``chunkline`` command."""
    _add_demo(sub)
    add_bench_parser(sub)
    add_capacity_parser(sub)
    add_top_parser(sub)
