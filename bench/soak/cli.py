"""``chunkline bench soak``: prints the report as JSON; exit status 1 if it found problems."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from chunkline.bench.help_text import plain_help
from chunkline.bench.report import ResultsDir, default_out

from .config import SoakConfig
from .run import run_soak

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``chunkline bench soak``: prints the report as JSON; exit status 1 if it found problems."""
    p = argparse.ArgumentParser(prog="chunkline bench soak", description=plain_help(sys.modules[__package__].__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the robots run (default 10)")
    p.add_argument("--robots", type=int, default=16)
    p.add_argument("--rate-hz", type=float, default=10.0, help="requests per robot per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-faults", action="store_true", help="normal requests only (a baseline)")
    p.add_argument("--no-proxy", action="store_true", help="no network faults")
    p.add_argument("--text-streams", type=int, default=4, help="text sessions beside the robots (0: robots only)")
    p.add_argument("--out", type=Path, default=None, help="results folder: report.json (default results/soak)")
    p.add_argument("--server-log", type=Path, default=None, help="keep the server's log here")
    p.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment for the server process (repeatable), e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--heap-snapshots", type=Path, default=None, metavar="DIR",
                   help="run the server with tracemalloc, dump a heap snapshot into DIR every --snapshot-period "
                        "seconds, and report the Python heap's growth from the second half's first snapshot to the last")
    p.add_argument("--snapshot-period", type=float, default=60.0, help="seconds between heap snapshots (default 60)")
    args = p.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.server_env)
    cfg = SoakConfig(duration_s=args.minutes * 60.0, robots=args.robots, rate_hz=args.rate_hz, seed=args.seed,
                     faults=not args.no_faults, proxy=not args.no_proxy, server_env=env, text_streams=args.text_streams,
                     heap_snapshots=args.heap_snapshots, snapshot_period_s=args.snapshot_period)
    report = run_soak(cfg, log_path=args.server_log)
    text = json.dumps(report.as_dict(), indent=2)
    print(text)
    out = ResultsDir(args.out or default_out("soak"), "soak")
    written = out.write_text("report.json", text + "\n")
    print(f"report: {written}", file=sys.stderr)
    return 1 if report.problems else 0
