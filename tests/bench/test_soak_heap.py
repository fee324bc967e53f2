"""The soak's memory findings: heap snapshots compared (the growing line named), resident memory
split by mapping, and the server's environment for snapshots."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

from chunkline.bench.soak.heap import heap_growth, rss_by_kind, server_env


def test_the_line_whose_allocations_grew_between_two_snapshots_is_named(tmp_path: Path) -> None:
    tracemalloc.start(4)
    try:
        tracemalloc.take_snapshot().dump(str(tmp_path / "heap-000010.tracemalloc"))
        kept = [bytearray(4096) for _ in range(256)]  # the growth: 1 MiB on one line
        tracemalloc.take_snapshot().dump(str(tmp_path / "heap-000070.tracemalloc"))
    finally:
        tracemalloc.stop()
    lines = heap_growth(tmp_path, after_s=5)
    assert lines[0].startswith("traced Python heap") and "at 10 s" in lines[0] and "at 70 s" in lines[0]
    assert __file__ in lines[1] and float(lines[1].split()[1]) >= 1024  # KiB
    assert len(kept) == 256
    assert "fewer than two" in heap_growth(tmp_path, after_s=60)[0]


def test_resident_memory_is_split_by_kind_of_mapping() -> None:
    kinds = rss_by_kind(os.getpid())
    assert kinds.get("files", 0) > 0 and sum(kinds.values()) > 0
    assert rss_by_kind(-1) == {}


def test_a_server_started_with_the_snapshot_environment_dumps_snapshots(tmp_path: Path) -> None:
    env = {**os.environ, **server_env(tmp_path, 0.05)}
    code = "import time, tracemalloc; time.sleep(1.0); assert tracemalloc.is_tracing()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert list(tmp_path.glob("heap-*.tracemalloc"))
