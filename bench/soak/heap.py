"""Where the server's memory goes during a soak: its Python heap by tracemalloc snapshots, and its
resident memory by kind of mapping.

``--heap-snapshots DIR`` starts the server with a ``sitecustomize`` module (written to
``DIR/site``, first on the server's ``PYTHONPATH``) that turns tracemalloc on after one period
(start-up is not slowed) and dumps a snapshot every ``period_s`` into ``DIR``;
:func:`heap_growth` compares the second half's first snapshot with the last.
:func:`rss_by_kind` splits resident memory by ``/proc/PID/smaps``: the main heap (glibc's main
arena, the event loop thread's ``malloc``), the threads' arenas, other anonymous mappings
(pymalloc's arenas, large ``malloc`` blocks), files. Python objects that grow show in the
snapshots; a main heap that grows while the snapshots stay flat is the allocator's.
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

__all__ = ["server_env", "heap_growth", "rss_by_kind"]

_SITE = textwrap.dedent('''
    import os, threading, time, tracemalloc

    def _dump(folder, period, frames):
        started = time.monotonic()
        time.sleep(period)
        tracemalloc.start(frames)  # after start-up: what is allocated from here on is traced
        while True:
            time.sleep(period)
            t = round(time.monotonic() - started)
            tracemalloc.take_snapshot().dump(os.path.join(folder, "heap-%06d.tracemalloc" % t))

    if os.environ.get("CHUNKLINE_HEAP_SNAPSHOTS"):
        threading.Thread(target=_dump, args=(os.environ["CHUNKLINE_HEAP_SNAPSHOTS"],
                         float(os.environ["CHUNKLINE_HEAP_SNAPSHOT_S"]), int(os.environ["CHUNKLINE_HEAP_FRAMES"])),
                         daemon=True).start()
''')


def server_env(folder: Path, period_s: float, frames: int = 4) -> dict[str, str]:
    """The server's environment for snapshots every ``period_s`` into ``folder``."""
    site = folder / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "CHUNKLINE_HEAP_FRAMES": str(frames), "CHUNKLINE_HEAP_SNAPSHOTS": str(folder),
            "CHUNKLINE_HEAP_SNAPSHOT_S": str(period_s)}


def heap_growth(folder: Path, after_s: float, top: int = 10) -> list[str]:
    """The traced Python heap of the first snapshot at or after ``after_s`` against the last, and
    the ``top`` source lines whose allocations grew most between them."""
    import tracemalloc

    snaps = sorted(folder.glob("heap-*.tracemalloc"))
    timed = [(int(p.stem.split("-")[1]), p) for p in snaps]
    later = [(t, p) for t, p in timed if t >= after_s]
    if len(later) < 2:
        return [f"fewer than two heap snapshots after {after_s:.0f} s in {folder}"]
    (t0, first), (t1, last) = later[0], later[-1]
    # Our own snapshot files, written by the sitecustomize above: not input from anyone else.
    old, new = tracemalloc.Snapshot.load(str(first)), tracemalloc.Snapshot.load(str(last))
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap*>")]
    old, new = old.filter_traces(ignore), new.filter_traces(ignore)
    total = (sum(s.size for s in old.statistics("filename")), sum(s.size for s in new.statistics("filename")))
    lines = [f"traced Python heap {total[0] / 2**20:.2f} MiB at {t0} s, {total[1] / 2**20:.2f} MiB at {t1} s "
             f"({(total[1] - total[0]) / 1024 / max(1e-9, (t1 - t0) / 60):+.1f} KiB/min)"]
    for stat in new.compare_to(old, "lineno")[:top]:
        frame = stat.traceback[0]
        lines.append(f"{frame.filename}:{frame.lineno} {stat.size_diff / 1024:+.1f} KiB ({stat.count_diff:+d} blocks)")
    return lines


def rss_by_kind(pid: int) -> dict[str, float]:
    """Resident MiB of ``pid`` by kind of mapping (see the module docstring); empty if unreadable."""
    kinds: dict[str, float] = {}
    kind = ""
    try:
        with open(f"/proc/{pid}/smaps") as smaps:
            for line in smaps:
                head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
                if head:
                    start, end, name = int(head[1], 16), int(head[2], 16), head[3].strip()
                    if name == "[heap]":
                        kind = "main_heap"
                    elif name.startswith("/"):
                        kind = "files"
                    elif name:
                        kind = "other"
                    elif start % (64 << 20) == 0 and end - start <= 64 << 20:
                        kind = "thread_arenas"  # glibc's per-thread heaps: 64 MiB-aligned
                    else:
                        kind = "anonymous"
                elif line.startswith("Rss:"):
                    kinds[kind] = kinds.get(kind, 0.0) + int(line.split()[1]) / 1024
    except OSError:
        return {}
    return {k: round(v, 1) for k, v in kinds.items()}
