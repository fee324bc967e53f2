"""``chunkline bench fuzz``: the coverage-guided run, then the live run; a JSON report."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chunkline.bench.help_text import plain_help

from .harness import write_seed_corpus
from .live import run_live

__all__ = ["main"]


# ---------------------------------------------------------------------------------- CLI


def _default_corpus() -> Path:
    return Path(__file__).resolve().parents[2] / "tests" / "fuzz_corpus"


def main(argv: list[str] | None = None) -> int:
    """``chunkline bench fuzz``: the coverage-guided run, then the live run; prints a JSON report."""
    p = argparse.ArgumentParser(prog="chunkline bench fuzz", description=plain_help(sys.modules[__package__].__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=["all", "atheris", "live", "seed"], default="all")
    p.add_argument("--seconds", type=float, default=None,
                   help="how long to fuzz: atheris's -max_total_time (default 300);"
                        " live: rounds of --examples until then (default one round)")
    p.add_argument("--runs", type=int, default=None, help="atheris: stop after this many inputs instead")
    p.add_argument("--corpus", type=Path, default=_default_corpus(), help="the kept corpus (read; new inputs are not added to it)")
    p.add_argument("--new-corpus", type=Path, default=None, help="where atheris writes new interesting inputs (default: a temp folder)")
    p.add_argument("--examples", type=int, default=5000, help="live: hypothesis examples of native frames per round")
    args = p.parse_args(argv)
    if args.mode == "seed":
        print(f"wrote {write_seed_corpus(args.corpus)} seeds to {args.corpus}")
        return 0
    report: dict[str, Any] = {}
    if args.mode in ("all", "atheris"):
        new = args.new_corpus or Path(tempfile.mkdtemp(prefix="chunkline-fuzz-"))
        new.mkdir(parents=True, exist_ok=True)
        stop = [f"-runs={args.runs}"] if args.runs is not None else [f"-max_total_time={int(args.seconds or 300)}"]
        cmd = [sys.executable, "-m", "chunkline.bench.fuzz", "_atheris", *stop, str(new), str(args.corpus)]
        t = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True)
        done = re.findall(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+)", out.stderr)
        report["atheris"] = {"exit": out.returncode, "seconds": round(time.monotonic() - t, 1),
                             "inputs": int(done[-1][0]) if done else None, "coverage_edges": int(done[-1][1]) if done else None,
                             "new_corpus": str(new), "new_inputs": sum(1 for _ in new.iterdir())}
        if out.returncode != 0:
            sys.stderr.write(out.stderr[-4000:])
    if args.mode in ("all", "live"):
        report["live"] = run_live(args.examples, args.seconds or 0.0)
    print(json.dumps(report, indent=2))
    live = report.get("live", {})
    failed = report.get("atheris", {}).get("exit", 0) != 0 or bool(
        live and (live["failures"] or not live["server_alive"] or live["server_tracebacks"]))
    return 1 if failed else 0
